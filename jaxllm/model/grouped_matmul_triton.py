"""The grouped matmul as Pallas-Triton kernels (implementation 'triton'), Hopper's default.

Three kernels, tied together by a custom VJP, each named in the program (the Triton custom
call's `name`, `KERNELS`):
- forward, `out[r] = x[r] @ w[g(r)]`, and input gradient, `dx[r] = dy[r] @ w[g(r)]ᵀ`: ragged in
  the rows. The rows are cut into tiles of `block_m`; a schedule made from the group sizes
  (`row_schedule`) visits each tile once for every group whose rows it holds, so a tile that
  straddles a group edge is computed once per group and each visit writes only its group's
  rows. The padding rows past the groups' total are one more "group" whose visits write zeros.
- weight gradient, `dw[g] = x[rows of g]ᵀ @ dy[rows of g]`: ragged in the contraction; one
  program per group and output tile walks its group's rows.

Products accumulate in fp32 and come out in the inputs' dtype. On NVIDIA GPUs the kernels are
Triton; on any other platform (the CPU) the same kernels run in Pallas' interpreter, slowly:
that is how they are tested without a GPU. The interpreter cannot run inside a `shard_map` that
checks how values vary (check_vma=True) in jax 0.10; Triton can.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FORWARD, INPUT_GRAD, WEIGHT_GRAD = KERNELS = (
    'grouped_matmul_forward', 'grouped_matmul_input_grad', 'grouped_matmul_weight_grad')


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's launch shape. Blocks are named by the forward problem's dimensions
  (x[M, K] @ w[K, N]) in every kernel: the input gradient's output tile is block_m × block_k and
  it contracts N in steps of block_n; the weight gradient's is block_k × block_n, contracting
  the rows in steps of block_m. Powers of two, at least 16 (Triton's smallest dot)."""
  block_m: int
  block_k: int
  block_n: int
  num_warps: int = 4
  num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class Plan:
  """The tiles of the three kernels, and whether they run in Pallas' interpreter (None: on any
  platform but CUDA)."""
  forward: Tiles
  input_grad: Tiles
  weight_grad: Tiles
  interpret: bool | None = None


def _block(size: int, most: int) -> int:
  """The power of two at least 16 that covers `size`, capped at `most`."""
  return max(16, min(most, pl.next_power_of_2(size)))


def _rows_block(rows: int, groups: int) -> int:
  """Row tile of the ragged-row kernels. A group edge inside a tile costs one more visit of
  that tile (up to `groups` extra tiles in all), so tiles shrink when groups are short: 128
  from 512 rows a group on average, 64 from 128, else 32."""
  per_group = rows / max(1, groups)
  return _block(rows, 128 if per_group >= 512 else 64 if per_group >= 128 else 32)


def choose_plan(rows: int, k: int, n: int, groups: int, dtype) -> Plan:
  """Tiles for H100s from the problem's shape: 128-wide output tiles, contraction steps of 64
  bf16 (32 fp32) values, 4 pipeline stages (about 128 KiB of the 227 KiB shared memory a block
  may take). Heuristics, not tuned on a device."""
  step = 64 if jnp.dtype(dtype).itemsize <= 2 else 32
  stages = 4
  block_m = _rows_block(rows, groups)
  return Plan(
      forward=Tiles(block_m, _block(k, step), _block(n, 128), num_stages=stages),
      input_grad=Tiles(block_m, _block(k, 128), _block(n, step), num_stages=stages),
      weight_grad=Tiles(_block(rows, step), _block(k, 128), _block(n, 128), num_stages=stages))


