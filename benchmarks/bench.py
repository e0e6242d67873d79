"""Steady-state training throughput of a config on its mesh.

    python benchmarks/bench.py --config configs/X.py [--config.a.b=v ...] [--steps 20] [--warmup 3]
    python benchmarks/bench.py --config configs/comparison.py --compare

The train step is compiled once ahead of time (as `jaxllm.train` does), run `--warmup` times,
then timed over `--steps` steps with one host sync at the end. `--compare` runs the three CPU
cases of the comparison — 1 device, fsdp=8, fsdp=4 × tensor=2 — each in its own process (a
process fixes its device count when JAX starts) and prints each against the 1-device case.
"""

import os
import re
import subprocess
import sys
import time

import jax
from absl import flags
from ml_collections import config_flags

from jaxllm import metrics
from jaxllm.config import main_guard, parse_command_line
from jaxllm.mesh import sharding_context
from jaxllm.train import setup

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps run after compiling.')
_COMPARE = flags.DEFINE_bool('compare', False, 'Run the three CPU mesh cases, one process each.')

CASES = {  # name -> overrides; every case names the whole mesh, so any base config works
    '1 device': dict(cpu_devices=1, data=1, fsdp=1, tensor=1),
    'fsdp=8': dict(cpu_devices=8, data=1, fsdp=8, tensor=1),
    'fsdp=4 tensor=2': dict(cpu_devices=8, data=1, fsdp=4, tensor=2),
}


def time_steps(run, steps: int, warmup: int):
  """Compiles `run`'s step ahead of time, runs `warmup` steps, then times `steps` steps.

  Returns seconds per step, compile seconds, the compiled step and the last step's metrics.
  """
  state, batch = run.state, next(run.batches)
  start = time.perf_counter()
  with sharding_context(run.mesh, run.cfg.sharding.rules):
    compiled = run.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    state, _ = compiled(state, next(run.batches))
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, step_metrics = compiled(state, next(run.batches))
  jax.block_until_ready((state, step_metrics))  # the only host sync of the timed steps
  return (time.perf_counter() - start) / steps, compile_s, compiled, step_metrics


def bench(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv)
  if cfg.cpu_devices:
    jax.config.update('jax_num_cpu_devices', cfg.cpu_devices)  # before the backend starts
  run = setup(cfg)
  cfg, mesh = run.cfg, run.mesh
  step_s, compile_s, _, step_metrics = time_steps(run, _STEPS.value, _WARMUP.value)

  tokens_per_s = cfg.train.global_batch * cfg.data.seq_len / step_s
  flop_per_token = metrics.flops_per_token(cfg.model, cfg.data.seq_len)['full']
  device = mesh.devices.flat[0]
  name = os.path.splitext(os.path.basename(config_flags.get_config_filename(flags.FLAGS['config'])))[0]
  line = [name,
          ' '.join(f'{a}={n}' for a, n in mesh.shape.items()),
          f'{mesh.size} × {device.device_kind}',
          f'tokens/s {tokens_per_s:,.0f}', f'step {step_s * 1e3:,.1f}ms',
          f'model GFLOP/s {tokens_per_s * flop_per_token / 1e9:,.1f}']
  peak = metrics.peak_flops(device, cfg.train.peak_flops)
  if peak:
    line.append(f'mfu {100 * tokens_per_s * flop_per_token / (mesh.size * peak):.1f}%')
  line += [f'compile {compile_s:.1f}s', f'loss {float(step_metrics["loss"]):.3f}']
  print('   '.join(line), flush=True)


def compare(argv: list[str]) -> None:
  """Runs this script once per case with the same arguments plus the case's overrides."""
  base = [a for a in argv[1:] if a not in ('--compare', '--compare=true')]
  rows = []
  for name, case in CASES.items():
    overrides = [f'--config.cpu_devices={case["cpu_devices"]}', '--config.mesh.pipe=1'] + [
        f'--config.mesh.{a}={case[a]}' for a in ('data', 'fsdp', 'tensor')]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *base, *overrides],
                         capture_output=True, text=True)
    if out.returncode:
      sys.exit(f'{name} failed:\n{out.stderr}')
    result = out.stdout.strip().splitlines()[-1]
    print(result, flush=True)
    tokens_per_s = float(re.search(r'tokens/s ([\d,.]+)', result).group(1).replace(',', ''))
    step_ms = re.search(r'step ([\d,.]+)ms', result).group(1)
    compile_s = re.search(r'compile ([\d.]+)s', result).group(1)
    rows.append((name, tokens_per_s, step_ms, compile_s))
  print(f'\n{"case":18} {"tokens/s":>9} {"step ms":>8} {"compile s":>9} {"vs 1 device":>11}')
  for name, tokens_per_s, step_ms, compile_s in rows:
    print(f'{name:18} {tokens_per_s:9,.0f} {step_ms:>8} {compile_s:>9} '
          f'{tokens_per_s / rows[0][1]:11.2f}')


def main(argv: list[str]) -> None:
  compare(argv) if '--compare' in argv or '--compare=true' in argv else bench(argv)


if __name__ == '__main__':
  main_guard(main)
