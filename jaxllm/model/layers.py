"""The decoder's building blocks: parameters, RMSNorm, rotary embeddings, `project` (a weight
matmul with its own backward), `project_all` (several of one input) and the gated MLP
(SwiGLU, or GeGLU).

Parameters and activations carry logical axis names only; `jaxllm.parallel.mesh` binds them to
mesh axes. Shapes are spelled in suffixes: B batch, T sequence, D embed, N query heads, K kv
heads, H head dim, F mlp hidden, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from jaxllm.model.fp8 import group_scales, matmuls as fp8_matmuls, value as scales_of
from jaxllm.parallel import collective_matmul
from jaxllm.parallel.mesh import constrain, keep_axes, logical_spec
from jaxllm.parallel.rules import mesh_axes


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis, in fp32. `zero_centered` (model.norm_zero_centered, Gemma's
  norms): the scale is stored as w and applied as 1 + w, starting at w = 0."""

  def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs,
               zero_centered: bool = False):
    self.eps = eps
    self.zero_centered = zero_centered
    init = nnx.initializers.zeros if zero_centered else nnx.initializers.ones
    self.scale = param(rngs, init, (dim,), ('norm',), param_dtype)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (x32 * (1 + scale if self.zero_centered else scale)).astype(x.dtype)


def rope_frequencies(cfg: ConfigDict, sliding: bool = False) -> jax.Array:
  """Inverse frequencies [H/2] of the rotary embedding, with optional scaling (Llama 3's or
  linear). `sliding`: a sliding layer's, which has a base of its own, unscaled, where
  model.sliding_rope_theta sets one (Gemma 3's local layers)."""
  h = cfg.head_dim
  own_base = sliding and cfg.sliding_rope_theta > 0
  theta = cfg.sliding_rope_theta if own_base else cfg.rope_theta
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  s = cfg.rope_scaling
  if s.factor <= 0 or own_base:
    return inv_freq
  if s.kind == 'linear':
    return inv_freq / s.factor
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


def project(spec: str, x, w, grad_dtype, out_dtype=None, w_names=None, collective=False,
            fp8: str = 'none', fp8_scales=None):
  """`jnp.einsum(spec, x, w)` on x's dtype, w cast to it first (so an fsdp gather moves that
  dtype), giving `out_dtype` (default x's). The backward runs both matmuls on x's dtype too,
  on the weight as the forward's matmul took it (one gather per pass, whatever the remat
  policy), and makes w's gradient in `grad_dtype` (w's own dtype is `w_dtype`): the gradient
  is summed over the devices that split the batch straight out of its matmul, so this is the
  element type of that reduction.
  The output is named 'projection' for the remat policies (REMAT).

  `w_names`, w's logical axes: where the sequence is split over an axis that also splits w
  (context parallelism over fsdp), w is gathered over it for the matmul, as fsdp gathers
  weights; left to itself XLA may gather the activations instead, a whole sequence each.

  `collective` (model.collective_matmul): where the output's sequence is split over tensor
  (sequence parallelism) and w's contracted axes are too (attention's output, the MLP's down
  projection), the partial sums are reduce-scattered round a ring beside the matmul
  (`collective_matmul.matmul_reduce_scatter`), not after it.

  `fp8` (model.fp8): 'delayed' or 'current' runs the matmul in FP8 (`fp8.matmuls`), with the
  group's `fp8_scales` under delayed scaling; the output then takes x's dtype."""
  if fp8 != 'none':
    return project_all(x, ((spec, w, w_names),), grad_dtype, fp8=fp8, fp8_scales=fp8_scales)[0]
  if collective and collective_matmul.scatters(spec, x, w_names):
    return checkpoint_name(collective_matmul.matmul_reduce_scatter(spec, x, w, w_names,
                                                                    grad_dtype), 'projection')
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  gathered = _gathered_over_sequence(w_names) if w_names else None
  return checkpoint_name(_project(spec, jnp.dtype(grad_dtype), out_dtype, gathered,
                                  jnp.dtype(w.dtype), x, w), 'projection')


def project_all(x, projections, grad_dtype, collective=False, fp8: str = 'none',
                fp8_scales=None) -> tuple:
  """`project` of one input x by each of `projections`, (spec, w, w_names) triples: q, k and
  v, or gate and up. With `collective` (model.collective_matmul), where x's sequence is split
  over tensor (sequence parallelism), x's blocks go round a ring once for all of them while
  the matmuls run (`collective_matmul.all_gather_matmul`), not all-gathered before.
  `fp8` and `fp8_scales` as `project`'s: x is quantized once for all of them."""
  if fp8 != 'none':
    specs, ws, names = zip(*projections)
    gathered = tuple(_gathered_over_sequence(n) if n else None for n in names)
    return tuple(checkpoint_name(y, 'projection') for y in
                 fp8_matmuls(specs, x, ws, fp8_scales, grad_dtype, gathered))
  if collective and collective_matmul.gathers(x, projections):
    return tuple(checkpoint_name(y, 'projection') for y in
                 collective_matmul.all_gather_matmul(x, projections, grad_dtype))
  return tuple(project(spec, x, w, grad_dtype, w_names=names) for spec, w, names in projections)


