"""Any mesh trains like one device; the sharding it claims is the sharding it has."""

import collections
import math

import jax
import numpy as np
import pytest

from conftest import (assert_params_close, leaf_paths, once_per_run, paired_leaves, small_config,
                      step_gradients, text_config)
from jaxllm.config import ConfigError
from jaxllm.cost import hlo
from jaxllm.data import make_batches
from jaxllm.data.sources import resolve_files
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.train import setup, train
from jaxllm.validate import resolve_mesh

SEQUENCE_PARALLEL = dict(act_seq=('tensor',))
CONTEXT_PARALLEL = dict(batch=('data',), seq=('fsdp',))
RUNS = {  # mesh, micro-batches, rules changed
    'data8': (dict(data=8), 1, {}),
    'fsdp8': (dict(fsdp=8), 1, {}),
    'tensor4_data2': (dict(tensor=4, data=2), 1, {}),
    'data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), 1, {}),
    'data2_fsdp2_tensor2_micro2': (dict(data=2, fsdp=2, tensor=2), 2, {}),
    'context_and_sequence_parallel_micro2': (dict(data=2, fsdp=2, tensor=2), 2,
                                             {**CONTEXT_PARALLEL, **SEQUENCE_PARALLEL}),
}
# The splits one at a time, each gradient tensor against one device's
# (`test_split_gradients_match_one_device`); three steps of all of them together above.
SPLITS = {  # mesh, micro-batches, rules changed, model fields changed
    # 4 K/V heads over tensor=8: each is replicated over the 2 devices whose query heads use it
    'tensor8_shared_kv_heads': (dict(tensor=8), 1, {}, {}),
    # 1 K/V head over tensor=2, beside data and fsdp
    'one_kv_head_data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), 1, {},
                                        dict(num_kv_heads=1)),
    'sequence_parallel': (dict(data=2, fsdp=2, tensor=2), 1, SEQUENCE_PARALLEL, {}),
    'context_parallel_fsdp4_tensor2': (dict(fsdp=4, tensor=2), 1, CONTEXT_PARALLEL, {}),
    'context_and_sequence_parallel_micro2': (*RUNS['context_and_sequence_parallel_micro2'], {}),
}


