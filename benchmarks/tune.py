"""`tune`'s search beside an exhaustive compile of every candidate: what each took, and their
rankings side by side.

    python benchmarks/tune.py --config configs/llama3_8b.py --devices 64 \
        --config.train.global_batch=64 [--top 5] [--exhaustive-cache DIR] [tune's other flags]

Runs `python -m jaxllm.tune ... --json` as a user would, twice: the default search, with an
empty program cache (nothing compiled before it), then `--exhaustive`, which compiles every
candidate whose state fits. For each: wall seconds, CPU seconds (the command's processes,
its workers and the compiler's ptxas included), how many candidates it compiled and how many
it left out and why; then the best `--top` of both side by side, and whether the winner and
their order agree. `--exhaustive-cache DIR` keeps the exhaustive search's programs in DIR, so
that a second run (after the timing model changed, say) compiles nothing: its CPU seconds are
then those each compile took when it was made, as the cache recorded them.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def run_tune(args: list[str]) -> tuple[dict, float, float]:
  """`python -m jaxllm.tune *args --json`: its JSON, wall seconds and CPU seconds."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  result = subprocess.run([sys.executable, '-m', 'jaxllm.tune', *args, '--json'],
                          capture_output=True, text=True)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if result.returncode:
    sys.exit(f'jaxllm.tune {" ".join(args)} failed:\n{result.stderr[-3000:]}')
  cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
  return json.loads(result.stdout), wall, cpu


def ranked(search: dict) -> list[dict]:
  return [c for c in search['candidates'] if 'rank' in c]


def settings(c: dict) -> str:
  mesh = '×'.join(f'{a}={n}' for a, n in c['mesh'].items() if n > 1) or 'one device'
  return (f'{mesh}, remat {c["remat"]}, micro {c["micro_batches"]}'
          + (f', {c["pipeline"]}' if c['pipeline'] != '-' else ''))


def key(c: dict) -> tuple:
  return tuple(c['mesh'].values()), c['remat'], c['micro_batches'], c['zero'], c['split'], \
      c['loss_chunk'], c['pipeline']


def summary(name: str, search: dict, wall: float, cpu: float) -> str:
  compiled = [c for c in search['candidates'] if 'prediction' in c]
  recorded = sum(c['compile_s'] for c in compiled)
  left = ', '.join(f'{n} {why}' for why, n in search['left_out'].items())
  return (f'| {name} | {wall:,.0f} s | {cpu:,.0f} s | {search["compiled"]} compiled, '
          f'{search["cached"]} from the cache (their compiles took {recorded:,.0f} CPU-s '
          f'when made) | {left} |')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--top', type=int, default=5)
  parser.add_argument('--exhaustive-cache', default='')
  ours, tune_args = parser.parse_known_args()
  print(f'{sys.argv[0]} {" ".join(sys.argv[1:])}')
  with tempfile.TemporaryDirectory() as empty:
    fast, fast_wall, fast_cpu = run_tune([*tune_args, f'--cache={empty}', f'--top={ours.top}'])
  exhaustive_cache = ours.exhaustive_cache or tempfile.mkdtemp()
  exhaustive, wall, cpu = run_tune([*tune_args, '--exhaustive', f'--cache={exhaustive_cache}'])
  print('| search | wall | CPU | compiles | left out |')
  print('|---|---:|---:|---|---|')
  print(summary('tune (default)', fast, fast_wall, fast_cpu))
  print(summary('tune --exhaustive', exhaustive, wall, cpu))
  print()
  print(f'| # | exhaustive | step | default search | step |')
  print('|---:|---|---:|---|---:|')
  a, b = ranked(exhaustive), ranked(fast)
  for i in range(ours.top):
    row = [f'| {i + 1}']
    for c in (a[i] if i < len(a) else None, b[i] if i < len(b) else None):
      row += [settings(c), f'{c["prediction"]["step_s"] * 1e3:,.1f} ms'] if c else ['–', '–']
    print(' | '.join(row) + ' |')
  same = [key(c) for c in a[:ours.top]] == [key(c) for c in b[:ours.top]]
  print(f'\nsame winner: {"yes" if a and b and key(a[0]) == key(b[0]) else "NO"}; same top '
        f'{ours.top} in the same order: {"yes" if same else "NO"}; the default search took '
        f'{fast_wall / wall:.1%} of the exhaustive one\'s wall time, {fast_cpu / cpu:.1%} of '
        'its CPU time' if cpu else '')
  if not ours.exhaustive_cache:
    print(f'(the exhaustive search\'s programs are kept in {exhaustive_cache})',
          file=sys.stderr)


if __name__ == '__main__':
  main()
