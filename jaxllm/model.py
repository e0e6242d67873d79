"""A Llama-style decoder in Flax NNX, written once for every mesh.

Parameters and main activations carry logical axis names only; `jaxllm.mesh` binds them
to mesh axes. Shapes are spelled in suffixes: B batch, T sequence, D embed, N query heads,
K kv heads, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict, FrozenConfigDict

from jaxllm.mesh import constrain, logical_spec, spec_axes


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
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
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
  every call would otherwise keep a copy of. Under 'none' it keeps the outputs of all matmuls
  and of cuDNN attention: only elementwise work is recomputed."""
  cp = jax.checkpoint_policies
  kept = REMAT[remat] if remat != 'none' else cp.save_from_both_policies(
      cp.dots_saveable, cudnn_attention_outputs)
  return cp.save_from_both_policies(kept, cp.save_only_these_names('layer_input'))


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
# stays whole (decoding runs without a pipeline), and so do the positions: every step writes one.
KV_CACHE_AXES = (None, 'batch', None, 'act_kv_heads', None)


class KVCache(NamedTuple):
  """Every layer's keys and values for decoding. Slot s of the S axis holds position s; the
  first `length` slots are filled, and the next tokens are written from there."""
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  length: jax.Array  # int32 scalar

  @classmethod
  def empty(cls, cfg: ConfigDict, batch: int, max_len: int) -> KVCache:
    """A cache for `batch` rows of up to `max_len` positions (call inside jit, under the rules)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, cfg.dtype), *KV_CACHE_AXES)
    return cls(zeros(), zeros(), jnp.zeros((), jnp.int32))

  def append(self, k_LBTKH, v_LBTKH) -> KVCache:
    """The cache with T more positions written at `length`."""
    write = lambda c, new: constrain(
        jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), self.length, axis=2),
        *KV_CACHE_AXES)
    return KVCache(write(self.k_LBSKH, k_LBTKH), write(self.v_LBSKH, v_LBTKH),
                   self.length + k_LBTKH.shape[2])


class LayerCache(NamedTuple):
  """One layer's slice of a `KVCache`: what its attention reads while decoding."""
  k_BSKH: jax.Array
  v_BSKH: jax.Array
  length: jax.Array


def cached_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache: LayerCache):
  """The new tokens attend to the cache's filled slots and to each other, causally."""
  k_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.k_BSKH, k_BTKH, cache.length, axis=1)
  v_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.v_BSKH, v_BTKH, cache.length, axis=1)
  # Slot s holds position s: a query sees the slots up to its own position, none beyond.
  slots_S = jnp.arange(k_BSKH.shape[1])
  mask_B1TS = slots_S[None, None, None, :] <= positions_BT[:, None, :, None]
  # XLA's attention takes any mask; the fused cuDNN kernel is for causal training shapes.
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS,
                                      implementation='xla')


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
    w = lambda p: p[...].astype(self.cfg.dtype)
    q_BTNH = jnp.einsum('btd,dnh->btnh', x_BTD, w(self.wq_DNH))
    k_BTKH = jnp.einsum('btd,dkh->btkh', x_BTD, w(self.wk_DKH))
    v_BTKH = jnp.einsum('btd,dkh->btkh', x_BTD, w(self.wv_DKH))
    # Names for the remat policies that keep some activations (REMAT).
    q_BTNH = checkpoint_name(constrain(q_BTNH, 'batch', 'seq', 'act_heads', None), 'q_proj')
    k_BTKH = checkpoint_name(constrain(k_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'k_proj')
    v_BTKH = checkpoint_name(constrain(v_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'v_proj')
    inv_freq = rope_frequencies(self.cfg)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
    if cache is None:
      o_BTNH = sharded_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, self.cfg.attention)
    else:
      o_BTNH = cached_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache)
    o_BTNH = constrain(o_BTNH, 'batch', 'seq', 'act_heads', None)
    if self.cfg.attention != 'cudnn':  # cuDNN's output is kept as the kernel's (REMAT)
      o_BTNH = checkpoint_name(o_BTNH, 'attention')
    out_BTD = jnp.einsum('btnh,nhd->btd', o_BTNH, w(self.wo_NHD))
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
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BTD):
    w = lambda p: p[...].astype(self.dtype)
    gate_BTF = jnp.einsum('btd,df->btf', x_BTD, w(self.w_gate_DF))
    up_BTF = jnp.einsum('btd,df->btf', x_BTD, w(self.w_up_DF))
    h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, 'batch', 'seq', 'act_mlp')
    return jnp.einsum('btf,fd->btd', h_BTF, w(self.w_down_FD))


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
    x_BTD = x_BTD + attn_BTD
    x_BTD = constrain(x_BTD, 'batch', 'seq', 'act_embed')
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    x_BTD = constrain(x_BTD, 'batch', 'seq', 'act_embed')
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


