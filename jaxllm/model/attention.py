"""Grouped-query attention: the module, attention computed where each device's rows and heads
are (split queries under context parallelism, K/V heads shared by devices), and cuDNN's fused
kernel with packed documents as spans."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from jaxllm.config import layer_types
from jaxllm.model import fp8
from jaxllm.model.kv_cache import LayerCache, cached_attention
from jaxllm.model.layers import (RMSNorm, apply_rope, param, project, project_all,
                                 rope_frequencies)
from jaxllm.parallel.mesh import constrain, dividing_spec
from jaxllm.parallel.rules import kv_heads_fit, mesh_axes


class Attention(nnx.Module):
  """Grouped-query attention through `jax.nn.dot_product_attention`; with the config's
  options, biases on q, k and v (model.qkv_bias), a norm over each head of q and k before RoPE
  (model.qk_norm), and a sliding window on the layers model.layer_types makes 'sliding'."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nnx.initializers.normal(cfg.init_std)
    out_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
    pd = jnp.dtype(cfg.param_dtype)
    self.wq_DNH = param(rngs, init, (D, N, H), ('embed', 'heads', 'head_dim'), pd)
    self.wk_DKH = param(rngs, init, (D, K, H), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wv_DKH = param(rngs, init, (D, K, H), ('embed', 'kv_heads', 'head_dim'), pd)
    self.wo_NHD = param(rngs, out_init, (N, H, D), ('heads', 'head_dim', 'embed'), pd)
    self.fp8_qkv, self.fp8_out = fp8.group_scales(cfg, 3), fp8.group_scales(cfg, 1)
    self.cfg = cfg
    # Made after the weights above, so that a model without them draws those as before.
    bias = lambda *shape_names: (param(rngs, nnx.initializers.zeros, *shape_names, pd)
                                 if cfg.qkv_bias else None)
    self.bias_q_NH = bias((N, H), ('heads', 'head_dim'))
    self.bias_k_KH = bias((K, H), ('kv_heads', 'head_dim'))
    self.bias_v_KH = bias((K, H), ('kv_heads', 'head_dim'))
    norm = lambda: (RMSNorm(H, cfg.norm_eps, pd, rngs, cfg.norm_zero_centered)
                    if cfg.qk_norm else None)
    self.q_norm, self.k_norm = norm(), norm()

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None,
               sliding=None):
    """The attention output; with a `cache` (decoding), also the new tokens' keys and values.
    `sliding`: whether this layer slides, a traced bool the layer scan carries where the
    layers differ; None where they do not (every layer is as model.layer_types says)."""
    q_BTNH, k_BTKH, v_BTKH = project_all(
        x_BTD, (('btd,dnh->btnh', self.wq_DNH[...], ('embed', 'heads', 'head_dim')),
                ('btd,dkh->btkh', self.wk_DKH[...], ('embed', 'kv_heads', 'head_dim')),
                ('btd,dkh->btkh', self.wv_DKH[...], ('embed', 'kv_heads', 'head_dim'))),
        self.cfg.grad_reduce_dtype, self.cfg.collective_matmul, self.cfg.fp8,
        fp8.value(self.fp8_qkv))
    if self.cfg.qkv_bias:
      q_BTNH, k_BTKH, v_BTKH = (a + b[...].astype(a.dtype) for a, b in (
          (q_BTNH, self.bias_q_NH), (k_BTKH, self.bias_k_KH), (v_BTKH, self.bias_v_KH)))
    # Names for the remat policies that keep some activations (REMAT).
    q_BTNH = checkpoint_name(constrain(q_BTNH, 'batch', 'seq', 'act_heads', None), 'q_proj')
    k_BTKH = checkpoint_name(constrain(k_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'k_proj')
    v_BTKH = checkpoint_name(constrain(v_BTKH, 'batch', 'seq', 'act_kv_heads', None), 'v_proj')
    if self.cfg.qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    if sliding is None:
      sliding = 'sliding' in layer_types(self.cfg)
    inv_freq = layer_rope_frequencies(self.cfg, sliding)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
    scale = self.cfg.attention_scale or None
    if cache is not None:
      window = (jnp.where(sliding, self.cfg.sliding_window, 0) if isinstance(sliding, jax.Array)
                else self.cfg.sliding_window)
      o_BTNH = cached_attention(q_BTNH, k_BTKH, v_BTKH, cache, window, scale)
    else:
      attend = lambda window: sharded_attention(
          q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, self.cfg.attention, self.cfg.max_documents,
          window, scale)
      o_BTNH = per_layer_window(attend, sliding, self.cfg.sliding_window,
                                layer_types(self.cfg))
    o_BTNH = constrain(o_BTNH, 'batch', 'seq', 'act_heads', None)
    if self.cfg.attention != 'cudnn':  # cuDNN's output is kept as the kernel's (REMAT)
      o_BTNH = checkpoint_name(o_BTNH, 'attention')
    out_BTD = project('btnh,nhd->btd', o_BTNH, self.wo_NHD[...], self.cfg.grad_reduce_dtype,
                      w_names=('heads', 'head_dim', 'embed'), collective=self.cfg.collective_matmul,
                      fp8=self.cfg.fp8, fp8_scales=fp8.value(self.fp8_out))
    return out_BTD if cache is None else (out_BTD, (k_BTKH, v_BTKH))


def layer_rope_frequencies(cfg: ConfigDict, sliding) -> jax.Array:
  """The rotary frequencies of a layer that slides or not (`sliding`, a bool or a traced one)."""
  if not cfg.sliding_rope_theta:  # the same for both
    return rope_frequencies(cfg)
  if not isinstance(sliding, jax.Array):
    return rope_frequencies(cfg, sliding)
  return jnp.where(sliding, rope_frequencies(cfg, True), rope_frequencies(cfg, False))


def per_layer_window(attend, sliding, window: int, kinds: tuple[str, ...]):
  """`attend(window)` (window 0: none) for a layer that slides or not. A traced `sliding` (the
  layers differ: `kinds`, every layer's type) chooses between the two at run time: cuDNN
  takes its window as a constant of the kernel, so each branch is a kernel of its own. Each
  branch is named with how many of the layers take it, which a compiled program's readers
  count its executions by (`jaxllm.cost.hlo.BRANCH_SHARE`)."""
  if not isinstance(sliding, jax.Array):
    return attend(window if sliding else 0)
  def branch(kind, w):
    def run():
      with jax.named_scope(f'{kind}_layers_runs_{kinds.count(kind)}_of_{len(kinds)}'):
        return attend(w)
    return run
  return jax.lax.cond(sliding, branch('sliding', window), branch('full', 0))


def with_available_attention(model_cfg: ConfigDict, platform: str) -> ConfigDict:
  """`model_cfg` as devices of `platform` ('gpu', 'cpu', ...) run it: 'cudnn' is a fused NVIDIA
  kernel, so elsewhere 'xla' (the same math) stands in for it (a copy; the same config where
  nothing changes). Chosen at start-up, on the devices of the run: loading a config never
  starts a backend."""
  if model_cfg.attention != 'cudnn' or platform == 'gpu':
    return model_cfg
  model_cfg = copy.deepcopy(model_cfg)
  model_cfg.attention = 'xla'
  return model_cfg


def sharded_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation: str,
                      max_documents: int, window: int = 0, scale: float | None = None):
  """Causal attention inside each document, computed where the rows and heads are: rows
  split as the batch, heads as the head activations. No shard then needs another's data, and
  cuDNN's fused kernel sees local arrays: JAX's partitioning rule for it fails inside the
  pipeline's shard_map, where some mesh axes are already manual. Packed rows reach cuDNN as
  up to `max_documents` spans each (`packed_cudnn_attention`) where the GPU takes that
  layout, as the dense segment mask elsewhere.

  With the sequence split (the 'seq' rule: context parallelism) each device's queries stay
  where they are and the keys and values come whole, all-gathered by the compiler (their
  gradients reduce-scattered back); a key is visible to a query of the same document at the
  same or an earlier index in the row (`_attend_split_queries`). Positions (RoPE's, which the
  caller has applied) take no part in the mask: padding has position 0.

  `window` > 0: a query sees only the keys of the last `window` indices of its row, its own
  included (Mistral's and Gemma's sliding window; inside a document, the last `window`
  positions). `scale`: the logits' factor (None: 1/√head_dim)."""
  def attend(q_BTNH, k_BSKH, v_BSKH, index_T, segment_ids_BT, key_segment_ids_BS):
    if shared_kv:  # K/V heads are whole here: take the ones this device's query heads use
      local, group = shared_kv
      start = jax.lax.axis_index(mesh_axes(q_spec[2])) * local // group
      k_BSKH, v_BSKH = (jax.lax.dynamic_slice_in_dim(a, start, max(1, local // group), axis=2)
                        for a in (k_BSKH, v_BSKH))
    if split_queries:
      return _attend_split_queries(q_BTNH, k_BSKH, v_BSKH, index_T, segment_ids_BT,
                                   key_segment_ids_BS, implementation, window, scale)
    if implementation == 'cudnn' and segment_ids_BT is not None and cudnn_packed_layout():
      return packed_cudnn_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, max_documents,
                                    window, scale)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                        mask=segment_mask(segment_ids_BT), scale=scale,
                                        local_window_size=local_window(window),
                                        implementation=implementation)

  mesh = jax.sharding.get_abstract_mesh()
  shared_kv, split_queries = None, False
  # Each query's index in its row, split as the queries are: the shard_map hands every device
  # its own, whatever layout the 'seq' rule gives the split.
  index_T = jnp.arange(q_BTNH.shape[1], dtype=jnp.int32)
  args = (q_BTNH, k_BTKH, v_BTKH, index_T, segment_ids_BT, segment_ids_BT)
  if mesh.empty:
    return attend(*args)
  q_spec = dividing_spec(q_BTNH, 'batch', 'seq', 'act_heads', None)
  kv_spec = dividing_spec(k_BTKH, 'batch', None, 'act_kv_heads', None)
  split_queries = q_spec[1] is not None
  if q_spec[2] != kv_spec[2]:  # a query head's kv head must be on its device
    shared_kv = shared_kv_heads(q_BTNH.shape[2], k_BTKH.shape[2], mesh_axes(q_spec[2]),
                                mesh_axes(kv_spec[2]), mesh)
    if shared_kv is None:
      q_spec, kv_spec = P(*q_spec[:2], None, None), P(*kv_spec[:2], None, None)
  rows, key_rows = P(*q_spec[:2]), P(kv_spec[0], None)
  segments = (None, None) if segment_ids_BT is None else (rows, key_rows)
  return jax.shard_map(attend, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[1]), *segments),
                       out_specs=q_spec, axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
                       check_vma=False)(*args)


