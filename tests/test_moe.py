"""Mixture of experts: the layer against references written here, the router losses against
transformers', capacity drops against a count, the block structures, and any mesh against one
device."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from ml_collections import FrozenConfigDict
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from conftest import (assert_params_close, first_step, leaf_paths, once_per_run, paired_leaves,
                      text_config)
from jaxllm.config import ConfigError, default_config
from jaxllm.metrics import param_counts
from jaxllm.model import KVCache, Transformer, sequence_positions
from jaxllm.model.layers import MLP
from jaxllm.model.moe import MoE, dispatch, route, router_losses, router_stats
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.validate import validate

RULES = default_config().sharding.rules
ONE_DEVICE = dict(data=1, fsdp=1, pipe=1, tensor=1)
LAYER_MESHES = {  # mesh, rules changed
    'one_device': (ONE_DEVICE, {}),
    'fsdp4': ({**ONE_DEVICE, 'fsdp': 4}, {}),
    'data2_fsdp2_tensor2_experts_over_data_fsdp': (dict(data=2, fsdp=2, pipe=1, tensor=2),
                                                   dict(experts=('data', 'fsdp'))),
    # the experts whole over data, whose devices hold other tokens: their gradients are summed
    'data2_fsdp2_tensor2': (dict(data=2, fsdp=2, pipe=1, tensor=2), {}),
}


def model_config(**moe):
  """A small model section with 8 experts of width 12, top-2."""
  c = default_config().model
  c.update(vocab_size=64, embed_dim=16, mlp_dim=24, num_layers=2, num_heads=2, num_kv_heads=2,
           head_dim=8)
  c.moe.update(experts=8, top_k=2, mlp_dim=12)
  c.moe.update(moe)
  return c


def mesh_and_rules(mesh_shape, rules=()):
  mesh = make_mesh(mesh_shape, jax.devices()[:math.prod(mesh_shape.values())])
  return mesh, {**RULES, **dict(rules)}


def moe_layer(cfg, mesh, rules, bias_seed=None):
  """(graphdef, params, biases) of `MoE(cfg)`: made on one device, placed on `mesh` by the
  rules. `bias_seed`: random router biases (a sigmoid router's), else zeros."""
  one, _ = mesh_and_rules(ONE_DEVICE)
  with sharding_context(one, rules):
    graphdef, params, biases = nnx.split(MoE(FrozenConfigDict(cfg), nnx.Rngs(0)), nnx.Param,
                                         ...)
    params, biases = jax.device_get((params, biases))
  if bias_seed is not None:
    biases = jax.tree.map(
        lambda b: np.random.default_rng(bias_seed).normal(0, 0.5, b.shape).astype(b.dtype),
        biases)
  with sharding_context(mesh, rules):
    return graphdef, *jax.device_put((params, biases), nnx.get_named_sharding(
        nnx.state(nnx.eval_shape(lambda: MoE(FrozenConfigDict(cfg), nnx.Rngs(0))),
                  nnx.Param, ...), mesh))


def swiglu(x, w_gate, w_up, w_down):
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def all_experts_reference(p, bias_E, x_BTD, m):
  """Every expert run on every token, summed with a gate matrix that is zero but for each
  token's top-k experts (one-hot gating): the routing and experts written out plainly."""
  logits = x_BTD @ p['router_DE']
  scores = jax.nn.softmax(logits, -1) if m.router == 'softmax' else jax.nn.sigmoid(logits)
  choice = scores if bias_E is None else scores + bias_E
  top_BTK = jnp.argsort(-choice, axis=-1)[..., :m.top_k]
  chosen_BTE = jax.nn.one_hot(top_BTK, m.experts).sum(-2)
  gates_BTE = scores * chosen_BTE
  if m.renormalize:
    gates_BTE = gates_BTE / gates_BTE.sum(-1, keepdims=True)
  outputs_EBTD = jax.vmap(swiglu, (None, 0, 0, 0))(x_BTD, p['w_gate_EDF'], p['w_up_EDF'],
                                                   p['w_down_EFD'])
  y = jnp.einsum('bte,ebtd->btd', gates_BTE * m.route_scale, outputs_EBTD)
  if 'shared' in p:
    s = p['shared']
    y = y + swiglu(x_BTD, s['w_gate_DF'], s['w_up_DF'], s['w_down_FD'])
  return y


def plain(tree):
  """An nnx.State as nested dicts of arrays."""
  return jax.tree.map(lambda v: v[...], nnx.to_pure_dict(tree)) if tree else tree


LAYER_CASES = {  # moe fields, mesh, in the quick tier
    'softmax_ring': (dict(), 'one_device', False),
    'softmax_all_to_all': (dict(dispatch='all_to_all'), 'one_device', False),
    'sigmoid_shared_ring': (dict(router='sigmoid', route_scale=2.5, shared_experts=2),
                            'one_device', True),
    'softmax_unnormalised_ring_fsdp4': (dict(renormalize=False), 'fsdp4', False),
    'sigmoid_all_to_all_fsdp4': (dict(router='sigmoid', dispatch='all_to_all'), 'fsdp4', True),
    'softmax_ring_data_fsdp_tensor': (dict(), 'data2_fsdp2_tensor2_experts_over_data_fsdp',
                                      True),
    'sigmoid_all_to_all_data_fsdp_tensor': (dict(router='sigmoid', dispatch='all_to_all'),
                                            'data2_fsdp2_tensor2_experts_over_data_fsdp', False),
    'softmax_all_to_all_experts_over_fsdp_only': (dict(dispatch='all_to_all'),
                                                  'data2_fsdp2_tensor2', False),
    # the own Pallas kernels, in Pallas' interpreter on the CPU
    'softmax_ring_triton_fsdp4': (dict(grouped_matmul='triton'), 'fsdp4', False),
}


@pytest.mark.parametrize('moe, mesh_name', [
    pytest.param(moe, mesh, id=name, marks=() if quick else pytest.mark.slow)
    for name, (moe, mesh, quick) in LAYER_CASES.items()])
def test_dropless_layer_equals_all_experts_with_one_hot_gates(moe, mesh_name):
  """fp32: the layer's output and its gradients (input, router, experts, shared experts) as
  the all-experts reference's, within 1e-5, on one device and with the experts split."""
  cfg = model_config(**moe)
  mesh, rules = mesh_and_rules(*LAYER_MESHES[mesh_name])
  sigmoid = cfg.moe.router == 'sigmoid'
  graphdef, params, biases = moe_layer(cfg, mesh, rules, bias_seed=1 if sigmoid else None)
  rng = np.random.default_rng(0)
  x_BTD = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)

  def ours(params, x_BTD):
    y_BTD, stats = nnx.merge(graphdef, params, biases)(x_BTD)
    return jnp.sum(y_BTD * cotangent), (y_BTD, stats)

  def reference(params, x_BTD):
    bias_E = plain(biases)['router_bias_E'] if sigmoid else None
    y_BTD = all_experts_reference(plain(params), bias_E, x_BTD, cfg.moe)
    return jnp.sum(y_BTD * cotangent), y_BTD

  with sharding_context(mesh, rules):
    (_, (got, stats)), got_grads = jax.jit(jax.value_and_grad(ours, (0, 1), has_aux=True))(
        params, x_BTD)
  (_, want), want_grads = jax.jit(jax.value_and_grad(reference, (0, 1), has_aux=True))(
      jax.device_get(params), x_BTD)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert float(stats.dropped) == 0 and float(stats.load_E.sum()) == 8 * 6 * 2
  got_grads, want_grads = (plain(got_grads[0]), got_grads[1]), (plain(want_grads[0]),
                                                                want_grads[1])
  for path, (g, w) in zip(leaf_paths(want_grads), paired_leaves(got_grads, want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=path)


@pytest.mark.parametrize('dispatch_name', ['ring', 'all_to_all'])
def test_one_expert_top_1_is_the_mlp(dispatch_name, one_device):
  """One expert, chosen by every token with weight 1, holding the MLP's weights: the MLP's
  output and gradients."""
  cfg = model_config(experts=1, top_k=1, mlp_dim=24, dispatch=dispatch_name)
  mlp_graph, mlp = nnx.split(MLP(cfg, nnx.Rngs(0)))
  moe_graph, moe = nnx.split(MoE(FrozenConfigDict(cfg), nnx.Rngs(1)))
  names = {'w_gate_DF': 'w_gate_EDF', 'w_up_DF': 'w_up_EDF', 'w_down_FD': 'w_down_EFD'}
  for mlp_name, moe_name in names.items():
    moe[moe_name].set_value(mlp[mlp_name][...][None])
  x_BTD = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
  loss = lambda y_BTD: jnp.sum(jnp.sin(y_BTD))
  got, (d_moe, d_x) = jax.jit(jax.value_and_grad(
      lambda p, x: loss(nnx.merge(moe_graph, p)(x)[0]), (0, 1)))(moe, x_BTD)
  want, (d_mlp, want_d_x) = jax.jit(jax.value_and_grad(
      lambda p, x: loss(nnx.merge(mlp_graph, p)(x)), (0, 1)))(mlp, x_BTD)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(d_x, want_d_x, rtol=1e-5, atol=1e-7)
  for mlp_name, moe_name in names.items():
    np.testing.assert_allclose(d_moe[moe_name][...][0], d_mlp[mlp_name][...], rtol=1e-5,
                               atol=1e-7)


def test_router_losses_are_transformers_load_balancing_and_z_losses(one_device):
  """Router logits of 3 layers: the load-balancing loss and its gradient as transformers'
  `load_balancing_loss_func` computes them; the z-loss as its formula; the objective adds
  both with their coefficients, times the tokens."""
  L, B, T, E, K = 3, 2, 5, 8, 2
  logits_LBTE = np.random.default_rng(0).normal(size=(L, B, T, E)).astype(np.float32)
  m = model_config(experts=E, top_k=K, aux_loss=0.01, z_loss=0.001).moe
  tokens = 7.0  # the targets the loss counts

  def ours(logits_LBTE):
    stats = jax.vmap(lambda l: router_stats(l, route(l, None, m)[0], 0.0))(logits_LBTE)
    objective, routing = router_losses(stats, m, tokens)
    return routing.aux / tokens, (objective, routing)

  (aux, (objective, routing)), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(
      logits_LBTE)
  logits_torch = torch.tensor(logits_LBTE, requires_grad=True)
  want_aux = load_balancing_loss_func(tuple(logits_torch.reshape(L, B * T, E)), E, K)
  want_aux.backward()
  np.testing.assert_allclose(aux, want_aux.item(), rtol=1e-6)
  # To 1e-5 of the gradient's scale: summed in another order than torch's, a component near
  # zero differs by fp32 roundings of the larger terms (2.4e-9 on 5.8e-5 on some CPUs).
  want_grad = logits_torch.grad.numpy()
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5 * np.abs(want_grad).max())
  lse = np.log(np.exp(logits_LBTE.astype(np.float64)).sum(-1))
  np.testing.assert_allclose(routing.z / tokens, np.mean(lse ** 2), rtol=1e-6)
  np.testing.assert_allclose(objective, (0.01 * want_aux.item() + 0.001 * np.mean(lse ** 2))
                             * tokens, rtol=1e-6)
  np.testing.assert_array_equal(routing.load_UE.sum(), L * B * T * K)


