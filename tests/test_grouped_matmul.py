"""The grouped matmul (model.grouped_matmul). Its Pallas-Triton kernels run in Pallas'
interpreter on the CPU against a per-group numpy loop: the product and the gradients of both
inputs, with uneven, empty and single groups, padding rows that hold NaN, group edges off the
row tile and K and N off theirs, in fp32 and bf16. The program they make for an H100, compiled
without one, runs them as Triton kernels and never expands the groups densely as XLA's
`ragged_dot` does."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import backends
from jaxllm.cost import hlo
from jaxllm.cost.hardware import PROFILES
from jaxllm.model import grouped_matmul_triton as gmt
from jaxllm.model.grouped_matmul import grouped_matmul

# Small enough for the interpreter, off the 16-row/column tiles in every dimension.
M, K, N, G = 45, 40, 24, 5
SMALL = gmt.Tiles(16, 16, 16)
INTERPRETED = gmt.Plan(SMALL, SMALL, SMALL, interpret=True)
GROUP_SIZES = {
    # edges at 7 and 27 (inside tiles) and 32 (on one); an empty group inside and one last;
    # 13 padding rows
    'uneven': [7, 0, 20, 5, 0],
    'no_padding': [0, 16, 13, 1, 15],  # an empty first group, a one-row group, rows fill M
    'one_group': [0, 0, 0, 30, 0],
    'all_padding': [0, 0, 0, 0, 0],
}


def per_group_loop(x_MK, w_GKN, group_sizes, dy_MN):
  """out = x·w[g] row group by row group, and the gradients of sum(out · dy) with respect to
  x and w, in float64; padding rows zero."""
  x_MK, w_GKN, dy_MN = (np.asarray(a, np.float64) for a in (x_MK, w_GKN, dy_MN))
  out, dx, dw = np.zeros((M, N)), np.zeros((M, K)), np.zeros((G, K, N))
  start = 0
  for g, size in enumerate(group_sizes):
    rows = slice(start, start + size)
    out[rows] = x_MK[rows] @ w_GKN[g]
    dx[rows] = dy_MN[rows] @ w_GKN[g].T
    dw[g] = x_MK[rows].T @ dy_MN[rows]
    start += size
  return out, dx, dw


@functools.cache
def interpreted_vjp(dtype):
  """The kernels' product and pullback of dy, compiled once per dtype (group sizes are
  traced, so every case reuses it)."""
  def run(x_MK, w_GKN, group_sizes_G, dy_MN):
    out, pullback = jax.vjp(lambda x, w: gmt.grouped_matmul(x, w, group_sizes_G, INTERPRETED),
                            x_MK, w_GKN)
    return (out, *pullback(dy_MN))
  return jax.jit(run)


def inputs(dtype, group_sizes, seed=0):
  """x, w and dy in `dtype`; x's padding rows hold NaN, which must reach no result."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(dtype)
  x[sum(group_sizes):] = np.nan
  return (x, rng.standard_normal((G, K, N)).astype(dtype),
          rng.standard_normal((M, N)).astype(dtype))


