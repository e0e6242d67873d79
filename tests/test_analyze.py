"""`jaxllm.analyze` and `jaxllm.tune`: compiled collectives against the analytic formulas
(the CPU compiler's program and the GPU's), memory against the shardings, the HLO reader, the
big-config path, the ranking, and bad input. More of the GPU's program: test_gpu_program."""

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import jax
import pytest
from absl import flags

from conftest import (REPO, data_reductions, once_per_run, run_cli_in_process, run_dir,
                      small_config)
from jaxllm import analyze as analyze_cli
from jaxllm import backends, tune
from jaxllm.cli import load_config
from jaxllm.config import PIPELINE_SCHEDULES, ConfigError
from jaxllm.cost import hlo
from jaxllm.cost.compile import compile_step
from jaxllm.cost import tune as tune_search
from jaxllm.cost.depth import extrapolate
from jaxllm.cost.estimate import Estimate
from jaxllm.cost.hardware import PROFILES, axes_across_nodes
from jaxllm.cost.report import analyze, collective_table, memory
from jaxllm.cost.traffic import expected_bytes
from jaxllm.cost.tune import (Space, candidates, experts_text, factorisations, format_table,
                               pipeline_text, rank)
from jaxllm.train import setup

H100 = PROFILES['h100-nvlink']


def comm_config(**mesh):
  """`small_config` with 8 kv heads, so that tensor=8 splits them too."""
  cfg = small_config(**mesh)
  cfg.model.update(num_heads=8, num_kv_heads=8)
  cfg.train.global_batch = 16
  return cfg


# Which meshes' figures are exact: data (the gradient all-reduce is the only traffic) and
# pipe (stage shifts, bubbles included, the outputs handed to the stages, the input's gradient
# and the output head's); fsdp's within 1% (the embedding's token ids and the loss's scalar
# sums are the bytes no formula counts); tensor a little over 4 all-reduces per layer, for the
# output head's backward and the vocabulary-split loss. The GPU's program meets them as the
# CPU compiler's does, in fp32 (where nothing is cast before it moves), read as compiled:
# notebooks/03_collectives.ipynb compiles these four configs for 8 H100s, and test_notebooks
# hands its reports to `assert_gpu_reports_meet_the_formulas`.
FSDP_BOUNDS = (0.99, 1.01)
MESH_BOUNDS = [
    (dict(data=8), dict(data=(0.999, 1.001))),
    # (With data > 1 too, XLA's GPU compiler merges the head's pipe all-reduce into the data
    # one, a group no single-axis figure counts.)
    # The loss splits the vocabulary over fsdp here (128 tokens in its group, 264 entries)...
    (dict(pipe=4, fsdp=2), dict(pipe=(0.999, 1.001), fsdp=FSDP_BOUNDS)),
    (dict(fsdp=8), dict(fsdp=FSDP_BOUNDS)),  # ...and gathers the head here (512 tokens)
    (dict(tensor=8), dict(tensor=(1.0, 1.15))),  # the loss, split by vocabulary, adds a few
]


def assert_meets_the_formulas(report, bounds):
  for axis, (low, high) in bounds.items():
    row = next(r for r in report['per_axis'] if r['axes'] == [axis])
    assert low <= row['ratio'] <= high, row


@pytest.mark.slow
@pytest.mark.parametrize('mesh, bounds', MESH_BOUNDS)
def test_compiled_collective_bytes_match_the_formulas(mesh, bounds):
  report = analyze(comm_config(**mesh), H100, jax.devices())
  assert report['compiler']['platform'] == 'cpu'
  assert_meets_the_formulas(report, bounds)


# What shapes a step's program (the rest of a config, e.g. the learning rate, moves no byte).
PROGRAM_SECTIONS = ('model', 'mesh', 'data', 'sharding', 'pipeline')


def assert_gpu_reports_meet_the_formulas(found: dict):
  """Notebook 03's analyses of the GPU's program: {name: {'config': its config as JSON,
  'report': analyze's report}}, one for each of MESH_BOUNDS's configs (the notebook's
  `small_config` must be `comm_config` in all that shapes the program)."""
  assert len(found) == len(MESH_BOUNDS)
  for mesh, bounds in MESH_BOUNDS:
    want = json.loads(comm_config(**mesh).to_json())
    [name] = [n for n, f in found.items() if json.loads(f['config'])['mesh'] == want['mesh']]
    got = json.loads(found[name]['config'])
    for section in PROGRAM_SECTIONS:
      assert got[section] == want[section], (name, section)
    assert (got['train']['global_batch'], got['train']['micro_batches']) == (
        want['train']['global_batch'], want['train']['micro_batches']), name
    report = found[name]['report']
    assert report['compiler']['platform'] == 'gpu', name
    assert_meets_the_formulas(report, bounds)
    assert not any(c['rewritten'] for c in report['collectives']), name
    assert report['attention'] == {'implementation': 'xla', 'kernels': [],
                                   'flops_per_device': 0.0}, name


PIPE_BOUNDS = (0.999, 1.001)


@pytest.mark.slow
@pytest.mark.parametrize('mesh,pipeline,bounds', [
    (dict(pipe=4, fsdp=2), dict(schedule='1f1b', microbatches=2),
     dict(pipe=PIPE_BOUNDS, fsdp=FSDP_BOUNDS)),
    (dict(pipe=2, fsdp=4), dict(schedule='interleaved_1f1b', repeats=2),
     dict(pipe=PIPE_BOUNDS, fsdp=FSDP_BOUNDS)),
    # (At S=2 without repeats the backward-only phase is one tick, which XLA unrolls, dropping
    # its gradient send that nothing receives: pipe sends one micro-batch's gradient less.)
    (dict(pipe=2, fsdp=2, tensor=2), dict(schedule='1f1b'), dict(fsdp=FSDP_BOUNDS)),
], ids=['1f1b', 'interleaved_1f1b', '1f1b_tensor'])
def test_1f1b_collective_bytes_match_the_formulas(mesh, pipeline, bounds):
  """1F1B shifts activations in every tick with a forward and gradients in every tick with a
  backward, hands no outputs out (the last stage runs the head) and gathers the head over fsdp
  once: the GPU program's bytes meet the formulas as GPipe's do. With tensor too, each device
  gathers its own tensor block of the stage weights over fsdp (XLA gathered them whole over
  tensor, tensor times the bytes, before `pipeline._blockwise`)."""
  if not backends.cuda_plugin_installed():
    pytest.skip('needs JAX\'s CUDA plugin: pip install -e ".[dev]"')
  cfg = comm_config(**mesh)
  cfg.pipeline.update(pipeline)
  report = analyze(cfg, H100, backends.gpu_devices(H100, 8))
  for axis, (low, high) in bounds.items():
    row = next(r for r in report['per_axis'] if r['axes'] == [axis])
    assert low <= row['ratio'] <= high, row


