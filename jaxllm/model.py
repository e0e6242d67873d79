"""A Llama-style decoder in Flax NNX, written once for every mesh.

Parameters and main activations carry logical axis names only; `jaxllm.mesh` binds them
to mesh axes. Shapes are spelled in suffixes: B batch, T sequence, D embed, N query heads,
K kv heads, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict, FrozenConfigDict

from jaxllm.mesh import constrain, keep_axes, logical_spec, spec_axes


def cudnn_attention_outputs(prim, *_, **__) -> bool:
  """A remat policy: keep what cuDNN's fused attention forward returns, the attention output
  and its softmax statistics (logsumexp). Its backward kernel takes them beside q, k and v, so
  the backward never reruns the forward kernel."""
  return prim.name == 'dot_product_attention_fwd_wrapper'


def _keep(*names: str):
  """A policy keeping the values of these `checkpoint_name`s and cuDNN attention's outputs.
  The name 'attention' is on XLA's attention output only: cuDNN's kernel keeps its own."""
  return jax.checkpoint_policies.save_from_both_policies(
      jax.checkpoint_policies.save_only_these_names(*names), cudnn_attention_outputs)


REMAT = {
    'full': jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of weight matmuls; recompute attention and elementwise work.
    'dots': jax.checkpoint_policies.save_only_these_names('projection'),
    # Keep q, k, v and the attention output (and cuDNN's softmax statistics); recompute the
    # MLP, whose two [B,T,F] matmul outputs are the largest activations (about 4× less saved
    # than 'dots' at F = 4D).
    'dots_except_mlp': _keep('q_proj', 'k_proj', 'v_proj', 'attention'),
    # Keep the attention output (and cuDNN's softmax statistics) beside each layer's input;
    # recompute every matmul but not cuDNN's attention forward, whose work grows with T².
    'attention': _keep('attention'),
}


def stack_policy(remat: str):
  """The policy of a checkpoint around `scan_blocks` whose weights are made anew on every call
  (a pipeline stage's, sliced or gathered per iteration): it keeps each layer's input and what
  the layers' own policy keeps, so nothing is recomputed twice, but never the weights, which
  every call would otherwise keep a copy of. Under 'none' it keeps the outputs of the weight
  matmuls and of attention: only elementwise work is recomputed."""
  kept = REMAT[remat] if remat != 'none' else _keep('projection', 'attention')
  return jax.checkpoint_policies.save_from_both_policies(
      kept, jax.checkpoint_policies.save_only_these_names('layer_input'))


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = _param(rngs, nnx.initializers.ones, (dim,), ('norm',), param_dtype)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ConfigDict) -> jax.Array:
  """Inverse frequencies [H/2] of the rotary embedding, with optional Llama-3 scaling."""
  h = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  s = cfg.rope_scaling
  if s.factor <= 0:
    return inv_freq
  # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = s.original_max_position / s.low_freq_factor
  high_freq_wavelen = s.original_max_position / s.high_freq_factor
  smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
  return jnp.where(wavelen < high_freq_wavelen, inv_freq,
                   jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, blended))


def apply_rope(x_BTnH, positions_BT, inv_freq):
  """Rotates the two halves of each head (the layout Hugging Face Llama weights use)."""
  angles = positions_BT[:, :, None, None].astype(jnp.float32) * inv_freq  # [B,T,1,H/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x_BTnH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BTnH.dtype)


# The KV cache [L, B, S, K, H] is laid out like the keys and values it holds. The layer axis
# stays whole (decoding runs without a pipeline), and so do the slots: every step writes one.
KV_CACHE_AXES = (None, 'batch', None, 'act_kv_heads', None)


class KVCache(NamedTuple):
  """Every layer's keys and values for decoding. The first `length` slots of the S axis are
  filled, and the next tokens are written from there. Row b's sequence starts at slot
  `start_B[b]`: prompts of different lengths are left-padded, and the slots before a row's
  start are never attended to."""
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  length: jax.Array   # int32 scalar
  start_B: jax.Array  # int32 [B]

  @classmethod
  def empty(cls, cfg: ConfigDict, batch: int, max_len: int, start_B=None) -> KVCache:
    """A cache for `batch` rows of up to `max_len` slots (call inside jit, under the rules);
    `start_B`: where each row starts (default: slot 0)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, cfg.dtype), *KV_CACHE_AXES)
    start_B = jnp.zeros((batch,), jnp.int32) if start_B is None else start_B
    return cls(zeros(), zeros(), jnp.zeros((), jnp.int32), start_B)

  def append(self, k_LBTKH, v_LBTKH) -> KVCache:
    """The cache with T more slots written at `length`."""
    write = lambda c, new: constrain(
        jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), self.length, axis=2),
        *KV_CACHE_AXES)
    return self._replace(k_LBSKH=write(self.k_LBSKH, k_LBTKH),
                         v_LBSKH=write(self.v_LBSKH, v_LBTKH),
                         length=self.length + k_LBTKH.shape[2])