def _attend_split_queries(q_BTNH, k_BSKH, v_BSKH, index_T, segment_ids_BT, key_segment_ids_BS,
                          implementation: str, window: int, scale: float | None):
  """Attention from T queries, a part of each row's sequence (at indices `index_T` of the
  row), to the S keys of all of it: masked by index and document, which is exact whatever
  order the split leaves the tokens in. cuDNN takes the mask as a dense bias: its packed
  layout places documents by offsets shared by queries and keys, which the split does not keep.

  Causality goes by index in the row, as one device's `is_causal` does, not by position:
  positions restart at 0 in the padding after an unpacked row's document (which carries no
  segment ids), so a position mask would let real tokens attend to that padding."""
  behind_TS = index_T[:, None] - jnp.arange(k_BSKH.shape[1])
  mask_B1TS = (behind_TS >= 0)[None, None]
  if window:
    mask_B1TS &= (behind_TS < window)[None, None]
  if segment_ids_BT is not None:
    mask_B1TS &= segment_ids_BT[:, None, :, None] == key_segment_ids_BS[:, None, None, :]
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS, scale=scale,
                                      implementation=implementation)


def shared_kv_heads(N: int, K: int, q_axes, kv_axes, mesh) -> tuple[int, int] | None:
  """With N query heads split over `q_axes` and the K K/V heads whole on every device: (query
  heads per device, query heads per K/V head), so that device i's query heads use K/V heads
  i·local/group on (`sharded_attention`); None where they do not map onto whole K/V heads."""
  if kv_axes or not q_axes:
    return None
  pieces = math.prod(mesh.shape[a] for a in q_axes)
  return (N // pieces, N // K) if kv_heads_fit(K, pieces) else None


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


def packed_cudnn_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, max_documents: int,
                           window: int = 0, scale: float | None = None):
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
      q_offsets=starts_BM1, kv_offsets=starts_BM1, scale=scale or 1 / math.sqrt(H),
      mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout='BTNH',
      sliding_window_length=window or None)


def local_window(window: int) -> tuple[int, int] | None:
  """`jax.nn.dot_product_attention`'s local_window_size for a window of `window` positions, the
  query's own included (0: none): it counts the keys left of the query, hence window - 1
  (cuDNN's sliding_window_length, like transformers' sliding_window, counts the query's too)."""
  return (window - 1, 0) if window else None


def segment_mask(segment_ids_BT):
  """[B, 1, T, T] True where query and key are in the same document of a packed row;
  None (no mask beyond causality) when rows hold one sequence each."""
  if segment_ids_BT is None:
    return None
  return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]