def test_data_parallel_traffic_is_the_gradient_all_reduce():
  """An independent check of the data formula: 2(N−1)/N × every parameter's fp32 bytes."""
  cfg = comm_config(data=8)
  compiled = compile_step(cfg)
  m = cfg.model
  params = 2 * m.vocab_size * m.embed_dim  # input embedding and (untied) output head
  per_layer = (m.embed_dim * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
               + m.num_heads * m.head_dim * m.embed_dim + 3 * m.embed_dim * m.mlp_dim
               + 2 * m.embed_dim)
  params += m.num_layers * per_layer + m.embed_dim
  assert expected_bytes(compiled)[('data',)] == pytest.approx(2 * 7 / 8 * 4 * params)
  found = hlo.collectives(compiled.text, compiled.mesh_shape, cpu=True)
  assert {c.axes for c in found} == {('data',)}
  assert sum(c.bytes for c in found) == pytest.approx(2 * 7 / 8 * 4 * params, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize('mesh, micro_batches', [
    (dict(data=2, fsdp=2, tensor=2), (2, 4)),
    (dict(data=2, pipe=2, tensor=2), (2,)),
], ids=['data2_fsdp2_tensor2', 'data2_pipe2_tensor2'])
def test_gradients_cross_the_data_axis_once_per_step(mesh, micro_batches):
  """The CPU compiler's program (the GPU's: test_gpu_program): summed over 2 or 4
  micro-batches, the gradients cross data once per step (count 1: in no loop over the
  micro-batches), moving the bytes of one batch's. Without the pipeline, that is the very same
  reduction as one batch's; through it, XLA merges one batch's two into one."""
  def reductions(micro):
    cfg = comm_config(**mesh)
    cfg.train.micro_batches = micro
    return data_reductions(compile_step(cfg))
  one = reductions(1)
  assert one and {c.count for c in one} == {1}
  for micro in micro_batches:
    accumulated = reductions(micro)
    assert {c.count for c in accumulated} == {1}, (micro, accumulated)
    assert sum(c.bytes for c in accumulated) == pytest.approx(sum(c.bytes for c in one),
                                                              rel=1e-6)
    if 'pipe' in mesh:
      assert len(accumulated) <= len(one)
    else:
      assert accumulated == one, micro


def test_fsdp_holds_an_eighth_of_params_and_optimizer_state():
  cfg = comm_config(fsdp=8)
  report = analyze(cfg, H100)
  total = report['params']['total'] * 4  # fp32
  state = report['memory']['params'] + report['memory']['optimizer']
  # AdamW keeps two moments per parameter: params + optimizer ≈ 3 × total / 8.
  assert state == pytest.approx(3 * total / 8, rel=0.05)


def test_collective_groups_are_read_in_every_form():
  mesh = dict(data=2, fsdp=2, pipe=1, tensor=2)
  assert hlo.device_groups('replica_groups={{0,1},{2,3},{4,5},{6,7}}, x') == [
      [0, 1], [2, 3], [4, 5], [6, 7]]
  assert hlo.group_axes(hlo.device_groups('replica_groups=[4,2]<=[8], x'), mesh)[0] == ('tensor',)
  assert hlo.group_axes(hlo.device_groups('replica_groups=[2,4]<=[2,4], x'), mesh)[0] == (
      'fsdp', 'tensor')
  assert hlo.group_axes(hlo.device_groups('replica_groups=[4,2]<=[2,4]T(1,0), x'), mesh)[0] == (
      'data',)
  groups = hlo.device_groups(
      "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, x")
  assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
  # Sub-axes: axis_0 (4) is a major factor 2 and a minor 2; groups run along one of them.
  sub_axis = "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0':(%d)2}, x"
  assert hlo.device_groups(sub_axis % 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert hlo.device_groups(sub_axis % 1) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo.group_axes(hlo.device_groups(sub_axis % 2), mesh)[0] == ('fsdp',)
  assert hlo.group_axes(hlo.device_groups('source_target_pairs={{0,4},{4,0}}, x'), mesh,
                        permute=True) == (('data',), 2)


GPU_SNIPPET = """HloModule m

%wrapped (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %a2a = f32[8,4]{1,0} all-to-all(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

ENTRY %main (x: bf16[4,16], y: f32[16], z: f32[8,4]) -> f32[8] {
  %x = bf16[4,16]{1,0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %z = f32[8,4]{1,0} parameter(2)
  %ag = ((bf16[4,16]{1,0}, f32[16]{0}), (bf16[8,16]{1,0}, f32[32]{0})) all-gather-start(%x, %y), replica_groups=[4,2]<=[8], dimensions={0}
  %agd = (bf16[8,16]{1,0}, f32[32]{0}) all-gather-done(%ag)
  %rs = ((f32[16]{0}), f32[8]{0}) reduce-scatter-start(%y), replica_groups=[4,2]<=[8], dimensions={0}
  %rsd = f32[8]{0} reduce-scatter-done(%rs)
  %ar = bf16[4,16]{1,0} all-reduce-start(%x), replica_groups=[4,2]<=[8]
  %ard = bf16[4,16]{1,0} all-reduce-done(%ar)
  %s = ((f32[8,4]{1,0}), f32[8,4]{1,0}, u32[]) async-start(%z), calls=%wrapped
  %d = f32[8,4]{1,0} async-done(%s), calls=%wrapped
  ROOT %out = f32[8]{0} copy(%rsd)
}
"""


def test_gpu_asynchronous_collectives_are_read_by_element_type():
  """A GPU program's collectives start and finish apart, several combined into one op of
  mixed element types; an op wrapped in async-start runs once, whatever its done names."""
  found = hlo.collectives(GPU_SNIPPET, dict(data=1, fsdp=4, pipe=1, tensor=2), cpu=False)
  got = sorted((c.kind, c.dtype, c.axes, c.count, c.bytes_per_call) for c in found)
  assert got == sorted([
      ('all-gather', 'bf16', ('tensor',), 1, 0.5 * 8 * 16 * 2),   # what arrives, (N−1)/N of it
      ('all-gather', 'f32', ('tensor',), 1, 0.5 * 32 * 4),
      ('reduce-scatter', 'f32', ('tensor',), 1, 1 * 8 * 4),       # (N−1) × the piece kept
      ('all-reduce', 'bf16', ('tensor',), 1, 2 * 0.5 * 4 * 16 * 2),
      ('all-to-all', 'f32', ('tensor',), 1, 0.5 * 8 * 4 * 4),
  ])


def _gemm(name: str) -> str:
  """An HLO computation `name` holding one [8,16]·[16,8] matmul."""
  return f"""%{name} (a: f32[8,16], b: f32[16,8]) -> f32[8,8] {{
  %a = f32[8,16]{{1,0}} parameter(0)
  %b = f32[16,8]{{1,0}} parameter(1)
  ROOT %dot.{name} = f32[8,8]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


# A matmul fusion with two clones from XLA's rematerialization (they rerun it), a clone whose
# original is gone (XLA moved it: it runs once), and a matmul JAX's remat recomputes.
RERUN_SNIPPET = f"""HloModule m

{_gemm('gemm')}
{_gemm('gemm.1')}
{_gemm('gemm.2')}
{_gemm('moved')}
ENTRY %main (x: f32[8,16], y: f32[16,8]) -> f32[8,8] {{
  %x = f32[8,16]{{1,0}} parameter(0)
  %y = f32[16,8]{{1,0}} parameter(1)
  %f = f32[8,8]{{1,0}} fusion(%x, %y), kind=kCustom, calls=%gemm
  %f.remat = f32[8,8]{{1,0}} fusion(%x, %y), kind=kCustom, calls=%gemm.1
  %f.remat2 = f32[8,8]{{1,0}} fusion(%x, %y), kind=kCustom, calls=%gemm.2
  %g.remat = f32[8,8]{{1,0}} fusion(%x, %y), kind=kCustom, calls=%moved
  %r = f32[8,8]{{1,0}} dot(%x, %y), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/transpose(jvp())/checkpoint/rematted_computation/dot_general"}}
  ROOT %out = f32[8,8]{{1,0}} add(%f.remat2, %r)
}}
"""


def test_reruns_are_told_apart_by_who_makes_them():
  one = 2 * 8 * 8 * 16
  assert hlo.dot_flops(RERUN_SNIPPET) == 5 * one
  assert hlo.recomputed_flops(RERUN_SNIPPET) == {'remat': one, 'xla': 2 * one}


def test_the_entry_is_named_as_its_line_names_it():
  """`entry_name` reads the ENTRY line alone, whichever computation comes first (the entry
  comes after the others here), and the parsed module holds a computation of that name."""
  assert hlo.entry_name(RERUN_SNIPPET) == 'main'
  named = RERUN_SNIPPET.replace('ENTRY %main', 'ENTRY %main.110_spmd')
  computations, entry = hlo.parse_module(named)
  assert entry == 'main.110_spmd' and entry in computations and list(computations)[-1] == entry


def test_axes_cross_nodes_as_the_run_lays_them_out():
  shape = dict(data=2, fsdp=8, pipe=1, tensor=4)  # 64 devices: 8 nodes of 8
  assert axes_across_nodes(shape, 'data,pipe,fsdp,tensor', 8) == {'data', 'fsdp'}
  assert axes_across_nodes(shape, 'fsdp,data', 8) == {'fsdp'}
  assert axes_across_nodes(dict(data=8, fsdp=1, pipe=1, tensor=1), 'data', 8) == set()


def test_factorisations_are_all_ordered_products():
  found = factorisations(8, 4)
  assert len(found) == len(set(found)) == 20  # C(3+3, 3): three factors of 2 in four places
  assert all(math.prod(f) == 8 for f in found)


@pytest.fixture(scope='module')
def tiny_searches():
  """tune's searches of the tiny config on 2 devices (every candidate a compile), with one
  program cache: exhaustive over remat none, then over none and full, then over none and full
  leaving out what the estimates rule out (top 3); micro-batches 1 and 3 each time. Made once
  per test run."""
  def searches():
    cfg = load_config(os.path.join(REPO, 'configs', 'tiny.py'))
    cache = os.path.join(run_dir('tiny_searches'), 'programs')
    search = lambda remat, **kw: rank(cfg, H100, Space(remat, (1, 3)), jax.devices()[:2],
                                      cache_dir=cache, **kw)
    return (search(('none',), exhaustive=True), search(('none', 'full'), exhaustive=True),
            search(('none', 'full'), top=3))
  return once_per_run('tiny_searches', searches)


@pytest.mark.slow
def test_tune_ranks_the_tiny_config_and_measures_the_best_two(tiny_searches, monkeypatch):
  """On 2 devices (every candidate is a compile): each of the 4 meshes with 1 micro-batch,
  none with 3, which do not divide the 16 rows. `measure` times the best two's own steps."""
  devices = jax.devices()[:2]
  ranking = tiny_searches[0]
  rows, skipped = ranking.rows, ranking.counts()
  steps = [r['step_s'] for r in rows]
  assert steps == sorted(steps)
  assert sorted(tuple(r['mesh'][a] for a in ('data', 'fsdp', 'pipe', 'tensor')) for r in rows) == (
      sorted(factorisations(2, 4)))
  assert {r['micro_batches'] for r in rows} == {1} and skipped['invalid'] == 4
  # no schedules asked for: the config's, gpipe, where there is a pipeline
  assert {(r['mesh']['pipe'] > 1, r['pipeline']) for r in rows} == {(False, '-'), (True, 'gpipe')}
  for row in rows[:2]:
    seconds, run, ran, drawn = measure_on_a_clock(row['config'], 3, devices, monkeypatch)
    # per timed step, the two warm-ups and the compile left out; each timed step on a batch
    # of its own (the warm-ups rerun the first); the candidate's own mesh and settings
    assert seconds == pytest.approx(STEP) and (ran, drawn) == (2 + 3, 1 + 3)
    assert dict(run.mesh.shape) == row['mesh'] and run.cfg.to_dict() == row['config'].to_dict()


def test_tune_on_the_cpu_compiler_measures_on_the_devices_it_ranked_for():
  """--compiler=cpu --devices 1 in a process of 8 CPU devices: the first one, where the best
  candidate is then measured (as many devices as ranked for)."""
  result = run_cli_in_process('--config', 'configs/tiny.py', '--compiler', 'cpu', '--devices', '1',
                              '--remat', 'none', '--micro-batches', '1', '--measure', '1',
                              '--measure-steps', '1', module='jaxllm.tune')
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.strip().splitlines()
  assert lines[0] == ("1 candidates fit h100-nvlink (none left out); CPU compiler's program for "
                      '1 devices; predicted, best first:')
  assert lines[-2] == 'measured on 1 × cpu, 1 steps each:'
  assert re.fullmatch(r'  1  data=1 fsdp=1 pipe=1 tensor=1  remat none  micro 1  .*: measured '
                      r'[\d,.]+ ms per step, predicted [\d,.]+ (ms|µs) on h100-nvlink', lines[-1])


STEP = 0.25  # seconds of `measure_on_a_clock`'s clock a train step takes


def measure_on_a_clock(cfg, steps, devices, monkeypatch):
  """`tune.measure(cfg, steps, devices)` on a clock that stands still but for the calls of the
  compiled train step, each STEP seconds (the steps themselves run). Returns the seconds it
  measured, the run it set up, how many steps it ran and how many batches it drew."""
  clock, ran, drawn, runs = [0.0], [], [], []

  class Clocked:
    """The run's jitted step, compiled as it is, each call of the program taking STEP."""

    def __init__(self, jitted):
      self.jitted = jitted

    def lower(self, *args):
      lowered = self.jitted.lower(*args)

      def compile():
        program = lowered.compile()

        def call(state, batch):
          ran.append(1)
          clock[0] += STEP
          return program(state, batch)
        return call
      return types.SimpleNamespace(compile=compile)

  def counted(batches):
    for batch in batches:
      drawn.append(1)
      yield batch

  def clocked_setup(c, devices):
    runs.append(setup(c, devices))
    return dataclasses.replace(runs[-1], train_step=Clocked(runs[-1].train_step),
                               batches=counted(runs[-1].batches))

  monkeypatch.setattr(tune, 'setup', clocked_setup)
  monkeypatch.setattr(tune, 'time', types.SimpleNamespace(perf_counter=lambda: clock[0]))
  seconds = tune.measure(cfg, steps=steps, devices=devices)
  return seconds, runs[0], len(ran), len(drawn)


@pytest.mark.slow
def test_tune_compiles_only_what_is_new_and_ranks_as_compiling_every_candidate_does(
    tiny_searches):
  """Every program compiled is kept in the cache, and a search with one flag changed (--remat
  none, then none,full) compiles only the programs that are new; the search that leaves out
  what its estimates rule out ranks the best as the exhaustive one does."""
  first, every, fast = tiny_searches
  compiled = lambda ranking: [o for o in ranking.outcomes if o.report]
  assert compiled(first) and not any(o.cached for o in compiled(first))
  assert {o.cached for o in compiled(every) if o.config.model.remat == 'none'} == {True}
  assert {o.cached for o in compiled(every) if o.config.model.remat == 'full'} == {False}
  assert {o.cached for o in compiled(fast)} == {True}
  best = lambda ranking: [(r['mesh'], r['remat'], r['pipeline'], r['step_s'])
                          for r in ranking.rows[:3]]
  assert best(fast) == best(every)


def searched(steps: dict[int, float], estimates: dict[int, float], top: int | None):
  """`tune.Search` over candidates (told apart by train.seed) of `estimates`' step estimates,
  whose compiles report `steps`: the outcomes, and the seeds compiled in order."""
  order = []

  class Reports:
    def submit(self, config):
      order.append(config.train.seed)
      done = concurrent.futures.Future()
      done.set_result(types.SimpleNamespace(
          log=[], compile_s=0.0, cached=False, error='',
          report={'memory': {'peak': 1.0}, 'prediction': {'step_s': steps[config.train.seed]},
                  'fits': True}))
      return done

  outcomes = []
  for seed, e in estimates.items():
    c = small_config()
    c.train.seed = seed
    outcomes.append(tune_search.Outcome(c, 'none', estimate=Estimate(e, 0, 0, 0, 0, 0, 1.0)))
  tune_search.Search(outcomes, 2.0, top, tune_search.Progress()).run(list(outcomes), Reports(), 1)
  return tune_search.Ranking(outcomes, top or 3), order


def test_tune_leaves_out_only_what_the_compiled_show_cannot_win():
  """Estimates that err alike (each step twice its estimate, ±3%): the search compiles the best
  estimates first and leaves out those whose estimate, so corrected, is slower than the third
  best compiled, and its best three are the exhaustive search's. Estimates that err by several
  times (a small model's steps are latency): the candidate whose estimate errs least is
  compiled and ranked first, though it is estimated slowest."""
  estimates = {i: 1.0 + 0.1 * i for i in range(10)}
  alike = {i: 2 * e * (1.03 if i % 2 else 0.97) for i, e in estimates.items()}
  fast, order = searched(alike, estimates, top=3)
  every, _ = searched(alike, estimates, top=None)
  assert order == sorted(order) and len(order) < len(estimates)
  assert fast.counts() == {'cannot win': len(estimates) - len(order)}
  assert fast.rows[:3] == every.rows[:3]
  spread = {**{i: 2 * e for i, e in estimates.items()}, 0: 8 * estimates[0], 9: estimates[9] / 2}
  fast, order = searched(spread, estimates, top=3)
  assert fast.rows[0]['config'].train.seed == 9 and 9 in order


def test_tune_lays_each_mesh_over_the_hosts_as_the_config_says(tiny_config):
  """16 H100s are two nodes: with mesh.across_hosts='data' a mesh with data=1 cannot be laid
  over them, and is left out with the config's reason (as a run would be refused) instead of
  ending the search when its compile raised."""
  tiny_config.mesh.across_hosts = 'data'
  found = list(candidates(tiny_config, 16, Space(('none',)), hosts=2))
  refused = {c.mesh.data for c, _, reason in found if reason and 'across_hosts' in reason}
  assert refused == {1}
  assert all(reason is None for c, _, reason in found if c.mesh.data == 2 and c.mesh.pipe == 1
             and c.mesh.fsdp * c.mesh.tensor == 8 and c.mesh.tensor <= 4), found
  reason = next(r for c, _, r in found if c.mesh.data == 1)
  assert reason.startswith("mesh.across_hosts='data': the devices are on 2 hosts but data=1 ")


def test_tune_goes_on_past_a_candidate_that_cannot_compile(tiny_config, monkeypatch):
  """A compile that raises leaves its candidate out as invalid, with the error's first line,
  and the search goes on: here every compile but the third raises."""
  real, calls = compile_step, []

  def fails_but_the_third(cfg, devices=None, cache=None):
    calls.append(cfg)
    if len(calls) != 3:
      raise RuntimeError('RESOURCE_EXHAUSTED: the compiler gave up\nits details')
    return real(cfg, devices, cache)

  monkeypatch.setattr('jaxllm.cost.compile.compile_step', fails_but_the_third)
  ranking = rank(tiny_config, H100, Space(('none',)), jax.devices()[:2], exhaustive=True)
  assert len(calls) == 4 and ranking.counts() == {'invalid': 3}
  assert [r['config'] for r in ranking.rows] == [calls[2]]
  assert {o.reason for o in ranking.outcomes if o.why} == {
      'RuntimeError: RESOURCE_EXHAUSTED: the compiler gave up'}


def test_tune_says_why_when_no_candidate_compiles():
  """cuDNN refuses a head dimension of 4 on every mesh: each of the 7 candidates (4 meshes, 4
  schedules on pipe=2) is left out with that reason, and the command says it in its one
  line (run in this process: its exit, not its start, is the subject)."""
  result = run_cli_in_process(
      '--config', 'configs/tiny.py', '--devices', '2', '--remat', 'none', '--micro-batches', '1',
      '--config.model.attention=cudnn', '--config.model.dtype=bfloat16',
      '--config.model.head_dim=4', '--cache=', '--workers=1', module='jaxllm.tune')
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, lines
  assert 'no mesh of 2 devices fits h100-nvlink (7 invalid, most often: ' in lines[0]
  assert 'The head dim must be <= 256 and a multiple of 8, but got 4' in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize('mesh, remat, schedule', [
    (dict(data=2, fsdp=2), 'none', None), (dict(fsdp=2, tensor=2), 'full', None),
    (dict(pipe=2, data=2), 'full', 'gpipe'), (dict(pipe=2, fsdp=2), 'none', '1f1b')])
def test_depth_extrapolation_meets_the_full_compile(mesh, remat, schedule):
  """The peak memory and predicted step of 8 layers, from the line through compiles of 2 and 3
  layers a chunk (a pipeline's chunk: a stage's layers), are within 2% of 8 layers compiled;
  with the same timing model, so its rates do not matter."""
  cfg = small_config(**mesh)
  cfg.model.update(num_layers=8, remat=remat)
  if schedule:
    cfg.pipeline.schedule = schedule
  devices = jax.devices()[:4]
  full = analyze(cfg, H100, devices)
  line = extrapolate(cfg, H100, devices)
  assert line.depths == (2, 3)
  assert line.peak == pytest.approx(full['memory']['peak'], rel=0.02)
  assert line.step_s == pytest.approx(full['prediction']['step_s'], rel=0.02)


@pytest.mark.slow
def test_tune_json_says_each_candidates_settings_figures_and_why_left_out():
  """--json on one device: the one mesh with 1 micro-batch ranked with its memory and
  prediction, with 3 left out as invalid with the config's reason (3 does not divide the 16
  rows), nothing but the JSON on stdout."""
  result = run_cli_in_process('--config', 'configs/tiny.py', '--devices', '1', '--remat', 'none',
                              '--micro-batches', '1,3', '--cache=', '--workers=1', '--json',
                              module='jaxllm.tune')
  assert result.returncode == 0, result.stderr
  search = json.loads(result.stdout)
  assert (search['devices'], search['left_out'], search['compiled']) == (1, {'invalid': 1}, 1)
  ranked, left = search['candidates']
  mesh = {'data': 1, 'fsdp': 1, 'pipe': 1, 'tensor': 1}
  assert ranked['rank'] == 1 and ranked['mesh'] == mesh and ranked['micro_batches'] == 1
  assert ranked['remat'] == 'none' and ranked['pipeline'] == '-' and ranked['fits']
  assert ranked['memory'] > 0 and ranked['prediction']['step_s'] > 0
  assert 'left_out' not in ranked and 'rank' not in left
  assert left['micro_batches'] == 3 and left['left_out'] == 'invalid'
  assert 'micro_batches' in left['reason'] and '16' in left['reason'], left['reason']


def test_tune_keeps_the_compilers_expected_warnings_from_the_terminal():
  """What a compile writes to file descriptor 2 (as XLA's C++ logging does) is captured; the
  rematerialization warning of a program that does not fit and the slow-compile alarm are
  left out, anything else (a real error) is passed on."""
  from jaxllm.cost.compilers import captured_stderr, unexpected
  written = [
      "W1126 21:57:31.638585   22121 hlo_rematerialization.cc:3231] Can't reduce memory use "
      'below 60.68GiB (65151072847 bytes) by rematerialization; only reduced to 89.60GiB',
      'E1126 23:17:00.729520   31607 slow_operation_alarm.cc:73] ',
      '********************************',
      '[Compiling module jit_train_step for GPU] Very slow compile? If you want to file a bug, '
      'run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.',
      'E1126 23:17:01.748817   31312 slow_operation_alarm.cc:140] The operation took 2m1.0s',
      'E1126 23:17:02.000000   31312 gpu_compiler.cc:99] INTERNAL: ptxas exited with status 1']
  with captured_stderr() as log:
    os.write(2, ('\n'.join(written) + '\n').encode())
  assert log == written
  assert unexpected(log) == [written[-1]]


WORKER_OF_A_KILLED_SEARCH = """
import os, signal, time
from jaxllm.cost.compilers import Compilers, Target
from jaxllm.cost.hardware import PROFILES
if __name__ == '__main__':
  compilers = Compilers(Target(PROFILES['h100-nvlink'], 2, 'cpu'), 2, None)
  busy = compilers.pool.submit(time.sleep, 300)
  print(compilers.pool.submit(os.getpid).result(), flush=True)
  os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # ~10 s of waiting on a process
def test_a_search_stopped_by_a_signal_leaves_no_compiling_worker(tmp_path):
  """A `tune` killed mid-search runs no clean-up: its compile workers, one of them busy, end
  with it instead of compiling on."""
  (tmp_path / 'search.py').write_text(WORKER_OF_A_KILLED_SEARCH)
  result = subprocess.run([sys.executable, str(tmp_path / 'search.py')], capture_output=True,
                          text=True, timeout=120, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
  worker = int(result.stdout.split()[0])
  for _ in range(20):
    if not os.path.exists(f'/proc/{worker}'):
      break
    time.sleep(0.5)
  assert not os.path.exists(f'/proc/{worker}')


def test_tune_progress_says_compiled_left_out_and_best():
  """The progress bar's text: compiled candidates (those that do not fit among them), those
  left out by why, and the best step of those that fit."""
  from jaxllm.cost.tune import Outcome
  compiled = lambda step, why='': Outcome(None, 'none', why, report={
      'prediction': {'step_s': step}})
  outcomes = [compiled(0.5), compiled(0.25), compiled(0.125, 'does not fit'),
              Outcome(None, 'none', 'invalid'), Outcome(None, 'none', 'cannot win'),
              Outcome(None, 'none')]
  assert tune.progress_text(outcomes) == (
      'compiled 3, left out 3 (1 does not fit, 1 invalid, 1 cannot win), best 250.00 ms')
  assert tune.progress_text(outcomes[-1:]) == 'compiled 0, left out 0, best –'


def test_tune_searches_zero_splits_and_loss_chunks(tiny_config):
  """Every combination asked for is a candidate, each config carrying its own values; the
  splits a mesh cannot make are refused by the config's own checks, none silently dropped."""
  space = Space(('none',), (1,), zero=(0, 1), splits=('none', 'sp', 'sp_cm', 'cp'),
                loss_chunk=(0, 64))
  found = list(candidates(tiny_config, 4, space))
  assert len(found) == len(factorisations(4, 4)) * 2 * 4 * 2
  valid = {(tuple(c.mesh[a] for a in ('data', 'fsdp', 'pipe', 'tensor')), c.sharding.zero,
            split, c.model.loss_chunk) for c, split, reason in found if reason is None}
  assert {(z, chunk) for _, z, _, chunk in valid} == {(0, 0), (0, 64), (1, 0), (1, 64)}
  assert all(mesh[0] > 1 for mesh, zero, _, _ in valid if zero)  # ZeRO splits over data
  by_split = lambda name: {mesh for mesh, _, split, _ in valid if split == name}
  assert ((1, 1, 1, 4) in by_split('sp')) and ((1, 4, 1, 1) in by_split('cp'))
  # tensor=4: tiny's 2 kv heads are replicated over the pairs that share them (the README's
  # tensor=4 command trains it)
  assert (1, 1, 1, 4) in by_split('none')
  assert all(mesh[3] > 1 for mesh in by_split('sp'))  # activations' sequence over tensor
  assert by_split('sp_cm') == by_split('sp')
  assert all(mesh[1] > 1 for mesh in by_split('cp'))  # the sequence over fsdp
  sp = next(c for c, split, reason in found if split == 'sp' and reason is None)
  assert sp.sharding.rules.act_seq == ('tensor',) and tiny_config.sharding.rules.act_seq != (
      'tensor',)
  assert not sp.model.collective_matmul and not tiny_config.model.collective_matmul
  rings = next(c for c, split, reason in found if split == 'sp_cm' and reason is None)
  assert rings.model.collective_matmul and rings.sharding.rules.act_seq == ('tensor',)


def tiny_moe():
  return load_config(os.path.join(REPO, 'configs', 'tiny_moe.py'))


EXPERT_SPACE = Space(('none',), dispatch=('ring', 'all_to_all'), capacity=(0.0, 1.25),
                     expert_axes=(('fsdp',), ('data', 'fsdp')))


def test_tune_searches_the_experts_dispatch_capacity_and_placement():
  """With experts, each dispatch, capacity factor and placement asked for is a candidate on
  each mesh, carrying its own values; a placement whose axes do not divide the 8 experts, or
  that splits them over axes of size 1 only, is refused by the config's own checks. A dense
  model has one candidate a mesh, the config's."""
  found = list(candidates(tiny_moe(), 4, EXPERT_SPACE))
  meshes = factorisations(4, 4)
  assert len(found) == len(meshes) * 2 * 2 * 2
  settings = lambda c: (c.model.moe.dispatch, c.model.moe.capacity_factor,
                        tuple(c.sharding.rules.experts))
  assert {settings(c) for c, _, _ in found} == {
      (d, f, a) for d in ('ring', 'all_to_all') for f in (0.0, 1.25)
      for a in (('fsdp',), ('data', 'fsdp'))}
  valid = {(tuple(c.mesh[a] for a in ('data', 'fsdp', 'pipe', 'tensor')), *settings(c))
           for c, _, reason in found if reason is None}
  assert ((1, 4, 1, 1), 'all_to_all', 1.25, ('fsdp',)) in valid
  assert ((2, 2, 1, 1), 'ring', 0.0, ('data', 'fsdp')) in valid
  assert experts_text(next(c for c, _, r in found if r is None and c.model.moe.capacity_factor
                           and c.model.moe.dispatch == 'ring'
                           and c.sharding.rules.experts == ('data', 'fsdp'))) == (
      'ring 1.25 data+fsdp')
  assert len(list(candidates(small_config(), 4, EXPERT_SPACE))) == len(meshes)


@pytest.mark.parametrize('args, message', [
    (['configs/tiny.py', '--dispatch=ring'],
     '--dispatch, --capacity and --expert-axes search a model with experts'),
    (['configs/tiny_moe.py', '--dispatch=ring,gather'], "--dispatch='gather' is unknown"),
    (['configs/tiny_moe.py', '--capacity=1.25,-1'], '--capacity=1.25,-1 must be'),
    (['configs/tiny_moe.py', '--expert-axes=fsdp,data+experts'],
     '--expert-axes=data+experts must name mesh axes'),
], ids=['dense', 'dispatch', 'capacity', 'axes'])
def test_tune_expert_flags_are_checked_in_one_line(args, message):
  """The expert flags, on a dense model (they would search nothing) or with a value the
  config does not take: one line naming the flag, exit status 2."""
  result = run_cli_in_process('--config', *args, '--devices', '1', module='jaxllm.tune')
  assert result.returncode == 2, result.stderr
  assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_tune_tries_each_pipeline_schedule_on_meshes_with_stages(tiny_config):
  """A candidate per schedule on each mesh with pipe > 1 (one on pipe=1, which runs none),
  circular and interleaved 1F1B at repeats=2, refused by the config's checks where tiny's 4
  layers do not split into pipe×2; the table names each row's schedule (rows made up here
  rather than compiled: test_tune_ranks_the_tiny_config_and_measures_the_best_two compiles)."""
  found = list(candidates(tiny_config, 4, Space(('none',), schedules=PIPELINE_SCHEDULES)))
  meshes = factorisations(4, 4)
  assert len(found) == len(meshes) + 3 * len([m for m in meshes if m[2] > 1])
  mesh = lambda c: tuple(c.mesh[a] for a in ('data', 'fsdp', 'pipe', 'tensor'))
  valid = {(mesh(c), pipeline_text(c)) for c, _, reason in found if reason is None}
  assert {p for m, p in valid if m == (1, 2, 2, 1)} == {
      'gpipe', '1f1b', 'circular×2', 'interleaved_1f1b×2'}
  assert {p for m, p in valid if m == (1, 1, 4, 1)} == {'gpipe', '1f1b'}
  assert {p for m, p in valid if m[2] == 1} == {'-'}
  assert {reason for c, _, reason in found if reason} == {
      'model.num_layers=4 is not divisible by pipe×repeats = 4×2; change the layers, mesh.pipe '
      'or pipeline.repeats.'}
  times = dict.fromkeys(('step_s', 'gemm_s', 'attention_s', 'memory_s', 'launch_s',
                         'exposed_comm_s', 'tokens_per_s', 'mfu'), 1.0)
  rows = [{'mesh': dict(c.mesh), 'remat': 'none', 'micro_batches': 1, 'zero': 0, 'split': split,
           'loss_chunk': 0, 'pipeline': pipeline_text(c), 'experts': '-', 'memory': 2**20,
           **times}
          for c, split, reason in found if reason is None]
  table = format_table(rows, {}, H100, jax.devices()[:4]).splitlines()[2:-1]
  assert {(tuple(map(int, line.split()[1:5])), line.split()[10]) for line in table} == valid


@pytest.mark.slow
def test_analyze_says_a_step_does_not_fit_a_small_device():
  """A verdict, not an error: 1 MB holds no step of tiny.py. (The verdict that fits: the
  README's Llama-3-8B, test_readme's test_analyze_and_tune_as_printed.)"""
  result = run_cli_in_process('--config', 'configs/tiny.py', '--device-memory', '0.001',
                              module='jaxllm.analyze')
  assert result.returncode == 0, result.stderr[-2000:]
  verdicts = re.findall(r'^  peak .*?(fits|does NOT fit) the ', result.stdout, re.M)
  assert verdicts == ['does NOT fit'], result.stdout


@pytest.mark.parametrize('args, field', [
    (['--devices', '3'], 'mesh'),
    (['--devices=0'], '--devices=0 must be at least 1'),
    (['--hardware', 'h1000'], '--hardware'),
])
def test_analyze_bad_input_gets_one_line(args, field):
  result = run_cli_in_process('--config', 'configs/tiny.py', *args, module='jaxllm.analyze')
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and field in lines[0], result.stderr


ONE_OP = 'ENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n'


@pytest.mark.parametrize('args, message', [
    (['--hlo={missing}'], 'no such file or directory; pass an HLO text file'),
    (['--hlo={notes}'], 'not an HLO module in text form'),
    (['--hlo={program}', '--config=configs/tiny.py'], 'leave out --config'),
    (['--hlo={program}', '--hardware=a100-80-nvlink'], 'has no measured kernel rates'),
    (['--hlo={program}', '--devices-per-node=-1'], '--devices-per-node=-1 must be at least 1'),
    # The program says what it was compiled for: fewer devices read its groups out of range,
    # more would time collectives over devices it does not have.
    (['--hlo={program}', '--devices=4'], '--devices=4, but the program was compiled for 8 '
     'devices (num_partitions × replica_count in its HloModule line); leave --devices out.'),
    (['--hlo={program}', '--devices=16'], '--devices=16, but the program was compiled for 8'),
    (['--hlo={cut}'], 'ends before its ENTRY computation does; pass the whole file'),
    (['--hlo={cut_before_entry}'], 'ends before its ENTRY computation does'),
], ids=['missing', 'not_hlo', 'config', 'no_rates', 'per_node', 'fewer_devices',
        'more_devices', 'cut_in_entry', 'cut_before_entry'])
def test_analyze_hlo_bad_input_is_a_config_error(tmp_path, args, message):
  """`analyze --hlo FILE`: what it needs, each missing piece named in one line."""
  files = {name: tmp_path / f'{name}.txt'
           for name in ('missing', 'notes', 'program', 'cut', 'cut_before_entry')}
  files['notes'].write_text('not a program\n')
  program = 'HloModule m, num_partitions=8\n\n' + ONE_OP
  files['program'].write_text(program)
  files['cut'].write_text(program[:program.index('ROOT') + 10])
  files['cut_before_entry'].write_text(GPU_SNIPPET[:GPU_SNIPPET.index('ENTRY')])
  try:
    with pytest.raises(ConfigError, match=re.escape(message)):
      analyze_cli.read_hlo_flags(['prog', *(a.format(**files) for a in args)])
  finally:
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize('header, devices', [
    ('HloModule m, is_scheduled=true, num_partitions=8', 8),
    ('HloModule m, replica_count=2, num_partitions=4', 8),
    ('HloModule m, is_scheduled=true', 1),  # XLA leaves out a count of 1
])
def test_analyze_hlo_times_the_devices_the_program_was_compiled_for(tmp_path, header, devices):
  (tmp_path / 'program.txt').write_text(f'{header}\n\n{ONE_OP}')
  try:
    _, _, got, per_node = analyze_cli.read_hlo_flags(['prog', f'--hlo={tmp_path}/program.txt'])
  finally:
    flags.FLAGS.unparse_flags()
  assert (got, per_node) == (devices, 8)


@pytest.mark.parametrize('cut, args', [(False, ['--devices', '4']), (True, ['--devices', '8'])],
                         ids=['fewer_devices', 'cut_short'])
def test_analyze_hlo_of_a_wrong_count_or_a_cut_file_is_one_line(cut, args, tmp_path, monkeypatch,
                                                                capfd):
  """The command on a program of 8 devices' collectives: told 4 devices, or the file cut in
  its ENTRY computation, it says so in one line (it raised from deep in the HLO reader)."""
  program = GPU_SNIPPET.replace('HloModule m\n', 'HloModule m, num_partitions=8\n')
  path = tmp_path / 'program.txt'
  path.write_text(program[:program.index('%rsd =')] if cut else program)
  monkeypatch.setattr(sys, 'argv', ['jaxllm-analyze', '--hlo', str(path), *args])
  try:
    with pytest.raises(SystemExit) as stopped:
      analyze_cli.cli()
  finally:
    flags.FLAGS.unparse_flags()
  err = capfd.readouterr().err
  assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith('error: --devices=4, but' if not cut else f'error: --hlo {path}: ')


@pytest.mark.parametrize('module, args, message', [
    (analyze_cli, ['--devices=-2'], '--devices=-2 must be at least 1'),
    (analyze_cli, ['--device-memory=0'], '--device-memory=0.0 must be a positive number'),
    (analyze_cli, ['--device-memory=nan'], '--device-memory=nan must be a positive number'),
    (tune, ['--measure=-1'], '--measure=-1 must be at least 0'),
    (tune, ['--measure-steps=0'], '--measure-steps=0 must be at least 1'),
    (tune, ['--micro-batches=2,0'], '--micro-batches=2,0 must be integers of at least 1'),
    (tune, ['--remat='], '--remat is empty'),
    (tune, ['--zero=1,3'], '--zero=1,3: ZeRO stages are 0, 1 and 2'),
    (tune, ['--splits=none,tp'], "--splits='tp' is unknown"),
    (tune, ['--loss-chunk=-1'], '--loss-chunk=-1 must be integers of at least 0'),
    (tune, ['--schedules=1f1b,zb'], "--schedules='zb' is unknown; pipeline.schedule takes gpipe, "
     'circular, 1f1b, interleaved_1f1b.'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_flags_are_config_errors(module, args, message):
  """The flags each command checks once they are parsed (the CLI case above: one line)."""
  try:
    flags.FLAGS(['prog', *args])
    with pytest.raises(ConfigError, match=re.escape(message)):
      module.check_flags()
  finally:
    flags.FLAGS.unparse_flags()


def test_tune_says_when_nothing_fits():
  """On 2 devices: 4 meshes to compile (8 devices have 20)."""
  result = run_cli_in_process('--config', 'configs/tiny.py', '--devices', '2', '--device-memory',
                              '0.001', '--remat', 'none', '--micro-batches', '1',
                              module='jaxllm.tune')
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and 'no mesh of 2 devices fits' in lines[0], result.stderr


@pytest.mark.slow
def test_zero_reduce_scatters_gradients_and_gathers_params_over_data():
  """The CPU compiler's program (the GPU's: test_gpu_program) on data=4 × fsdp=2: ZeRO-1
  turns the gradients' one all-reduce over data into reduce-scatters and all-gathers of the
  updated params, moving the same bytes, as `expected_bytes` says."""
  compiled = {}
  for zero in (0, 1):
    cfg = comm_config(data=4, fsdp=2)
    cfg.model.num_layers = 2
    cfg.sharding.zero = zero
    compiled[zero] = compile_step(cfg)
  over_data = {zero: [x for x in hlo.collectives(c.text, c.mesh_shape, cpu=True)
                      if 'data' in x.axes] for zero, c in compiled.items()}
  assert [(x.kind, x.axes) for x in over_data[0]] == [('all-reduce', ('data',))]
  # Gradients and params move as reduce-scatters and all-gathers; what is still all-reduced
  # are scalars: the pieces of the gradient norm, and the step's loss and token count.
  moved = {(x.kind, x.axes) for x in over_data[1] if x.kind != 'all-reduce'}
  assert moved == {('reduce-scatter', ('data',)), ('all-gather', ('data',))}
  assert max(x.bytes_per_call for x in over_data[1] if x.kind == 'all-reduce') < 32
  split = compiled[1].zero_split_bytes
  assert split == compiled[1].state_bytes['params']  # every parameter's update is split
  for kind in ('reduce-scatter', 'all-gather'):
    assert sum(x.bytes for x in over_data[1] if x.kind == kind) == pytest.approx(3 / 4 * split)
  total = {zero: sum(x.bytes for x in xs) for zero, xs in over_data.items()}
  assert total[1] == pytest.approx(total[0], rel=1e-3)
  assert expected_bytes(compiled[1])[('data',)] == expected_bytes(compiled[0])[('data',)]
  assert expected_bytes(compiled[1])[('data',)] == pytest.approx(total[1], rel=1e-3)


@pytest.mark.slow
def test_zero2_reduce_scatters_each_micro_batch_into_a_split_sum():
  """sharding.zero=2 with 2 micro-batches on data=4 × fsdp=2 (CPU compiler): the gradients
  are reduce-scattered over data once per micro-batch, inside the accumulation loop, the
  params all-gathered once; the gradient sum per device is a quarter of the params."""
  compiled = {}
  for zero in (1, 2):
    cfg = comm_config(data=4, fsdp=2)
    cfg.model.num_layers = 2
    cfg.train.micro_batches = 2
    cfg.sharding.zero = zero
    compiled[zero] = compile_step(cfg)
  moved = {zero: [x for x in hlo.collectives(c.text, c.mesh_shape, cpu=True)
                  if x.axes == ('data',) and x.kind != 'all-reduce']
           for zero, c in compiled.items()}
  split = compiled[2].zero_split_bytes
  for zero, scatters in ((1, 1), (2, 2)):
    assert {(x.kind, x.count) for x in moved[zero]} == {('reduce-scatter', scatters),
                                                       ('all-gather', 1)}
    assert sum(x.bytes for x in moved[zero] if x.kind == 'reduce-scatter') == pytest.approx(
        scatters * 3 / 4 * split)
    data = next(r for r in collective_table(compiled[zero], H100)[1] if r['axes'] == ['data'])
    assert data['ratio'] == pytest.approx(1, rel=1e-3)
  params = compiled[2].state_bytes['params']
  assert memory(compiled[1])['gradients'] == params
  assert memory(compiled[2])['gradients'] == params / 4
