"""model.collective_matmul: sequence parallelism's tensor collectives as rings beside the
matmuls (`jaxllm.parallel.collective_matmul`) train exactly as one device does."""

import collections
import os
import re

import jax
import numpy as np
import pytest

from conftest import (REPO, leaf_paths, once_per_run, paired_leaves, small_config, step_gradients,
                      text_config)
from jaxllm import backends
from jaxllm.cli import load_config
from jaxllm.config import ConfigError
from jaxllm.cost import hlo
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import PROFILES
from jaxllm.parallel import collective_matmul
from jaxllm.validate import validate

SEQUENCE_PARALLEL = dict(act_seq=('tensor',))
CONTEXT_PARALLEL = dict(batch=('data',), seq=('fsdp',))
# 2 K/V heads: split over tensor=2, kept whole on every device of tensor=4
MODEL = dict(num_kv_heads=2)
RINGS = {  # mesh, remat, rules changed beside act_seq
    'data2_fsdp2_tensor2_full': (dict(data=2, fsdp=2, tensor=2), 'full', {}),
    'context_parallel_fsdp2_tensor4_dots': (dict(fsdp=2, tensor=4), 'dots', CONTEXT_PARALLEL),
    'data2_pipe2_tensor2': (dict(data=2, pipe=2, tensor=2), 'none', {}),
}


@pytest.fixture(scope='module')
def one_device_gradients(short_documents):
  """The first step's loss and gradients of `text_config` (with MODEL) on one device, fp32, on
  rows packed with several documents."""
  cfg = text_config(short_documents)
  cfg.model.update(MODEL)
  return once_per_run('test_collective_matmul.one_device_gradients',
                      lambda: step_gradients(cfg, jax.devices()[:1]))


@pytest.mark.slow
@pytest.mark.parametrize('mesh, remat, rules', RINGS.values(), ids=RINGS.keys())
def test_rings_give_one_devices_gradients(mesh, remat, rules, short_documents,
                                          one_device_gradients, monkeypatch):
  """The first step's loss and every gradient tensor as one device's (fp32, within 1e-5
  relative in norm), on packed rows (segment ids), with both kinds of ring in every layer."""
  rings = collections.Counter()
  for name in ('all_gather_matmul', 'matmul_reduce_scatter'):
    def counted(*args, ring=getattr(collective_matmul, name), name=name):
      rings[name] += 1
      return ring(*args)
    monkeypatch.setattr(collective_matmul, name, counted)
  ref_loss, ref_grads = one_device_gradients
  cfg = text_config(short_documents, **mesh)
  cfg.model.update(MODEL, remat=remat, collective_matmul=True)
  cfg.sharding.rules.update(SEQUENCE_PARALLEL, **rules)
  loss, grads = step_gradients(cfg)
  # attention's and the MLP's, in the one trace of the layer (a pipeline's stage included)
  assert rings == {'all_gather_matmul': 2, 'matmul_reduce_scatter': 2}
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for path, (got, want) in zip(leaf_paths(ref_grads), paired_leaves(grads, ref_grads)):
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), path


@pytest.mark.parametrize('overrides, message', [
    (dict(act_seq=()), "model.collective_matmul=True overlaps the tensor all-gathers and "
                       "reduce-scatters of sequence parallelism with the matmuls, but "
                       "sharding.rules.act_seq=(); set sharding.rules.act_seq=('tensor',) or "
                       "model.collective_matmul=False."),
    (dict(act_seq=('fsdp',)), "but sharding.rules.act_seq=('fsdp',); set"),
])
def test_collective_matmul_needs_sequence_parallelism(overrides, message):
  cfg = small_config(data=2, fsdp=2, tensor=2)
  cfg.model.collective_matmul = True
  cfg.sharding.rules.update(batch=('data',), **overrides)  # rows off fsdp: act_seq may take it
  with pytest.raises(ConfigError) as error:
    validate(cfg, dict(cfg.mesh))
  assert message in str(error.value) and '\n' not in str(error.value)


def test_on_tensor_1_collective_matmul_is_valid_and_does_nothing():
  """As act_seq=('tensor',) itself (a printed note): there is no ring to run."""
  cfg = small_config(data=2)
  cfg.model.collective_matmul = True
  cfg.sharding.rules.update(SEQUENCE_PARALLEL)
  validate(cfg, dict(cfg.mesh))


def test_a_sequence_the_ring_cannot_divide_is_a_config_error():
  cfg = small_config(fsdp=2, tensor=4)
  cfg.model.collective_matmul = True
  cfg.sharding.rules.update(SEQUENCE_PARALLEL)
  cfg.data.seq_len = 30
  with pytest.raises(ConfigError, match=r'data.seq_len=30 does not split over sharding.rules.seq '
                                        r'and act_seq \(tensor = 4\); make it a multiple of 4'):
    validate(cfg, dict(cfg.mesh))


# --- the H100 program -------------------------------------------------------------------------

H100 = PROFILES['h100-nvlink']
needs_cuda_plugin = pytest.mark.skipif(not backends.cuda_plugin_installed(),
                                       reason='needs JAX\'s CUDA plugin: pip install -e ".[dev]"')


def sequence_parallel(cfg, rings: bool):
  cfg.model.collective_matmul = rings
  cfg.sharding.rules.update(SEQUENCE_PARALLEL)
  return cfg


