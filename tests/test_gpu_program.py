"""The H100 program, compiled without a GPU: it compiles for the models users train, runs
attention as cuDNN flash attention, moves what the compute dtype says, and its memory verdict
is what a JAX process may really use. (Its traffic against the formulas: test_analyze.)"""

import collections
import contextlib
import copy
import dataclasses
import glob
import itertools
import json
import math
import os
import re

import pytest

from conftest import REPO, data_reductions, real_ptxas, run_cli_in_process, small_config
from jaxllm import analyze, backends
from jaxllm.cli import load_config
from jaxllm.config import ConfigError
from jaxllm.cost import hlo, timing
from jaxllm.cost import compile as compile_module
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import PROFILES, usable_memory
from jaxllm.cost.report import attention, format_report, memory, program_report, report
from jaxllm.model import with_available_attention
from jaxllm.pipeline.ticks import schedule_ticks

pytestmark = pytest.mark.skipif(not backends.cuda_plugin_installed(),
                                reason='needs JAX\'s CUDA plugin: pip install -e ".[dev]"')

H100, A100 = PROFILES['h100-nvlink'], PROFILES['a100-80-nvlink']


@pytest.fixture(scope='session')
def h100s():
  return backends.gpu_devices(H100, 8)


def tiny(**overrides):
  cfg = load_config(os.path.join(REPO, 'configs', 'tiny.py'))
  cfg.model.update({'dtype': 'bfloat16', 'attention': 'cudnn', **overrides})
  return cfg


@pytest.fixture(scope='session')
def tiny_program(h100s):
  """configs/tiny.py as users train it (packed file data, data=2 fsdp=2 tensor=2) in bf16 with
  cuDNN attention, on 8 H100s."""
  return compile_step(tiny(), h100s)


@pytest.fixture(scope='session')
def tiny_accumulating(h100s):
  """tiny_program's step summing 4 micro-batches of 4 rows."""
  cfg = tiny()
  cfg.train.micro_batches = 4
  return compile_step(cfg, h100s)


def one_b_width(micro_batches: int, rows: int = 16):
  """Llama-3.2-1B's width with 2 layers on one H100, `rows` rows of 4096 tokens."""
  cfg = load_config(os.path.join(REPO, 'configs', 'llama3_1b.py'))
  cfg.model.num_layers = 2
  cfg.mesh.update(data=1, fsdp=1, pipe=1, tensor=1)
  cfg.train.update(global_batch=rows, micro_batches=micro_batches)
  return cfg


@pytest.fixture(scope='session')
def one_b_programs():
  """`one_b_width(micro_batches=8)` under a remat policy, compiled when first asked for."""
  programs = {}

  def program(remat: str):
    if remat not in programs:
      cfg = one_b_width(micro_batches=8)
      cfg.model.remat = remat
      programs[remat] = compile_step(cfg, backends.gpu_devices(H100, 1))
    return programs[remat]
  return program


@pytest.fixture(scope='session')
def one_b_program(one_b_programs):
  return one_b_programs('dots')  # llama3_1b.py's own policy


@pytest.fixture(scope='session')
def tiny_pipelines(h100s):
  """tiny() on data=2 pipe=2 tensor=2 (2 of its 4 layers per stage, M=4 micro-batches) under
  a remat policy and schedule, compiled when first asked for."""
  programs = {}

  def program(remat: str, schedule: str):
    if (remat, schedule) not in programs:
      cfg = tiny(remat=remat)
      cfg.mesh.update(data=2, fsdp=1, pipe=2, tensor=2)
      cfg.pipeline.update(schedule=schedule,
                          repeats=2 if schedule in ('circular', 'interleaved_1f1b') else 1)
      programs[remat, schedule] = compile_step(cfg, h100s)
    return programs[remat, schedule]
  return program


@pytest.mark.slow
def test_the_program_is_the_h100s(tiny_program):
  assert tiny_program.device.platform == 'gpu' and backends.is_compile_only(tiny_program.device)
  assert tiny_program.device.device_kind == 'NVIDIA H100 80GB HBM3'
  text = tiny_program.text
  assert 'all-reduce-start' in text and '__triton_nested_gemm_fusion' in text  # async, Triton GEMMs


@pytest.mark.slow
def test_kernels_kept_in_the_cache_or_left_unassembled_make_the_same_program(h100s, tmp_path,
                                                                            monkeypatch):
  """A compile for GPUs that are not there keeps its kernels in the compilation cache, one file
  per kind of GPU; a later compile that finds them all there adds none (the file is left as
  it was) and makes the program, memory and all, that a compile without the cache makes, and
  with ptxas optimizing each kernel as XLA's default would (`COMPILE_OPTIONS` skips that).
  So does a compile of the tests' own (conftest's stand-in for ptxas), whose kernels hold no
  machine code."""
  cfg = small_config()
  cfg.model.dtype = 'bfloat16'
  path = backends.gpu_kernel_file(str(tmp_path), h100s[0])
  stand_in = str(tmp_path / 'stand_in')
  programs, kept = [], []
  for cache in ('', str(tmp_path), str(tmp_path), stand_in):  # one line: the same source lines
    cfg.compilation_cache = cache
    assembler = contextlib.nullcontext() if cache == stand_in else real_ptxas()
    with monkeypatch.context() as m, assembler:
      if not cache:  # ptxas optimizing each kernel, as XLA's default would
        m.setitem(compile_module.COMPILE_OPTIONS, 'xla_gpu_disable_gpuasm_optimizations', False)
      programs.append(compile_step(cfg, h100s[:1]))
    kept.append(os.path.exists(path) and (os.stat(path).st_mtime_ns, os.path.getsize(path)))
  assert kept[0] is False and kept[1] and kept[2] == kept[1] == kept[3]
  assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
  plain, _, again, unassembled = programs
  assert (again.text, again.memory) == (plain.text, plain.memory)
  assert (unassembled.text, unassembled.memory) == (plain.text, plain.memory)
  [stand_in_kernels] = glob.glob(os.path.join(stand_in, '**', '*.bin'), recursive=True)
  assert os.path.getsize(stand_in_kernels) < os.path.getsize(path) / 4, (  # no machine code
      'ptxas assembled the kernels: conftest.PTXAS_STAND_IN did not run')


