"""FP8 matmuls with per-tensor scaling (model.fp8), as Hopper's tensor cores run them.

A layer matmul's input and weight are quantized to E4M3 and its output gradient to E5M2, each
divided by a scale that maps the tensor's largest magnitude (its amax) onto the format's
largest value; the products are rescaled by the scales' product. Each scale is rounded to the
compute dtype once and that value serves both sides, so no product carries the rounding's
error as a gain. XLA's GPU compiler makes each of these matmuls a cuBLASLt FP8 call with the
scales as its operands. On the CPU XLA emulates the FP8 types, with the same rounding; the
rescaled operands are then rounded to the compute dtype, where a GPU multiplies the FP8 values
exactly.

Scaling recipes:
- 'current': each scale comes from this step's amax of its tensor: over every shard the
  compiler splits, and where the step splits the batch by hand (data; data and fsdp in a
  pipeline), over the device's own rows, as Transformer Engine's current scaling is per GPU.
  No state.
- 'delayed' (Transformer Engine's and Flax's recipe): each scale comes from the largest amax in
  a history of the last `model.fp8_history` steps', kept in the train state. The matmuls report
  this step's amaxes as the gradient of their scales (`Fp8Scales`); `next_delayed_state` rolls
  them into the history and makes the next step's scales.

Where one delayed scale serves several matmuls (micro-batches, pipeline iterations, devices
that split the batch), their amaxes are combined by their maximum, not summed (`fan_out`), so
the history holds each tensor's amax over the whole step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

E4M3 = jnp.float8_e4m3fn   # inputs and weights
E5M2 = jnp.float8_e5m2     # output gradients: more range, less precision


class Fp8Scales(nnx.Variable):
  """Delayed scaling's scales of one group of matmuls that share an input: [input, weight_1..n,
  output-gradient_1..n]. A scale s stores a tensor x as x/s in FP8."""


def group_scales(model_cfg, matmuls: int) -> Fp8Scales | None:
  """The scales of `matmuls` matmuls of one input under delayed scaling (ones: the first step
  quantizes unscaled); None under any other recipe."""
  if model_cfg.fp8 != 'delayed':
    return None
  return Fp8Scales(jnp.ones((1 + 2 * matmuls,), jnp.float32), out_sharding=(None,))


def value(scales: Fp8Scales | None):
  return None if scales is None else scales[...]


class Fp8State(NamedTuple):
  """Delayed scaling's part of the train state: every group's scales, laid out as the model
  holds them, and their amax histories (a trailing axis, newest first)."""
  scales: nnx.State
  history: nnx.State


def initial_state(scales: nnx.State, history: int) -> Fp8State:
  return Fp8State(scales, jax.tree.map(lambda s: jnp.zeros((*s.shape, history), s.dtype),
                                       scales))


def initial_state_like(abstract: Fp8State | None) -> Fp8State | None:
  """A fresh state (scales 1, histories empty) shaped as `abstract`; None for None."""
  if abstract is None:
    return None
  return Fp8State(jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), abstract.scales),
                  jax.tree.map(lambda h: jnp.zeros(h.shape, h.dtype), abstract.history))


def largest(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def amax(x) -> jax.Array:
  """The largest magnitude of x, over every shard of it the compiler splits; where the step
  splits the batch by hand (data; data and fsdp in a pipeline), of this device's rows."""
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def scale_for(amax, top, previous=1.0):
  """The scale that maps `amax` onto `top`, a format's largest value; `previous` where amax is
  zero or not finite (nothing seen yet, or an overflow)."""
  good = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(good, amax / top, previous)


def quantize(x, scale, dtype):
  """x/scale, saturated to `dtype`'s range and rounded to it: x ≈ quantize(x, scale)·scale."""
  top = largest(dtype)
  return jnp.clip(x.astype(jnp.float32) / scale.astype(jnp.float32), -top, top).astype(dtype)


def dequantize(q, scale, dtype):
  """q·scale in `dtype`: the form XLA's GPU compiler folds into a cuBLASLt FP8 call (the scale
  an fp32 operand of the call) where a matmul takes it."""
  return q.astype(dtype) * scale.astype(dtype)


def group_formats(size: int) -> jax.Array:
  """Each entry's format's largest value in a group's scales of `size` entries."""
  matmuls = (size - 1) // 2
  return jnp.array([largest(E4M3)] * (1 + matmuls) + [largest(E5M2)] * matmuls, jnp.float32)


def next_delayed_state(state: Fp8State, amaxes: nnx.State) -> Fp8State:
  """The state after a step whose matmuls saw `amaxes` (laid out as the scales): each amax
  joins the front of its history (a non-finite one as 0: it must not rule for a whole
  history), and each scale maps its history's largest amax onto its format's largest value."""
  def history(h, a):
    a = jnp.where(jnp.isfinite(a), a, 0.0)
    return jnp.concatenate([a[..., None], h[..., :-1]], axis=-1)

  histories = jax.tree.map(history, state.history, amaxes)
  scales = jax.tree.map(
      lambda s, h: scale_for(jnp.max(h, axis=-1), group_formats(s.shape[-1]), s),
      state.scales, histories)
  return Fp8State(scales, histories)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(x, n: int):
  """`x` broadcast to [n, *x.shape], for n users that each take one copy; its gradient (the
  users' amaxes) is their maximum, where a plain broadcast's would be their sum."""
  return jnp.broadcast_to(x, (n, *x.shape))


