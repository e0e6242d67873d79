"""The grouped GEMM's kernels on the device at hand: what they compute against an fp32
reference, and how fast, beside a dense GEMM of the same useful FLOPs.

    python benchmarks/grouped_matmul.py [--reps 10] [--shapes qwen3_ep8,qwen3_one_gpu]

For each shape (the experts' gate/up and down projections of a config, as one GPU of its mesh
sees them), bf16 inputs, rows routed to the groups by a skewed router (seeded: a few groups
hold most rows, some none) and padding rows past them, as the capacity buffer has:
- **numerics**: the Triton kernels' product, input gradient and weight gradient against a
  per-group loop in fp32, as a relative Frobenius error beside the same loop's in bf16 with
  fp32 accumulation (what any bf16 GEMM writes); padding rows and empty groups must come out
  exactly zero. A kernel more than 1.5× the bf16 loop's error fails the run (exit status 1).
- **speed**: each kernel's time (`--reps` calls back to back, the median of 3 rounds, after a
  warm-up) and useful TFLOP/s, beside XLA's `ragged_dot` (which NVIDIA GPUs run as a dense
  masked GEMM: groups × the FLOPs) and a dense GEMM of the rows in groups (cuBLAS through XLA:
  the rate the timing model gives the kernels).

On a CPU the kernels run in Pallas' interpreter: use `--shapes tiny` there.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from timing import seconds_per_call  # benchmarks/ is on the path when this runs as a script
from jaxllm.backends import start_backends
from jaxllm.model import grouped_matmul_triton as gmt

# (rows in the buffer, rows routed, groups, [(K, N) of each projection]). qwen3_ep8:
# configs/qwen3_30b_a3b.py on 8 GPUs, experts over fsdp=8: 16 experts a GPU, 4,096 tokens a
# GPU × top-8 routed to them on average, a buffer of capacity 1.25 × that. qwen3_one_gpu: its
# 128 experts on one GPU, 8,192 tokens × top-8.
SHAPES = {
    'qwen3_ep8': (40_960, 32_768, 16, [(2048, 768), (768, 2048)]),
    'qwen3_one_gpu': (65_536, 65_536, 128, [(2048, 768), (768, 2048)]),
    'tiny': (300, 240, 5, [(64, 48)]),
}


def group_sizes(routed: int, groups: int, seed: int = 0) -> np.ndarray:
  """`routed` rows over `groups` groups, as a skewed router sends them: popularity drawn from a
  Dirichlet(0.3), so a few groups hold most rows and some may hold none."""
  rng = np.random.default_rng(seed)
  return rng.multinomial(routed, rng.dirichlet(np.full(groups, 0.3))).astype(np.int32)


def per_group(x, w, dy, sizes, dtype, accumulate):
  """(out, dx, dw) of out = x·w[g] by row group, in `dtype` with `accumulate` accumulation:
  each group's rows gathered into a [groups, largest group, ·] block (zero rows beyond its
  size), so one batched GEMM of each kind does every group (a GEMM per group would compile
  once per group size)."""
  ends = np.cumsum(sizes)
  starts, widest = ends - sizes, max(int(sizes.max()), 1)
  index_GR = starts[:, None] + np.arange(widest)[None, :]
  valid_GR = jnp.asarray(np.arange(widest)[None, :] < sizes[:, None])
  index_GR = jnp.asarray(np.minimum(index_GR, x.shape[0] - 1))

  @jax.jit
  def loop(x, w, dy):
    gather = lambda a: jnp.where(valid_GR[..., None], a[index_GR], 0).astype(dtype)
    x_GRK, dy_GRN, w = gather(x), gather(dy), w.astype(dtype)
    mm = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=accumulate,
                                       precision=jax.lax.Precision.HIGHEST).astype(dtype)
    out_GRN, dx_GRK = mm('grk,gkn->grn', x_GRK, w), mm('grn,gkn->grk', dy_GRN, w)
    dw = mm('grk,grn->gkn', x_GRK, dy_GRN)
    scatter = lambda a_GRC: jnp.zeros((x.shape[0], a_GRC.shape[-1]), dtype).at[
        jnp.where(valid_GR, index_GR, x.shape[0])].set(a_GRC, mode='drop')
    return scatter(out_GRN), scatter(dx_GRK), dw
  return loop(x, w, dy)


def relative_error(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check_shape(name: str, reps: int) -> bool:
  rows, routed, groups, projections = SHAPES[name]
  sizes = group_sizes(routed, groups)
  sizes_dev = jnp.asarray(sizes)
  ok = True
  print(f'\n{name}: {rows:,} rows in the buffer, {routed:,} routed to {groups} groups (largest '
        f'{sizes.max():,}, smallest {sizes.min():,}, {int((sizes == 0).sum())} empty), bf16')
  print(f'{"projection":14} {"kernel":12} {"error":>9} {"bf16 loop":>9}  {"time":>9} '
        f'{"TFLOP/s":>8}')
  for k, n in projections:
    keys = jax.random.split(jax.random.key(k * n), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
    x = x.at[routed:].set(jnp.nan)  # padding may hold anything: nothing of it may leak
    dy = dy.at[routed:].set(jnp.nan)

    def loss(x, w):
      return jnp.sum(gmt.grouped_matmul(x, w, sizes_dev).astype(jnp.float32) * dy)

    forward = jax.jit(lambda x, w: gmt.grouped_matmul(x, w, sizes_dev))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out = forward(x, w)
    dx, dw = grads(x, w)
    clean = lambda a: jnp.where(jnp.isnan(a), 0, a)
    reference = per_group(clean(x), w, clean(dy), sizes, jnp.float32, jnp.float32)
    bf16_loop = per_group(clean(x), w, clean(dy), sizes, jnp.bfloat16, jnp.float32)
    zero_padding = bool(jnp.all(out[routed:] == 0)) and bool(jnp.all(dx[routed:] == 0))
    zero_empty = bool(jnp.all(dw[sizes == 0] == 0))
    if not (zero_padding and zero_empty):
      print(f'  FAIL: padding rows zero {zero_padding}, empty groups\' gradient zero {zero_empty}')
      ok = False

    useful = 2.0 * routed * k * n
    dense = jax.jit(lambda a, b: a @ b)
    ragged = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, sizes_dev))
    x_routed = clean(x)[:routed]
    plan = gmt.choose_plan(rows, k, n, groups, jnp.bfloat16)  # the one grouped_matmul takes
    bwd_dx = jax.jit(lambda dy, w: gmt._ragged_rows(dy, w, sizes_dev, plan.input_grad,
                                                    None, True))
    bwd_dw = jax.jit(lambda x, dy: gmt._weight_grad(x, dy, sizes_dev, plan.weight_grad, None,
                                                    jnp.bfloat16))
    rows_of = [('forward', out, reference[0], bf16_loop[0], forward, (x, w)),
               ('input grad', dx, reference[1], bf16_loop[1], bwd_dx, (dy, w)),
               ('weight grad', dw, reference[2], bf16_loop[2], bwd_dw, (x, dy))]
    for kernel, got, ref, loop, fn, args in rows_of:
      error, floor = relative_error(got, ref), relative_error(loop, ref)
      seconds = seconds_per_call(fn, args, reps)
      verdict = '' if error <= 1.5 * floor + 1e-6 else '  FAIL'
      ok &= not verdict
      print(f'{k}x{n:<9} {kernel:12} {error:9.2e} {floor:9.2e}  {seconds * 1e3:7.3f}ms '
            f'{useful / seconds / 1e12:8.1f}{verdict}')
    # XLA's dense rewrite costs groups × the FLOPs and a [rows, groups, K] temporary: timed
    # up to 16 groups.
    others = [('xla ragged', ragged, (clean(x), w))] if groups <= 16 else []
    for label, fn, args in others + [('dense GEMM', dense, (x_routed, w[0]))]:
      seconds = seconds_per_call(fn, args, reps)
      print(f'{k}x{n:<9} {label:12} {"":9} {"":9}  {seconds * 1e3:7.3f}ms '
            f'{useful / seconds / 1e12:8.1f}')
  return ok


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--reps', type=int, default=10)
  parser.add_argument('--shapes', default='qwen3_ep8,qwen3_one_gpu')
  args = parser.parse_args()
  names = args.shapes.split(',')
  unknown = [n for n in names if n not in SHAPES]
  if unknown or args.reps < 1:
    print(f'error: --shapes takes {", ".join(SHAPES)} (got {", ".join(unknown) or "-"}); '
          f'--reps at least 1 (got {args.reps})', file=sys.stderr)
    return 2
  start_backends()
  device = jax.devices()[0]
  print(f'{device.device_kind} ({device.platform}), jax {jax.__version__}; TFLOP/s count the '
        'routed rows\' FLOPs (2·rows·K·N) for every row')
  ok = all([check_shape(name, args.reps) for name in names])
  print('\nall kernels within 1.5× the bf16 loop\'s error' if ok else '\nFAILED')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