@pytest.mark.slow
def test_cudnn_flash_attention_runs_both_ways(tiny_program, one_b_program):
  """Forward and backward are cuDNN flash kernels, one pair per layer per micro-batch (plus a
  forward recomputed under remat='dots'). Packed rows reach them in cuDNN's packed layout:
  each row's documents as spans (model.max_documents = 16 per row), no bias; one sequence per
  row needs neither."""
  kernels = {k.target: k for k in hlo.fused_attention(tiny_program.text)}
  assert set(kernels) == {'__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'}
  for k in kernels.values():
    assert k.flash and k.mask == 'PADDING_CAUSAL' and k.segments == 16 and k.bias is None
    assert k.count == 4
  forward = [k for k in hlo.fused_attention(one_b_program.text) if not k.backward]
  backward = [k for k in hlo.fused_attention(one_b_program.text) if k.backward]
  cfg = one_b_program.cfg
  layers, micro = cfg.model.num_layers, cfg.train.micro_batches
  assert sum(k.count for k in forward) == 2 * layers * micro  # remat recomputes the forward
  assert sum(k.count for k in backward) == layers * micro
  assert all(k.flash and k.bias is None and k.mask == 'CAUSAL' and k.segments == 1
             for k in forward + backward)
  # rows × 32 heads × 4096² × 64 per kernel: 4× that forward, 10× backward, causal half.
  per = cfg.train.global_batch // micro * 32 * 4096 * 4096 * 64
  assert {k.flops for k in forward} == {2 * per} and {k.flops for k in backward} == {5 * per}


def square_arrays(hlo_text: str, T: int) -> set[str]:
  """Shapes in the program with two dimensions of T."""
  return {shape for shape, dims in re.findall(r'\b(\w+\[([\d,]+)\])', hlo_text)
          if dims.split(',').count(str(T)) >= 2}


@pytest.mark.slow
@pytest.mark.parametrize('pipe', [1, 2])
def test_packed_rows_make_no_sequence_by_sequence_array(h100s, pipe):
  """Packed rows of 256 tokens (not the width, 128, so no activation has two dimensions of
  256): no array in the program is [.., 256, 256] (no segment mask, no bias, nor its
  gradient), with or without the pipeline. Inside the pipeline's shard_map (manual over pipe
  and the batch axes) JAX's partitioning rule for cuDNN attention fails to compile; attention
  runs on local shards instead. (The same search finds the A100 program's [B,1,T,T] mask:
  test_packed_rows_reach_cudnn_as_a_mask_before_hopper.)"""
  cfg = tiny()
  cfg.data.seq_len = 256
  if pipe > 1:
    cfg.mesh.update(data=2, fsdp=1, pipe=pipe, tensor=2)
  text = compile_step(cfg, h100s).text
  kernels = hlo.fused_attention(text)
  assert {k.target for k in kernels} == {'__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'}
  assert all(k.flash and k.mask == 'PADDING_CAUSAL' and k.segments == 16 for k in kernels)
  assert square_arrays(text, 256) == set()


@pytest.mark.slow
def test_packed_rows_reach_cudnn_as_a_mask_before_hopper():
  """JAX offers cuDNN's packed layout from Hopper on: on A100s packed rows of 256 tokens reach
  the kernels as the dense segment mask, a [B,1,T,T] bias (B = 16 rows / 4 shards), which
  `square_arrays` finds: the search the Hopper programs above are clear of sees a T×T array
  where a program has one."""
  cfg = tiny()
  cfg.data.seq_len = 256
  text = compile_step(cfg, backends.gpu_devices(A100, 8)).text
  kernels = hlo.fused_attention(text)
  assert {k.target for k in kernels} == {'__cudnn$fmhaScaleBiasSoftmax',
                                         '__cudnn$fmhaScaleBiasSoftmaxBackward'}
  assert all(k.flash and k.mask == 'CAUSAL' and k.bias == 'bf16[4,1,256,256]' and
             k.segments == 1 for k in kernels)
  assert 'bf16[4,1,256,256]' in square_arrays(text, 256)


# Attention forwards per backward kernel: the backward reruns the forward unless the policy
# keeps what cuDNN's forward returns (the output and its softmax statistics).
FORWARDS_PER_BACKWARD = {'none': 1, 'attention': 1, 'dots_except_mlp': 1, 'full': 2, 'dots': 2}


@pytest.mark.slow
@pytest.mark.parametrize('remat', FORWARDS_PER_BACKWARD)
def test_remat_reruns_the_attention_forward_only_if_it_drops_its_outputs(remat, one_b_programs):
  kernels = hlo.fused_attention(one_b_programs(remat).text)
  layers, micro = 2, 8
  assert sum(k.count for k in kernels if k.backward) == layers * micro
  forward = [k for k in kernels if not k.backward]
  assert sum(k.count for k in forward if k.recomputed_by is None) == layers * micro
  reruns = (FORWARDS_PER_BACKWARD[remat] - 1) * layers * micro
  assert sum(k.count for k in forward if k.recomputed_by == 'remat') == reruns


@pytest.mark.slow
def test_recomputed_flops_are_the_forward_work_remat_reruns(one_b_programs):
  """None under 'none'. Under 'full', each layer's forward but the MLP's down projection (its
  output, the next layer's input, is kept): the weight matmuls, 2·(D·(N+2K)·H + N·H·D + 2·D·F)
  FLOPs per token, and the causal attention forward, 2·N·H·T. Both are counted from shapes,
  so the figure is exact. Whatever the policy, the program less what it reruns is the same."""
  reports = {remat: report(one_b_programs(remat), H100) for remat in FORWARDS_PER_BACKWARD}
  flops = {remat: r['flops'] for remat, r in reports.items()}
  once = {remat: f['compiled_per_step'] - f['recomputed_per_step'] for remat, f in flops.items()}
  assert once == pytest.approx({remat: once['none'] for remat in once}, rel=1e-9)
  m, rows, T = one_b_width(micro_batches=8).model, 16, 4096
  D, N, K, H, F = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  per_token = m.num_layers * (2 * (D * (N + 2 * K) * H + N * H * D + 2 * D * F) + 2 * N * H * T)
  assert flops['none']['recomputed_per_step'] == 0
  assert flops['full']['recomputed_per_step'] == pytest.approx(rows * T * per_token, rel=1e-9)
  assert all(f['recomputed_by_xla_per_step'] == 0 for f in flops.values())  # all fit
  assert re.search(r"recomputed 0\.000 TFLOP/step \(0\.0% of model\).*: 0\.000 by remat "
                   r"'none', 0\.000 by XLA", format_report(reports['none']))
  assert re.search(r"recomputed 13\.744 TFLOP/step \(8\.4% of model\).*: 13\.744 by remat "
                   r"'full', 0\.000 by XLA", format_report(reports['full']))