def row_schedule(group_sizes_G, rows: int, block_m: int):
  """The visits of the ragged-row kernels: for visit v, the row tile it computes, the group
  whose rows of that tile it writes (G stands for the padding rows past the groups' total,
  written as zeros) and those rows, [lo, hi). There are at most cdiv(rows, block_m) + G
  visits (each of the G + 1 spans adds one at most beyond the tiles); unused ones have
  lo == hi and do nothing. Empty groups get no visit."""
  groups = group_sizes_G.shape[0]
  visits = pl.cdiv(rows, block_m) + groups
  ends_S = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), rows)
  ends_S = jnp.concatenate([ends_S, jnp.array([rows], jnp.int32)])      # + the padding span
  starts_S = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_S[:-1]])
  first_S = starts_S // block_m
  tiles_S = jnp.where(ends_S > starts_S, (ends_S - 1) // block_m - first_S + 1, 0)
  visits_end_S = jnp.cumsum(tiles_S)
  v_V = jnp.arange(visits, dtype=jnp.int32)
  # The span of visit v: how many spans' visits end at or before it (one fusion; a binary
  # search would be a loop of small kernels).
  span_V = jnp.minimum(jnp.sum(visits_end_S[None, :] <= v_V[:, None], axis=1), groups)
  tile_V = first_S[span_V] + v_V - (visits_end_S[span_V] - tiles_S[span_V])
  used_V = v_V < visits_end_S[-1]
  tile_V = jnp.where(used_V, tile_V, 0).astype(jnp.int32)
  lo_V = jnp.where(used_V, jnp.maximum(starts_S[span_V], tile_V * block_m), 0)
  hi_V = jnp.where(used_V, jnp.minimum(ends_S[span_V], (tile_V + 1) * block_m), 0)
  return tile_V, span_V.astype(jnp.int32), lo_V.astype(jnp.int32), hi_V.astype(jnp.int32)


def _ragged_rows_kernel(tile_ref, group_ref, lo_ref, hi_ref, a_ref, w_ref, out_ref, *,
                        block_m: int, block_c: int, block_o: int, transpose_w: bool):
  """One visit × one output-column tile of `out[r] = a[r] @ w[g]` (forward: a = x, w[g] is
  [C, O]) or `a[r] @ w[g]ᵀ` (input gradient: a = dy, w[g] is [O, C]); C is contracted."""
  groups = w_ref.shape[0]
  contract, cols = a_ref.shape[1], out_ref.shape[1]
  col, v = pl.program_id(0), pl.program_id(1)
  tile, group, lo, hi = tile_ref[v], group_ref[v], lo_ref[v], hi_ref[v]
  row0, col0 = tile * block_m, col * block_o
  rows_M = row0 + jnp.arange(block_m)
  mine_M = (rows_M >= lo) & (rows_M < hi)  # this visit's rows: its group's, in bounds
  in_O = _inside(col0, block_o, cols)
  out_ref = out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_o)]

  @pl.when((lo < hi) & (group < groups))
  def _multiply():
    def step(i, acc_MO):
      c0 = i * block_c
      in_C = _inside(c0, block_c, contract)
      a_MC = _load(a_ref.at[pl.ds(row0, block_m), pl.ds(c0, block_c)], mine_M, in_C)
      if transpose_w:
        w_OC = _load(w_ref.at[group, pl.ds(col0, block_o), pl.ds(c0, block_c)], in_O, in_C)
        return acc_MO + plgpu.dot(a_MC, w_OC, trans_b=True)
      w_CO = _load(w_ref.at[group, pl.ds(c0, block_c), pl.ds(col0, block_o)], in_C, in_O)
      return acc_MO + plgpu.dot(a_MC, w_CO)

    acc_MO = jax.lax.fori_loop(0, pl.cdiv(contract, block_c), step,
                               jnp.zeros((block_m, block_o), jnp.float32))
    _store(out_ref, acc_MO, mine_M, in_O)

  @pl.when((lo < hi) & (group == groups))
  def _padding():
    _store(out_ref, jnp.zeros((block_m, block_o), jnp.float32), mine_M, in_O)


def _inside(start, block: int, size: int):
  """Which of the `block` indices from `start` fall below `size`; None where all must (the
  size a multiple of the block), so whole tiles load and store unmasked."""
  return None if size % block == 0 else start + jnp.arange(block) < size


def _mask(rows, cols, shape):
  """The mask of a tile of `shape` from its rows' and columns' masks (None: all)."""
  if rows is None and cols is None:
    return None
  rows = jnp.full((shape[0],), True) if rows is None else rows
  cols = jnp.full((shape[1],), True) if cols is None else cols
  return rows[:, None] & cols[None, :]