def sharded_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation: str):
  """Causal attention inside each document, computed where the rows and heads are: rows
  split as the batch, heads as the head activations, each sequence whole. No shard then needs
  another's data, and cuDNN's fused kernel sees local arrays: JAX's partitioning rule for it
  fails inside the pipeline's shard_map, where some mesh axes are already manual."""
  def attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT):
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                        mask=segment_mask(segment_ids_BT),
                                        implementation=implementation)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)

  def spec(x, *names):  # a dimension its mesh axes do not divide (a small batch) stays whole
    return P(*(e if x.shape[i] % math.prod(mesh.shape[a] for a in spec_axes(e)) == 0 else None
               for i, e in enumerate(logical_spec(*names))))

  q_spec = spec(q_BTNH, 'batch', None, 'act_heads', None)
  kv_spec = spec(k_BTKH, 'batch', None, 'act_kv_heads', None)
  if q_spec[2] != kv_spec[2]:  # a query head's kv head must be on its device
    q_spec, kv_spec = P(*q_spec[:2], None, None), P(*kv_spec[:2], None, None)
  rows = None if segment_ids_BT is None else P(q_spec[0], None)
  return jax.shard_map(attend, in_specs=(q_spec, kv_spec, kv_spec, rows), out_specs=q_spec,
                       axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
                       check_vma=False)(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


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
                                      LayerCache(k_BSKH, v_BSKH, cache.length))

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
    # Gather rows from a whole table (an all-gather under fsdp/tensor, as for any weight):
    # a lookup into a sharded table makes the compiler replicate the activations instead.
    table_VD = constrain(self.embed_VD[...], None, None)
    x_BTD = table_VD[tokens_BT].astype(self.cfg.dtype)
    return constrain(x_BTD, 'batch', 'seq', 'act_embed')

  def layers(self, x_BTD, positions_BT, segment_ids_BT=None, cache: KVCache | None = None):
    """Runs the block stack as one `lax.scan`, rematerialised per the config.

    Decoding passes a `cache` (and one sequence per row, no segment ids): the tokens sit at
    `positions_BT` from `cache.length` on; returns the output and the cache holding them."""
    graphdef, stacked = nnx.split(self.blocks)
    return scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, self.cfg.remat,
                       cache)

  def logits(self, x_BTD):
    """Output logits in fp32, whatever the compute dtype."""
    x_BTD = self.final_norm(x_BTD)
    if self.cfg.tie_embeddings:
      w_DV = self.embed_VD[...].T
    else:
      w_DV = self.head_DV[...]
    logits_BTV = jnp.einsum('btd,dv->btv', x_BTD, w_DV.astype(x_BTD.dtype),
                            preferred_element_type=jnp.float32)
    return constrain(logits_BTV, 'batch', 'seq', 'act_vocab')

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
    """Logits [B, T, V]. Packed rows give each token's position in its document and the
    document's segment id; attention then stays inside each document."""
    if positions_BT is None:
      positions_BT = sequence_positions(tokens_BT)
    return self.logits(self.layers(self.embed(tokens_BT), positions_BT, segment_ids_BT))