@pytest.mark.slow
@pytest.mark.parametrize('remat,schedule,forwards_per_backward', [
    ('none', 'gpipe', 1), ('full', 'gpipe', 2), ('none', 'circular', 1), ('full', 'circular', 2),
    ('none', '1f1b', 1), ('full', '1f1b', 2), ('full', 'interleaved_1f1b', 2)])
def test_the_pipeline_recomputes_what_model_remat_says(remat, schedule, forwards_per_backward,
                                                       tiny_pipelines):
  """Inside the pipeline the layers keep what model.remat says, as outside it: under 'none'
  the attention forward runs once per backward and nothing is recomputed; under 'full' it runs
  twice, not three times. No iteration (no 1F1B residual slot) keeps a copy of the stage's
  weights (circular slices them per iteration; the checkpoint that recomputes them keeps what
  the layers keep: `model.stack_policy`; 1F1B puts the chunk's weights back in its pullbacks).
  1F1B has as many ticks with forwards, and with backwards, as GPipe has iterations."""
  c = tiny_pipelines(remat, schedule)
  kernels = hlo.fused_attention(c.text)
  iterations = c.pipeline.iterations
  layers = 2 // c.pipeline.repeats  # per iteration
  assert sum(k.count for k in kernels if k.backward) == layers * iterations
  assert sum(k.count for k in kernels if not k.backward) == (
      forwards_per_backward * layers * iterations)
  recomputed = report(c, H100)['flops']['recomputed_per_step']
  assert (recomputed == 0) == (remat == 'none')
  # The stage's MLP weights are [2 layers, 128, 192] on each device (tensor=2 splits the 384),
  # as the program takes them. Kept per iteration (or 1F1B slot) the stage's, or a visit's
  # layers', or one layer's would be an array of [kept, ...] those dimensions, in whatever
  # order XLA lays them out (the activations have a row dimension too).
  entry = next(line for line in c.text.splitlines() if line.startswith('ENTRY '))
  assert 'f32[2,128,192]' in entry.split('->')[0]
  slots = schedule_ticks(schedule, 2, c.pipeline.repeats, 4).slots()[2]
  for kept in (iterations, slots):
    for weight in ((2, 128, 192), (layers, 128, 192), (128, 192)):
      assert not stacked(c.text, kept, weight), (kept, weight)


def stacked(hlo_text: str, lead: int, dims: tuple[int, ...]) -> set[str]:
  """The program's arrays of `lead` × the dimensions `dims`, in any order: a value stacked
  `lead` times, however XLA laid it out."""
  orders = set(itertools.permutations(dims))
  found = set(re.findall(rf'\b([a-z]\w*)\[{lead},([\d,]+)\]', hlo_text))
  return {f'{dtype}[{lead},{rest}]' for dtype, rest in found
          if tuple(map(int, rest.split(','))) in orders}


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_1f1b_keeps_a_few_micro_batches_residuals(remat, tiny_pipelines):
  """GPipe keeps every iteration's residuals for the backward: its stacks of the layers'
  per-row values are [M+S−1 = 5, layers, rows, T, ...]. 1F1B keeps its slots', min(M+1, 2S−1)
  = 3 (`Ticks.slots`): the same stacks lead with 3, and nothing with 5."""
  leading = lambda c: set(re.findall(r'(?:bf16|f32)\[(\d+),2,2,128,\d+\]', c.text)) - {'1'}
  assert leading(tiny_pipelines(remat, 'gpipe')) == {'5'}
  assert leading(tiny_pipelines(remat, '1f1b')) == {'3'}


def test_cudnn_falls_back_to_xla_attention_off_a_gpu():
  model_cfg = tiny().model
  assert with_available_attention(model_cfg, 'cpu').attention == 'xla'
  assert model_cfg.attention == 'cudnn'  # a copy changed, not the config
  assert with_available_attention(model_cfg, 'gpu').attention == 'cudnn'


def tensor_all_reduces(compiled) -> dict[str, float]:
  """Bytes of tensor-axis all-reduces per element type."""
  found = {}
  for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=compiled.cpu):
    if c.axes == ('tensor',) and c.kind == 'all-reduce':
      found[c.dtype] = found.get(c.dtype, 0) + c.bytes
  return found


def fsdp_dtypes(compiled, kind: str) -> set[str]:
  """Element types of the fsdp-axis collectives of one kind."""
  return {c.dtype for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=False)
          if c.axes == ('fsdp',) and c.kind == kind}


@pytest.mark.slow
def test_bf16_compute_moves_bf16_activations_and_weights(tiny_program):
  """The GPU moves what it computes in: the activation all-reduces over tensor (4 per layer)
  and the layer weights gathered over fsdp are bf16. The CPU compiler computes bf16 in f32,
  so its program of the same step moves f32."""
  cfg, m = tiny_program.cfg, tiny_program.cfg.model
  rows = cfg.train.global_batch // 4  # data × fsdp
  activation = rows * cfg.data.seq_len * m.embed_dim * 2  # bf16
  layer_all_reduces = 4 * m.num_layers * 2 * (2 - 1) / 2 * activation
  assert tensor_all_reduces(tiny_program)['bf16'] >= layer_all_reduces
  assert fsdp_dtypes(tiny_program, 'all-gather') == {'bf16', 's32'}  # weights; token ids
  on_cpu = compile_step(tiny())
  assert on_cpu.cpu and set(tensor_all_reduces(on_cpu)) == {'f32'}


