"""The next-token loss from the final activations, a chunk of positions' logits at a time,
with its gradients taken as it goes (cross-entropy and z-loss)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.mesh import constrain, keep_axes, logical_spec
from jaxllm.parallel.rules import mesh_axes


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
      for axes in (('pipe', *mesh_axes(logical_spec('batch')[0])),
                   mesh_axes(logical_spec('seq')[0])))
  split_axes = batch_axes + seq_axes
  embed_axes, vocab_axes = (mesh_axes(e) for e in logical_spec('embed', 'vocab'))
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
