"""Mixture of experts: a router sends each token to `top_k` of `experts` SwiGLU MLPs and sums
their outputs weighted by its scores (Mixtral, Qwen3-MoE, DeepSeek-V3), beside optional shared
experts every token goes through.

Expert parallelism needs no mesh axis of its own: the experts' dimension has the logical name
'experts' (sharding.rules.experts, fsdp by default, so the devices that split the batch hold
the experts between them) and their hidden units 'expert_mlp' (tensor). The dispatch runs
inside `jax.shard_map` with static shapes, in one of two ways (model.moe.dispatch):

- 'ring': each device all-gathers the tokens of the devices the experts are split over, runs
  its own experts on the rows routed to them (sorted by expert into a fixed buffer, one grouped
  matmul per weight) and the outputs are reduce-scattered back to the tokens' devices.
- 'all_to_all': each device sends every assignment of its tokens to the device holding the
  expert, in a fixed buffer per destination, and gets the outputs back the same way.

What the static shapes cost. With N tokens per device, K = top_k, E experts split EP ways:
dropless (capacity_factor 0), a device's buffer holds min(EP·K, E)·N rows, as all the
tokens of its EP group could choose its experts: EP times the N·K rows an even load brings.
A capacity factor c lets an expert take at most C = ceil(c·N·K/E) assignments of each device's
tokens (every token's first choice before any second choice); the buffers then hold about
c·N·K rows, and the assignments past C are dropped (their tokens keep the other experts' and
the shared experts' outputs) and counted. Both dispatches drop the same assignments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxllm.model.grouped_matmul import grouped_matmul
from jaxllm.model.layers import MLP, param
from jaxllm.parallel.mesh import constrain, dividing_spec, logical_spec, manual_axes_of
from jaxllm.parallel.rules import mesh_axes


class RouterBias(nnx.Variable):
  """The sigmoid router's per-expert bias: added to the scores to choose the experts, never
  to weight them (DeepSeek-V3's aux-loss-free balancing). fp32; the train step moves it
  (`next_router_bias`), not the optimizer."""


class RouterStats(NamedTuple):
  """What a layer's router did, summed over the tokens it saw."""
  load_E: jax.Array   # assignments each expert was chosen for (dropped ones included)
  probs_E: jax.Array  # the router's softmax probabilities
  z: jax.Array        # logsumexp(logits)², the router z-loss's summand
  dropped: jax.Array  # assignments past an expert's capacity


def has_experts(cfg) -> bool:
  return cfg.moe.experts > 0


def expert_mlp_dim(cfg) -> int:
  return cfg.moe.mlp_dim or cfg.mlp_dim


class MoE(nnx.Module):
  """The routed experts (and shared ones) that take a block's MLP's place."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    m = cfg.moe
    E, D, F = m.experts, cfg.embed_dim, expert_mlp_dim(cfg)
    init = nnx.initializers.normal(cfg.init_std)
    out_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
    pd = jnp.dtype(cfg.param_dtype)
    self.router_DE = param(rngs, init, (D, E), ('embed', None), pd)
    self.w_gate_EDF = param(rngs, init, (E, D, F), ('experts', None, 'expert_mlp'), pd)
    self.w_up_EDF = param(rngs, init, (E, D, F), ('experts', None, 'expert_mlp'), pd)
    self.w_down_EFD = param(rngs, out_init, (E, F, D), ('experts', 'expert_mlp', None), pd)
    self.router_bias_E = (RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
                          if m.router == 'sigmoid' else None)
    # Shared experts of one width are one MLP that many times wider.
    self.shared = (MLP(cfg, rngs, m.shared_experts * (m.shared_mlp_dim or F))
                   if m.shared_experts else None)
    self.moe = m

  def __call__(self, x_BTD):
    """(output [B, T, D], RouterStats)."""
    m = self.moe
    logits_BTE = constrain(jnp.einsum('btd,de->bte', x_BTD.astype(jnp.float32),
                                      self.router_DE[...].astype(jnp.float32)),
                           'batch', 'seq', None)
    bias_E = (None if self.router_bias_E is None
              else jax.lax.stop_gradient(self.router_bias_E[...]))
    ids_BTK, gates_BTK = route(logits_BTE, bias_E, m)
    weights = (self.w_gate_EDF[...], self.w_up_EDF[...], self.w_down_EFD[...])
    y_BTD, dropped = dispatch(x_BTD, ids_BTK, gates_BTK, weights, m)
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD, router_stats(logits_BTE, ids_BTK, dropped)


def router_stats(logits_BTE, ids_BTK, dropped) -> RouterStats:
  """A layer's `RouterStats` from its router's logits, the experts it chose and the
  assignments it dropped."""
  one_hot_BTKE = jax.nn.one_hot(ids_BTK, logits_BTE.shape[-1], dtype=jnp.float32)
  return RouterStats(load_E=jnp.sum(one_hot_BTKE, axis=(0, 1, 2)),
                     probs_E=jnp.sum(jax.nn.softmax(logits_BTE, axis=-1), axis=(0, 1)),
                     z=jnp.sum(jax.nn.logsumexp(logits_BTE, axis=-1) ** 2),
                     dropped=jnp.asarray(dropped, jnp.float32))


def route(logits_BTE, bias_E, m):
  """(expert ids [B, T, K] int32, their weights [B, T, K] fp32) from fp32 router logits.

  'softmax': the k most probable experts, weighted by their probabilities; 'sigmoid': the k
  best sigmoid scores plus `bias_E` (selection only), weighted by the scores. Either way the
  weights are divided by their sum with `renormalize`, then scaled by `route_scale`."""
  if m.router == 'softmax':
    gates_BTK, ids_BTK = jax.lax.top_k(jax.nn.softmax(logits_BTE, axis=-1), m.top_k)
  else:
    scores_BTE = jax.nn.sigmoid(logits_BTE)
    _, ids_BTK = jax.lax.top_k(scores_BTE + bias_E, m.top_k)
    gates_BTK = jnp.take_along_axis(scores_BTE, ids_BTK, axis=-1)
  if m.renormalize:
    gates_BTK = gates_BTK / jnp.sum(gates_BTK, axis=-1, keepdims=True)
  return ids_BTK.astype(jnp.int32), gates_BTK * m.route_scale


@dataclasses.dataclass(frozen=True)
class _Axes:
  """The compiler's mesh axes (manual inside the dispatch) that split the tokens, the experts
  and the experts' hidden units."""
  tokens: tuple[str, ...]
  experts: tuple[str, ...]
  mlp: tuple[str, ...]

  @property
  def gathered(self) -> tuple[str, ...]:
    """The experts' axes that split the tokens: the ring gathers tokens over them."""
    return tuple(a for a in self.experts if a in self.tokens)


def dispatch(x_BTD, ids_BTK, gates_BTK, weights, m):
  """(the routed experts' output [B, T, D] in x's dtype, the assignments dropped over capacity
  on every device the compiler splits the tokens over): `weights` = (gate [E, D, F],
  up [E, D, F], down [E, F, D]) split as the rules say, run by `m.dispatch`."""
  mesh = jax.sharding.get_abstract_mesh()
  tokens = dividing_spec(x_BTD, 'batch', 'seq', None)
  w_in, w_out = logical_spec('experts', None, 'expert_mlp'), logical_spec('experts', 'expert_mlp',
                                                                          None)
  axes = _Axes(mesh_axes(tokens[0]) + mesh_axes(tokens[1]), mesh_axes(w_in[0]),
               mesh_axes(w_in[2]))
  local = functools.partial(_ring if m.dispatch == 'ring' else _all_to_all, axes=axes, m=m)

  def run(x_btD, ids_btK, gates_btK, *w):
    b, t, D = x_btD.shape
    y_ND, dropped = local(x_btD.reshape(b * t, D), ids_btK.reshape(b * t, -1),
                          gates_btK.reshape(b * t, -1), w)
    if axes.tokens:
      dropped = jax.lax.psum(dropped, axes.tokens)
    return y_ND.reshape(b, t, D), dropped

  if not mesh.axis_names:  # no mesh in scope: one device
    return run(x_BTD, ids_BTK, gates_BTK, *weights)
  auto = set(mesh.axis_names) - set(mesh.manual_axes)
  with jax.named_scope('moe_dispatch'):  # names its collectives for the cost model
    return jax.shard_map(run, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
                         out_specs=(tokens, P()), axis_names=auto, check_vma=False)(
                             x_BTD, ids_BTK, gates_BTK, *weights)


def _ranks(keys_A, n: int):
  """Each element's rank among the elements of `keys_A` with the same key, in array order
  (keys in [0, n]; n for none, whose ranks mean nothing)."""
  order_A = jnp.argsort(keys_A, stable=True)
  counts = jnp.bincount(keys_A, length=n + 1)
  starts = jnp.cumsum(counts) - counts
  sorted_ranks = jnp.arange(keys_A.shape[0]) - starts[keys_A[order_A]]
  return jnp.zeros_like(keys_A).at[order_A].set(sorted_ranks)


def _by_preference(a_NK):
  """[N, K] -> [K·N]: every token's first choice, then every second choice, ..."""
  return a_NK.T.reshape(-1)


def _from_preference(a_A, N: int):
  return a_A.reshape(-1, N).T


def _capacity(m, N: int) -> int:
  """The assignments of a device's N tokens an expert takes: N (all it can get) when
  dropless."""
  if not m.capacity_factor:
    return N
  return min(N, math.ceil(m.capacity_factor * N * m.top_k / m.experts))


def _kept(ids_NK, m, C: int):
  """Which assignments are within their expert's capacity C, first choices first."""
  if not m.capacity_factor:
    return jnp.ones(ids_NK.shape, bool)
  N = ids_NK.shape[0]
  return _from_preference(_ranks(_by_preference(ids_NK), m.experts) < C, N)


def _grouped_swiglu(x_RD, weights, group_sizes_G, impl: str):
  """The experts' SwiGLU on rows sorted by expert, `group_sizes_G` rows each (rows past
  their total, padding, come out as zeros)."""
  w_gate, w_up, w_down = (w.astype(x_RD.dtype) for w in weights)
  gmm = lambda x, w: checkpoint_name(grouped_matmul(x, w, group_sizes_G, impl), 'projection')
  h_RF = jax.nn.silu(gmm(x_RD, w_gate)) * gmm(x_RD, w_up)
  return gmm(h_RF, w_down)


def _reduce_partial_sums(y_ND, axes: tuple[str, ...]):
  return jax.lax.psum(y_ND, axes) if axes else y_ND


def _ring(x_ND, ids_NK, gates_NK, weights, axes: _Axes, m):
  """One device's share of the ring dispatch: (its tokens' output [N, D], assignments of its
  tokens dropped)."""
  N, K = ids_NK.shape
  C = _capacity(m, N)
  kept_NK = _kept(ids_NK, m, C)
  E_local = weights[0].shape[0]
  gathered = axes.gathered
  if gathered:
    x_MD, ids_MK, gates_MK, kept_MK = (jax.lax.all_gather(a, gathered, axis=0, tiled=True)
                                       for a in (x_ND, ids_NK, gates_NK, kept_NK))
  else:
    x_MD, ids_MK, gates_MK, kept_MK = x_ND, ids_NK, gates_NK, kept_NK
  M = x_MD.shape[0]
  first = jax.lax.axis_index(axes.experts) * E_local if axes.experts else 0
  local_MK = ids_MK - first
  mine_MK = kept_MK & (local_MK >= 0) & (local_MK < E_local)
  keys_A = jnp.where(mine_MK, local_MK, E_local).reshape(-1)
  # Room for every assignment this device's experts can take: all the gathered tokens', or
  # C from each device's tokens for each expert.
  rows = min(M * K, E_local * (M // N) * C)
  order_R = jnp.argsort(keys_A, stable=True)[:rows]
  token_R = order_R // K
  group_sizes = jnp.bincount(keys_A, length=E_local + 1)[:E_local]
  y_RD = _grouped_swiglu(x_MD[token_R], weights, group_sizes, m.grouped_matmul)
  weight_R = jnp.where(keys_A[order_R] < E_local, gates_MK.reshape(-1)[order_R], 0.0)
  y_MD = jnp.zeros((M, x_ND.shape[1]), jnp.float32).at[token_R].add(
      y_RD.astype(jnp.float32) * weight_R[:, None]).astype(x_ND.dtype)
  y_ND = jax.lax.psum_scatter(y_MD, gathered, scatter_dimension=0, tiled=True) if gathered else y_MD
  # Experts split over axes that do not split the tokens, and hidden units split over tensor,
  # leave partial sums on each device.
  rest = tuple(a for a in axes.experts if a not in gathered) + axes.mlp
  return _reduce_partial_sums(y_ND, rest), N * K - jnp.sum(kept_NK)


def _all_to_all(x_ND, ids_NK, gates_NK, weights, axes: _Axes, m):
  """One device's share of the all-to-all dispatch: (its tokens' output [N, D], assignments
  of its tokens dropped)."""
  N, K = ids_NK.shape
  D = x_ND.shape[1]
  C = _capacity(m, N)
  kept_NK = _kept(ids_NK, m, C)
  E_local = weights[0].shape[0]
  devices = m.experts // E_local
  # Each assignment's place in the buffer of the device holding its expert: its rank among
  # this device's assignments to that device, first choices first.
  dest_NK = jnp.where(kept_NK, ids_NK // E_local, devices)
  slot_NK = _from_preference(_ranks(_by_preference(dest_NK), devices), N)
  per_device = min(N * K, E_local * C)
  slot_NK = jnp.where(kept_NK, slot_NK, per_device)  # out of range: never written or read
  token_NK = jnp.broadcast_to(jnp.arange(N)[:, None], (N, K))
  send_XSD = jnp.zeros((devices, per_device, D), x_ND.dtype).at[dest_NK, slot_NK].set(
      x_ND[token_NK], mode='drop')
  send_ids_XS = jnp.full((devices, per_device), E_local, jnp.int32).at[dest_NK, slot_NK].set(
      ids_NK % E_local, mode='drop')
  exchange = ((lambda a: jax.lax.all_to_all(a, axes.experts, 0, 0, tiled=True))
              if axes.experts else (lambda a: a))
  recv_XSD, recv_ids_XS = exchange(send_XSD), exchange(send_ids_XS)
  keys_R = recv_ids_XS.reshape(-1)
  order_R = jnp.argsort(keys_R, stable=True)
  group_sizes = jnp.bincount(keys_R, length=E_local + 1)[:E_local]
  y_sorted_RD = _grouped_swiglu(recv_XSD.reshape(-1, D)[order_R], weights, group_sizes,
                                m.grouped_matmul)
  y_XSD = jnp.zeros_like(y_sorted_RD).at[order_R].set(y_sorted_RD).reshape(recv_XSD.shape)
  back_XSD = exchange(y_XSD)
  y_NKD = back_XSD.at[dest_NK, slot_NK].get(mode='fill', fill_value=0)
  y_ND = jnp.einsum('nkd,nk->nd', y_NKD.astype(jnp.float32),
                    jnp.where(kept_NK, gates_NK, 0.0)).astype(x_ND.dtype)
  return _reduce_partial_sums(y_ND, axes.mlp), N * K - jnp.sum(kept_NK)


class RoutingSums(NamedTuple):
  """What the routers did in a train step, as sums over its micro-batches and devices."""
  load_UE: jax.Array  # assignments each MoE layer gave each expert
  aux: jax.Array      # each forward's load-balancing loss times its tokens (as the objective)
  z: jax.Array        # each forward's router z-loss times its tokens
  dropped: jax.Array  # assignments dropped over capacity


def router_losses(stats: RouterStats, m, tokens):
  """(the router losses' part of the objective, this device's `RoutingSums`) of one forward,
  from its MoE layers' `RouterStats` [U, ...] and the tokens its loss counts.

  The load-balancing loss is transformers' `load_balancing_loss_func` on the forward's
  router logits, every MoE layer's and device's together: E·Σ_e f_e·P_e, with f_e the
  share of the (layer, token) pairs that chose expert e and P_e its mean probability; the
  z-loss is the mean of logsumexp(logits)² over those pairs. Both are means over the forward,
  added to the objective (a sum over tokens, divided by the step's tokens) times the forward's
  tokens: the loss per token gains aux_loss·aux + z_loss·z. Where the batch is split by hand
  (inside a shard_map over its axes) f_e is summed over the devices first, and each device
  adds its share of P_e and of the z-loss: the shares sum to the whole."""
  manual = manual_axes_of('batch', 'seq')
  total = lambda a: jax.lax.psum(a, manual) if manual else a
  load_UE = jax.lax.stop_gradient(stats.load_E)
  load_E = total(jnp.sum(load_UE, axis=0))
  pairs = jnp.sum(load_E) / m.top_k
  aux = m.experts * jnp.sum(load_E / pairs * jnp.sum(stats.probs_E, axis=0) / pairs)
  z = jnp.sum(stats.z) / pairs
  forward_tokens = total(tokens)
  objective = (m.aux_loss * aux + m.z_loss * z) * forward_tokens
  return objective, RoutingSums(load_UE, aux * forward_tokens, z * forward_tokens,
                                jnp.sum(stats.dropped))


def routing_metrics(routing: RoutingSums, tokens) -> dict:
  """A train step's routing metrics from its `RoutingSums` and tokens."""
  assignments = jnp.maximum(jnp.sum(routing.load_UE), 1.0)
  return {'moe_aux_loss': routing.aux / tokens, 'moe_z_loss': routing.z / tokens,
          'moe_dropped': routing.dropped / assignments, 'moe_load': routing.load_UE}


def next_router_bias(router_bias, load_UE, rate: float):
  """The sigmoid routers' biases after a step whose MoE layers gave their experts `load_UE`
  assignments (over the whole batch): b += rate·sign(mean load − load), raising the
  underloaded experts' chances and lowering the overloaded ones' (DeepSeek-V3)."""
  step_UE = rate * jnp.sign(jnp.mean(load_UE, axis=-1, keepdims=True) - load_UE)
  return jax.tree.map(lambda b: b + step_UE.astype(b.dtype), router_bias)
