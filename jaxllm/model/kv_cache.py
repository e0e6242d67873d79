"""The KV cache decoding reads and extends, and attention over it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxllm.parallel.mesh import constrain


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


def cached_attention(q_BTNH, k_BTKH, v_BTKH, cache: LayerCache, window=0,
                     scale: float | None = None):
  """The new tokens, written at slots length … length+T-1, attend to their row's filled
  slots and to each other, causally; with a `window` (> 0; traced where the layers differ)
  only to the last `window` slots, their own included. `scale`: the logits' factor (None:
  1/√head_dim)."""
  k_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.k_BSKH, k_BTKH, cache.length, axis=1)
  v_BSKH = jax.lax.dynamic_update_slice_in_dim(cache.v_BSKH, v_BTKH, cache.length, axis=1)
  slots_S = jnp.arange(k_BSKH.shape[1])
  query_slots_T = cache.length + jnp.arange(q_BTNH.shape[1])
  mask_B1TS = ((slots_S[None, None, None, :] <= query_slots_T[None, None, :, None]) &
               (slots_S[None, None, None, :] >= cache.start_B[:, None, None, None]))
  if isinstance(window, jax.Array) or window:  # a traced 0: a full layer among sliding ones
    behind_TS = query_slots_T[:, None] - slots_S[None, :]
    mask_B1TS &= ((behind_TS < window) | (window == 0))[None, None]
  # XLA's attention takes any mask; the fused cuDNN kernel is for causal training shapes.
  return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B1TS, scale=scale,
                                      implementation='xla')