def kept_by_count(ids_NK, experts: int, capacity: int):
  """Which assignments an expert of `capacity` keeps, counting each expert's assignments in
  order of preference: every token's first choice, then every second choice."""
  kept, taken = np.zeros(ids_NK.shape, bool), [0] * experts
  for k in range(ids_NK.shape[1]):
    for n in range(ids_NK.shape[0]):
      e = ids_NK[n, k]
      kept[n, k] = taken[e] < capacity
      taken[e] += 1
  return kept


@pytest.mark.parametrize('dispatch_name', ['ring', 'all_to_all'])
@pytest.mark.parametrize('mesh_name', ['one_device', 'fsdp4'])
def test_capacity_drops_the_counted_assignments(dispatch_name, mesh_name):
  """Capacity factor 0.5 on skewed routing: each device's tokens give each expert at most
  C = ceil(0.5·N·K/E) assignments, first choices first; the dropped count and the output
  are those of the assignments counted off here (per device's rows)."""
  E, K, B, T, D, F = 4, 2, 8, 6, 16, 12
  cfg = model_config(experts=E, top_k=K, capacity_factor=0.5, dispatch=dispatch_name)
  mesh, rules = mesh_and_rules(*LAYER_MESHES[mesh_name])
  rng = np.random.default_rng(0)
  ids_BTK = np.stack([[rng.choice(E, K, replace=False, p=[0.55, 0.25, 0.15, 0.05])
                       for _ in range(T)] for _ in range(B)]).astype(np.int32)
  gates_BTK = rng.uniform(0.1, 1, (B, T, K)).astype(np.float32)
  x_BTD = rng.normal(size=(B, T, D)).astype(np.float32)
  w = [rng.normal(0, 0.3, s).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
  with sharding_context(mesh, rules):
    y_BTD, dropped = jax.jit(lambda *a: dispatch(*a, cfg.moe))(x_BTD, ids_BTK, gates_BTK, w)

  devices = mesh.shape['fsdp']  # the batch's rows, split over the devices
  rows = np.split(np.arange(B), devices)
  want_y, want_dropped = np.zeros_like(x_BTD), 0
  for r in rows:
    ids_NK = ids_BTK[r].reshape(-1, K)
    C = math.ceil(0.5 * len(ids_NK) * K / E)
    kept_NK = kept_by_count(ids_NK, E, C)
    want_dropped += np.sum(~kept_NK)
    x_ND = x_BTD[r].reshape(-1, D)
    y_ND = sum(np.where(kept_NK[:, k, None], gates_BTK[r].reshape(-1, K)[:, k, None], 0)
               * np.stack([swiglu(x, *(a[e] for a in w)) for x, e in zip(x_ND, ids_NK[:, k])])
               for k in range(K))
    want_y[r] = y_ND.reshape(len(r), T, D)
  assert want_dropped > 10  # the case drops
  assert int(dropped) == want_dropped
  np.testing.assert_allclose(y_BTD, want_y, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_dense_first_layers_and_every_other_layer_decode_as_they_run(one_device):
  """model.moe.first_dense=1, every=2 over 5 layers: a dense stack of 1, then two groups of a
  dense and an MoE block. The KV cache filled in pieces gives the logits of the whole
  sequence, and the parameters count as metrics.param_counts says."""
  cfg = model_config(first_dense=1, every=2)
  cfg.num_layers = 5
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert model.dense_blocks.attn.wq_DNH.shape[0] == 1
  assert model.blocks.layers[0].mlp.w_gate_DF.shape[0] == 2
  assert model.blocks.layers[1].mlp.w_gate_EDF.shape[:2] == (2, 8)
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == (
      param_counts(cfg)['total'])
  graphdef, params = nnx.split(model)
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)

  def in_pieces(params):
    model = nnx.merge(graphdef, params)
    cache, logits = KVCache.empty(model.cfg, 2, 9), []
    for start, stop in ((0, 4), (4, 5), (5, 9)):
      piece_BT = tokens_BT[:, start:stop]
      x_BTD, cache = model.layers(model.embed(piece_BT),
                                  cache.length + sequence_positions(piece_BT), cache=cache)
      logits.append(model.logits(x_BTD))
    return jnp.concatenate(logits, axis=1)

  whole = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens_BT))(params)
  np.testing.assert_allclose(jax.jit(in_pieces)(params), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('moe, active', [(dict(), 2),
                                         (dict(shared_experts=1, shared_mlp_dim=20), 2),
                                         (dict(first_dense=1, top_k=3), 3)])
def test_param_counts_of_experts(moe, active, one_device):
  """Total parameters as the model holds them; active ones with top_k of the experts."""
  cfg = model_config(**moe)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  counts = param_counts(cfg)
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == counts['total']
  experts = cfg.moe.experts * 3 * 16 * 12 * (2 - cfg.moe.first_dense)
  assert counts['total'] - counts['active'] == experts * (8 - active) // 8


def moe_config(data_path, **mesh):
  """`text_config` with 8 experts of width 32 (top-2) in every layer and both router losses
  on, so that their gradients count."""
  cfg = text_config(data_path, **mesh)
  cfg.model.moe.update(experts=8, top_k=2, mlp_dim=32, aux_loss=0.01, z_loss=0.001)
  return cfg


@pytest.fixture(scope='module')
def one_device_step(short_documents):
  """`first_step` on one device of `moe_config` with these moe fields and micro-batches;
  made once each per run."""
  made = {}

  def reference(micro_batches, **moe):
    key = (micro_batches, *sorted(moe.items()))
    if key not in made:
      cfg = moe_config(short_documents)
      cfg.model.moe.update(moe)
      cfg.train.micro_batches = micro_batches
      made[key] = once_per_run(f'test_moe.one_device_step{key}',
                               lambda: first_step(cfg, jax.devices()[:1]))
    return made[key]
  return reference


MESH_CASES = {  # mesh, moe fields, rules changed, pipeline fields, micro-batches, ZeRO
    'fsdp4_ring': (dict(fsdp=4), dict(), {}, {}, 1, 0),
    'fsdp4_all_to_all': (dict(fsdp=4), dict(dispatch='all_to_all'), {}, {}, 1, 0),
    'data2_fsdp2_tensor2_ring': (dict(data=2, fsdp=2, tensor=2), dict(), {}, {}, 1, 0),
    'data2_fsdp2_tensor2_all_to_all_experts_over_data_fsdp': (
        dict(data=2, fsdp=2, tensor=2), dict(dispatch='all_to_all'),
        dict(experts=('data', 'fsdp')), {}, 1, 0),
    # the residual stream split along the sequence over tensor (the layer gathers its input)
    'sequence_parallel_data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), dict(),
                                              dict(act_seq=('tensor',)), {}, 1, 0),
    # the tokens split along the sequence over fsdp, which the experts are split over too
    'context_parallel_data2_fsdp2_tensor2_all_to_all': (
        dict(data=2, fsdp=2, tensor=2), dict(dispatch='all_to_all'),
        dict(batch=('data',), seq=('fsdp',)), {}, 1, 0),
    # each micro-batch's gradients reduce-scattered into the sum split over data
    'data2_fsdp2_tensor2_micro2_zero2': (dict(data=2, fsdp=2, tensor=2), dict(), {}, {}, 2, 2),
    'gpipe_pipe2_data2_fsdp2_every2': (dict(pipe=2, data=2, fsdp=2), dict(every=2), {},
                                       dict(microbatches=2), 1, 0),
    'circular_pipe2_fsdp2_tensor2_sigmoid': (dict(pipe=2, fsdp=2, tensor=2),
                                             dict(router='sigmoid'), {},
                                             dict(schedule='circular', repeats=2), 1, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize('mesh, moe, rules, pipeline, micro_batches, zero', MESH_CASES.values(),
                         ids=MESH_CASES.keys())
def test_mesh_step_equals_one_device(mesh, moe, rules, pipeline, micro_batches, zero,
                                     short_documents, one_device_step):
  """Dropless, fp32, on rows packed with several documents: the first step's loss, aux and z
  losses, expert loads and every gradient tensor as one device's (within 1e-5 of the
  tensor's largest element), with the experts split over the devices (in a pipeline, each
  stage's experts gathered with its other weights). With micro-batches, as one device's with
  as many."""
  want, want_grads = one_device_step(micro_batches, **moe)
  cfg = moe_config(short_documents, **mesh)
  cfg.model.moe.update(moe)
  cfg.sharding.rules.update(rules)
  cfg.pipeline.update(pipeline)
  cfg.train.micro_batches = micro_batches
  cfg.sharding.zero = zero
  got, grads = first_step(cfg, jax.devices()[:math.prod(cfg.mesh[a] for a in ONE_DEVICE)])
  for name in ('loss', 'moe_aux_loss', 'moe_z_loss'):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  load = got['moe_load']
  if pipeline.get('repeats', 1) > 1:  # stored stage-major: layers 0, 2 on stage 0, 1, 3 on 1
    load = load[np.argsort([0, 2, 1, 3])]
  np.testing.assert_array_equal(load, want['moe_load'])
  assert got['moe_dropped'] == want['moe_dropped'] == 0
  for path, (g, w) in zip(leaf_paths(want_grads), paired_leaves(grads, want_grads)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max(), err_msg=path)


BAD_INPUT = {  # moe fields, mesh and rules changes, the start of the one line it says
    'experts_not_divisible': (dict(experts=6), dict(fsdp=4),
                              'model.moe.experts=6 does not split over the 4 expert-parallel '
                              "devices (sharding.rules.experts=('fsdp',): fsdp=4); make it a "
                              'multiple of 4'),
    'top_k_above_experts': (dict(experts=4, top_k=5), {},
                            'model.moe.top_k=5 must be between 1 and model.moe.experts=4'),
    'negative_capacity': (dict(capacity_factor=-1.0), {},
                          'model.moe.capacity_factor=-1.0 must be at least 0 (0: dropless'),
    'unknown_dispatch': (dict(dispatch='alltoall'), {},
                         "model.moe.dispatch='alltoall' is unknown; use one of ring, all_to_all"),
    'unknown_router': (dict(router='topk'), {},
                       "model.moe.router='topk' is unknown; use one of softmax, sigmoid"),
    'unknown_grouped_matmul': (dict(grouped_matmul='pallas'), {},
                               "model.moe.grouped_matmul='pallas' is unknown; use one of xla, "
                               'triton'),
    'layers_not_in_groups': (dict(every=3), {},
                             'model.num_layers=4 less model.moe.first_dense=0 is not a multiple '
                             'of model.moe.every=3'),
    'no_moe_layer_left': (dict(first_dense=4), {},
                          'model.moe.first_dense=4 leaves no layer of model.num_layers=4'),
    'experts_and_their_mlp_on_one_axis': (dict(), dict(rules=dict(expert_mlp=('fsdp',))),
                                          "sharding.rules.experts=('fsdp',) and sharding.rules."
                                          "expert_mlp=('fsdp',) both split over 'fsdp', but "
                                          'one array has both axes ([layers, experts, -, '
                                          'expert_mlp])'),
    'experts_over_the_layers_axis': (dict(), dict(rules=dict(experts=('pipe',))),
                                     "sharding.rules.layers=('pipe',) and sharding.rules."
                                     "experts=('pipe',) both split over 'pipe'"),
    'fp8': (dict(), dict(model=dict(fp8='delayed')), "model.fp8='delayed' is not built for "
            'experts'),
    'one_f_one_b': (dict(), dict(pipe=2, pipeline=dict(schedule='1f1b')),
                    "pipeline.schedule='1f1b' is not built for experts"),
    'first_dense_in_a_pipeline': (dict(first_dense=2), dict(pipe=2),
                                  'model.moe.first_dense=2 is not built for pipelines'),
    'mixed_layer_types': (dict(), dict(model=dict(layer_types=('sliding', 'full'),
                                                  sliding_window=4)),
                          "model.layer_types=('sliding', 'full') mixes full and sliding layers, "
                          'which is not built for experts (model.moe.experts=8)'),
}


@pytest.mark.parametrize('moe, changes, message', BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_expert_settings_are_one_line(moe, changes, message):
  from conftest import small_config
  changes = dict(changes)
  cfg = small_config(**{a: changes.pop(a) for a in ONE_DEVICE if a in changes})
  cfg.model.moe.update({'experts': 8, **moe})
  cfg.sharding.rules.update(changes.pop('rules', {}))
  cfg.model.update(changes.pop('model', {}))
  cfg.pipeline.update(changes.pop('pipeline', {}))
  with pytest.raises(ConfigError) as error:
    validate(cfg, {a: cfg.mesh[a] for a in ONE_DEVICE})
  assert str(error.value).startswith(message), str(error.value)
  assert '\n' not in str(error.value)


@pytest.mark.slow
def test_experts_with_every_layer_sliding_see_only_the_window(one_device):
  """Experts with model.layer_types=('sliding',) (what validate allows with experts), in a
  group of a dense block and an MoE one (model.moe.every=2): a window of 2 in each of the 2
  layers lets position t see tokens t-2 on at most, so changing the first token changes the
  logits at positions 0 to 2 and none after; with full attention (the reference that the
  window is what cuts them) it changes them all."""
  from conftest import small_config
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(1, 64, (1, 8)), jnp.int32)
  both_BT = jnp.concatenate([tokens_BT, tokens_BT.at[0, 0].set(0)])

  def moved(**window):
    cfg = model_config(every=2, capacity_factor=0.0)  # dropless: no token moves another
    cfg.update(window)
    run_cfg = small_config()
    run_cfg.model = cfg
    validate(run_cfg, ONE_DEVICE)
    logits_BTV = jax.jit(Transformer(FrozenConfigDict(cfg), rngs=nnx.Rngs(0)))(both_BT)
    return np.abs(np.asarray(logits_BTV[0] - logits_BTV[1])).max(axis=-1)

  sliding_T = moved(layer_types=('sliding',), sliding_window=2)
  assert (sliding_T[:3] > 1e-6).all() and (sliding_T[3:] == 0).all(), sliding_T
  assert (moved()[3:] > 1e-6).all()


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['full', 'dots'])
def test_remat_keeps_the_loss_and_gradients(remat, one_device):
  """The MoE layers rerun under a remat policy (their dispatch too) give what they kept."""
  tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)

  def loss_and_grads(policy):
    cfg = model_config(dispatch='all_to_all')
    cfg.remat = policy
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    loss = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens_BT)))
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss, grads), (want_loss, want_grads) = loss_and_grads(remat), loss_and_grads('none')
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for path, (g, w) in zip(leaf_paths(want_grads), paired_leaves(grads, want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=path)


def sigmoid_config(data_path, **mesh):
  """`moe_config` with sigmoid routers whose biases move 0.01 a step, at a constant lr (a
  run cut short and resumed then takes the same updates as one run through)."""
  cfg = moe_config(data_path, **mesh)
  cfg.model.moe.update(router='sigmoid', bias_rate=0.01)
  cfg.optim.schedule = 'constant'
  return cfg


@pytest.fixture(scope='module')
def sigmoid_one_device_run(corpus):
  """3 steps of `sigmoid_config` on one device: (params, router biases), the logged rows.
  On the corpus of long documents: on rows of many tiny ones, some attention-output weights
  get gradients near 0, and Adam's g/√v turns reduction-order noise there into 1e-4 of the
  tensor in 3 steps, experts or not (measured). Made once per run."""
  from jaxllm.train import train

  def run():
    state, history = train(sigmoid_config(corpus), devices=jax.devices()[:1])
    return jax.device_get((state.params, state.router_bias)), history
  return once_per_run('test_moe.sigmoid_one_device_run', run)


def assert_run_is(state, history, reference):
  (ref_params, ref_biases), ref_history = reference
  for name in ('loss', 'grad_norm', 'moe_aux_loss', 'moe_z_loss', 'moe_load_max'):
    np.testing.assert_allclose([r[name] for r in history], [r[name] for r in ref_history],
                               rtol=1e-5, err_msg=name)
  assert_params_close(jax.device_get(state.params), ref_params)
  for got, want in paired_leaves(jax.device_get(state.router_bias), ref_biases):
    assert np.abs(want).max() > 0  # they moved
    np.testing.assert_allclose(got, want, atol=1e-7)


@pytest.mark.slow
def test_router_biases_move_by_the_loads_of_the_whole_batch(short_documents):
  """On data=2 × fsdp=2 × tensor=2 (the step splits data by hand): one step's loads count every
  token's choices, and each bias moves by bias_rate·sign(mean load − load)."""
  import optax
  from jaxllm.step import TrainState, make_train_step
  from jaxllm.train import setup
  cfg = sigmoid_config(short_documents, data=2, fsdp=2, tensor=2)
  run = setup(cfg)
  tx = optax.sgd(0.0)
  step = make_train_step(run.graphdef, tx, lambda _: 0.0, 1,
                         router_bias_rate=cfg.model.moe.bias_rate)
  with sharding_context(run.mesh, run.layout.rules):
    state = TrainState(run.state.step, run.state.params, tx.init(run.state.params),
                       router_bias=run.state.router_bias)
    state, metrics = jax.jit(step)(state, next(run.batches))
  load_UE = np.asarray(metrics['moe_load'])
  np.testing.assert_array_equal(load_UE.sum(-1), 8 * 32 * 2)  # rows × positions × top_k
  [bias_UE] = jax.tree.leaves(jax.device_get(state.router_bias))
  np.testing.assert_allclose(
      bias_UE, 0.01 * np.sign(load_UE.mean(-1, keepdims=True) - load_UE), atol=1e-8)


@pytest.mark.slow
def test_a_skipped_step_leaves_the_router_biases():
  """train.skip_nonfinite: a step whose loss is NaN moves neither the parameters nor the
  sigmoid routers' biases (its loads are finite: they would move), a good step moves both."""
  from conftest import small_config
  from jaxllm.train import setup
  cfg = small_config()
  cfg.model.update(num_layers=2, mlp_dim=32)
  cfg.model.moe.update(experts=4, top_k=2, router='sigmoid', bias_rate=0.01)
  cfg.train.skip_nonfinite = True
  run = setup(cfg, jax.devices()[:1])
  good = next(run.batches)
  bad = dict(good, mask=jnp.full(good['mask'].shape, jnp.nan))
  states = [jax.device_get(run.state)]  # the step donates the state it takes
  with sharding_context(run.mesh, run.layout.rules):
    state, row = run.train_step(run.state, good)
    states.append(jax.device_get(state))
    state, row = run.train_step(state, bad)
    states.append(jax.device_get(state))
  assert not row['finite'] and np.all(np.isfinite(row['moe_load']))
  moved = [[np.abs(a - b).max() for a, b in paired_leaves((s1.params, s1.router_bias),
                                                            (s0.params, s0.router_bias))]
           for s0, s1 in zip(states, states[1:])]
  assert min(moved[0]) > 0 and max(moved[1]) == 0


@pytest.mark.slow
def test_zero1_mesh_trains_like_one_device(corpus, sigmoid_one_device_run):
  """ZeRO-1 on data=2 × fsdp=2 × tensor=2, experts over fsdp: three steps' losses, router
  metrics, parameters and router biases as one device's."""
  from jaxllm.train import train
  cfg = sigmoid_config(corpus, data=2, fsdp=2, tensor=2)
  cfg.sharding.zero = 1
  assert_run_is(*train(cfg), sigmoid_one_device_run)


@pytest.mark.slow
def test_resumed_on_another_mesh_goes_on_as_one_run(corpus, sigmoid_one_device_run, tmp_path):
  """Two steps on one device, saved; the third on fsdp=4 with the all-to-all dispatch, from
  that checkpoint: the parameters and router biases of three steps in one run."""
  from jaxllm.train import train
  first = sigmoid_config(corpus)
  first.train.steps = 2
  train(first, str(tmp_path), devices=jax.devices()[:1])
  then = sigmoid_config(corpus, fsdp=4)
  then.model.moe.dispatch = 'all_to_all'
  state, history = train(then, str(tmp_path), devices=jax.devices()[:4])
  assert [r['step'] for r in history] == [3]
  ref_state, ref_history = sigmoid_one_device_run
  assert_run_is(state, history, (ref_state, ref_history[2:]))