def _load(ref, rows, cols):
  """A tile, zero outside the masks (rows of other groups, past the array's edges)."""
  mask = _mask(rows, cols, ref.shape)
  return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _store(ref, value, rows, cols):
  plgpu.store(ref, value.astype(ref.dtype), mask=_mask(rows, cols, value.shape))


def _ragged_rows(a_MC, w, group_sizes_G, tiles: Tiles, interpret: bool | None,
                 transpose_w: bool):
  """`a_MC @ w[g]` per row group (forward: w is [G, C, O]) or `a_MC @ w[g]ᵀ` (input gradient:
  w is [G, O, C]), padding rows zero."""
  rows, _ = a_MC.shape
  cols = w.shape[1] if transpose_w else w.shape[2]
  block_m = tiles.block_m
  block_c, block_o = ((tiles.block_n, tiles.block_k) if transpose_w
                      else (tiles.block_k, tiles.block_n))
  schedule = row_schedule(group_sizes_G, rows, block_m)
  kernel = functools.partial(_ragged_rows_kernel, block_m=block_m, block_c=block_c,
                             block_o=block_o, transpose_w=transpose_w)
  call = lambda interpret: pl.pallas_call(
      kernel, out_shape=_result((rows, cols), a_MC.dtype, a_MC),
      grid=(pl.cdiv(cols, block_o), schedule[0].shape[0]),
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret, name=INPUT_GRAD if transpose_w else FORWARD,
  )(*schedule, a_MC, w)
  return _on_platform(call, interpret)


def _weight_grad_kernel(lo_ref, hi_ref, x_ref, dy_ref, dw_ref, *, block_m: int, block_k: int,
                        block_n: int):
  """One group × one [block_k, block_n] tile of `dw[g] = x[lo:hi]ᵀ @ dy[lo:hi]`."""
  k_all, n_all = x_ref.shape[1], dy_ref.shape[1]
  kt, nt, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = lo_ref[group], hi_ref[group]
  k0, n0 = kt * block_k, nt * block_n
  in_K = _inside(k0, block_k, k_all)
  in_N = _inside(n0, block_n, n_all)

  def step(i, acc_KN, last: bool = False):
    r0 = lo + i * block_m
    mine_M = (r0 + jnp.arange(block_m)) < hi if last else None
    x_MK = _load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], mine_M, in_K)
    dy_MN = _load(dy_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], mine_M, in_N)
    return acc_KN + plgpu.dot(x_MK, dy_MN, trans_a=True)

  # Whole steps of block_m rows, then the group's last rows under a mask: both operands are
  # masked so no other group's rows (nor padding, which may hold anything) enter the sum.
  whole = (hi - lo) // block_m
  acc_KN = jax.lax.fori_loop(0, whole, step, jnp.zeros((block_k, block_n), jnp.float32))
  acc_KN = jax.lax.cond(lo + whole * block_m < hi,
                        lambda acc: step(whole, acc, last=True), lambda acc: acc, acc_KN)
  _store(dw_ref.at[group, pl.ds(k0, block_k), pl.ds(n0, block_n)], acc_KN, in_K, in_N)


def _weight_grad(x_MK, dy_MN, group_sizes_G, tiles: Tiles, interpret: bool | None, dtype):
  """dw[G, K, N]: each group's rows of x, transposed, times the same rows of dy."""
  (rows, k), n = x_MK.shape, dy_MN.shape[1]
  groups = group_sizes_G.shape[0]
  hi_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), rows)
  lo_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), hi_G[:-1]])
  kernel = functools.partial(_weight_grad_kernel, block_m=tiles.block_m,
                             block_k=tiles.block_k, block_n=tiles.block_n)
  call = lambda interpret: pl.pallas_call(
      kernel, out_shape=_result((groups, k, n), dtype, x_MK),
      grid=(pl.cdiv(k, tiles.block_k), pl.cdiv(n, tiles.block_n), groups),
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret, name=WEIGHT_GRAD,
  )(lo_G, hi_G, x_MK, dy_MN)
  return _on_platform(call, interpret)