class LayerCache(NamedTuple):
  """One layer's slice of a `KVCache`: what its attention reads while decoding."""
  k_BSKH: jax.Array
  v_BSKH: jax.Array
  length: jax.Array
  start_B: jax.Array


def cached_attention(q_BTNH, k_BTKH, v_BTKH, cache: LayerCache):
  """The new tokens, written at slots length … length+T-1, attend to their row's filled
  slots and to each other, causally."""
  k_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.k_BSKH, k_BTKH, cache.length, axis=1)
  v_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.v_BSKH, v_BTKH, cache.length, axis=1)
  slots_S = jnp.arange(k_BSKH.shape[1])
  query_slots_T = cache.length + jnp.arange(q_BTNH.shape[1])
  mask_B1TS = ((slots_S[None, None, None, :] <= query_slots_T[None, None, :, None]) &
               (slots_S[None, None, None, :] >= cache.start_B[:, None, None, None]))
  # XLA's attention takes any mask; the fused cuDNN kernel is for causal training shapes.
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS,
                                      implementation='xla')


def project(spec: str, x, w, grad_dtype, out_dtype=None, w_names=None):
  """`jnp.einsum(spec, x, w)` on x's dtype, w cast to it first (so an fsdp gather moves that
  dtype), giving `out_dtype` (default x's). The backward runs both matmuls on x's dtype too and
  makes w's gradient in `grad_dtype`: the gradient is summed over the devices that split the
  batch straight out of its matmul, so this is the element type of that reduction.
  The output is named 'projection' for the remat policies (REMAT).

  `w_names`, w's logical axes: where the sequence is split over an axis that also splits w
  (context parallelism over fsdp), w is gathered over it for the matmul, as fsdp gathers
  weights; left to itself XLA may gather the activations instead, a whole sequence each."""
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  gathered = _gathered_over_sequence(w_names) if w_names else None
  return checkpoint_name(_project(spec, jnp.dtype(grad_dtype), out_dtype, gathered, x, w),
                         'projection')


def _gathered_over_sequence(w_names) -> P | None:
  """The layout of a weight with logical axes `w_names` whole over the mesh axes that split
  the sequence; None where none of them splits it."""
  seq_axes = set(spec_axes(logical_spec('seq')[0]))
  spec = logical_spec(*w_names)
  if not seq_axes & {a for entry in spec for a in spec_axes(entry)}:
    return None
  return keep_axes(spec, set(jax.sharding.get_abstract_mesh().axis_names) - seq_axes)