@pytest.mark.parametrize('dtype', [np.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('case', GROUP_SIZES)
def test_kernels_match_a_per_group_loop(dtype, case):
  group_sizes = GROUP_SIZES[case]
  x, w, dy = inputs(dtype, group_sizes)
  got = interpreted_vjp(dtype)(x, w, np.array(group_sizes, np.int32), dy)
  want = per_group_loop(x, w, group_sizes, dy)
  # The error bound of a product of `dtype` inputs accumulated in fp32 and rounded once to
  # `dtype`: a rounding of the result, plus fp32 rounding over the contraction's length times
  # the sum of the products' magnitudes. Padding rows (magnitude 0) must be exact zeros.
  magnitude = per_group_loop(np.abs(np.nan_to_num(x)), np.abs(w), group_sizes, np.abs(dy))
  contraction = {'out': K, 'dx': N, 'dw': M}
  for name, got_, want_, magnitude_ in zip(('out', 'dx', 'dw'), got, want, magnitude):
    assert got_.dtype == dtype, name
    got_ = np.asarray(got_, np.float64)
    bound = (jnp.finfo(dtype).eps * np.abs(want_)
             + contraction[name] * np.finfo(np.float32).eps * magnitude_)
    worst = np.max(np.abs(got_ - want_) - bound)
    assert np.all(np.abs(got_ - want_) <= bound), f'{name}: {worst} beyond the bound'


def test_triton_through_the_interface_off_gpu():
  """`implementation='triton'` with the tiles it picks itself runs in Pallas' interpreter on
  the CPU, and equals XLA's ragged_dot."""
  group_sizes = np.array(GROUP_SIZES['uneven'], np.int32)
  x, w, _ = inputs(np.float32, group_sizes.tolist())
  x[group_sizes.sum():] = 1.0  # ragged_dot's padding rows are zero only for finite inputs
  run = jax.jit(grouped_matmul, static_argnames='implementation')
  got = run(x, w, group_sizes, implementation='triton')
  np.testing.assert_allclose(got, run(x, w, group_sizes, implementation='xla'),
                             rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got)[group_sizes.sum():])


@pytest.mark.parametrize('case', GROUP_SIZES)
def test_row_schedule_writes_each_row_once(case):
  """Each row is written by exactly one visit, of its own group (G: padding), inside the
  visit's tile; the schedule fits its static length."""
  group_sizes = GROUP_SIZES[case]
  tile, group, lo, hi = map(np.asarray, jax.jit(gmt.row_schedule, static_argnums=(1, 2))(
      jnp.array(group_sizes, jnp.int32), M, 16))
  owner = np.repeat(np.arange(G + 1), group_sizes + [M - sum(group_sizes)])
  writes = np.zeros(M, int)
  for t, g, a, b in zip(tile, group, lo, hi):
    assert 16 * t <= a and b <= 16 * (t + 1) or a == b
    writes[a:b] += 1
    assert np.all(owner[a:b] == g)
  np.testing.assert_array_equal(writes, 1)


def test_triton_kernels_read_from_a_printed_call():
  """A Pallas-Triton custom call as a compiled program prints it: the kernel's name, grid and
  shapes, read around the Triton module its backend config embeds (an escaped string)."""
  text = '\n'.join([
      'ENTRY %main (x: bf16[64,32], w: bf16[4,32,16]) -> bf16[64,16] {',
      '  %x = bf16[64,32]{1,0} parameter(0)',
      '  %w = bf16[4,32,16]{2,1,0} parameter(1)',
      '  ROOT %pallas_call.1 = bf16[64,16]{1,0} custom-call(%x, %w), '
      'custom_call_target="__gpu$xla.gpu.triton", '
      'operand_layout_constraints={bf16[64,32]{1,0}, bf16[4,32,16]{2,1,0}}, '
      'backend_config={debug = false, grid_x = 1 : i32, grid_y = 8 : i32, grid_z = 1 : i32, '
      r'ir = "ML\EFR\22 name = \22decoy\22, grid_y = 99 \\", '
      'name = "grouped_matmul_forward", num_stages = 4 : i32, num_warps = 4 : i32}',
      '}'])
  [kernel] = hlo.triton_kernels(text)
  assert (kernel.name, kernel.count, kernel.grid) == ('grouped_matmul_forward', 1, (1, 8, 1))
  assert kernel.operands == [('bf16', (64, 32)), ('bf16', (4, 32, 16))]
  assert kernel.result == [('bf16', (64, 16))]


@pytest.mark.skipif(not backends.cuda_plugin_installed(),
                    reason='needs JAX\'s CUDA plugin: pip install -e ".[dev]"')
def test_h100_program_runs_the_kernels_without_dense_expansion():
  """On one H100 (compiled here), the product and both gradients of a 16-expert layer are the
  three Triton kernels, with the shapes of the problem and no XLA matmul; XLA's ragged_dot
  makes a dense [rows, experts, K] value and 16× the matmul FLOPs instead."""
  rows, k, n, groups = 4096, 2048, 768, 16
  gpu = jax.sharding.SingleDeviceSharding(backends.gpu_devices(PROFILES['h100-nvlink'], 1)[0])
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=gpu) for shape, dtype in (
      ((rows, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16), ((groups,), jnp.int32),
      ((rows, n), jnp.bfloat16))]

  def compiled(implementation):
    def run(x_MK, w_GKN, group_sizes_G, dy_MN):
      out, pullback = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes_G, implementation),
                              x_MK, w_GKN)
      return (out, *pullback(dy_MN))
    return jax.jit(run).lower(*args).compile()

  dense_bytes = rows * groups * k * 2
  useful = 3 * 2 * rows * k * n  # the product and the two gradients
  xla = compiled('xla')
  assert hlo.dot_flops(xla.as_text()) >= groups * useful
  assert xla.memory_analysis().temp_size_in_bytes >= dense_bytes

  triton = compiled('triton')
  text = triton.as_text()
  kernels = {kernel.name: kernel for kernel in hlo.triton_kernels(text)}
  assert sorted(kernels) == sorted(gmt.KERNELS)
  assert hlo.dot_flops(text) == 0
  assert triton.memory_analysis().temp_size_in_bytes < dense_bytes / 16
  shapes = {name: ([dims for _, dims in kernel.operands[-2:]], kernel.result[0])
            for name, kernel in kernels.items()}
  assert shapes == {
      gmt.FORWARD: ([(rows, k), (groups, k, n)], ('bf16', (rows, n))),
      gmt.INPUT_GRAD: ([(rows, n), (groups, k, n)], ('bf16', (rows, k))),
      gmt.WEIGHT_GRAD: ([(rows, k), (rows, n)], ('bf16', (groups, k, n)))}
  costs = [gmt.call_cost(kernel.name, [dims for _, dims in kernel.operands],
                         kernel.result[0][1], 2) for kernel in kernels.values()]
  assert sum(flops for flops, _ in costs) == useful