@pytest.mark.slow
def test_gradients_cross_the_data_axis_once_per_step(tiny_program, tiny_accumulating):
  """Each device sums its micro-batches' gradients in fp32; the sums are all-reduced over data
  once, after the last. So 4 micro-batches send over data what one batch does (within a few
  bytes: with one, XLA folds the final norm's fsdp all-reduce into the data one), and every
  data reduction runs once per step, inside no loop: neither the micro-batches' nor the layers'."""
  one, four = data_reductions(tiny_program), data_reductions(tiny_accumulating)
  assert {c.count for c in one + four} == {1} and {c.dtype for c in one + four} == {'f32'}
  assert len(four) <= len(one)
  assert sum(c.bytes for c in four) == pytest.approx(sum(c.bytes for c in one), rel=1e-3)


@pytest.mark.slow
def test_zero_reduce_scatters_gradients_and_gathers_params_over_data(tiny_program, h100s):
  """tiny_program (data=2) with sharding.zero=1: over data, the one fp32 all-reduce of the
  gradients becomes one reduce-scatter of them and all-gathers of the updated params, half
  the bytes each; the optimizer state per device halves, the params' does not."""
  cfg = tiny()
  cfg.sharding.zero = 1
  zero = compile_step(cfg, h100s)
  over_data = lambda c: [x for x in hlo.collectives(c.text, c.mesh_shape, cpu=False)
                         if x.axes == ('data',)]
  params = tiny_program.state_bytes['params']
  assert [(x.kind, x.dtype, x.count) for x in over_data(tiny_program)] == [('all-reduce', 'f32', 1)]
  assert over_data(tiny_program)[0].bytes == pytest.approx(params, rel=1e-3)
  # What zero still all-reduces over data are the scalars of the gradient norm.
  moved = [(x.kind, x.dtype, x.count) for x in over_data(zero) if x.bytes_per_call > 32]
  assert sorted(set(moved)) == [('all-gather', 'f32', 1), ('reduce-scatter', 'f32', 1)]
  assert moved.count(('reduce-scatter', 'f32', 1)) == 1
  for kind in ('reduce-scatter', 'all-gather'):
    assert sum(x.bytes for x in over_data(zero) if x.kind == kind) == pytest.approx(
        params / 2, rel=1e-3)
  assert zero.state_bytes['params'] == params
  counts = 8  # the optimizer's two int32 step counts, on every device
  assert zero.state_bytes['optimizer'] - counts == (
      tiny_program.state_bytes['optimizer'] - counts) // 2


@pytest.mark.slow
def test_zero2_reduce_scatters_every_micro_batch(tiny_accumulating, h100s):
  """tiny_accumulating (4 micro-batches) with sharding.zero=2: the gradients are
  reduce-scattered over data once per micro-batch into a sum split as the moments are (where
  without ZeRO they are all-reduced once); the params are all-gathered once."""
  cfg = tiny()
  cfg.train.micro_batches = 4
  cfg.sharding.zero = 2
  zero = compile_step(cfg, h100s)
  over_data = lambda c: [(x.kind, x.dtype, x.count) for x in hlo.collectives(
      c.text, c.mesh_shape, cpu=False) if x.axes == ('data',) and x.bytes_per_call > 32]
  assert over_data(tiny_accumulating) == [('all-reduce', 'f32', 1)]
  assert sorted(set(over_data(zero))) == [('all-gather', 'f32', 1), ('reduce-scatter', 'f32', 4)]
  scattered = sum(x.bytes for x in hlo.collectives(zero.text, zero.mesh_shape, cpu=False)
                  if x.axes == ('data',) and x.kind == 'reduce-scatter')
  assert scattered == pytest.approx(4 * zero.state_bytes['params'] / 2, rel=1e-3)


@pytest.mark.slow
def test_memory_verdict_is_what_a_process_may_use(monkeypatch, one_b_program):
  """The whole batch (48 rows) at once needs more than JAX lets a process take of an H100 by
  default (75%), though less than the card: it does not fit, unless XLA_PYTHON_CLIENT_MEM_FRACTION
  allows more. Accumulating over 8 micro-batches fits."""
  one_h100 = backends.gpu_devices(H100, 1)
  whole = report(compile_step(one_b_width(micro_batches=1, rows=48), one_h100), H100)
  assert 0.75 * H100.memory < whole['memory']['peak'] < H100.memory
  assert whole['memory']['usable'] == 0.75 * H100.memory and not whole['fits']
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.98')
  assert usable_memory(H100) == (0.98 * H100.memory, 0.98)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION')
  accumulated = report(compile_step(one_b_width(micro_batches=8, rows=48), one_h100), H100)
  assert accumulated['fits'] and accumulated['memory']['peak'] < whole['memory']['peak'] / 3
  # The buffer assignment holds the state and the batch as the step's arguments.
  state = one_b_program.state_bytes['params'] + one_b_program.state_bytes['optimizer']
  batch = one_b_program.cfg.train.global_batch * 4096 * 4 * 4  # inputs, targets, positions, mask
  assert one_b_program.memory.arguments == pytest.approx(state + batch, abs=1024)


def test_a_bad_mem_fraction_is_one_line(monkeypatch):
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '75')
  with pytest.raises(ConfigError, match='XLA_PYTHON_CLIENT_MEM_FRACTION'):
    usable_memory(H100)


@pytest.mark.slow
def test_cudnn_checks_ask_the_gpu_compiled_for():
  """cuDNN flash attention takes a head dim of 256 on Hopper only. JAX asks the live backend
  (here the CPU); the compile asks the GPU it is for, and a refusal is a config error."""
  cfg = small_config(data=8)
  cfg.model.update(num_heads=2, num_kv_heads=2, head_dim=256, dtype='bfloat16',
                   attention='cudnn')
  hopper = compile_step(cfg, backends.gpu_devices(H100, 8))
  assert [k.flash for k in hlo.fused_attention(hopper.text)] == [True, True]
  with pytest.raises(ConfigError, match=r"model.attention='cudnn' on NVIDIA A100.*256"):
    compile_step(cfg, backends.gpu_devices(A100, 8))


def test_without_the_plugin_a_gpu_profile_says_what_to_install(monkeypatch):
  monkeypatch.setattr(backends, 'cuda_plugin_installed', lambda: False)
  with pytest.raises(ConfigError, match=r'pip install .*gpu-compile.*--compiler=cpu'):
    backends.gpu_devices(H100, 8)