def _in_compute_layout(w, x_dtype, gathered):
  w = w.astype(x_dtype)
  return w if gathered is None else jax.lax.with_sharding_constraint(w, gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _project(spec, grad_dtype, out_dtype, gathered, x, w):
  return jnp.einsum(spec, x, _in_compute_layout(w, x.dtype, gathered),
                    preferred_element_type=out_dtype)


def _project_fwd(spec, grad_dtype, out_dtype, gathered, x, w):
  return _project(spec, grad_dtype, out_dtype, gathered, x, w), (x, w)


def _project_bwd(spec, grad_dtype, out_dtype, gathered, residuals, g):
  x, w = residuals
  x_axes, rest = spec.split(',')
  w_axes, out_axes = rest.split('->')
  g = g.astype(x.dtype)
  dx = jnp.einsum(f'{out_axes},{w_axes}->{x_axes}', g, _in_compute_layout(w, x.dtype, gathered))
  dw = jnp.einsum(f'{x_axes},{out_axes}->{w_axes}', x, g, preferred_element_type=grad_dtype)
  if gathered is not None:  # each device's positions' share, summed (and split) afterwards
    dw = jax.lax.with_sharding_constraint(dw, gathered)
  return dx, dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


class Attention(nnx.Module):
  """Grouped-query attention through `jax.nn.dot_product_attention`."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nnx.initializers.normal(cfg.init_std)
    out_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
    pd = jnp.dtype(cfg.param_dtype)
    self.wq_DNH = _param(rngs, init, (D, N, H), ('embed', 'heads', 'head_dim'), pd)
    self.wk_DKH = _param(rngs, init, (D, K, H), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wv_DKH = _param(rngs, init, (D, K, H), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wo_NHD = _param(rngs, out_init, (N, H, D), ('heads', 'head_dim', 'embed'), pd)
    self.cfg = cfg

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None):
    """The attention output; with a `cache` (decoding), also the new tokens' keys and values."""
    mm = lambda spec, x, p, names: project(spec, x, p[...], self.cfg.grad_reduce_dtype,
                                           w_names=names)
    q_BTNH = mm('btd,dnh->btnh', x_BTD, self.wq_DNH, ('embed', 'heads', 'head_dim'))
    k_BTKH = mm('btd,dkh->btkh', x_BTD, self.wk_DKH, ('embed', 'kv_heads', 'head_dim'))
    v_BTKH = mm('btd,dkh->btkh', x_BTD, self.wv_DKH, ('embed', 'kv_heads', 'head_dim'))
    # Names for the remat policies that keep some activations (REMAT).
    q_BTNH = checkpoint_name(constrain(q_BTNH, 'batch', 'seq', 'act_heads', None), 'q_proj')
    k_BTKH = checkpoint_name(constrain(k_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'k_proj')
    v_BTKH = checkpoint_name(constrain(v_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'v_proj')
    inv_freq = rope_frequencies(self.cfg)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
    if cache is None:
      o_BTNH = sharded_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT,
                                 self.cfg.attention, self.cfg.max_documents)
    else:
      o_BTNH = cached_attention(q_BTNH, k_BTKH, v_BTKH, cache)
    o_BTNH = constrain(o_BTNH, 'batch', 'seq', 'act_heads', None)
    if self.cfg.attention != 'cudnn':  # cuDNN's output is kept as the kernel's (REMAT)
      o_BTNH = checkpoint_name(o_BTNH, 'attention')
    out_BTD = mm('btnh,nhd->btd', o_BTNH, self.wo_NHD, ('heads', 'head_dim', 'embed'))
    return out_BTD if cache is None else (out_BTD, (k_BTKH, v_BTKH))


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    D, F = cfg.embed_dim, cfg.mlp_dim
    init = nnx.initializers.normal(cfg.init_std)
    out_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
    pd = jnp.dtype(cfg.param_dtype)
    self.w_gate_DF = _param(rngs, init, (D, F), ('embed', 'mlp'), pd)
    self.w_up_DF = _param(rngs, init, (D, F), ('embed', 'mlp'), pd)
    self.w_down_FD = _param(rngs, out_init, (F, D), ('mlp', 'embed'), pd)
    self.grad_reduce_dtype = cfg.grad_reduce_dtype

  def __call__(self, x_BTD):
    mm = lambda spec, x, p, names: project(spec, x, p[...], self.grad_reduce_dtype,
                                           w_names=names)
    gate_BTF = mm('btd,df->btf', x_BTD, self.w_gate_DF, ('embed', 'mlp'))
    up_BTF = mm('btd,df->btf', x_BTD, self.w_up_DF, ('embed', 'mlp'))
    h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, 'batch', 'seq', 'act_mlp')
    return mm('btf,fd->btd', h_BTF, self.w_down_FD, ('mlp', 'embed'))


# The residual stream between the blocks' matmuls, and its norms: the sequence split as the
# blocks' activations are (seq: context parallelism) and further by act_seq (sequence
# parallelism: with act_seq=('tensor',) the tensor all-reduces after the attention and MLP
# outputs become reduce-scatters, and all-gathers before the next matmuls).
RESIDUAL_AXES = ('batch', ('seq', 'act_seq'), 'act_embed')


class Block(nnx.Module):
  """Pre-norm residual block: attention, then MLP."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd, rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None):
    """The block's output; with a `cache`, also the new tokens' keys and values."""
    attn = self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT, cache)
    attn_BTD, new_kv = attn if cache is not None else (attn, None)
    x_BTD = constrain(x_BTD + attn_BTD, *RESIDUAL_AXES)
    x_BTD = constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), *RESIDUAL_AXES)
    return x_BTD if cache is None else (x_BTD, new_kv)


def available_attention(model_cfg: ConfigDict, platform: str) -> str:
  """model.attention on devices of `platform` ('gpu', 'cpu', ...): 'cudnn' is a fused NVIDIA
  kernel, so elsewhere 'xla' (the same math) stands in for it."""
  if model_cfg.attention == 'cudnn' and platform != 'gpu':
    return 'xla'
  return model_cfg.attention


def sequence_positions(tokens_BT):
  """Positions 0..T-1 of every row: one unpacked sequence per row."""
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)


def dividing_spec(x, *names) -> P:
  """The PartitionSpec of `x`'s logical axis names, except that a dimension its mesh axes do
  not divide (a small batch) stays whole."""
  mesh = jax.sharding.get_abstract_mesh()
  return P(*(e if x.shape[i] % math.prod(mesh.shape[a] for a in spec_axes(e)) == 0 else None
             for i, e in enumerate(logical_spec(*names))))


def sharded_lookup(table_VD, tokens_BT, dtype):
  """`table_VD[tokens_BT]` in `dtype`, without gathering the table.

  Each device looks up, in its own block of vocabulary rows and embedding columns, the tokens
  of every device that shares that block with it; the pieces are then summed over the vocabulary
  split and handed back to the devices whose rows (and positions) they are. Traffic is B·T·D,
  not V·D, and the gradient is a scatter-add into each device's block: no dense [V, D]
  reduction.
  Rows are cast to `dtype` after the lookup, so they move in it and the gradient is added into
  the table in the table's own dtype.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return table_VD[tokens_BT].astype(dtype)
  table_spec = logical_spec('vocab', 'embed')
  vocab_axes, embed_axes = spec_axes(table_spec[0]), spec_axes(table_spec[1])
  # Tokens split over rows (batch) and positions (seq: context parallelism): the dimension
  # each mesh axis splits them along.
  rows_spec = dividing_spec(tokens_BT, 'batch', 'seq')
  token_dim = {a: d for d in (0, 1) for a in spec_axes(rows_spec[d])}
  # Columns are joined minor axis first, so they end in the spec's order; the tokens are
  # split back in the reverse of the order they were gathered in.
  column_axes = embed_axes[::-1]
  splits = [a for a in vocab_axes + column_axes if a in token_dim]

  def lookup(table_VD, tokens_BT):
    for a in reversed(splits):
      tokens_BT = jax.lax.all_gather(tokens_BT, a, axis=token_dim[a], tiled=True)
    rows = table_VD.shape[0]
    local_BT = tokens_BT - (jax.lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
    mine_BT = (local_BT >= 0) & (local_BT < rows)
    x_BTD = jnp.where(mine_BT[..., None], table_VD[jnp.where(mine_BT, local_BT, 0)], 0)
    x_BTD = x_BTD.astype(dtype)
    for a in vocab_axes:  # one device holds each token's row: the sums are exact
      x_BTD = (jax.lax.psum_scatter(x_BTD, a, scatter_dimension=token_dim[a], tiled=True)
               if a in token_dim else jax.lax.psum(x_BTD, a))
    for a in column_axes:
      x_BTD = (jax.lax.all_to_all(x_BTD, a, token_dim[a], 2, tiled=True) if a in token_dim
               else _join_columns(x_BTD, a))
    return x_BTD

  return jax.shard_map(lookup, in_specs=(table_spec, rows_spec),
                       out_specs=P(*rows_spec, None),
                       axis_names=set(mesh.axis_names) - set(mesh.manual_axes))(table_VD, tokens_BT)


def _join_columns(x, axis):
  """All-gathers the last dimension over `axis` as a sum of zero-padded blocks, so the result
  is known to be the same on every device of `axis` (as its out_specs says)."""
  block = x.shape[-1]
  whole = jnp.zeros((*x.shape[:-1], block * jax.lax.axis_size(axis)), x.dtype)
  return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
      whole, x, jax.lax.axis_index(axis) * block, axis=x.ndim - 1), axis)


