"""jaxllm's Llama decoder and train step written out in plain JAX: the "no framework" baseline.

Pure functions over a nested dict of arrays, one device, no sharding, no Flax in the model.
`benchmarks/gpu.py --plain` times it beside jaxllm's step on the same shapes and weights, and
`tests/test_gpu_bench.py` checks it against jaxllm step for step, so it doubles as an
independent reference for the model.

The parameters keep jaxllm's names (so the optimizer's decay mask, which spares names holding
'scale', treats them alike); the layer stack has a leading layer axis L:

    embed_VD [V, D]              head_DV [D, V] (untied only)       final_norm.scale [D]
    blocks.attn_norm.scale, blocks.mlp_norm.scale [L, D]
    blocks.attn.wq_DNH [L, D, N, H], wk_DKH / wv_DKH [L, D, K, H], wo_NHD [L, N, H, D]
    blocks.mlp.w_gate_DF / w_up_DF [L, D, F], w_down_FD [L, F, D]

`m` below is the model section of a jaxllm config (any object with those attributes); the
caller reads it, this module imports nothing of jaxllm.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name


def cudnn_attention_outputs(prim, *_, **__) -> bool:
  """cuDNN's fused attention forward: its output and softmax statistics, all its backward
  kernel needs beside q, k and v."""
  return prim.name == 'dot_product_attention_fwd_wrapper'


def keep(*names):
  """The named values and cuDNN attention's outputs ('attention' names XLA's output only)."""
  return jax.checkpoint_policies.save_from_both_policies(
      jax.checkpoint_policies.save_only_these_names(*names), cudnn_attention_outputs)


# The remat policies by the names jaxllm's config uses ('none' means no jax.checkpoint).
REMAT = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'dots_except_mlp': keep('q_proj', 'k_proj', 'v_proj', 'attention'),
    'attention': keep('attention'),
}


def params_from_jaxllm(state_params) -> dict:
  """A jaxllm `TrainState.params` (an nnx.State) as the plain nested dict, on the host.

  Host copies, because jaxllm's step donates its state: the device buffers behind
  `state_params` are gone after its first step. `jax.device_put` them to use them.
  """
  from flax import nnx  # only to read jaxllm's container; the model below never uses Flax
  return jax.tree.map(lambda x: np.array(jax.device_get(x)), nnx.to_pure_dict(state_params))


def rope_inv_freq(m) -> jax.Array:
  """Inverse rotary frequencies [H/2]; Llama-3 scaling when m.rope_scaling.factor > 0."""
  inv_freq = m.rope_theta ** (-jnp.arange(0, m.head_dim, 2, dtype=jnp.float32) / m.head_dim)
  s = m.rope_scaling
  if s.factor <= 0:
    return inv_freq
  # Llama-3: a wavelength above original/low_freq_factor is stretched by `factor`, one below
  # original/high_freq_factor kept; in between the two are mixed linearly in original/wavelen.
  ratio = s.original_max_position * inv_freq / (2 * math.pi)  # = original / wavelength
  keep = jnp.clip((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0, 1)
  return (1 - keep) * inv_freq / s.factor + keep * inv_freq


def rope(x_BTnH, positions_BT, inv_freq):
  """Rotates element i of each head with element i + H/2 (the half-split layout), in fp32."""
  angle = positions_BT[:, :, None, None].astype(jnp.float32) * inv_freq
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  a, b = jnp.split(x_BTnH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x_BTnH.dtype)


def rms_norm(x, scale, eps):
  """RMSNorm with fp32 statistics and an fp32 scale; the result in x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def attention(x_BTD, p, positions_BT, segment_ids_BT, inv_freq, implementation):
  dt = x_BTD.dtype
  q = checkpoint_name(jnp.einsum('btd,dnh->btnh', x_BTD, p['wq_DNH'].astype(dt)), 'q_proj')
  k = checkpoint_name(jnp.einsum('btd,dkh->btkh', x_BTD, p['wk_DKH'].astype(dt)), 'k_proj')
  v = checkpoint_name(jnp.einsum('btd,dkh->btkh', x_BTD, p['wv_DKH'].astype(dt)), 'v_proj')
  q, k = rope(q, positions_BT, inv_freq), rope(k, positions_BT, inv_freq)
  # Packed rows: a token sees only its own document (beyond the causal mask).
  mask = (None if segment_ids_BT is None else
          segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])
  o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                   implementation=implementation)  # GQA: K divides N
  if implementation != 'cudnn':  # cuDNN's output is kept as the kernel's (REMAT)
    o = checkpoint_name(o, 'attention')
  return jnp.einsum('btnh,nhd->btd', o, p['wo_NHD'].astype(dt))


def mlp(x_BTD, p):
  dt = x_BTD.dtype
  gate = jnp.einsum('btd,df->btf', x_BTD, p['w_gate_DF'].astype(dt))
  up = jnp.einsum('btd,df->btf', x_BTD, p['w_up_DF'].astype(dt))
  return jnp.einsum('btf,fd->btd', jax.nn.silu(gate) * up, p['w_down_FD'].astype(dt))


def logits(params, tokens_BT, positions_BT, m, segment_ids_BT=None, implementation=None):
  """fp32 logits [B, T, V] of the decoder; compute in m.dtype, parameters as stored."""
  inv_freq = rope_inv_freq(m)
  x = params['embed_VD'][tokens_BT].astype(m.dtype)

  def layer(x, p):
    x = x + attention(rms_norm(x, p['attn_norm']['scale'], m.norm_eps), p['attn'],
                      positions_BT, segment_ids_BT, inv_freq, implementation)
    x = x + mlp(rms_norm(x, p['mlp_norm']['scale'], m.norm_eps), p['mlp'])
    return x, None

  if m.remat != 'none':
    layer = jax.checkpoint(layer, policy=REMAT[m.remat], prevent_cse=False)
  x, _ = jax.lax.scan(layer, x, params['blocks'])  # one layer's slice of every array per step
  x = rms_norm(x, params['final_norm']['scale'], m.norm_eps)
  head_DV = params['embed_VD'].T if m.tie_embeddings else params['head_DV']
  return jnp.einsum('btd,dv->btv', x, head_DV.astype(x.dtype),
                    preferred_element_type=jnp.float32)


def loss(params, batch, m, implementation=None):
  """Mean next-token cross-entropy over the targets the batch's mask keeps."""
  tokens = batch['inputs']
  positions = batch.get('positions')
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  out = logits(params, tokens, positions, m, batch.get('segment_ids'), implementation)
  losses = optax.softmax_cross_entropy_with_integer_labels(out, batch['targets'])
  mask = batch['mask'].astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(m, tx: optax.GradientTransformation):
  """`step(params, opt_state, batch) -> (params, opt_state, {'loss', 'grad_norm'})`, to jit.

  `tx` is the optimizer (jaxllm.optim.make_optimizer gives the trainer's AdamW + clipping).
  Attention is the fused cuDNN kernel when m.attention says 'cudnn', else XLA's.
  """
  implementation = 'cudnn' if m.attention == 'cudnn' else None  # None: XLA's
  if m.remat != 'none' and m.remat not in REMAT:
    raise ValueError(f'model.remat={m.remat!r}: the plain step knows none, {", ".join(REMAT)}.')

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch, m, implementation)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {'loss': value, 'grad_norm': optax.tree.norm(grads)}

  return step