def test_devices_fill_whole_nodes():
  with pytest.raises(ConfigError, match='--devices=12'):
    backends.gpu_devices(H100, 12)
  devices = backends.gpu_devices(H100, 16)
  assert len(devices) == 16 and len({d.process_index for d in devices}) == 2  # two hosts


@pytest.mark.slow
def test_analyze_json_and_dump_show_the_gpu_program(tmp_path, tiny_program, monkeypatch):
  """The command on tiny_program's config reports and dumps tiny_program, which it is handed
  rather than compiling it again: the config it builds from the command line must be the
  fixture's, for the fixture's devices."""
  def compiled(cfg, devices):
    assert cfg.to_dict() == tiny().to_dict()
    assert [d.device_kind for d in devices] == [tiny_program.device.device_kind] * 8
    return tiny_program
  monkeypatch.setattr(analyze, 'compile_step', compiled)
  dump = tmp_path / 'dump'
  result = run_cli_in_process('--config', 'configs/tiny.py', '--json', '--dump', str(dump),
                              '--config.model.attention=cudnn', '--config.model.dtype=bfloat16',
                              module='jaxllm.analyze')
  assert result.returncode == 0, result.stderr[-2000:]
  r = json.loads(result.stdout)
  assert r['mesh'] == dict(data=2, fsdp=2, pipe=1, tensor=2) and r['prediction']['step_s'] > 0
  assert r['compiler']['platform'] == 'gpu' and r['compiler']['compile_only']
  assert r['compiler']['device'] == 'NVIDIA H100 80GB HBM3'
  assert {k['target'] for k in r['attention']['kernels']} >= {'__cudnn$fmhaSoftmax'}
  assert ('tensor', 'bf16') in {(c['axes'][0], c['dtype']) for c in r['collectives']}
  assert sorted(os.listdir(dump)) == ['program.hlo.txt', 'report.json', 'report.txt']
  assert json.loads((dump / 'report.json').read_text()) == r
  assert 'all-reduce-start' in (dump / 'program.hlo.txt').read_text()
  assert 'cuDNN kernels' in (dump / 'report.txt').read_text()
  pr = r['prediction']  # where the step's time goes, kernel by kernel
  parts = [pr[f'{c}_s'] for c in timing.CATEGORIES]
  assert min(parts) >= 0 and pr['gemm_s'] > 0 and pr['attention_s'] > 0
  assert sum(parts) == pytest.approx(pr['step_s'])
  assert pr['hidden_comm_s'] + pr['exposed_comm_s'] == pytest.approx(pr['comm_s'])
  top = pr['top_kernels']
  assert len(top) == 10 and [k['seconds'] for k in top] == sorted(
      (k['seconds'] for k in top), reverse=True)
  assert {k['category'] for k in top} <= {'gemm', 'attention', 'memory', 'collective'}
  # Any program's HLO text, read back as `analyze --hlo` reads it (the command itself:
  # test_readme), is predicted the same, on one node of 8 or on two of 4: there the
  # collectives over data (alone or with fsdp) cross between nodes, which `--hlo` finds from
  # the device numbers in the program's groups and `analyze` from the mesh and its
  # mesh.across_hosts.
  text = (dump / 'program.hlo.txt').read_text()
  assert program_report(text, H100, 8, 8)['prediction']['step_s'] == pytest.approx(pr['step_s'])
  two_nodes = dataclasses.replace(H100, devices_per_node=4)
  across = report(tiny_program, two_nodes)
  crossing = {tuple(c['axes']) for c in across['collectives'] if c['crosses_nodes']}
  assert crossing and all('data' in axes for axes in crossing)
  assert program_report(text, two_nodes, 8, 4)['prediction']['step_s'] == pytest.approx(
      across['prediction']['step_s'])
  assert across['prediction']['exposed_comm_s'] > pr['exposed_comm_s']  # InfiniBand is slower
  before = {f: (dump / f).read_text() for f in os.listdir(dump)}
  again = run_cli_in_process('--config', 'configs/tiny.py', '--dump', str(dump),
                             module='jaxllm.analyze')
  assert again.returncode == 2
  assert again.stderr.strip().splitlines() == [
      f'error: --dump {dump}: exists and is not an empty directory; name a new one.']
  assert {f: (dump / f).read_text() for f in os.listdir(dump)} == before


def test_tune_measures_only_on_as_many_devices_as_present():
  """(tune's GPU path end to end: the README's tune command, test_readme.)"""
  result = run_cli_in_process('--config', 'configs/tiny.py', '--devices', '16', '--measure', '1',
                              module='jaxllm.tune')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'error: --measure runs the candidates on the devices present, 8 × cpu; rank for as many '
      '(--devices 8) or leave --measure out.']


@pytest.mark.slow
def test_weight_gradients_reduce_in_grad_reduce_dtype(tiny_program, h100s):
  """Weights are gathered in bf16, but their gradients are made and reduce-scattered in fp32
  unless model.grad_reduce_dtype says otherwise."""
  assert fsdp_dtypes(tiny_program, 'reduce-scatter') == {'f32'}
  bf16_grads = compile_step(tiny(grad_reduce_dtype='bfloat16'), h100s)
  assert fsdp_dtypes(bf16_grads, 'reduce-scatter') == {'bf16'}
  assert fsdp_dtypes(bf16_grads, 'all-gather') == {'bf16', 's32'}


def collective_arrays(hlo_text: str) -> set[str]:
  """The arrays (dtype[dims]) the program's collectives deliver."""
  computations, _ = hlo.program(hlo_text)
  return {f'{dtype}[{",".join(map(str, dims))}]'
          for insts in computations.values() for inst in insts.values()
          if hlo.collective_kind(inst) for dtype, dims in hlo.arrays(hlo.delivered(inst))}


