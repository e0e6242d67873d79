"""Tensor-parallel projections whose sequence all-gather or reduce-scatter over 'tensor' runs
beside their matmuls (collective matmuls): model.collective_matmul, under sequence
parallelism (sharding.rules.act_seq=('tensor',)).

There the residual stream is split over the sequence on 'tensor'. Left to XLA, it is
all-gathered before the column-parallel projections (q, k, v; gate, up), and the partial sums
of the row-parallel ones (o; down) are reduce-scattered after them: each collective sits
between two dependent matmuls, fully exposed. Here the n devices of 'tensor' pass blocks of
the sequence round a ring instead, in n steps, each multiplying a block while `ppermute`
moves one on, so the transfers hide behind the matmuls.

The backward (custom_vjp) runs the same rings the other way round: an all-gather matmul's
input gradient is a reduce-scatter ring and a reduce-scatter matmul's an all-gather ring.
The weight gradients take the gathered operand, collected as its blocks pass round: the
activation's, riding with the input gradient's partial sums, or the output gradient's. The
residuals are the inputs, as `jaxllm.model.layers.project` keeps them.

Activations are [B, T, ...]; the einsum specs name their axes (e.g. 'btd,dnh->btnh'). Under
context parallelism (the seq rule) each of the S pieces of the sequence is a ring's sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import string

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.mesh import keep_axes, logical_spec
from jaxllm.parallel.rules import mesh_axes, parts

AXIS = 'tensor'


def _ring_size() -> int:
  """The devices of the ring: those of 'tensor' where the act_seq rule splits the residual
  stream's sequence over it alone (and the compiler, not a shard_map, manages it); else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if (mesh.empty or AXIS in mesh.manual_axes or
      mesh_axes(logical_spec('act_seq')[0]) != (AXIS,)):
    return 1
  return mesh.shape[AXIS]


def gathers(x, projections) -> bool:
  """Whether `all_gather_matmul` takes x and these (spec, w, w_names): a ring that divides
  x's sequence (not decoding's few new tokens), and weights split over tensor on output axes
  only (column-parallel), some of them at all."""
  split = [(_split_axes(spec, logical_spec(*names)), spec) for spec, _, names in projections]
  return (_divides(x) and any(axes for axes, _ in split) and
          all(axes <= set(spec.split('->')[1]) for axes, spec in split))


def scatters(spec: str, x, w_names) -> bool:
  """Whether `matmul_reduce_scatter` takes this projection: a ring that divides x's sequence,
  and a weight split over tensor on contracted axes only (row-parallel)."""
  split = _split_axes(spec, logical_spec(*w_names))
  return _divides(x) and bool(split) and not split & set(spec.split('->')[1])


def all_gather_matmul(x, projections, grad_dtype) -> tuple:
  """The products `jnp.einsum(spec, x, w)` of x [B, T, ...], its sequence split over tensor,
  with each weight of `projections` ((spec, w, w_names), ...: q, k and v, or gate and up),
  with the whole sequence: x's blocks go round the ring once for all of them. Products of
  weights split over tensor are split as they are; those of whole weights (K/V heads kept
  whole, see `jaxllm.parallel.rules.derive`) are whole on every device."""
  x, unfold = _in_pieces(x)
  piece = _free_letter(spec for spec, _, _ in projections)
  matmuls = tuple(_Matmul.of(spec, piece, names, w) for spec, w, names in projections)
  ys = _all_gather_matmul(matmuls, jnp.dtype(grad_dtype), x, tuple(w for _, w, _ in projections))
  return tuple(unfold(y, m.sequence_axis(m.out_axes)) for m, y in zip(matmuls, ys))


def matmul_reduce_scatter(spec: str, x, w, w_names, grad_dtype):
  """`jnp.einsum(spec, x, w)` summed over the tensor devices that split its contraction, the
  result's sequence split over them: the partial sums go round the ring."""
  x, unfold = _in_pieces(x)
  m = _Matmul.of(spec, _free_letter([spec]), w_names, w)
  return unfold(_matmul_reduce_scatter(m, jnp.dtype(grad_dtype), x, w),
                m.sequence_axis(m.out_axes))


