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

from conftest import assert_params_close, leaf_paths, paired_leaves, step_gradients, text_config
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


LAYER_CASES = {  # moe fields, mesh
    'softmax_ring': (dict(), 'one_device'),
    'softmax_all_to_all': (dict(dispatch='all_to_all'), 'one_device'),
    'sigmoid_shared_ring': (dict(router='sigmoid', route_scale=2.5, shared_experts=2),
                            'one_device'),
    'softmax_unnormalised_ring_fsdp4': (dict(renormalize=False), 'fsdp4'),
    'sigmoid_all_to_all_fsdp4': (dict(router='sigmoid', dispatch='all_to_all'), 'fsdp4'),
    'softmax_ring_data_fsdp_tensor': (dict(), 'data2_fsdp2_tensor2_experts_over_data_fsdp'),
    'sigmoid_all_to_all_data_fsdp_tensor': (dict(router='sigmoid', dispatch='all_to_all'),
                                            'data2_fsdp2_tensor2_experts_over_data_fsdp'),
}


@pytest.mark.parametrize('moe, mesh_name', LAYER_CASES.values(), ids=LAYER_CASES.keys())
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
  (_, want), want_grads = jax.value_and_grad(reference, (0, 1), has_aux=True)(
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

  (aux, (objective, routing)), grad = jax.value_and_grad(ours, has_aux=True)(logits_LBTE)
  logits_torch = torch.tensor(logits_LBTE, requires_grad=True)
  want_aux = load_balancing_loss_func(tuple(logits_torch.reshape(L, B * T, E)), E, K)
  want_aux.backward()
  np.testing.assert_allclose(aux, want_aux.item(), rtol=1e-6)
  np.testing.assert_allclose(grad, logits_torch.grad.numpy(), rtol=1e-5, atol=1e-9)
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


@pytest.mark.parametrize('moe, active', [(dict(), 2), (dict(shared_experts=1, shared_mlp_dim=20), 2),
                                         (dict(first_dense=1, top_k=3), 3)])
def test_param_counts_of_experts(moe, active, one_device):
  """Total parameters as the model holds them; active ones with top_k of the experts."""
  cfg = model_config(**moe)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  counts = param_counts(cfg)
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == counts['total']
  experts = cfg.moe.experts * 3 * 16 * 12 * (2 - cfg.moe.first_dense)
  assert counts['total'] - counts['active'] == experts * (8 - active) // 8