def _result(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """A kernel's result type: varying over the manual mesh axes its input `like` varies over
  (inside a `shard_map` that checks how values vary, a kernel must say so)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _varying_alike(*arrays):
  """`arrays`, each made to vary over every manual mesh axis any of them varies over, so the
  kernels' inputs and results agree (outside a `shard_map`: unchanged). A weight that is the
  same on every device of such an axis gets its gradient summed over them (the transpose of
  the cast)."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying
  axes = frozenset().union(*map(varying, arrays))
  return [jax.lax.pcast(a, tuple(sorted(axes - varying(a))), to='varying')
          if axes - varying(a) else a for a in arrays]


def _on_platform(call, interpret: bool | None):
  """`call(interpret)`: Triton where the program is lowered for CUDA, Pallas' interpreter on
  any other platform, unless `interpret` says which."""
  if interpret is not None:
    return call(interpret)
  return jax.lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x_MK, w_GKN, group_sizes_G, plan: Plan):
  return _ragged_rows(x_MK, w_GKN, group_sizes_G, plan.forward, plan.interpret, False)


def _forward(x_MK, w_GKN, group_sizes_G, plan: Plan):
  return _grouped_matmul(x_MK, w_GKN, group_sizes_G, plan), (x_MK, w_GKN, group_sizes_G)


def _backward(plan: Plan, residuals, dy_MN):
  x_MK, w_GKN, group_sizes_G = residuals
  dy_MN = dy_MN.astype(x_MK.dtype)
  dx_MK = _ragged_rows(dy_MN, w_GKN, group_sizes_G, plan.input_grad, plan.interpret, True)
  dw_GKN = _weight_grad(x_MK, dy_MN, group_sizes_G, plan.weight_grad, plan.interpret,
                        w_GKN.dtype)
  return dx_MK, dw_GKN, None


_grouped_matmul.defvjp(_forward, _backward)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, plan: Plan | None = None):
  """out[M, N] = x_MK's rows of group g times w_GKN[g] (see `jaxllm.model.grouped_matmul`),
  in the inputs' common dtype; `plan` defaults to `choose_plan`'s for the shapes."""
  dtype = jnp.result_type(x_MK, w_GKN)
  x_MK, w_GKN = x_MK.astype(dtype), w_GKN.astype(dtype)
  rows, k = x_MK.shape
  groups, _, n = w_GKN.shape
  plan = plan or choose_plan(rows, k, n, groups, dtype)
  return _grouped_matmul(*_varying_alike(x_MK, w_GKN, group_sizes_G.astype(jnp.int32)), plan)


def kernel_cost(name: str, rows: int, k: int, n: int, groups: int, itemsize: int
                ) -> tuple[float, float] | None:
  """(useful FLOPs, bytes) of one call of kernel `name` (one of `KERNELS`; None for any other
  name) in the problem x[rows, k] @ w[groups, k, n], in a dtype of `itemsize` bytes. FLOPs
  count every row as in a group (which rows are padding is known only when it runs); bytes
  are each operand read and the result written once: the kernels read the weights again for
  each row tile of their group, and x or dy for each output-column tile, mostly from L2."""
  if name not in KERNELS:
    return None
  operands = {FORWARD: rows * k + groups * k * n, INPUT_GRAD: rows * n + groups * k * n,
              WEIGHT_GRAD: rows * k + rows * n}[name]
  result = {FORWARD: rows * n, INPUT_GRAD: rows * k, WEIGHT_GRAD: groups * k * n}[name]
  return 2.0 * rows * k * n, float((operands + result) * itemsize)


def call_cost(name: str, operands: list[tuple[int, ...]], result: tuple[int, ...],
              itemsize: int) -> tuple[float, float] | None:
  """`kernel_cost` of a call as a compiled program shows it: the kernel's name (the Triton
  custom call's `name`), its operands' dims, in the order the kernels take them (schedule
  arrays first), and its result's."""
  if name not in KERNELS:
    return None
  if name == WEIGHT_GRAD:   # (lo_G, hi_G, x[M, K], dy[M, N]) -> dw[G, K, N]
    groups, k, n = result
    return kernel_cost(name, operands[2][0], k, n, groups, itemsize)
  groups, k, n = operands[-1]  # (tile, group, lo, hi, x or dy, w[G, K, N])
  return kernel_cost(name, result[0], k, n, groups, itemsize)