@pytest.mark.slow
def test_embedding_table_is_never_gathered(tiny_program):
  """The lookup moves rows (an all-to-all over fsdp), not the [V, D] table. Every array with a
  vocabulary dimension (320, or 160 per tensor part) that a collective delivers is one of the
  output head's [D, V] and its gradient's, gathered for the loss (the embed dimension 128, or
  64 per fsdp part, first): none is the table's, in either order."""
  m = tiny_program.cfg.model
  V, D = m.vocab_size, m.embed_dim
  with_vocab = {a for a in collective_arrays(tiny_program.text)
                if {V, V // 2} & set(map(int, a[a.index('[') + 1:-1].split(',')))}
  assert with_vocab == {f'bf16[{D // 2},{V}]', f'bf16[{D},{V}]', f'f32[{D},{V}]',
                        f'f32[{D // 2},{V}]'}
  assert fsdp_dtypes(tiny_program, 'all-to-all') == {'bf16'}


def logit_positions(compiled) -> int:
  """The most positions any fp32 [..., V] logits the program makes hold, counted as rows ×
  positions however XLA lays them out. Logits are the head matmul's output ('rd,dv->rv' in
  `model.loss`): other [..., V] arrays, such as the head's gradient being summed, are not
  logits."""
  V = compiled.cfg.model.vocab_size
  return max(math.prod(int(d) for d in shape.split('[')[1].rstrip(']').split(',')[:-1])
             for _, shape, op in hlo.largest_values(compiled.text, k=1000)
             if shape.startswith('f32[') and shape.endswith(f',{V}]') and 'rd,dv->rv' in op)


@pytest.mark.slow
def test_logits_exist_one_chunk_at_a_time(one_b_program):
  """The 1B-width program (2 rows of 4096 per micro-batch, vocabulary 128,256) holds fp32
  logits for model.loss_chunk = 1024 positions at a time, never for the whole sequence."""
  assert logit_positions(one_b_program) == 2 * 1024


@pytest.mark.slow
def test_the_head_gradient_is_summed_split_as_the_head_is(tiny_program, h100s):
  """With a vocabulary larger than its fsdp group's tokens (4096 against 1024 per tensor
  part), the loss gives each device all the group's rows and a slice of the vocabulary: the
  head's gradient it sums over the chunks is [D, V/(fsdp·tensor)] in fp32, complete for its
  slice, and no array of a whole embed dimension × the tensor part [D, V/tensor] exists (each
  device's rows' unreduced gradient of the whole head, or the head gathered whole along it):
  the head reaches the slices by ppermutes of 1/fsdp of each device's part. With tiny's own
  320 entries (160 per tensor part) the rows would move more: the head is gathered."""
  sliced = compile_step(tiny(vocab_size=4096), h100s)
  mesh = sliced.mesh_shape
  D, fsdp, tensor = sliced.cfg.model.embed_dim, mesh['fsdp'], mesh['tensor']

  def head_arrays(compiled):
    V = compiled.cfg.model.vocab_size
    shapes = set(re.findall(r'\b((?:bf16|f32)\[\d+,\d+\])', compiled.text))
    return {f'{dtype}[{D},{V // parts}]' for dtype in ('bf16', 'f32') for parts in (
        tensor, fsdp * tensor)} & shapes

  V = sliced.cfg.model.vocab_size
  assert head_arrays(sliced) == {f'{dtype}[{D},{V // (fsdp * tensor)}]' for dtype in (
      'bf16', 'f32')}  # the slice and its gradient
  head_parts = [x for x in hlo.collectives(sliced.text, mesh, cpu=False)
                if x.axes == ('fsdp',) and x.kind == 'collective-permute']
  part = D // fsdp * V // tensor // fsdp  # of the head, to one other device
  assert {(x.dtype, x.bytes_per_call) for x in head_parts} == {('bf16', 2 * part),
                                                            ('f32', 4 * part)}
  V = tiny_program.cfg.model.vocab_size
  assert {f'bf16[{D},{V // tensor}]', f'f32[{D},{V // tensor}]'} <= head_arrays(tiny_program)


@pytest.fixture(scope='session')
def pipeline_program(h100s):
  """tiny as a pipeline over pipe=2, with data=2 × fsdp=2 (packed, bf16, cuDNN)."""
  cfg = tiny()
  cfg.mesh.update(data=2, fsdp=2, pipe=2, tensor=1)
  return compile_step(cfg, h100s)


@pytest.mark.slow
@pytest.mark.parametrize('gather', ['step', 'iteration'])
def test_pipeline_gathers_stage_weights_in_bf16(gather, pipeline_program, h100s):
  """Under the pipeline too, stage weights cross fsdp in bf16 and their gradients in fp32."""
  compiled = pipeline_program
  if gather == 'iteration':
    cfg = tiny()
    cfg.mesh.update(data=2, fsdp=2, pipe=2, tensor=1)
    cfg.pipeline.gather_weights = 'iteration'
    compiled = compile_step(cfg, h100s)
  assert fsdp_dtypes(compiled, 'all-gather') == {'bf16', 's32'}
  assert fsdp_dtypes(compiled, 'reduce-scatter') == {'f32'}


@pytest.mark.slow
def test_the_pipeline_runs_the_output_head_once_per_row(pipeline_program):
  """The last stage hands each stage M/S of the finished micro-batches: each device makes the
  logits of its 16 / (data × fsdp × pipe) = 2 rows of 128 positions, not of the 4 its pipe
  group holds (the head ran on every stage, on every row, before)."""
  c = pipeline_program
  rows = c.cfg.train.global_batch // (c.mesh_shape['data'] * c.mesh_shape['fsdp'] *
                                      c.mesh_shape['pipe'])
  assert logit_positions(c) == rows * c.cfg.data.seq_len == 2 * 128


SEQUENCE_PARALLEL = dict(act_seq=('tensor',))
CONTEXT_PARALLEL = dict(batch=('data',), seq=('fsdp',))


@pytest.fixture(scope='session')
def tiny_split(h100s):
  """tiny() with these rules changed, compiled when first asked for."""
  programs = {}

  def program(**rules):
    key = tuple(sorted(rules.items()))
    if key not in programs:
      cfg = tiny()
      cfg.sharding.rules.update(rules)
      programs[key] = compile_step(cfg, h100s)
    return programs[key]
  return program


@pytest.mark.slow
def test_sequence_parallelism_splits_the_tensor_all_reduces(tiny_program, tiny_split):
  """sharding.rules.act_seq=('tensor',) on tiny_program's mesh: each all-reduce of the
  residual stream's b·s·h over tensor (4 per layer, and the head's) becomes a reduce-scatter
  of half its bytes (and all-gathers), and the activations each device keeps shrink."""
  cfg = tiny()
  sp = tiny_split(**SEQUENCE_PARALLEL)
  rows, T, D = 16 // 4, 128, 128  # rows on a device: global_batch over data×fsdp
  bsh = rows * T * D * 2
  over_tensor = lambda c, kind, size: sum(
      x.count for x in hlo.collectives(c.text, c.mesh_shape, cpu=False)
      if x.axes == ('tensor',) and x.kind == kind and x.dtype == 'bf16' and
      x.bytes_per_call == size)
  layers = cfg.model.num_layers
  assert over_tensor(tiny_program, 'all-reduce', bsh) >= 4 * layers
  assert over_tensor(tiny_program, 'reduce-scatter', bsh / 2) == 0
  assert over_tensor(sp, 'reduce-scatter', bsh / 2) >= 4 * layers
  assert over_tensor(sp, 'all-reduce', bsh) <= 1
  assert memory(sp)['temporaries'] < memory(tiny_program)['temporaries']


@pytest.mark.slow
def test_context_parallelism_gathers_keys_and_values_over_fsdp(tiny_split):
  """sharding.rules.seq=('fsdp',), batch=('data',) on tiny's mesh: each device keeps half
  of every row's sequence and attends with cuDNN from those queries to all the keys (the
  mask as a [B, 1, T/2, T] bias); per layer the keys' and values' gradients are
  reduce-scattered back over fsdp in bf16, (N−1)/N of the whole sequence's K and V."""
  cp = tiny_split(**CONTEXT_PARALLEL)
  m = tiny().model
  rows, T, kv_width = 16 // 2, 128, m.num_kv_heads // 2 * m.head_dim  # kv heads over tensor=2
  kv_bytes = 2 * 1 / 2 * rows * T * kv_width * 2
  scatters = [x for x in hlo.collectives(cp.text, cp.mesh_shape, cpu=False)
              if x.axes == ('fsdp',) and x.kind == 'reduce-scatter' and x.dtype == 'bf16']
  assert sum(x.count for x in scatters if x.bytes_per_call == kv_bytes) == m.num_layers
  kernels = attention(cp)['kernels']
  assert {k['target'] for k in kernels} == {'__cudnn$fmhaScaleBiasSoftmax',
                                           '__cudnn$fmhaScaleBiasSoftmaxBackward'}
  assert {k['bias'] for k in kernels} == {f'bf16[{rows},1,{T // 2},{T}]'}


@pytest.mark.slow
def test_context_and_sequence_parallelism_together_move_what_each_does_alone(tiny_split):
  """Both splits at once: fsdp carries context parallelism's bytes and tensor sequence
  parallelism's, within 2%; over fsdp × tensor at once only the norm scales' gradients are
  summed. (Left to itself XLA gathered whole sequences over both instead of the projections'
  weights: 2.7× the fsdp bytes, 2.3× the tensor bytes and 3.2 MiB over fsdp × tensor; and
  an embedding lookup of whole rows had its gradient gathered over both, 0.2 MiB.)"""
  both = tiny_split(**CONTEXT_PARALLEL, **SEQUENCE_PARALLEL)

  def bytes_over(c):
    totals = collections.Counter()
    for x in hlo.collectives(c.text, c.mesh_shape, cpu=False):
      totals[x.axes] += x.bytes
    return totals
  both_bytes = bytes_over(both)
  assert both_bytes[('fsdp',)] == pytest.approx(
      bytes_over(tiny_split(**CONTEXT_PARALLEL))[('fsdp',)], rel=0.02)
  assert both_bytes[('tensor',)] == pytest.approx(
      bytes_over(tiny_split(**SEQUENCE_PARALLEL))[('tensor',)], rel=0.02)
  assert both_bytes[('fsdp', 'tensor')] < 0.01 * both_bytes[('fsdp',)]


@pytest.mark.slow
def test_each_weight_is_gathered_once_per_pass_whatever_the_remat_policy(h100s):
  """The backward gathers each layer's weights once, whether it reruns the forward (remat)
  or keeps its activations: the rerun forward and the matmuls of the gradients share the
  weight as the matmul took it. So every policy moves what `dots` does over fsdp (bf16
  weights once forward, once backward; fp32 gradients once)."""
  def fsdp_traffic(remat):
    cfg = tiny(remat=remat)
    cfg.mesh.update(data=1, fsdp=8, pipe=1, tensor=1)
    c = compile_step(cfg, h100s)
    moved = collections.Counter()
    for x in hlo.collectives(c.text, c.mesh_shape, cpu=False):
      if x.axes == ('fsdp',) and x.kind == 'all-gather':
        moved['count'] += x.count
        moved[x.dtype] += x.bytes
    return moved
  kept = fsdp_traffic('dots')
  assert kept['bf16'] > 0
  for remat in ('full', 'dots_except_mlp'):
    assert fsdp_traffic(remat) == kept, remat


@pytest.mark.parametrize('options', [{}, {'xla_gpu_enable_triton_gemm': False}],
                         ids=['default', 'triton_gemm_off'])
def test_cublas_gemms_count_their_flops(options, h100s):
  """GEMMs XLA hands to cuBLAS (`__cublas$lt$matmul` custom calls, as with
  --xla_gpu_enable_triton_gemm=false, which NVIDIA's and MaxText's GPU flags set) count
  2·M·N·K FLOPs each, batch dimensions included, as `dot`s do."""
  import jax
  import jax.numpy as jnp
  device = jax.sharding.SingleDeviceSharding(h100s[0])
  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=device)
  matmuls = lambda x, w, a, b: (x @ w, jnp.einsum('bij,bjk->bik', a, b))
  text = jax.jit(matmuls).lower(arg(256, 512), arg(512, 384), arg(4, 128, 256),
                                arg(4, 256, 64)).compile(options).as_text()
  # Without Triton GEMMs every product is a cuBLAS call; with them, Triton fusions of `dot`s
  # (split-K among them). The FLOPs are the same either way.
  assert ('__cublas$lt$matmul' in text) == (options != {})
  assert hlo.dot_flops(text) == 2 * 256 * 512 * 384 + 2 * 4 * 128 * 256 * 64
  # The timing model times every product as a GEMM; cuBLAS's at the measured rate of each
  # shape (Triton's may be split along K, into shapes of their own)
  rates = H100.rates
  t = timing.step_time(text, rates, 1, timing.node_crossing(8, 1))
  gemms = [k for k in t.kernels if k.category == 'gemm']
  assert sum(k.flops for k in gemms) == hlo.dot_flops(text)
  if options:
    assert t.by_category['gemm'] == pytest.approx(
        2 * 256 * 512 * 384 / rates.gemm_rate('bf16xbf16->bf16', 1, 256, 384, 512)
        + 2 * 4 * 128 * 256 * 64 / rates.gemm_rate('bf16xbf16->bf16', 4, 128, 64, 256), rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize('recipe', ['delayed', 'current'])
def test_fp8_layer_matmuls_are_cublaslt_fp8_calls_and_gather_fp8(recipe, h100s):
  """configs/tiny.py with model.fp8 on 8 H100s: every matmul of the layers (forward, input
  and weight gradients) is a cuBLASLt FP8 call taking E4M3 inputs and weights and E5M2
  output gradients, none left in bf16; only the head's stay bf16; and fsdp gathers the
  layers' weights in FP8. ptxas assembles its kernels (the quantizing fusions among them)."""
  with real_ptxas():
    compiled = compile_step(tiny(fp8=recipe), h100s)
  computations, counts = hlo.program(compiled.text)
  kinds = collections.Counter()
  for comp, insts in computations.items():
    for inst in insts.values():
      if counts.get(comp) and (shape := hlo.gemm_shape(insts, inst)):
        target = re.search(r'custom_call_target="([^"]+)"', inst.attrs)
        kinds[target.group(1) if target else inst.opcode, shape[0].split('->')[0]] += (
            counts[comp])
  fp8 = {k: n for k, n in kinds.items() if k[0] == '__cublas$lt$matmul$f8'}
  assert {types for _, types in fp8} == {'f8e4m3fnxf8e4m3fn', 'f8e5m2xf8e4m3fn',
                                         'f8e4m3fnxf8e5m2'}, kinds
  layers = tiny().model.num_layers
  # 7 matmuls a layer in each pass (forward, input and weight gradients), none merged
  assert set(fp8.values()) == {7 * layers}, kinds
  bf16 = {k: n for k, n in kinds.items() if 'bf16' in k[1]}
  assert sum(bf16.values()) <= 3, kinds  # the head's forward and two gradients
  gathered = collections.Counter()
  for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=False):
    if c.kind == 'all-gather' and c.axes == ('fsdp',):
      gathered[c.dtype] += c.bytes
  assert gathered['f8e4m3fn'] > gathered['bf16'] > 0  # the layers' weights; the head's