def _by_chunk(chunks: int, a):
  """[B, T, ...] -> [chunks, B, T/chunks, ...] where chunk k takes positions k, k + chunks, ...:
  cutting the minor axis leaves every device its own positions, however T is split."""
  B, T = a.shape[:2]
  return jnp.moveaxis(a.reshape(B, T // chunks, chunks, *a.shape[2:]), 2, 0)


def _chunk_logits(x_BCD, w_DV):
  logits_BCV = jnp.einsum('bcd,dv->bcv', x_BCD, w_DV, preferred_element_type=jnp.float32)
  # Positions stay split as they come (over 'pipe' after a pipeline).
  batch, _, vocab = logical_spec('batch', None, 'act_vocab')
  return jax.lax.with_sharding_constraint(logits_BCV, P(batch, P.UNCONSTRAINED, vocab))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked_loss_sum(chunks: int, grad_dtype, z_loss: float, x_BTD, w_DV, targets_BT, mask_BT):
  """(objective, cross-entropy): sum(mask · (cross_entropy + z_loss · log²Z)) of the logits
  x·w, and sum(mask · cross_entropy), with [B, T/chunks, V] fp32 logits at a time.

  Differentiated, each chunk's gradients are taken by hand as its loss is (the loss is the
  last op, so they are known then): no logits are kept or remade for the backward, the head is
  gathered once in the compute dtype, and its gradient is summed over the chunks in fp32 and
  reduced across devices once, in `grad_dtype`. Only the objective carries gradients; the
  cross-entropy is for the log."""
  return _chunked_loss(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT, mask_BT,
                       grads=False)[0]


def _chunked_loss(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT, mask_BT, grads: bool):
  """((objective, cross-entropy) sums, and with `grads` the objective's gradients for x and
  w)."""
  # Manual over the axes that split the rows, so each device sums its rows' head gradient over
  # the chunks before any reduction. Rows are split over pipe, then the batch axes, as the
  # pipeline leaves them (`pipeline_layers`): every row's head and loss run once. (Axes of size
  # 1 are left out: XLA's partitioner rejects collectives over them here.)
  # The sequence, split by the seq rule (context parallelism), stays split the same way: each
  # device takes its own positions' loss.
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes, seq_axes = ((), ()) if mesh.empty else (tuple(
      a for a in axes if mesh.shape[a] > 1 and a not in mesh.manual_axes)
      for axes in (('pipe', *spec_axes(logical_spec('batch')[0])),
                   spec_axes(logical_spec('seq')[0])))
  split_axes = batch_axes + seq_axes
  embed_axes, vocab_axes = (spec_axes(e) for e in logical_spec('embed', 'vocab'))
  scatter_axes = tuple(a for a in embed_axes if a in split_axes)
  sum_axes = tuple(a for a in split_axes if a not in scatter_axes)
  vocab_entry = keep_axes(P(vocab_axes), split_axes)[0]
  varying = (lambda a: jax.lax.pcast(a, split_axes, to='varying')) if split_axes else (
      lambda a: a)
  seq_parts = math.prod(mesh.shape[a] for a in seq_axes)
  chunks = math.gcd(chunks, x_BTD.shape[1] // seq_parts)  # of this device's positions

  def local(x_BTD, w_DV, targets_BT, mask_BT):
    # The head in the compute dtype, gathered once for every chunk (what fsdp split).
    w_c = w_DV.astype(x_BTD.dtype)
    if scatter_axes:
      w_c = jax.lax.all_gather(w_c, scatter_axes, axis=0, tiled=True)

    def chunk(carry, inputs):
      (objective, ce), dw_DV = carry
      x_BCD, targets_BC, mask_BC = inputs
      logits_BCV = _chunk_logits(x_BCD, w_c)
      lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
      chunk_ce = jnp.sum((lse_BC - jnp.take_along_axis(
          logits_BCV, targets_BC[..., None], axis=-1)[..., 0]) * mask_BC)
      ce += chunk_ce
      objective += chunk_ce
      if z_loss:
        objective += z_loss * jnp.sum(lse_BC ** 2 * mask_BC)
      if not grads:
        return ((objective, ce), dw_DV), None
      onehot_BCV = jax.nn.one_hot(targets_BC, logits_BCV.shape[-1], dtype=jnp.float32)
      # d(log²Z)/dlogits = 2·logZ·softmax
      softmax_BCV = jax.nn.softmax(logits_BCV, axis=-1)
      if z_loss:
        softmax_BCV *= 1 + 2 * z_loss * lse_BC[..., None]
      dlogits_BCV = ((softmax_BCV - onehot_BCV) * mask_BC[..., None]).astype(x_BCD.dtype)
      dw_DV += jnp.einsum('bcd,bcv->dv', x_BCD, dlogits_BCV, preferred_element_type=jnp.float32)
      return ((objective, ce), dw_DV), jnp.einsum('bcv,dv->bcd', dlogits_BCV, w_c)

    zeros_DV = jnp.zeros(w_c.shape, jnp.float32) if grads else jnp.float32(0)
    zeros_DV = varying(constrain(zeros_DV, None, 'vocab') if grads else zeros_DV)
    (totals, dw_DV), dx_BCD = jax.lax.scan(
        chunk, ((varying(jnp.float32(0)),) * 2, zeros_DV),
        [_by_chunk(chunks, a) for a in (x_BTD, targets_BT, mask_BT)])
    totals = jax.lax.psum(totals, split_axes) if split_axes else totals
    if not grads:
      return totals, None, None
    B, T, D = x_BTD.shape
    dx_BTD = jnp.moveaxis(dx_BCD, 0, 2).reshape(B, T, D)  # undoes _by_chunk
    dw_DV = dw_DV.astype(grad_dtype)
    if scatter_axes:  # reduced once, and split as the head is
      dw_DV = jax.lax.psum_scatter(dw_DV, scatter_axes, scatter_dimension=0, tiled=True)
    if sum_axes:
      dw_DV = jax.lax.psum(dw_DV, sum_axes)
    return totals, dx_BTD, dw_DV

  if split_axes:
    rows = P(batch_axes or None, seq_axes or None)
    local = jax.shard_map(
        local, in_specs=(P(*rows, None), P(scatter_axes or None, vocab_entry), rows, rows),
        out_specs=((P(), P()), P(*rows, None), P(scatter_axes or None, vocab_entry)),
        axis_names=set(split_axes))
  totals, dx_BTD, dw_DV = local(x_BTD, constrain(w_DV, 'embed', 'vocab'), targets_BT, mask_BT)
  if grads:
    dw_DV = constrain(dw_DV, 'embed', 'vocab').astype(w_DV.dtype)
  return totals, dx_BTD, dw_DV


def _chunked_loss_fwd(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT, mask_BT):
  totals, dx_BTD, dw_DV = _chunked_loss(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT,
                                        mask_BT, grads=True)
  return totals, (dx_BTD, dw_DV)


def _chunked_loss_bwd(chunks, grad_dtype, z_loss, residuals, g):
  dx_BTD, dw_DV = residuals
  g = g[0]  # the objective's; the cross-entropy output is for the log only
  return (g * dx_BTD).astype(dx_BTD.dtype), g * dw_DV, None, None


chunked_loss_sum.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


def sharded_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, implementation: str,
                      max_documents: int):
  """Causal attention inside each document, computed where the rows and heads are: rows
  split as the batch, heads as the head activations. No shard then needs another's data, and
  cuDNN's fused kernel sees local arrays: JAX's partitioning rule for it fails inside the
  pipeline's shard_map, where some mesh axes are already manual. Packed rows reach cuDNN as
  up to `max_documents` spans each (`packed_cudnn_attention`) where the GPU takes that
  layout, as the dense segment mask elsewhere.

  With the sequence split (the 'seq' rule: context parallelism) each device's queries stay
  where they are and the keys and values come whole, all-gathered by the compiler (their
  gradients reduce-scattered back); a key is visible to a query of the same document at the
  same or an earlier position (`_attend_split_queries`)."""
  def attend(q_BTNH, k_BSKH, v_BSKH, positions_BT, key_positions_BS, segment_ids_BT,
             key_segment_ids_BS):
    if shared_kv:  # K/V heads are whole here: take the ones this device's query heads use
      local, group = shared_kv
      start = jax.lax.axis_index(spec_axes(q_spec[2])) * local // group
      k_BSKH, v_BSKH = (jax.lax.dynamic_slice_in_dim(a, start, max(1, local // group), axis=2)
                        for a in (k_BSKH, v_BSKH))
    if split_queries:
      return _attend_split_queries(q_BTNH, k_BSKH, v_BSKH, positions_BT, key_positions_BS,
                                   segment_ids_BT, key_segment_ids_BS, implementation)
    if implementation == 'cudnn' and segment_ids_BT is not None and cudnn_packed_layout():
      return packed_cudnn_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, max_documents)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                        mask=segment_mask(segment_ids_BT),
                                        implementation=implementation)

  mesh = jax.sharding.get_abstract_mesh()
  shared_kv, split_queries = None, False
  args = (q_BTNH, k_BTKH, v_BTKH, positions_BT, positions_BT, segment_ids_BT, segment_ids_BT)
  if mesh.empty:
    return attend(*args)
  q_spec = dividing_spec(q_BTNH, 'batch', 'seq', 'act_heads', None)
  kv_spec = dividing_spec(k_BTKH, 'batch', None, 'act_kv_heads', None)
  split_queries = q_spec[1] is not None
  if q_spec[2] != kv_spec[2]:  # a query head's kv head must be on its device
    shared_kv = shared_kv_heads(q_BTNH.shape[2], k_BTKH.shape[2], spec_axes(q_spec[2]),
                                spec_axes(kv_spec[2]), mesh)
    if shared_kv is None:
      q_spec, kv_spec = P(*q_spec[:2], None, None), P(*kv_spec[:2], None, None)
  rows, key_rows = P(*q_spec[:2]), P(kv_spec[0], None)
  segments = (None, None) if segment_ids_BT is None else (rows, key_rows)
  return jax.shard_map(attend, in_specs=(q_spec, kv_spec, kv_spec, rows, key_rows, *segments),
                       out_specs=q_spec, axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
                       check_vma=False)(*args)


def _attend_split_queries(q_BTNH, k_BSKH, v_BSKH, positions_BT, key_positions_BS,
                          segment_ids_BT, key_segment_ids_BS, implementation: str):
  """Attention from T queries, a part of each row's sequence, to the S keys of all of it:
  masked by position and document, which is exact whatever order the split leaves the
  tokens in. cuDNN takes the mask as a dense bias: its packed layout places documents by
  offsets shared by queries and keys, which the split does not keep."""
  mask_B1TS = positions_BT[:, None, :, None] >= key_positions_BS[:, None, None, :]
  if segment_ids_BT is not None:
    mask_B1TS &= segment_ids_BT[:, None, :, None] == key_segment_ids_BS[:, None, None, :]
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS,
                                      implementation=implementation)


def shared_kv_heads(N: int, K: int, q_axes, kv_axes, mesh) -> tuple[int, int] | None:
  """With N query heads split over `q_axes` and the K K/V heads whole on every device: (query
  heads per device, query heads per K/V head), so that device i's query heads use K/V heads
  i·local/group on (`sharded_attention`); None where they do not map onto whole K/V heads."""
  if kv_axes or not q_axes:
    return None
  local, group = N // math.prod(mesh.shape[a] for a in q_axes), N // K
  return (local, group) if group % local == 0 or local % group == 0 else None


def document_spans(segment_ids_BT, max_documents: int):
  """Each row's documents as cuDNN's packed layout describes them: starts [B, M+1] and
  lengths [B, M], M = max_documents, -1 past a row's last document (the layout keeps the last
  start column for that too). A document is a run of equal segment ids; a run of padding
  (id 0) is one as well, so every token lies in a span and gets a defined output. A row with
  more than M runs gives its last span the rest of the row: the loader refuses such rows."""
  B, T = segment_ids_BT.shape
  opens_document_BT = jnp.concatenate(
      [jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  span_BT = jnp.minimum(jnp.cumsum(opens_document_BT, axis=1) - 1, max_documents - 1)
  in_span_BTM = span_BT[:, :, None] == jnp.arange(max_documents)
  lengths_BM = jnp.sum(in_span_BTM, axis=1, dtype=jnp.int32)
  starts_BM = jnp.argmax(in_span_BTM, axis=1).astype(jnp.int32)  # a span's first token
  present_BM = lengths_BM > 0
  starts_BM = jnp.where(present_BM, starts_BM, -1)
  return (jnp.pad(starts_BM, ((0, 0), (0, 1)), constant_values=-1),
          jnp.where(present_BM, lengths_BM, -1))


def cudnn_packed_layout() -> bool:
  """Whether JAX offers cuDNN's packed layout on the GPU compiled for (asked of it:
  `jaxllm.backends.lowering_for`): from Hopper on. Before, the dense segment mask goes to cuDNN
  as a [B, 1, T, T] bias."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  return cudnn.check_compute_capability('9.0')


def packed_cudnn_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, max_documents: int):
  """Causal attention inside each document of packed rows, in cuDNN's packed layout: the
  kernel takes each row's documents as spans (`document_spans`), so no [T, T] mask is made,
  nor its gradient. cuDNN keeps fp32 softmax statistics for each of the M spans as if it
  filled the row, [B·M, N, T]: hence a bound M (model.max_documents), not the T a row of
  one-token documents would need.

  JAX offers the layout only in its private cuDNN module (jax.nn.dot_product_attention takes
  one length per row), hence this one function, for GPUs that take it (`cudnn_packed_layout`)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  T, N, H = q_BTNH.shape[1:]
  # JAX up to 0.11.0 steps through the keys by the query's head count: with fewer kv heads
  # it would read other tokens' keys (fixed upstream after 0.11.0). One kv head per query
  # head keeps the two strides equal.
  k_BTNH, v_BTNH = (jnp.repeat(a, N // a.shape[2], axis=2) for a in (k_BTKH, v_BTKH))
  starts_BM1, lengths_BM = document_spans(segment_ids_BT, min(max_documents, T))
  return cudnn.dot_product_attention(
      q_BTNH, k_BTNH, v_BTNH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM,
      q_offsets=starts_BM1, kv_offsets=starts_BM1, scale=1 / math.sqrt(H),
      mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout='BTNH')


def segment_mask(segment_ids_BT):
  """[B, 1, T, T] True where query and key are in the same document of a packed row;
  None (no mask beyond causality) when rows hold one sequence each."""
  if segment_ids_BT is None:
    return None
  return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]


def scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, remat: str,
                cache: KVCache | None = None):
  """Applies the blocks stacked on the leading axis of `stacked`, in order, with `lax.scan`.

  With a `cache` (decoding) returns the output and the cache holding the new tokens too."""
  if cache is not None:
    if segment_ids_BT is not None:
      raise ValueError('decoding with a KV cache takes one sequence per row: no segment ids.')
    return _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, cache)

  def body(x_BTD, layer):
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, segment_ids_BT), None

  if remat != 'none':
    body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
  # Named outside the layer's own checkpoint, for one around the whole stack (stack_policy).
  named_body = lambda x_BTD, layer: body(checkpoint_name(x_BTD, 'layer_input'), layer)
  x_BTD, _ = jax.lax.scan(named_body, x_BTD, stacked)
  return x_BTD


def _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, cache: KVCache):
  """The scan of `scan_blocks` with each layer reading its slice of the cache and returning
  its new keys and values; they are written into the cache once, after the scan.
  No remat: decoding takes no gradients."""
  def body(x_BTD, layer_and_cache):
    layer, k_BSKH, v_BSKH = layer_and_cache
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, None,
                                      LayerCache(k_BSKH, v_BSKH, cache.length, cache.start_B))

  x_BTD, (k_LBTKH, v_LBTKH) = jax.lax.scan(body, x_BTD,
                                           (stacked, cache.k_LBSKH, cache.v_LBSKH))
  return x_BTD, cache.append(k_LBTKH, v_LBTKH)