@pytest.mark.skipif(not backends.cuda_plugin_installed(),
                    reason='needs JAX\'s CUDA plugin: pip install -e ".[dev]"')
def test_h100_kernels_inside_a_checking_shard_map():
  """Inside a `shard_map` that checks how values vary over its axes, the kernels' results vary
  as their inputs do, and a weight the same on both devices gets its gradient summed over
  them: an all-reduce of dw's shape. (Compiled for 2 H100s: Pallas' interpreter, which the
  CPU runs, cannot run inside such a `shard_map` in jax 0.10.)"""
  rows, k, n, groups = 256, 64, 32, 4
  mesh = jax.sharding.Mesh(np.array(backends.gpu_devices(PROFILES['h100-nvlink'], 2)),
                           ('fsdp',), axis_types=(jax.sharding.AxisType.Explicit,))
  P = jax.sharding.PartitionSpec
  specs = (P('fsdp'), P(), P('fsdp'))
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
          for (shape, dtype), spec in zip((((2 * rows, k), jnp.bfloat16),
                                           ((groups, k, n), jnp.bfloat16),
                                           ((2 * groups,), jnp.int32)), specs)]

  def loss(x_MK, w_GKN, group_sizes_G):
    out = jax.shard_map(lambda x, w, sizes: grouped_matmul(x, w, sizes, 'triton'), mesh=mesh,
                        in_specs=specs, out_specs=P('fsdp'), check_vma=True)(
                            x_MK, w_GKN, group_sizes_G)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
  assert sorted(kernel.name for kernel in hlo.triton_kernels(text)) == sorted(gmt.KERNELS)
  sums = [c for c in hlo.collectives(text, {'fsdp': 2}, cpu=False) if c.kind == 'all-reduce']
  assert any(c.bytes_per_call >= groups * k * n * 2 for c in sums), sums