@pytest.mark.slow
@pytest.mark.parametrize('mesh, micro_batches, rules', RUNS.values(), ids=RUNS.keys())
def test_mesh_trains_like_one_device(mesh, micro_batches, rules, corpus, one_device_run):
  """Three steps on text rows: losses, gradient norms and parameters as on one device."""
  ref_params, ref_losses, ref_norms = one_device_run
  cfg = text_config(corpus, **mesh)
  cfg.train.micro_batches = micro_batches
  cfg.sharding.rules.update(rules)
  state, history = train(cfg)
  losses = [row['loss'] for row in history]
  assert len(losses) == 3 and losses[-1] < losses[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose([row['grad_norm'] for row in history], ref_norms, rtol=1e-5)
  assert_params_close(jax.device_get(state.params), ref_params)


@pytest.mark.slow
def test_bf16_mesh_gradients_match_one_device(corpus):
  """bf16 compute (fp32 params) on data=2 × fsdp=2 × tensor=2, 2 micro-batches: the first
  step's loss and gradients against one device's, also in bf16.

  Measured (jax 0.10.2, CPU): each gradient tensor within 0.6% (in norm) of one device's,
  the loss within 7.5e-6 relative; one device in bf16 is itself 0.8% from fp32. The bounds,
  3% and 3e-5, are well below what a wrong collective does: a reduction counted twice
  scales the gradients by 2 (100% off, the loss unchanged: measured by doubling the step's
  data psum), and without the data psum each device keeps its half of the batch's gradient,
  which resembles the whole one: 5% to 13% off per tensor, the loss 1e-4 off (measured by
  dropping that psum)."""
  def bf16(**mesh):
    cfg = text_config(corpus, **mesh)
    cfg.model.dtype = 'bfloat16'
    return cfg
  ref_loss, ref_grads = step_gradients(bf16(), jax.devices()[:1])
  cfg = bf16(data=2, fsdp=2, tensor=2)
  cfg.train.micro_batches = 2
  loss, grads = step_gradients(cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=3e-5)
  for path, (got, want) in zip(leaf_paths(ref_grads), paired_leaves(grads, ref_grads)):
    assert got.dtype == want.dtype == np.float32, path
    assert np.linalg.norm(got - want) <= 0.03 * np.linalg.norm(want), path


@pytest.fixture(scope='module')
def one_device_gradients(short_documents):
  """The first step's loss and gradients of `text_config` (with these model fields) on rows
  of several documents, on one device (fp32); made once per model."""
  made = {}

  def gradients(**model):
    key = tuple(sorted(model.items()))
    if key not in made:
      cfg = text_config(short_documents)
      cfg.model.update(model)
      first = next(iter(setup(cfg, jax.devices()[:1]).batches))
      assert (np.asarray(first['segment_ids']).max(axis=1) > 1).all()  # documents meet in rows
      made[key] = once_per_run(f'test_parallel.one_device_gradients{key}',
                               lambda: step_gradients(cfg, jax.devices()[:1]))
    return made[key]
  return gradients


@pytest.mark.slow
@pytest.mark.parametrize('mesh, micro_batches, rules, model', SPLITS.values(), ids=SPLITS.keys())
def test_split_gradients_match_one_device(mesh, micro_batches, rules, model, short_documents,
                                          one_device_gradients):
  """Each gradient tensor of the first step, not only their norm, as one device's: fp32,
  within 1e-5 of its largest element, on rows packed with several documents."""
  ref_loss, ref_grads = one_device_gradients(**model)
  cfg = text_config(short_documents, **mesh)
  cfg.model.update(model)
  cfg.train.micro_batches = micro_batches
  cfg.sharding.rules.update(rules)
  loss, grads = step_gradients(cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for path, (got, want) in zip(leaf_paths(ref_grads), paired_leaves(grads, ref_grads)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=path)



@pytest.mark.slow
def test_context_parallel_on_padded_unpacked_rows_matches_one_device(short_documents):
  """data.packing=False on documents shorter than a row: one document per row, then padding
  (position 0, no segment ids). Split over fsdp=4 × tensor=2 with the sequence on fsdp, the
  first step's loss and every gradient tensor are one device's (fp32, within 1e-5 of the
  tensor's largest element): no real token attends to the padding after its document."""
  def unpacked(**mesh):
    cfg = text_config(short_documents, **mesh)
    cfg.data.packing = False
    return cfg
  first = next(iter(setup(unpacked(), jax.devices()[:1]).batches))
  assert 'segment_ids' not in first
  positions = np.asarray(first['positions'])
  assert ((positions[:, 1:] == 0) & (positions[:, :-1] > 0)).any(axis=1).all()  # padded rows
  ref_loss, ref_grads = step_gradients(unpacked(), jax.devices()[:1])
  cfg = unpacked(fsdp=4, tensor=2)
  cfg.sharding.rules.update(CONTEXT_PARALLEL)
  loss, grads = step_gradients(cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for path, (got, want) in zip(leaf_paths(ref_grads), paired_leaves(grads, ref_grads)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=path)

@pytest.mark.slow
def test_micro_batches_equal_one_large_batch(corpus):
  """k micro-batches of b sequences give the update of one batch of k·b."""
  results = []
  for micro_batches in (1, 4):
    cfg = text_config(corpus, data=2, fsdp=2)
    cfg.train.update(micro_batches=micro_batches, global_batch=16, steps=2)
    state, history = train(cfg, devices=jax.devices()[:4])
    results.append((jax.device_get(state.params), [r['loss'] for r in history],
                    [r['grad_norm'] for r in history]))
  (one_params, one_losses, one_norms), (acc_params, acc_losses, acc_norms) = results
  np.testing.assert_allclose(acc_losses, one_losses, rtol=1e-5)
  np.testing.assert_allclose(acc_norms, one_norms, rtol=1e-5)  # AdamW hides a scale
  assert_params_close(acc_params, one_params)


def _equations(jaxpr):
  """Every equation of a jaxpr, however deeply nested (jit, shard_map, remat, custom_vjp)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      inner = getattr(value, 'jaxpr', value)
      if hasattr(inner, 'eqns'):
        yield from _equations(inner)


@pytest.mark.parametrize('micro_batches', [1, 4])
def test_gradients_are_summed_in_fp32_under_bf16_parameters(micro_batches):
  """bf16 weights (chosen knowingly) still sum their gradients in fp32: over micro-batches (a
  bf16 sum of many would lose the small ones) and over data, one micro-batch's too. Read from
  the step's own program."""
  cfg = small_config(data=2, fsdp=2)
  cfg.model.update(dtype='bfloat16', param_dtype='bfloat16', num_layers=2)
  cfg.train.update(micro_batches=micro_batches, global_batch=16)
  run = setup(cfg, jax.devices()[:4])
  with sharding_context(run.mesh, run.layout.rules):
    program = run.train_step.trace(run.state, next(run.batches)).jaxpr
  assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {np.dtype('bfloat16')}
  num_params = len(jax.tree.leaves(run.state.params))
  over_data = [e for e in _equations(program.jaxpr)
               if e.primitive.name == 'psum' and 'data' in e.params['axes']]
  assert len(over_data) >= num_params  # the gradients', the loss's and the tokens'
  assert {v.aval.dtype for e in over_data for v in e.invars} == {np.dtype('float32')}
  if micro_batches == 1:
    return
  accumulation = [e for e in _equations(program.jaxpr) if e.primitive.name == 'scan' and
                  e.params['length'] == 4 and e.params['num_carry'] == num_params + 2]
  assert len(accumulation) == 1
  scan = accumulation[0]
  carry = scan.invars[scan.params['num_consts']:][:scan.params['num_carry']]
  assert {v.aval.dtype for v in carry} == {np.dtype('float32')}


def test_text_batches_follow_the_seed(corpus):
  """Same seed: same batches on any mesh; another seed: another order."""
  def first_inputs(seed, **mesh):
    cfg = text_config(corpus, **mesh)
    cfg.train.seed = seed
    mesh = make_mesh(resolve_mesh(cfg.mesh, jax.device_count()))
    return np.asarray(next(make_batches(cfg, mesh))['inputs'])
  a = first_inputs(0, fsdp=8)
  np.testing.assert_array_equal(a, first_inputs(0, data=2, tensor=4))
  assert not np.array_equal(a, first_inputs(1, fsdp=8))
  assert len(resolve_files(corpus)) == 12


def _shard_shapes(array):
  return {shard.data.shape for shard in array.addressable_shards}


@pytest.mark.slow  # ~8 CPU-s
def test_fsdp_splits_params_and_moments_eight_ways():
  cfg = small_config(fsdp=8)
  run = setup(cfg)
  params = run.state.params
  adam = run.state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
  for tree in (params, adam.mu, adam.nu):
    wq = tree['blocks']['attn']['wq_DNH'][...]          # [L, D, N, H], D split on fsdp
    assert _shard_shapes(wq) == {(4, 64 // 8, 8, 8)}
    w_gate = tree['blocks']['mlp']['w_gate_DF'][...]    # [L, D, F]
    assert _shard_shapes(w_gate) == {(4, 64 // 8, 128)}
    assert _shard_shapes(tree['embed_VD'][...]) == {(264, 64 // 8)}
  with sharding_context(run.mesh, run.layout.rules):
    text = run.train_step.lower(run.state, next(run.batches)).compile().as_text()
  # Inside the backward's layer loop (once per layer), each layer's gradients are summed over
  # fsdp and each device keeps its eighth: the CPU compiler emits that as an all-reduce whose
  # result is only sliced, which `hlo.collectives` reads as the reduce-scatter an accelerator
  # runs (7/8 of the layer's fp32 matrices sent per device). The norm scales, not split, are
  # all-reduced whole. The weights are all-gathered for the forward and again for the backward.
  m, L = cfg.model, cfg.model.num_layers
  matrices = (m.embed_dim * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
              + m.num_heads * m.head_dim * m.embed_dim + 3 * m.embed_dim * m.mlp_dim)
  per_layer = collections.defaultdict(float)
  for c in hlo.collectives(text, dict(run.mesh.shape), cpu=True):
    if c.count == L:
      assert c.axes == ('fsdp',) and c.dtype == 'f32', c
      per_layer[c.kind, c.from_all_reduce] += c.bytes_per_call
  assert dict(per_layer) == {
      ('all-gather', False): 2 * 7 / 8 * 4 * matrices,
      ('reduce-scatter', True): 7 / 8 * 4 * matrices,
      ('all-reduce', False): 2 * 7 / 8 * 4 * 2 * m.embed_dim,
  }


def test_tensor_splits_heads_and_hidden_units():
  run = setup(small_config(tensor=4, data=2))
  blocks = run.state.params['blocks']
  assert _shard_shapes(blocks['attn']['wq_DNH'][...]) == {(4, 64, 8 // 4, 8)}
  assert _shard_shapes(blocks['attn']['wk_DKH'][...]) == {(4, 64, 4 // 4, 8)}
  assert _shard_shapes(blocks['attn']['wo_NHD'][...]) == {(4, 8 // 4, 8, 64)}
  assert _shard_shapes(blocks['mlp']['w_up_DF'][...]) == {(4, 64, 128 // 4)}
  assert _shard_shapes(blocks['mlp']['w_down_FD'][...]) == {(4, 128 // 4, 64)}


ZERO_RUNS = {  # mesh, micro-batches, sharding.zero
    'data4_fsdp2': (dict(data=4, fsdp=2), 1, 1),
    'data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), 1, 1),
    'data2_fsdp2_tensor2_micro2': (dict(data=2, fsdp=2, tensor=2), 2, 1),
    'data4_fsdp2_zero2': (dict(data=4, fsdp=2), 1, 2),
    'data2_fsdp2_tensor2_micro2_zero2': (dict(data=2, fsdp=2, tensor=2), 2, 2),
    'data2_pipe2_tensor2': (dict(data=2, pipe=2, tensor=2), 1, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize('mesh, micro_batches, zero', ZERO_RUNS.values(), ids=ZERO_RUNS.keys())
def test_zero_trains_like_one_device(mesh, micro_batches, zero, corpus, one_device_run):
  ref_params, ref_losses, ref_grad_norms = one_device_run
  cfg = text_config(corpus, **mesh)
  cfg.train.micro_batches = micro_batches
  cfg.sharding.zero = zero
  state, history = train(cfg)
  np.testing.assert_allclose([row['loss'] for row in history], ref_losses, rtol=1e-5)
  np.testing.assert_allclose([row['grad_norm'] for row in history], ref_grad_norms, rtol=1e-5)
  assert_params_close(jax.device_get(state.params), ref_params)


def _per_device_bytes(tree) -> int:
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_zero_splits_the_moments_over_data_not_the_params():
  """data=4 × fsdp=2, read from the arrays' own shardings: ZeRO-1 keeps a quarter of each
  moment per device (every one has a dimension that splits 4 ways more); the params, and the
  optimizer's step counts, stay as they were."""
  states = {}
  for zero in (0, 1):
    cfg = small_config(data=4, fsdp=2)
    cfg.model.num_layers = 2
    cfg.sharding.zero = zero
    states[zero] = setup(cfg).state
  moments = lambda state: (state.opt_state[1][0].mu, state.opt_state[1][0].nu)
  counts = lambda state: (state.opt_state[1][0].count, state.opt_state[1][2].count)
  plain, zero = states[0], states[1]
  assert _per_device_bytes(zero.params) == _per_device_bytes(plain.params)
  assert _per_device_bytes(moments(zero)) * 4 == _per_device_bytes(moments(plain))
  assert _per_device_bytes(zero.opt_state) == (
      _per_device_bytes(moments(plain)) // 4 + _per_device_bytes(counts(plain)))
  # [L, D, N, H]: D, the largest shard, split over fsdp and then data
  wq = zero.opt_state[1][0].mu['blocks']['attn']['wq_DNH'][...]
  assert wq.sharding.spec == jax.P('pipe', ('fsdp', 'data'), 'tensor', None)
  assert wq.sharding.shard_shape(wq.shape) == (2, 64 // (2 * 4), 8, 8)
  wq = zero.params['blocks']['attn']['wq_DNH'][...]
  assert wq.sharding.shard_shape(wq.shape) == (2, 64 // 2, 8, 8)


def test_zero_without_a_data_axis_is_a_note(capsys):
  """Nothing to split: the run says so and goes on with the state it would have had."""
  cfg = small_config(fsdp=2)
  cfg.sharding.zero = 1
  run = setup(cfg, jax.devices()[:2])
  assert 'note: sharding.zero=1 splits over the data axis, but mesh.data=1' in capsys.readouterr().out
  mu = run.state.opt_state[1][0].mu['embed_VD'][...]
  assert mu.sharding.spec == jax.P('tensor', 'fsdp')


def test_fewer_kv_heads_than_tensor_are_replicated_over_it():
  """4 K/V heads over tensor=8: the K/V weights are kept whole over tensor (split over fsdp
  as before), the query heads split; 3 K/V heads over tensor=2 can be neither and are an error."""
  cfg = small_config(fsdp=1, tensor=8)
  run = setup(cfg, jax.devices())
  assert cfg.sharding.rules.kv_heads == run.cfg.sharding.rules.kv_heads == ('tensor',)
  assert run.layout.rules['kv_heads'] == ()  # the rules the run applies
  attn = run.state.params['blocks']['attn']
  assert attn['wq_DNH'][...].sharding.spec == jax.P('pipe', 'fsdp', 'tensor', None)
  assert attn['wk_DKH'][...].sharding.spec == jax.P('pipe', 'fsdp', None, None)
  cfg = small_config(data=4, tensor=2)
  cfg.model.update(num_heads=6, num_kv_heads=3)
  with pytest.raises(ConfigError, match='model.num_kv_heads=3 does not split evenly'):
    setup(cfg, jax.devices())


@pytest.mark.parametrize('rules, message', [
    (dict(act_seq=('tensor',)), "sharding.rules.act_seq=('tensor',) splits the sequence over "
                                'axes of size 1'),
    (CONTEXT_PARALLEL, "sharding.rules.seq=('fsdp',) splits the sequence over axes of size 1"),
])
def test_a_sequence_split_over_nothing_is_a_note(rules, message, capsys):
  cfg = small_config(data=2)
  cfg.sharding.rules.update(rules)
  setup(cfg, jax.devices()[:2])
  assert f'note: {message}' in capsys.readouterr().out