@pytest.mark.slow
def test_fp8_is_predicted_faster_where_gemms_take_the_step(one_b_programs, monkeypatch):
  """analyze's FP8 speed-up (`analyze.fp8_speedup`: the same step with model.fp8='none',
  compiled and timed alike) on the 1B width, where GEMMs take most of the step: FP8 GEMMs are
  predicted faster and so is the step, though quantizing adds memory-bound kernels. (On tiny's
  widths launches and small kernels take the step and FP8, adding kernels, is predicted
  slower.) The bf16 step is `one_b_programs('dots')`, compiled once for the session."""
  cfg = one_b_width(micro_batches=8)
  cfg.model.update(remat='dots', fp8='delayed')
  bf16_program = one_b_programs('dots')

  def compiled_already(bf16_cfg, devices):
    twin = copy.deepcopy(cfg)
    twin.model.fp8 = 'none'
    assert bf16_cfg.to_dict() == twin.to_dict() and len(devices) == 1
    return bf16_program

  r = report(compile_step(cfg, backends.gpu_devices(H100, 1)), H100)
  monkeypatch.setattr(analyze, 'compile_step', compiled_already)
  r['fp8_speedup'] = analyze.fp8_speedup(cfg, backends.gpu_devices(H100, 1), H100,
                                         r['prediction'])
  bf16, fp8 = report(bf16_program, H100)['prediction'], r['prediction']
  assert r['fp8_speedup']['bf16_step_s'] == bf16['step_s']
  assert r['fp8_speedup']['speedup'] == pytest.approx(bf16['step_s'] / fp8['step_s'])
  assert fp8['gemm_s'] < 0.9 * bf16['gemm_s'] and fp8['memory_s'] > bf16['memory_s']
  assert r['fp8_speedup']['speedup'] > 1.03
  assert "FP8 (model.fp8='delayed') against bf16" in format_report(r)


