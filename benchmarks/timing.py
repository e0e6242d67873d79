"""Timing a compiled train step (warm-up, then timed steps with one host sync at the end) and
one call of a jitted function."""

import contextlib
import copy
import itertools
import statistics
import time

import jax
from ml_collections import ConfigDict

from jaxllm import metrics
from jaxllm.parallel.mesh import sharding_context


# How long a GPU's clock takes to settle under full load, from its boost clock to what its
# power limit sustains: stas00/ml-engineering soaks for up to 20 s before measuring sustained
# matmul rates (branch fast-mamf, compute/accelerator/benchmarks/README.md); a minute, to be
# sure.
GPU_WARMUP_S = 60.0


def settle_seconds(requested: float, device) -> float:
  """`requested` seconds of warm-up; by default (negative) a minute on a GPU, none elsewhere."""
  if requested >= 0:
    return requested
  return GPU_WARMUP_S if device.platform == 'gpu' else 0.0


def benchmark_config(cfg: ConfigDict, keep_data: bool) -> ConfigDict:
  """The config as benchmarked: no evaluation, no checkpoints; a synthetic batch by default
  (it costs no input time, and every step sees the same shapes)."""
  cfg = copy.deepcopy(cfg)
  cfg.eval.every = 0
  cfg.checkpoint.dir = ''
  if not keep_data:
    cfg.data.source = 'synthetic'
  return cfg


def timed(step, state, batches, steps: int, warmup: int, warmup_s: float = 0.0,
          during=contextlib.nullcontext):
  """Calls the compiled `step(state, batch) -> (state, metrics)` `warmup` times, and on until
  `warmup_s` seconds have passed (a GPU's clocks settle under load), then `steps` times inside
  the context `during()` with no host sync until the end. Returns seconds per timed step and
  the first step's metrics (on the host)."""
  first = None
  start, done = time.perf_counter(), 0
  while done < warmup or time.perf_counter() - start < warmup_s:
    state, step_metrics = step(state, next(batches))
    first = step_metrics if first is None else first
    done += 1
    if warmup_s:
      jax.block_until_ready(state)  # the time the device ran, not the host's dispatch
  jax.block_until_ready(state)
  with during():
    start = time.perf_counter()
    for _ in range(steps):
      state, step_metrics = step(state, next(batches))
      first = step_metrics if first is None else first
    jax.block_until_ready((state, step_metrics))  # the only host sync of the timed steps
    seconds = time.perf_counter() - start
  return seconds / steps, jax.device_get(first)


def time_steps(run, steps: int, warmup: int, first_batch=None, warmup_s: float = 0.0,
               during=contextlib.nullcontext):
  """Compiles `run`'s step ahead of time (as `jaxllm.train` does) on its first batch (default:
  the next of `run.batches`), warms it up (`timed`'s `warmup` and `warmup_s`), then times
  `steps` steps inside `during()`.

  Returns seconds per step, compile seconds, the compiled step and the first step's metrics.
  """
  first_batch = next(run.batches) if first_batch is None else first_batch
  start = time.perf_counter()
  with sharding_context(run.mesh, run.layout.rules):
    compiled = run.train_step.lower(run.state, first_batch).compile()
  compile_s = time.perf_counter() - start
  batches = itertools.chain([first_batch], run.batches)
  step_s, first = timed(compiled, run.state, batches, steps, warmup, warmup_s,
                        during)  # donates run.state
  return step_s, compile_s, compiled, first


def seconds_per_call(fn, args, reps: int) -> float:
  """Seconds a call of `fn(*args)`, after one call to compile and warm it: the median of 3
  rounds of `reps` calls dispatched back to back with one host sync at the end (a sync after
  each call would add its launch and wait to every sub-millisecond kernel)."""
  jax.block_until_ready(fn(*args))
  rounds = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(reps)])
    rounds.append((time.perf_counter() - start) / reps)
  return statistics.median(rounds)


def rates_per_device(cfg: ConfigDict, step_s: float, mesh) -> tuple[float, dict, dict]:
  """A step of `step_s` seconds on `mesh`, per device: tokens/s, model FLOP/s and MFU (text;
  'n/a' where the device's peak is unknown), the last two in both FLOP conventions ('full',
  'causal': `metrics.flops_per_token`)."""
  tokens_per_s = cfg.train.global_batch * cfg.data.seq_len / step_s / mesh.size
  flops = {k: tokens_per_s * f for k, f in
           metrics.flops_per_token(cfg.model, cfg.data.seq_len).items()}
  peak = metrics.peak_flops(mesh.devices.flat[0], cfg.train.peak_flops)
  mfu = {k: f'{100 * f / peak:.1f}%' if peak else 'n/a' for k, f in flops.items()}
  return tokens_per_s, flops, mfu