@dataclasses.dataclass(frozen=True)
class _Matmul:
  """One projection as the ring runs it: its einsum spec, with an axis for the sequence's
  pieces (`_in_pieces`) before the sequence's; its weight's layouts (as stored, and in the
  ring: split over tensor alone, whole over fsdp as `project` gathers it) and stored dtype."""
  spec: str
  sequence: str      # the sequence's letter
  stored_spec: P
  w_spec: P
  w_dtype: jnp.dtype

  @classmethod
  def of(cls, spec: str, piece: str, w_names, w) -> _Matmul:
    x_axes, rest = spec.split(',')
    w_axes, out_axes = rest.split('->')
    sequence = x_axes[1]
    pieced = lambda axes: axes.replace(sequence, piece + sequence)
    stored = logical_spec(*w_names)
    return cls(f'{pieced(x_axes)},{w_axes}->{pieced(out_axes)}', sequence, stored,
               keep_axes(stored, {AXIS}), jnp.dtype(w.dtype))

  @property
  def x_axes(self) -> str:
    return self.spec.split(',')[0]

  @property
  def w_axes(self) -> str:
    return self.spec.split(',')[1].split('->')[0]

  @property
  def out_axes(self) -> str:
    return self.spec.split('->')[1]

  def sequence_axis(self, axes: str) -> int:
    return axes.index(self.sequence)

  @property
  def split_axes(self) -> set[str]:
    return _split_axes(self.spec, self.w_spec)

  def layout(self, axes: str, sequence_split: bool) -> P:
    """The tensor split of an operand with einsum axes `axes`: the weight's axes as the
    weight is split, the sequence over tensor if `sequence_split`."""
    w_entries = dict(zip(self.w_axes, self.w_spec))
    return P(*(AXIS if a == self.sequence and sequence_split else w_entries.get(a)
               for a in axes))

  def input_gradient(self, g, w):
    return jnp.einsum(f'{self.out_axes},{self.w_axes}->{self.x_axes}', g, w)

  def weight_gradient(self, x, g, grad_dtype):
    return jnp.einsum(f'{self.x_axes},{self.out_axes}->{self.w_axes}', x, g,
                      preferred_element_type=grad_dtype)


def _split_axes(spec: str, w_spec: P) -> set[str]:
  """The axes of the weight of einsum `spec`, laid out as `w_spec`, split over tensor."""
  return {a for a, e in zip(spec.split(',')[1].split('->')[0], w_spec) if AXIS in mesh_axes(e)}


def _free_letter(specs) -> str:
  used = set(''.join(specs))
  return next(a for a in string.ascii_letters if a not in used)


def _divides(x) -> bool:
  n = _ring_size()
  return n > 1 and x.shape[1] % (_sequence_pieces() * n) == 0


def _sequence_pieces() -> int:
  """How many pieces the seq rule (context parallelism) splits the sequence into here."""
  return parts(logical_spec('seq')[0], jax.sharding.get_abstract_mesh().shape)


def _in_pieces(x):
  """x [B, T, ...] as [B, S, T/S, ...], S the pieces the seq rule (context parallelism; 1
  without) splits the sequence into, so that the ring sees each piece split over tensor alone.
  A view: the seq rule's axes come before act_seq's, so nothing moves. With the function that
  merges a result's pieces (at `axis`) back."""
  B, T = x.shape[:2]
  S = _sequence_pieces()
  unfold = lambda y, axis: y.reshape(*y.shape[:axis - 1], S * y.shape[axis], *y.shape[axis + 1:])
  return x.reshape(B, S, T // S, *x.shape[2:]), unfold


def _in_ring_layout(matmul: _Matmul, w, dtype):
  """w cast to the compute dtype, then gathered over every axis but tensor: fsdp gathers move
  the compute dtype, and each ring step multiplies by the whole of it."""
  return jax.lax.with_sharding_constraint(w.astype(dtype), matmul.w_spec)


def _stored(matmul: _Matmul, dw):
  """A weight gradient split as the weight is stored, before its cast to the weight's dtype:
  its sum over the batch's devices moves the dtype it was made in (model.grad_reduce_dtype)."""
  return jax.lax.with_sharding_constraint(dw, matmul.stored_spec).astype(matmul.w_dtype)


def _ring(body, in_specs, out_specs):
  # Unchecked varying axes: the rings' loops carry zeros made inside (device-invariant to
  # the checker) that the first step fills with this device's blocks.
  return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                       check_vma=False)