def _fan_out_fwd(x, n):
  return fan_out(x, n), None


def _fan_out_bwd(n, _, g):
  return (jnp.max(g, axis=0),)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def matmuls(specs: tuple[str, ...], x, ws: tuple, scales, grad_dtype, gathered: tuple):
  """`jnp.einsum(spec, x, w)` for each (spec, w), in FP8: x and each w quantized to E4M3,
  each output's gradient to E5M2, with `scales` (delayed scaling: the group's `Fp8Scales`)
  or, where `scales` is None, scales from this step's amaxes (current scaling).

  Outputs and x's gradient take x's dtype; w's gradient is made in `grad_dtype` (the element
  type of its reduction over the batch's devices), then w's own dtype. Each weight is quantized
  before any gather, so a gather moves FP8; `gathered` holds each weight's layout for its matmul
  where the sequence is split over an axis that splits it (as `layers.project`), else None.
  Under delayed scaling the gradient of `scales` is this step's amaxes, in their order."""
  return _matmuls(specs, jnp.dtype(grad_dtype), gathered, tuple(w.dtype for w in ws), x, ws,
                  scales)


def _scales(scales, x, ws):
  """The input's and weights' scales: the stored ones, or this step's; in x's dtype
  (`_in_compute`)."""
  if scales is not None:
    found = scales[0], [scales[1 + i] for i in range(len(ws))]
  else:
    found = scale_for(amax(x), largest(E4M3)), [scale_for(amax(w), largest(E4M3)) for w in ws]
  return _in_compute(found, x.dtype)


def _in_compute(scales, compute_dtype):
  """`scales` rounded to the dtype the matmuls multiply them in, once: each tensor is then
  quantized by the same value its product is rescaled by (a scale rounded on one side only
  would scale every product of the tensor by the rounding's error, up to ±0.4% in bf16)."""
  return jax.tree.map(lambda s: s.astype(compute_dtype), scales)


def _matmul(spec, a, sa, b, sb, compute_dtype, out_dtype):
  """einsum of two FP8 operands with their scales in `out_dtype`: one cuBLASLt FP8 call on a
  GPU, the scales its operands (on a CPU, XLA's emulation of it, which multiplies in
  `compute_dtype`)."""
  return jnp.einsum(spec, dequantize(a, sa, compute_dtype), dequantize(b, sb, compute_dtype),
                    preferred_element_type=out_dtype)


def _laid_out(w, gathered):
  return w if gathered is None else jax.lax.with_sharding_constraint(w, gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _matmuls(specs, grad_dtype, gathered, w_dtypes, x, ws, scales):
  return _matmuls_fwd(specs, grad_dtype, gathered, w_dtypes, x, ws, scales)[0]


def _matmuls_fwd(specs, grad_dtype, gathered, w_dtypes, x, ws, scales):
  sx, sws = _scales(scales, x, ws)
  qx = quantize(x, sx, E4M3)
  qws = [_laid_out(quantize(w, s, E4M3), g) for w, s, g in zip(ws, sws, gathered)]
  ys = tuple(_matmul(spec, qx, sx, qw, sw, x.dtype, x.dtype)
             for spec, qw, sw in zip(specs, qws, sws))
  seen = None if scales is None else (amax(x), [amax(w) for w in ws])
  return ys, (qx, sx, qws, sws, scales, seen)


def _matmuls_bwd(specs, grad_dtype, gathered, w_dtypes, residuals, gs):
  qx, sx, qws, sws, scales, seen = residuals
  x_dtype = gs[0].dtype  # the outputs' and x's
  n = len(qws)
  if scales is None:
    sgs = [scale_for(amax(g), largest(E5M2)) for g in gs]
  else:
    sgs = [scales[1 + n + i] for i in range(n)]
  sgs = _in_compute(sgs, x_dtype)
  qgs = [quantize(g, s, E5M2) for g, s in zip(gs, sgs)]
  dx, dws = None, []
  for spec, qw, sw, qg, sg, w_dtype, layout in zip(specs, qws, sws, qgs, sgs, w_dtypes,
                                                    gathered):
    x_axes, rest = spec.split(',')
    w_axes, out_axes = rest.split('->')
    dx_i = _matmul(f'{out_axes},{w_axes}->{x_axes}', qg, sg, qw, sw, x_dtype, x_dtype)
    dx = dx_i if dx is None else dx + dx_i
    # each device's positions' share where the weight was gathered, summed (and split) after
    dw = _laid_out(_matmul(f'{x_axes},{out_axes}->{w_axes}', qx, sx, qg, sg, x_dtype,
                           grad_dtype), layout)
    dws.append(dw.astype(w_dtype))
  if scales is None:
    return dx, tuple(dws), None
  amax_x, amax_ws = seen
  return dx, tuple(dws), jnp.stack([amax_x, *amax_ws, *[amax(g) for g in gs]])


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)