@pytest.mark.slow
def test_sliding_and_full_layers_run_their_own_cudnn_kernels(h100s):
  """Layers that differ (Gemma 3's options, sliding and full in turn, a window of 32 of the
  128 positions) run a windowed and a full cuDNN flash kernel, each counted for the layers
  that take it (its branch of the per-layer choice says how many), with the windowed one's
  FLOPs over the window's band: W·T − W²/2 query-key pairs where causal attention has T²/2.
  The report names the window."""
  cfg = tiny(qk_norm=True, mlp_activation='gelu_tanh', norm_zero_centered=True, post_norms=True,
             scale_embeddings=True, layer_types=('sliding', 'full'), sliding_window=32,
             sliding_rope_theta=100.0)
  compiled = compile_step(cfg, h100s)
  kernels = {(k.target, k.window): k for k in hlo.fused_attention(compiled.text)}
  assert set(kernels) == {(target, window) for window in (0, 32)
                          for target in ('__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward')}
  for k in kernels.values():
    assert k.flash and k.mask == 'PADDING_CAUSAL' and k.count == 2 and k.length == 128
  for target in ('__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'):
    assert kernels[target, 32].flops == kernels[target, 0].flops * (32 * 128 - 32**2 / 2) / (
        128**2 / 2)
  text = format_report(report(compiled, H100))
  assert re.search(r'__cudnn\$fmhaSoftmax +×2 +flash, mask PADDING_CAUSAL, window 32, ', text)
  # The timing model runs each branch for its layers too, not the longer one for all four.
  predicted = timing.step_time(compiled.text, H100.rates, 8, timing.node_crossing(8, 8))
  assert sorted(k.count for k in predicted.kernels if k.category == 'attention') == [2] * 4