# --- the rings (inside a shard_map manual over tensor) ----------------------------------------
# Each is a loop, one step per iteration: XLA then schedules each step's transfer around its
# matmul. Unrolled, it sent every block first and merged the steps' matmuls into one after.

def _to_next_device(n: int) -> list[tuple[int, int]]:
  return [(i, (i + 1) % n) for i in range(n)]


def _come_round(x, axis: int, use, acc):
  """`acc = use(acc, index, block)` for each block of the sequence (x's `axis`) that the
  ring's devices hold, this device's own first: n steps, each handing the block in hand on to
  the next device while `use` works on it."""
  n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)

  def step(s, carry):
    block, acc = carry
    return jax.lax.ppermute(block, AXIS, _to_next_device(n)), use(acc, (me - s) % n, block)

  block, acc = jax.lax.fori_loop(0, n - 1, step, (x, acc))
  return use(acc, (me + 1) % n, block)


def _summed_round(partial, passenger=None, axis: int = 0):
  """Σ over the ring's devices of `partial(index)` for this device's block of the sequence:
  each step adds this device's partial sum for a block to the running sum that arrived from
  the previous device, and hands it on; the last to arrive is this device's own block's, every
  other device's part in it. Each transfer hides behind the next partial's matmul.

  With a `passenger` (this device's block of another sequence, at `axis`, shaped as the
  sums), also that sequence whole: its blocks ride round with the sums, in the same transfers."""
  n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
  first = partial((me - 1) % n)
  if passenger is None:
    step = lambda s, total: partial((me - s - 1) % n) + jax.lax.ppermute(
        total, AXIS, _to_next_device(n))
    return jax.lax.fori_loop(1, n, step, first)

  def step(s, carry):
    pair, whole = carry  # [passenger's block, running sum]
    pair = jax.lax.ppermute(pair, AXIS, _to_next_device(n))
    return (pair.at[1].add(partial((me - s - 1) % n)),
            _put(whole, pair[0], (me - s) % n, axis))

  whole = _put(_whole(passenger, axis), passenger, me, axis)
  pair, whole = jax.lax.fori_loop(1, n, step, (jnp.stack([passenger, first]), whole))
  return pair[1], whole


def _block(x, index, size: int, axis: int):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _whole(block, axis: int):
  """Zeros for the whole sequence of which `block` (an array or its shape) is one block."""
  shape = list(block.shape)
  shape[axis] *= jax.lax.axis_size(AXIS)
  return jnp.zeros(shape, block.dtype)


def _put(whole, block, index, axis: int):
  """`whole` with `block` as its block `index` of the sequence (`axis`)."""
  return jax.lax.dynamic_update_slice_in_dim(whole, block, index * block.shape[axis], axis)


# --- all-gather, then matmul: column-parallel -------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _all_gather_matmul(matmuls, grad_dtype, x, ws):
  return _all_gather_matmul_fwd(matmuls, grad_dtype, x, ws)[0]


def _all_gather_matmul_fwd(matmuls, grad_dtype, x, ws):
  # The backward takes the weights as these matmuls took them (as `project` does): one fsdp
  # gather per pass whatever the remat policy.
  ws_c = tuple(_in_ring_layout(m, w, x.dtype) for m, w in zip(matmuls, ws))
  x_axes = matmuls[0].x_axes

  def forward(x, ws):
    def multiply(ys, index, block):
      return tuple(_put(y, jnp.einsum(m.spec, block, w), index, m.sequence_axis(m.out_axes))
                   for m, w, y in zip(matmuls, ws, ys))

    products = [jax.eval_shape(functools.partial(jnp.einsum, m.spec), x, w)
                for m, w in zip(matmuls, ws)]
    return _come_round(x, matmuls[0].sequence_axis(x_axes), multiply, tuple(
        _whole(y, m.sequence_axis(m.out_axes)) for m, y in zip(matmuls, products)))

  ys = _ring(forward, (matmuls[0].layout(x_axes, True), tuple(m.w_spec for m in matmuls)),
             tuple(m.layout(m.out_axes, False) for m in matmuls))(x, ws_c)
  return ys, (x, ws_c)


