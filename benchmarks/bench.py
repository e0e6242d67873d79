"""Steady-state training throughput of a config on its mesh.

    python benchmarks/bench.py --config configs/X.py [--config.a.b=v ...] [--steps 20] [--warmup 3]
    python benchmarks/bench.py --config configs/comparison.py --compare [--rounds 3]

The train step is compiled once ahead of time (as `jaxllm.train` does), run `--warmup` times,
then timed over `--steps` steps with one host sync at the end. `--compare` runs the three CPU
cases of the comparison — 1 device, fsdp=8, fsdp=4 × tensor=2 — each in its own process (a
process fixes its device count when JAX starts), `--rounds` times in turn, and prints each
case's median against the 1-device median: on a shared machine only ratios measured side by
side mean much.
"""

import os
import re
import statistics
import subprocess
import sys

from absl import flags
from ml_collections import config_flags

from jaxllm import metrics
from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.train import setup
from timing import time_steps  # benchmarks/ is on the path when this runs as a script

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps run after compiling.')
_COMPARE = flags.DEFINE_bool('compare', False, 'Run the three CPU mesh cases, one process each.')
_ROUNDS = flags.DEFINE_integer('rounds', 1, '--compare: times to run the cases, in turn.')

CASES = {  # name -> overrides; every case names the whole mesh, so any base config works
    '1 device': dict(cpu_devices=1, data=1, fsdp=1, tensor=1),
    'fsdp=8': dict(cpu_devices=8, data=1, fsdp=8, tensor=1),
    'fsdp=4 tensor=2': dict(cpu_devices=8, data=1, fsdp=4, tensor=2),
}


def bench(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  start_backends(cfg)
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
  line += [f'compile {compile_s:.1f}s', f'first-step loss {float(step_metrics["loss"]):.3f}']
  print('   '.join(line), flush=True)


def compare(argv: list[str]) -> None:
  """Runs this script once per case and round, with the same arguments plus the case's mesh."""
  flags.FLAGS(argv, known_only=True)  # just for --rounds; the cases parse the rest
  base = [a for a in argv[1:] if not a.startswith(('--compare', '--rounds'))]
  results = {name: [] for name in CASES}
  for _ in range(_ROUNDS.value):
    for name, case in CASES.items():
      overrides = [f'--config.cpu_devices={case["cpu_devices"]}', '--config.mesh.pipe=1'] + [
          f'--config.mesh.{a}={case[a]}' for a in ('data', 'fsdp', 'tensor')]
      out = subprocess.run([sys.executable, os.path.abspath(__file__), *base, *overrides],
                           capture_output=True, text=True)
      if out.returncode:
        sys.exit(f'{name} failed:\n{out.stderr}')
      line = out.stdout.strip().splitlines()[-1]
      print(line, flush=True)
      results[name].append(float(re.search(r'tokens/s ([\d,]+)', line)[1].replace(',', '')))
  baseline = statistics.median(results['1 device'])
  print(f'\n{"case":16} {"tokens/s (median)":>17} {"min-max":>13} {"vs 1 device":>11}')
  for name, runs in results.items():
    print(f'{name:16} {statistics.median(runs):17,.0f} {f"{min(runs):,.0f}-{max(runs):,.0f}":>13} '
          f'{statistics.median(runs) / baseline:11.2f}')


def main(argv: list[str]) -> None:
  compare(argv) if '--compare' in argv or '--compare=true' in argv else bench(argv)


if __name__ == '__main__':
  main_guard(main)
