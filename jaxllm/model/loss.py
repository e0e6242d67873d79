"""The next-token loss from the final activations, a chunk of positions' logits at a time,
with its gradients taken as it goes (cross-entropy and z-loss)."""

from __future__ import annotations

import dataclasses
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked_loss_sum(chunks: int, grad_dtype, z_loss: float, x_BTD, w_DV, targets_BT, mask_BT):
  """(objective, cross-entropy): sum(mask · (cross_entropy + z_loss · log²Z)) of the logits
  x·w, and sum(mask · cross_entropy), with [B, T/chunks, V] fp32 logits at a time.

  Differentiated, each chunk's gradients are taken by hand as its loss is (the loss is the
  last op, so they are known then): no logits are kept or remade for the backward. The head
  is moved once, in the compute dtype; its gradient is summed over the chunks in fp32 (over
  fsdp split as the head is, by vocabulary, where that moves fewer bytes:
  `splits_vocabulary`) and crosses devices once, in `grad_dtype`. Only the objective carries
  gradients; the cross-entropy is for the log."""
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
  parts = lambda axes: math.prod(mesh.shape[a] for a in axes)
  # The axes that split both the rows and the head's embed dimension (fsdp) either gather the
  # head (and reduce-scatter its gradient) or split the vocabulary (`_VocabSlices`), whichever
  # moves fewer bytes; the rest sum the head's gradient.
  head_axes = tuple(a for a in embed_axes if a in split_axes)
  tensor_parts = parts(a for a in vocab_axes if a not in split_axes)
  sliced = splits_vocabulary(parts(head_axes), tensor_parts,
                             x_BTD.shape[0] * x_BTD.shape[1] // parts(split_axes),
                             w_DV.shape[1], x_BTD.dtype.itemsize, jnp.dtype(grad_dtype).itemsize)
  slice_axes, gather_axes = (head_axes, ()) if sliced else ((), head_axes)
  sum_axes = tuple(a for a in split_axes if a not in head_axes)
  vocab_entry = keep_axes(P(vocab_axes), split_axes)[0]
  varying = (lambda a: jax.lax.pcast(a, split_axes, to='varying')) if split_axes else (
      lambda a: a)
  seq_parts = parts(seq_axes)
  chunks = math.gcd(chunks, x_BTD.shape[1] // seq_parts)  # of this device's positions

  def local(x_BTD, w_DV, targets_BT, mask_BT):
    vocab = _VocabSlices(slice_axes, w_DV.shape[1], parts(slice_axes), tensor_parts)
    w_c = vocab.head(w_DV.astype(x_BTD.dtype))  # in the compute dtype, moved once
    if gather_axes:
      w_c = jax.lax.all_gather(w_c, gather_axes, axis=0, tiled=True)
    # Each chunk's rows from every device of the group, [rows, ...] flattened position-major
    # (a split of the positions, sequence parallelism's, stays a split of the rows): the
    # targets and mask gathered once (small), the activations a chunk at a time.
    by_chunk = lambda a: jnp.swapaxes(_by_chunk(chunks, a), 1, 2).reshape(
        chunks, -1, *a.shape[2:])
    targets_CR, mask_CR = (vocab.rows(by_chunk(a), axis=1) for a in (targets_BT, mask_BT))

    def chunk(carry, inputs):
      (objective, ce), dw_DV = carry
      x_rD, targets_R, mask_R, mask_r = inputs
      x_RD = vocab.rows(x_rD)
      logits_RV = vocab.mask_padding(jax.lax.with_sharding_constraint(
          jnp.einsum('rd,dv->rv', x_RD, w_c, preferred_element_type=jnp.float32),
          P(P.UNCONSTRAINED, logical_spec('act_vocab')[0])))
      lse_R = vocab.logsumexp(logits_RV)
      lse_r = vocab.own(lse_R)  # this device's rows' share of the sums
      target_R = vocab.local(targets_R)  # -1 where the target is another device's slice
      picked_R = jnp.where(target_R >= 0, jnp.take_along_axis(
          logits_RV, jnp.maximum(target_R, 0)[:, None], axis=-1)[:, 0], 0.)
      chunk_ce = jnp.sum(lse_r * mask_r) - jnp.sum(picked_R * mask_R)
      ce += chunk_ce
      objective += chunk_ce
      if z_loss:
        objective += z_loss * jnp.sum(lse_r ** 2 * mask_r)
      if not grads:
        return ((objective, ce), dw_DV), None
      onehot_RV = jax.nn.one_hot(target_R, logits_RV.shape[-1], dtype=jnp.float32)
      # d(log²Z)/dlogits = 2·logZ·softmax
      softmax_RV = jnp.exp(logits_RV - lse_R[:, None])
      if z_loss:
        softmax_RV *= 1 + 2 * z_loss * lse_R[:, None]
      dlogits_RV = ((softmax_RV - onehot_RV) * mask_R[:, None]).astype(x_rD.dtype)
      dw_DV += jnp.einsum('rd,rv->dv', x_RD, dlogits_RV, preferred_element_type=jnp.float32)
      # Summed over the slices, a gradient reduction (in grad_dtype); whole, x's dtype.
      dx_RD = jnp.einsum('rv,dv->rd', dlogits_RV, w_c,
                         preferred_element_type=grad_dtype if slice_axes else x_rD.dtype)
      return ((objective, ce), dw_DV), vocab.sum_rows(dx_RD).astype(x_rD.dtype)

    zeros_DV = jnp.zeros(w_c.shape, jnp.float32) if grads else jnp.float32(0)
    zeros_DV = varying(constrain(zeros_DV, None, 'vocab') if grads else zeros_DV)
    (totals, dw_DV), dx_CrD = jax.lax.scan(
        chunk, ((varying(jnp.float32(0)),) * 2, zeros_DV),
        (by_chunk(x_BTD), targets_CR, mask_CR, by_chunk(mask_BT)))
    totals = jax.lax.psum(totals, split_axes) if split_axes else totals
    if not grads:
      return totals, None, None
    B, T, D = x_BTD.shape
    dx_BTD = jnp.transpose(dx_CrD.reshape(chunks, T // chunks, B, D), (2, 1, 0, 3)).reshape(
        B, T, D)  # undoes by_chunk
    dw_DV = vocab.head_gradient(dw_DV.astype(grad_dtype))  # split as the head is
    if gather_axes:
      dw_DV = jax.lax.psum_scatter(dw_DV, gather_axes, scatter_dimension=0, tiled=True)
    if sum_axes:
      dw_DV = jax.lax.psum(dw_DV, sum_axes)
    return totals, dx_BTD, dw_DV

  if split_axes:
    rows = P(batch_axes or None, seq_axes or None)
    local = jax.shard_map(
        local, in_specs=(P(*rows, None), P(head_axes or None, vocab_entry), rows, rows),
        out_specs=((P(), P()), P(*rows, None), P(head_axes or None, vocab_entry)),
        axis_names=set(split_axes))
  totals, dx_BTD, dw_DV = local(x_BTD, constrain(w_DV, 'embed', 'vocab'), targets_BT, mask_BT)
  if grads:
    dw_DV = constrain(dw_DV, 'embed', 'vocab').astype(w_DV.dtype)
  return totals, dx_BTD, dw_DV


def splits_vocabulary(parts: int, tensor_parts: int, tokens: int, vocab: int, act_bytes: int,
                      grad_bytes: int) -> bool:
  """Whether the loss over `parts` devices that split both its rows (`tokens` on each) and
  the head's embed dimension gives each device a slice of the vocabulary for all their rows
  (`_VocabSlices`), or its own rows and the whole head: the first when it sends fewer bytes.
  Per device and embed unit, the rows gathered and their gradients reduce-scattered,
  (p−1)·tokens·(act + grad), plus the tensor sum of the other devices' rows' gradients where
  the vocabulary is split `tensor_parts` ways too, 2(t−1)/t·(p−1)·tokens·grad; against the
  head's gather and gradient's reduce-scatter, (p−1)/p·vocab/t·(act + grad). With rows
  enough (p·tokens > vocab/t) the head moves less, though its gradient is then summed whole
  along the embed dimension on each device before the reduce-scatter."""
  if parts == 1:
    return False
  t = tensor_parts
  rows = (parts - 1) * tokens * (act_bytes + grad_bytes + 2 * (t - 1) / t * grad_bytes)
  return rows < (parts - 1) / parts * vocab / t * (act_bytes + grad_bytes)


@dataclasses.dataclass(frozen=True)
class _VocabSlices:
  """The loss over `axes` (fsdp: the axes that split both the rows and the head's embed
  dimension), split by vocabulary: each of the `parts` devices takes all the group's rows and
  a slice of the vocabulary, whole along the embed dimension. It moves the head by an
  all-to-all (1/parts of a gather's bytes), keeps a 1/parts share of the head's gradient, complete
  for its slice, in place of a whole head's unreduced gradient, and moves the rows instead:
  the activations gathered and their gradients reduce-scattered, once per row. No axes: one
  device's loss, nothing moved.

  Where the compiler splits the vocabulary `tensor_parts` ways too (over tensor), a slice is
  a piece of each tensor part, so that the all-to-alls leave that split alone: the vocabulary
  is viewed as [tensor_parts, V/tensor_parts] and the minor dimension cut into `parts`
  pieces of `width` columns, padded where they do not divide it."""
  axes: tuple[str, ...]
  vocab: int
  parts: int
  tensor_parts: int

  @property
  def per_tensor_part(self) -> int:
    return self.vocab // self.tensor_parts

  @property
  def width(self) -> int:
    return -(-self.per_tensor_part // self.parts)

  def head(self, w_DV):
    """[D/parts, V] -> this device's slice, [D, tensor_parts · width]."""
    if not self.axes:
      return w_DV
    t, v = self.tensor_parts, self.per_tensor_part
    w_DtV = jnp.pad(w_DV.reshape(-1, t, v), ((0, 0), (0, 0), (0, self.width * self.parts - v)))
    w_DtpW = self._all_to_all(w_DtV.reshape(-1, t, self.parts, self.width), 2, 0)
    return w_DtpW.reshape(-1, t * self.width)

  def head_gradient(self, dw_DV):
    """The inverse of `head`: [D, tensor_parts · width] -> [D/parts, V]."""
    if not self.axes:
      return dw_DV
    t = self.tensor_parts
    dw_DtpW = self._all_to_all(dw_DV.reshape(-1, t, 1, self.width), 0, 2)
    dw_DtV = dw_DtpW.reshape(-1, t, self.parts * self.width)[..., :self.per_tensor_part]
    return dw_DtV.reshape(-1, self.vocab)

  def _all_to_all(self, a, split_axis: int, concat_axis: int):
    """`jax.lax.all_to_all(a, axes, split_axis, concat_axis, tiled=True)` made of
    `parts − 1` ppermutes: XLA's all-to-all gathers a dimension the compiler splits (the
    vocabulary over tensor) first; a ppermute moves each device's own piece as it is."""
    n, me = self.parts, jax.lax.axis_index(self.axes)
    pieces = jnp.stack(jnp.split(a, n, axis=split_axis))  # piece k goes to device k
    received = [pieces[me]]  # from the device `shift` places before this one, by shift
    for shift in range(1, n):
      sent = jax.lax.dynamic_index_in_dim(pieces, (me + shift) % n, keepdims=False)
      received.append(jax.lax.ppermute(sent, self.axes,
                                       [(i, (i + shift) % n) for i in range(n)]))
    # In the order of the devices they came from: device k's piece is received[(me − k) % n].
    by_source = jnp.roll(jnp.stack(received[::-1]), me + 1, axis=0)
    return jnp.concatenate(list(by_source), axis=concat_axis)

  def rows(self, a, axis: int = 0):
    """Every device's rows of `a`, in device order along `axis`."""
    return jax.lax.all_gather(a, self.axes, axis=axis, tiled=True) if self.axes else a

  def sum_rows(self, a_R):
    """The sum over the slices of a per-row partial, this device's rows of it."""
    return jax.lax.psum_scatter(a_R, self.axes, scatter_dimension=0, tiled=True) if (
        self.axes) else a_R

  def own(self, a_R):
    """This device's rows of a per-row value every device holds."""
    if not self.axes:
      return a_R
    rows = a_R.shape[0] // self.parts
    return jax.lax.dynamic_slice_in_dim(a_R, jax.lax.axis_index(self.axes) * rows, rows)

  def _start(self):
    """Where this device's piece starts within each tensor part."""
    return jax.lax.axis_index(self.axes) * self.width if self.axes else 0

  def local(self, tokens_R):
    """Token ids as columns of this device's slice, -1 for another slice's."""
    if not self.axes:
      return tokens_R
    tensor_part, column_R = jnp.divmod(tokens_R, self.per_tensor_part)
    column_R -= self._start()
    mine = (column_R >= 0) & (column_R < self.width)
    return jnp.where(mine, tensor_part * self.width + column_R, -1)

  def mask_padding(self, logits_RV):
    if self.width * self.parts == self.per_tensor_part:
      return logits_RV
    real_W = self._start() + jnp.arange(self.width) < self.per_tensor_part
    return jnp.where(jnp.tile(real_W, self.tensor_parts), logits_RV, -jnp.inf)

  def logsumexp(self, logits_RV):
    """log Σ exp over the whole vocabulary: each slice's, combined across the slices."""
    lse_R = jax.nn.logsumexp(logits_RV, axis=-1)
    return jax.nn.logsumexp(self.rows(lse_R[None]), axis=0) if self.axes else lse_R


def _chunked_loss_fwd(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT, mask_BT):
  totals, dx_BTD, dw_DV = _chunked_loss(chunks, grad_dtype, z_loss, x_BTD, w_DV, targets_BT,
                                        mask_BT, grads=True)
  return totals, (dx_BTD, dw_DV)


def _chunked_loss_bwd(chunks, grad_dtype, z_loss, residuals, g):
  dx_BTD, dw_DV = residuals
  g = g[0]  # the objective's; the cross-entropy output is for the log only
  return (g * dx_BTD).astype(dx_BTD.dtype), g * dw_DV, None, None


chunked_loss_sum.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
