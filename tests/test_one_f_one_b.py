"""1F1B and interleaved 1F1B: the tick tables against the rules of pipelining, the
schedules' loss and gradients against the plain layer stack, head and loss on one device (and
in bf16, against GPipe's), and what the compiled program keeps in the residual slots."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (leaf_paths, model_on, paired_leaves, small_config, step_gradients,
                      text_config)
from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.pipeline.one_f_one_b import pipeline_loss
from jaxllm.pipeline.spec import PipelineSpec, to_stage_order
from jaxllm.pipeline.ticks import gpipe_ticks, one_f_one_b_ticks
from jaxllm.validate import resolve_mesh, validate

SHAPES = [(2, 1, 2), (2, 1, 3), (4, 1, 1), (4, 1, 6), (4, 1, 16), (2, 2, 4), (4, 2, 8),
          (4, 2, 16), (4, 3, 8)]


def check_dependencies(ticks, loop_buffer: bool):
  """Every item's forward and backward run once on every stage, each after what it needs:
  a forward after the previous stage's (or, for a later chunk, the last stage's previous
  chunk), a tick before; a backward after its own forward and after the next stage's backward
  (or the next chunk's on stage 0) a tick before; the last chunk's backward on the last stage
  in its forward's tick (the loss runs between). Between chunks an item waits in a
  `loop_buffer` (circular) or goes straight on, in the next tick (interleaved 1F1B). Returns
  {(item, stage): tick} for forwards and backwards."""
  S, R, M = ticks.stages, ticks.repeats, ticks.microbatches
  forward, backward = {}, {}
  for table, found in ((ticks.forward, forward), (ticks.backward, backward)):
    for t, s in zip(*np.nonzero(table >= 0)):
      assert (table[t, s], s) not in found, 'an item ran twice on one stage'
      found[(table[t, s], s)] = t
  assert len(forward) == len(backward) == R * M * S
  item = {(ticks.microbatch[i], ticks.chunk[i]): i for i in range(R * M)}
  assert len(item) == R * M
  for (i, s), t in forward.items():
    m, r = ticks.microbatch[i], ticks.chunk[i]
    if s > 0:
      assert forward[(i, s - 1)] == t - 1
    elif r > 0:
      arrived = forward[(item[(m, r - 1)], S - 1)] + 1
      assert arrived <= t if loop_buffer else arrived == t
  for (i, s), t in backward.items():
    m, r = ticks.microbatch[i], ticks.chunk[i]
    assert forward[(i, s)] <= t
    if s < S - 1:
      assert backward[(i, s + 1)] == t - 1
    elif r < R - 1:
      arrived = backward[(item[(m, r + 1)], 0)] + 1
      assert arrived <= t if loop_buffer else arrived == t
  return forward, backward


@pytest.mark.parametrize('stages,repeats,microbatches', SHAPES)
def test_ticks_keep_dependencies_and_the_bubble(stages, repeats, microbatches):
  S, R, M = stages, repeats, microbatches
  ours, gpipe = one_f_one_b_ticks(S, R, M), gpipe_ticks(S, R, M)
  forward, backward = check_dependencies(ours, loop_buffer=False)
  check_dependencies(gpipe, loop_buffer=True)
  for (i, s), t in backward.items():  # the last chunk's backward right after the loss
    if s == S - 1 and ours.chunk[i] == R - 1:
      assert forward[(i, s)] == t
  # Both waves move a stage a tick: the bubble is GPipe's, (S−1)/(R·M+S−1) of the work.
  for table in (ours, gpipe):
    assert table.bubble_fraction() == pytest.approx((S - 1) / (R * M + S - 1))
  # Residuals held: GPipe all R·M items'; 1F1B at most 2(S−1)+1 (with few micro-batches,
  # one more than M: an idle forward slot writes to a free one). Each slot's item is kept
  # from its forward to its backward, never written over, idle slots' writes included.
  write, read, slots = ours.slots()
  assert slots == min(M + 1, 2 * S - 1) if R == 1 else slots <= 2 * R * S - 1 < R * M
  for s in range(S):
    held = {}
    for t in range(len(write)):
      assert write[t, s] not in held.values()
      if ours.forward[t, s] >= 0:
        held[ours.forward[t, s]] = write[t, s]
      if ours.backward[t, s] >= 0:
        assert read[t, s] == held.pop(ours.backward[t, s])


def test_interleaving_holds_fewer_residuals_than_circular():
  """Interleaved 1F1B's slots (chunk-sized) against the circular schedule's R·M."""
  assert one_f_one_b_ticks(4, 2, 16).slots()[2] == 11  # against 32
  assert one_f_one_b_ticks(4, 1, 16).slots()[2] == 7   # 1F1B against GPipe's 16


LAYERS, Z_LOSS = 8, 1e-3


def loss_and_grads(cfg, mesh, loss_fn, evaluate: bool = False):
  """Objective, cross-entropy and the objective's gradients (params, input) for a fixed model,
  input and packed rows (row b holds a document of b % 7 + 1 tokens, then another), with
  masked targets; with `evaluate`, also the objective computed without differentiation."""
  graphdef, params = model_on(cfg, mesh)
  with sharding_context(mesh, cfg.sharding.rules):
    keys = jax.random.split(jax.random.key(1), 3)
    x_BTD = jax.random.normal(keys[0], (24, 8, cfg.model.embed_dim))
    targets_BT = jax.random.randint(keys[1], (24, 8), 0, cfg.model.vocab_size)
    mask_BT = jax.random.bernoulli(keys[2], 0.8, (24, 8))
    t, cut = np.arange(8), np.arange(24)[:, None] % 7 + 1
    segment_ids_BT = jnp.asarray(np.where(t < cut, 1, 2))
    positions_BT = jnp.asarray(np.where(t < cut, t, t - cut))

    def loss(params, x_BTD):
      return loss_fn(graphdef, params, x_BTD, positions_BT, segment_ids_BT, targets_BT, mask_BT)

    (objective, ce), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x_BTD)
    return objective, ce, grads, jax.jit(loss)(params, x_BTD)[0] if evaluate else None


def stack_config():
  cfg = small_config()
  cfg.model.num_layers = LAYERS
  return cfg


def plain(graphdef, params, x_BTD, positions_BT, segment_ids_BT, targets_BT, mask_BT):
  model = nnx.merge(graphdef, params)
  return model.loss_sum(model.layers(x_BTD, positions_BT, segment_ids_BT)[0], targets_BT, mask_BT,
                        Z_LOSS)


@pytest.fixture(scope='module')
def plain_stack():
  """The reference: layer stack, head and loss on one device."""
  mesh = make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])
  return loss_and_grads(stack_config(), mesh, plain)


CASES = {  # schedule, stages, repeats, micro-batches, remat, the other axes, run undifferentiated
    '1f1b_S2_M3_data_tensor': ('1f1b', 2, 1, 3, 'none', dict(data=2, tensor=2), True),
    '1f1b_S4_M6_fsdp_full': ('1f1b', 4, 1, 6, 'full', dict(fsdp=2), False),
    '1f1b_S4_M2_tensor': ('1f1b', 4, 1, 2, 'none', dict(tensor=2), False),
    'interleaved_S2_R2_M4_data_tensor_full': ('interleaved_1f1b', 2, 2, 4, 'full',
                                              dict(data=2, tensor=2), False),
    'interleaved_S4_R2_M4_fsdp': ('interleaved_1f1b', 4, 2, 4, 'none', dict(fsdp=2), True),
    'interleaved_S2_R4_M2_fsdp_tensor_dots': ('interleaved_1f1b', 2, 4, 2, 'dots',
                                              dict(fsdp=2, tensor=2), False),
}


def pipelined(spec: PipelineSpec):
  """`loss_and_grads`' loss through the pipeline `spec`: the parameters are stored stage-major
  under interleaving, converted inside, so the gradients come in layer order."""
  def loss(graphdef, params, x_BTD, positions_BT, segment_ids_BT, targets_BT, mask_BT):
    model = nnx.merge(graphdef, to_stage_order(params, spec.stages, spec.repeats))
    return pipeline_loss(model.blocks, model.final_norm, model.head(), x_BTD, positions_BT,
                         segment_ids_BT, targets_BT, mask_BT, spec, model.cfg, Z_LOSS)
  return loss


@pytest.mark.slow
@pytest.mark.parametrize('schedule,stages,repeats,microbatches,remat,axes,evaluate',
                         CASES.values(), ids=CASES.keys())
def test_schedule_equals_plain_stack(schedule, stages, repeats, microbatches, remat, axes,
                                     evaluate, plain_stack):
  """Objective, cross-entropy and every gradient (blocks, final norm, head, input) match the
  plain stack in fp32; what idle slots receive is NaN and must not leak. Undifferentiated
  (eval: the forwards and head alone) the objective matches too, once per schedule."""
  cfg = stack_config()
  cfg.model.remat = remat
  cfg.mesh.update(pipe=stages, **axes)
  mesh = make_mesh(resolve_mesh(cfg.mesh, jax.device_count()))
  spec = PipelineSpec(stages, repeats, microbatches, 'step', schedule, bubble_fill=float('nan'))
  objective, ce, grads, undifferentiated = loss_and_grads(cfg, mesh, pipelined(spec), evaluate)
  ref_objective, ref_ce, ref_grads, _ = plain_stack
  assert ref_objective != ref_ce  # the z-loss is in the objective only
  np.testing.assert_allclose([objective, ce], [ref_objective, ref_ce], rtol=1e-5)
  if evaluate:
    np.testing.assert_allclose(undifferentiated, ref_objective, rtol=1e-5)
  for got, want in paired_leaves(grads, ref_grads):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_the_stage_and_the_head_are_traced_once_whatever_the_ticks(monkeypatch):
  """Interleaved 1F1B's ticks come in four kinds (forwards alone; both, with the head or
  without; backwards alone), each a scan body of its own. Each calls one trace of the stage's
  forward, one of its pullback and one of the head's gradients, which jit keeps: tracing the
  stage in every kind made a program slower to build, more so the deeper the stage."""
  from jaxllm.pipeline import one_f_one_b
  traced = {'forward': 0, 'pullback': 0, 'head': 0}

  def counted(name, method):
    def count(*args, **kwargs):
      traced[name] += 1
      return method(*args, **kwargs)
    return count

  monkeypatch.setattr(one_f_one_b._Stage, 'linearize',
                      counted('forward', one_f_one_b._Stage.linearize))
  monkeypatch.setattr(one_f_one_b._Stage, 'pullback',
                      staticmethod(counted('pullback', one_f_one_b._Stage.pullback)))
  monkeypatch.setattr(one_f_one_b._Head, 'grads', counted('head', one_f_one_b._Head.grads))
  cfg = stack_config()
  mesh = make_mesh(dict(data=1, fsdp=1, pipe=2, tensor=1), jax.devices()[:2])
  spec = PipelineSpec(2, 2, 4, 'step', 'interleaved_1f1b')
  graphdef, params = model_on(cfg, mesh)
  rows = jax.ShapeDtypeStruct((8, 8), jnp.int32)
  x_BTD = jax.ShapeDtypeStruct((8, 8, cfg.model.embed_dim), jnp.float32)
  loss = lambda params, x_BTD, *rows: pipelined(spec)(graphdef, params, x_BTD, *rows)[0]
  with sharding_context(mesh, cfg.sharding.rules):
    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x_BTD, rows, rows, rows,
                                                  rows.update(dtype=jnp.float32))
  assert traced == {'forward': 1, 'pullback': 1, 'head': 1}


@pytest.mark.slow
def test_bf16_step_gradients_match_gpipe(corpus, one_device_gradients):
  """A train step in bf16 compute (fp32 params) on pipe=2 × fsdp=2 × tensor=2: 1F1B's loss
  and every gradient against GPipe's, whose weight gradients are summed over the iterations
  in fp32 (interleaved 1F1B sums as 1F1B does). Both run the same bf16 layers on the same
  micro-batches; what may part them is the order of fp32 sums. So each gradient tensor must
  lie within 5% of the distance bf16 itself puts between GPipe's and an independent
  reference, one device's fp32 gradients (0.6% to 1% in norm). Rounding each tick's weight
  gradients to bf16 before summing them parted them by a fifth of it (measured: 0.17%)."""
  _, fp32_grads = one_device_gradients

  def gradients(schedule):
    cfg = text_config(corpus, pipe=2, fsdp=2, tensor=2)
    cfg.model.dtype = 'bfloat16'
    cfg.pipeline.schedule = schedule
    return step_gradients(cfg)

  (want_loss, want), (loss, got) = gradients('gpipe'), gradients('1f1b')
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for path, (g, w), (_, fp32) in zip(leaf_paths(want), paired_leaves(got, want),
                                     paired_leaves(want, fp32_grads)):
    bf16_error = np.linalg.norm(w - fp32)
    assert bf16_error > 1e-3 * np.linalg.norm(fp32), path  # bf16 is at work
    assert np.linalg.norm(g - w) <= 0.05 * bf16_error, path


def pipe_config(**fields):
  cfg = small_config(pipe=2, data=2, fsdp=2)
  cfg.model.num_layers = 8
  cfg.train.global_batch = 48
  for path, value in fields.items():
    section, name = path.split('.')
    cfg[section][name] = value
  return cfg


@pytest.mark.parametrize('fields,message', [
    ({'pipeline.schedule': 'interleaved_1f1b', 'pipeline.repeats': 2,
      'pipeline.microbatches': 3}, 'pipeline.microbatches=3 is not a multiple of mesh.pipe=2'),
    ({'pipeline.schedule': 'interleaved_1f1b'}, 'needs repeats ≥ 2'),
    ({'pipeline.schedule': '1f1b', 'pipeline.repeats': 2}, "needs pipeline.schedule="
                                                           "'interleaved_1f1b'"),
    ({'pipeline.schedule': '1f1b', 'pipeline.gather_weights': 'iteration'},
     "use gather_weights='step'"),
    ({'pipeline.schedule': '1f1b', 'model.fp8': 'delayed', 'model.dtype': 'bfloat16'},
     "use model.fp8='none'"),
])
def test_what_a_schedule_cannot_run_is_one_line(fields, message):
  with pytest.raises(ConfigError) as error:
    validate(pipe_config(**fields), dict(data=2, fsdp=2, pipe=2, tensor=1))
  assert message in str(error.value) and '\n' not in str(error.value)


def test_1f1b_takes_micro_batches_gpipe_refuses():
  """M = 3 on 2 stages: GPipe hands M/S outputs to each stage and refuses; 1F1B runs the head
  on the last stage and takes it."""
  mesh = dict(data=2, fsdp=2, pipe=2, tensor=1)
  with pytest.raises(ConfigError, match='pipeline.microbatches=3 is not a multiple'):
    validate(pipe_config(**{'pipeline.microbatches': 3}), mesh)
  validate(pipe_config(**{'pipeline.microbatches': 3, 'pipeline.schedule': '1f1b'}), mesh)


def slot_stacks(hlo_text: str, slots: int) -> set[tuple[int, ...]]:
  """The shapes of a compiled program's arrays that lead with `slots`: 1F1B's residual slots."""
  shapes = {tuple(map(int, dims.split(','))) for dims in
            re.findall(r'\b(?:bf16|f32|s32|pred)\[(\d+(?:,\d+)*)\]', hlo_text)}
  return {shape for shape in shapes if shape[0] == slots}


def weight_shaped(stack: tuple[int, ...], layers: int, weights) -> bool:
  """Whether a slot stack is [slots, layers, *w] for one of a layer's `weights`, whole or
  split over axes of 2 devices (each dimension whole or halved)."""
  return len(stack) > 2 and stack[1] == layers and any(
      len(stack) - 2 == len(w) and all(d in (b, 2 * b) for d, b in zip(w, stack[2:]))
      for w in weights)


@pytest.mark.slow
@pytest.mark.parametrize('platform', ['cpu', 'h100'])
def test_no_slot_keeps_a_copy_of_the_stage_weights(platform):
  """1F1B under remat 'none' where each layer makes new copies of its weights for its matmuls:
  gathered over fsdp, which splits the sequence (context parallelism), and laid out for the
  collective matmul's rings (sequence parallelism over tensor). Compiled for 8 CPU devices and
  for 8 H100s (in bf16, with cuDNN attention), the program's slot stacks [slots, ...] hold the
  activations' residuals, each with the sequence's 48 positions or its 24 or 12 on a device
  (a length no weight has), and none is [slots, layers, w] for a weight w or a block of it."""
  from jaxllm import backends
  from jaxllm.cost.compile import compile_step
  from jaxllm.cost.hardware import PROFILES
  cfg = small_config(pipe=2, fsdp=2, tensor=2)
  cfg.sharding.rules.update(batch=('data',), seq=('fsdp',), act_seq=('tensor',))
  cfg.model.update(remat='none', collective_matmul=True)
  cfg.pipeline.schedule = '1f1b'
  cfg.train.global_batch = 16
  cfg.data.seq_len = 48
  devices = jax.devices()
  if platform == 'h100':
    if not backends.cuda_plugin_installed():
      pytest.skip('needs JAX\'s CUDA plugin: pip install -e ".[dev]"')
    cfg.model.update(dtype='bfloat16', attention='cudnn')
    devices = backends.gpu_devices(PROFILES['h100-nvlink'], 8)
  compiled = compile_step(cfg, devices)
  spec = compiled.pipeline
  slots = one_f_one_b_ticks(spec.stages, spec.repeats, spec.microbatches).slots()[2]
  layers_per_stage = cfg.model.num_layers // spec.stages
  stacks = slot_stacks(compiled.text, slots)
  assert any({48, 24, 12} & set(s) for s in stacks), stacks
  assert not [s for s in stacks if weight_shaped(s, layers_per_stage, weight_shapes(cfg.model))]


def weight_shapes(m) -> set[tuple[int, ...]]:
  """A layer's matrices: q, k and v; the attention output; gate and up; down."""
  D, N, K, H, F = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  return {(D, N, H), (D, K, H), (N, H, D), (D, F), (F, D)}