def _gathered_over_sequence(w_names) -> P | None:
  """The layout of a weight with logical axes `w_names` whole over the mesh axes that split
  the sequence; None where none of them splits it."""
  seq_axes = set(mesh_axes(logical_spec('seq')[0]))
  spec = logical_spec(*w_names)
  if not seq_axes & {a for entry in spec for a in mesh_axes(entry)}:
    return None
  return keep_axes(spec, set(jax.sharding.get_abstract_mesh().axis_names) - seq_axes)


def _in_compute_layout(w, x_dtype, gathered):
  w = w.astype(x_dtype)
  return w if gathered is None else jax.lax.with_sharding_constraint(w, gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _project(spec, grad_dtype, out_dtype, gathered, w_dtype, x, w):
  return jnp.einsum(spec, x, _in_compute_layout(w, x.dtype, gathered),
                    preferred_element_type=out_dtype)


def _project_fwd(spec, grad_dtype, out_dtype, gathered, w_dtype, x, w):
  # The backward takes the weight as the matmul took it (cast, gathered by fsdp): under a remat
  # policy, which never keeps it, the rerun forward and the backward's matmuls share one
  # gather of it, where remaking it from w in the backward would gather it again.
  w_c = _in_compute_layout(w, x.dtype, gathered)
  return jnp.einsum(spec, x, w_c, preferred_element_type=out_dtype), (x, w_c)


def _project_bwd(spec, grad_dtype, out_dtype, gathered, w_dtype, residuals, g):
  x, w_c = residuals
  x_axes, rest = spec.split(',')
  w_axes, out_axes = rest.split('->')
  g = g.astype(x.dtype)
  dx = jnp.einsum(f'{out_axes},{w_axes}->{x_axes}', g, w_c)
  dw = jnp.einsum(f'{x_axes},{out_axes}->{w_axes}', x, g, preferred_element_type=grad_dtype)
  if gathered is not None:  # each device's positions' share, summed (and split) afterwards
    dw = jax.lax.with_sharding_constraint(dw, gathered)
  return dx, dw.astype(w_dtype)


_project.defvjp(_project_fwd, _project_bwd)


class MLP(nnx.Module):
  """Gated feed-forward `mlp_dim` wide (default model.mlp_dim): SwiGLU, or GeGLU with the tanh
  GELU (model.mlp_activation)."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs, mlp_dim: int | None = None):
    D, F = cfg.embed_dim, mlp_dim or cfg.mlp_dim
    init = nnx.initializers.normal(cfg.init_std)
    out_init = nnx.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
    pd = jnp.dtype(cfg.param_dtype)
    self.w_gate_DF = param(rngs, init, (D, F), ('embed', 'mlp'), pd)
    self.w_up_DF = param(rngs, init, (D, F), ('embed', 'mlp'), pd)
    self.w_down_FD = param(rngs, out_init, (F, D), ('mlp', 'embed'), pd)
    self.fp8_gate_up, self.fp8_down = group_scales(cfg, 2), group_scales(cfg, 1)
    self.grad_reduce_dtype = cfg.grad_reduce_dtype
    self.collective_matmul = cfg.collective_matmul
    self.fp8 = cfg.fp8
    self.activation = cfg.mlp_activation

  def __call__(self, x_BTD):
    gate_BTF, up_BTF = project_all(
        x_BTD, (('btd,df->btf', self.w_gate_DF[...], ('embed', 'mlp')),
                ('btd,df->btf', self.w_up_DF[...], ('embed', 'mlp'))),
        self.grad_reduce_dtype, self.collective_matmul, self.fp8, scales_of(self.fp8_gate_up))
    act = jax.nn.silu if self.activation == 'silu' else functools.partial(jax.nn.gelu,
                                                                          approximate=True)
    h_BTF = constrain(act(gate_BTF) * up_BTF, 'batch', 'seq', 'act_mlp')
    return project('btf,fd->btd', h_BTF, self.w_down_FD[...], self.grad_reduce_dtype,
                   w_names=('mlp', 'embed'), collective=self.collective_matmul, fp8=self.fp8,
                   fp8_scales=scales_of(self.fp8_down))