@pytest.fixture(scope='session')
def tiny_programs():
  """configs/tiny.py in bf16 with cuDNN attention and 4 K/V heads (split over tensor, so
  attention sums no K/V gradients over it) on fsdp=2 × tensor=4, under sequence parallelism,
  compiled for 8 H100s: {collective_matmul: program}."""
  def tiny(rings):
    cfg = load_config(os.path.join(REPO, 'configs', 'tiny.py'))
    cfg.model.update(dtype='bfloat16', attention='cudnn', num_kv_heads=4)
    cfg.mesh.update(data=1, fsdp=2, pipe=1, tensor=4)
    return sequence_parallel(cfg, rings)
  devices = backends.gpu_devices(H100, 8)
  return {on: compile_step(tiny(on), devices) for on in (False, True)}


def layer_computations(text: str, num_layers: int) -> set[str]:
  """The computations the layer scans run: the bodies of the loops of `num_layers` trips, and
  every computation they call (as `hlo.call_counts` walks them)."""
  computations, _ = hlo.parse_module(text)
  bodies = [re.search(r'body=%?([\w.\-]+)', inst.attrs).group(1)
            for insts in computations.values() for inst in insts.values()
            if inst.opcode == 'while' and f'"known_trip_count":{{"n":"{num_layers}"}}' in inst.attrs]
  return {name for body in bodies for name in hlo.call_counts(computations, body)}


def is_matmul(computations, insts, inst) -> bool:
  """A dot, a cuBLAS GEMM call or a fusion (Triton's GEMMs) holding a dot."""
  if hlo.gemm_shape(insts, inst):
    return True
  return inst.opcode == 'fusion' and any(
      is_matmul(computations, computations[hlo.called(inst)], i)
      for i in computations[hlo.called(inst)].values())


def tensor_transfers_in_layers(compiled) -> list[tuple[str, bool, int]]:
  """The collectives over tensor alone in the layer loops: (opcode, whether a matmul is
  scheduled between its start and its done, if it has them, executions per step)."""
  computations, counts = hlo.program(compiled.text)
  found = []
  for name in layer_computations(compiled.text, compiled.cfg.model.num_layers):
    insts, running = computations[name], {}  # a start's name -> its entry in found
    for inst in insts.values():
      kind = hlo.collective_kind(inst)
      if kind and hlo.group_axes(hlo.device_groups(inst.attrs), compiled.mesh_shape,
                                 kind == 'collective-permute')[0] == ('tensor',):
        found.append([inst.opcode, False, counts[name]])
        if inst.opcode.endswith('-start'):
          running[inst.name] = found[-1]
      elif inst.opcode.endswith('-done') and inst.operands[0] in running:
        del running[inst.operands[0]]
      elif is_matmul(computations, insts, inst):
        for entry in running.values():
          entry[1] = True
  return [tuple(entry) for entry in found]


@pytest.mark.slow
@needs_cuda_plugin
def test_each_transfer_of_the_rings_hides_behind_a_matmul(tiny_programs):
  """With model.collective_matmul, the layers move nothing over tensor but the rings'
  blocks: async collective-permutes, one in each ring's loop (four rings forward, four
  backward), run n−1 times per layer, each with a matmul scheduled between its start and its
  done. Without it, the program is sequence parallelism's: all-gathers and reduce-scatters."""
  rings = tensor_transfers_in_layers(tiny_programs[True])
  layers, n = tiny_programs[True].cfg.model.num_layers, 4
  assert rings == [('collective-permute-start', True, (n - 1) * layers)] * 8
  plain = {opcode for opcode, _, _ in tensor_transfers_in_layers(tiny_programs[False])}
  assert plain == {'all-gather-start', 'reduce-scatter-start'}


def bytes_by(compiled) -> collections.Counter:
  """Bytes each device sends per step, by (mesh axes, kind, element type)."""
  moved = collections.Counter()
  for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=False):
    moved[c.axes, c.kind, c.dtype] += c.bytes
  return moved


@pytest.mark.slow
@needs_cuda_plugin
def test_rings_move_what_the_collectives_did(tiny_programs):
  """The rings send over tensor the bytes the all-gathers and reduce-scatters did; over fsdp
  the weights still move in bf16, gathered once per pass (no more than XLA's own program
  gathers), and their gradients as before, in fp32."""
  plain, rings = (bytes_by(tiny_programs[on]) for on in (False, True))
  over = lambda moved, axes: sum(b for (a, _, _), b in moved.items() if a == axes)
  assert over(rings, ('tensor',)) == pytest.approx(over(plain, ('tensor',)), rel=1e-3)
  assert rings['fsdp', 'all-gather', 'bf16'] <= plain['fsdp', 'all-gather', 'bf16']
  gathers = lambda moved: {dtype for (axes, kind, dtype) in moved if axes == ('fsdp',)
                           and kind == 'all-gather'}
  assert gathers(rings) == gathers(plain)
  assert rings['fsdp', 'reduce-scatter', 'f32'] == plain['fsdp', 'reduce-scatter', 'f32']


@pytest.mark.slow
@needs_cuda_plugin
def test_rings_hide_their_transfers_at_70b_layer_shapes():
  """configs/llama3_70b.py's layers (2 of them, remat 'full') on fsdp=2 × tensor=4: each
  ring's transfer, forward, recomputed and backward, hides behind a matmul."""
  cfg = load_config(os.path.join(REPO, 'configs', 'llama3_70b.py'))
  cfg.model.num_layers = 2
  cfg.mesh.update(data=1, fsdp=2, pipe=1, tensor=4)
  cfg.train.global_batch = 2
  rings = tensor_transfers_in_layers(compile_step(sequence_parallel(cfg, True),
                                                  backends.gpu_devices(H100, 8)))
  # forward 4 rings; the backward reruns the forward's first 3 (the last one's output is the
  # next layer's input, kept) beside its own 4
  assert rings == [('collective-permute-start', True, 3 * 2)] * 11