def _all_gather_matmul_bwd(matmuls, grad_dtype, residuals, gs):
  x, ws_c = residuals
  x_spec = matmuls[0].layout(matmuls[0].x_axes, True)

  def backward(x, ws, gs):
    gs = [g.astype(x.dtype) for g in gs]
    axis = matmuls[0].sequence_axis(matmuls[0].x_axes)
    at = lambda m, g, index: _block(g, index, x.shape[axis], m.sequence_axis(m.out_axes))
    split = [(m, w, g) for m, w, g in zip(matmuls, ws, gs) if m.split_axes]
    whole = [(m, w, g) for m, w, g in zip(matmuls, ws, gs) if not m.split_axes]
    # Weights split over tensor: x's gradient sums every device's part round the ring, and
    # x's blocks ride along for the weight gradients. Whole ones: every device holds all of
    # it, so each takes its own block's alone.
    partial = lambda index: sum(m.input_gradient(at(m, g, index), w) for m, w, g in split)
    dx, x_whole = _summed_round(partial, x, axis)
    me = jax.lax.axis_index(AXIS)
    dx += sum(m.input_gradient(at(m, g, me), w) for m, w, g in whole)
    return dx, tuple(m.weight_gradient(x_whole, g, grad_dtype) for m, g in zip(matmuls, gs))

  w_specs = tuple(m.w_spec for m in matmuls)
  dx, dws = _ring(backward,
                  (x_spec, w_specs, tuple(m.layout(m.out_axes, False) for m in matmuls)),
                  (x_spec, w_specs))(x, ws_c, gs)
  return dx, tuple(_stored(m, dw) for m, dw in zip(matmuls, dws))


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


# --- matmul, then reduce-scatter: row-parallel ------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul_reduce_scatter(matmul, grad_dtype, x, w):
  return _matmul_reduce_scatter_fwd(matmul, grad_dtype, x, w)[0]


def _matmul_reduce_scatter_fwd(matmul, grad_dtype, x, w):
  m, w_c = matmul, _in_ring_layout(matmul, w, x.dtype)

  def forward(x, w):
    axis = m.sequence_axis(m.x_axes)
    size = x.shape[axis] // jax.lax.axis_size(AXIS)
    return _summed_round(lambda index: jnp.einsum(m.spec, _block(x, index, size, axis), w))

  y = _ring(forward, (m.layout(m.x_axes, False), m.w_spec),
            m.layout(m.out_axes, True))(x, w_c)
  return y, (x, w_c)


def _matmul_reduce_scatter_bwd(matmul, grad_dtype, residuals, g):
  x, w_c = residuals
  m = matmul

  def backward(x, w, g):
    x_axis, g_axis = m.sequence_axis(m.x_axes), m.sequence_axis(m.out_axes)

    def multiply(acc, index, block):
      dx, g_whole = acc
      return (_put(dx, m.input_gradient(block, w), index, x_axis),
              _put(g_whole, block, index, g_axis))

    g = g.astype(x.dtype)
    dx, g_whole = _come_round(g, g_axis, multiply, (jnp.zeros_like(x), _whole(g, g_axis)))
    return dx, m.weight_gradient(x, g_whole, grad_dtype)

  x_spec = m.layout(m.x_axes, False)
  dx, dw = _ring(backward, (x_spec, m.w_spec, m.layout(m.out_axes, True)),
                 (x_spec, m.w_spec))(x, w_c, g)
  return dx, _stored(m, dw)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)