class Transformer(nnx.Module):
  """Embedding, a scanned stack of `num_layers` blocks, final norm and output head."""

  def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
    cfg = FrozenConfigDict(cfg)  # hashable, so it can live in the static graph
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.embed_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.embed_VD = _param(rngs, nnx.initializers.normal(cfg.init_std), (V, D),
                           ('vocab', 'embed'), pd)

    # One Block with a leading layer axis on every parameter, so the stack runs as a scan.
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(D, cfg.norm_eps, pd, rngs)
    if not cfg.tie_embeddings:
      self.head_DV = _param(rngs, nnx.initializers.normal(cfg.init_std), (D, V),
                            ('embed', 'vocab'), pd)

  def embed(self, tokens_BT):
    x_BTD = sharded_lookup(self.embed_VD[...], tokens_BT, self.cfg.dtype)
    return constrain(x_BTD, *RESIDUAL_AXES)

  def layers(self, x_BTD, positions_BT, segment_ids_BT=None, cache: KVCache | None = None):
    """Runs the block stack as one `lax.scan`, rematerialised per the config.

    Decoding passes a `cache` (and one sequence per row, no segment ids): the tokens are
    written at slots `cache.length` on, and `positions_BT` are their positions in their rows;
    returns the output and the cache holding them."""
    graphdef, stacked = nnx.split(self.blocks)
    return scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, self.cfg.remat,
                       cache)

  def logits(self, x_BTD):
    """Output logits in fp32 (from matmuls in the compute dtype)."""
    logits_BTV = project('btd,dv->btv', self.final_norm(x_BTD), self.head(),
                         self.cfg.grad_reduce_dtype, jnp.float32)
    return constrain(logits_BTV, 'batch', 'seq', 'act_vocab')

  def loss_sum(self, x_BTD, targets_BT, mask_BT, z_loss: float = 0.0):
    """(objective, cross-entropy) summed over the tokens `mask_BT` keeps, from the final
    activations: next-token cross-entropy, plus `z_loss`·log²Z in the objective. The logits
    are made `loss_chunk` positions at a time (`chunked_loss_sum`)."""
    T = x_BTD.shape[1]
    chunks = T // self.cfg.loss_chunk if 0 < self.cfg.loss_chunk < T else 1
    return chunked_loss_sum(chunks, jnp.dtype(self.cfg.grad_reduce_dtype), z_loss,
                            self.final_norm(x_BTD), self.head(), targets_BT,
                            mask_BT.astype(jnp.float32))

  def head(self):
    """The output head [D, V]: the embedding table's transpose when they are tied."""
    return self.embed_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
    """Logits [B, T, V]. Packed rows give each token's position in its document and the
    document's segment id; attention then stays inside each document."""
    if positions_BT is None:
      positions_BT = sequence_positions(tokens_BT)
    return self.logits(self.layers(self.embed(tokens_BT), positions_BT, segment_ids_BT))
