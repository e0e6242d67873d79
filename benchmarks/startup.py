"""Start-up time of a run with and without the persistent compilation cache.

    python benchmarks/startup.py --config configs/X.py [--config.a.b=v ...] [--rounds 2]

Each round starts `python -m jaxllm.train` three times, each in a fresh process and a fresh
workdir (nothing to resume): with `compilation_cache=''` (no cache), then with an empty cache
directory (the first run of a config: it compiles and writes the cache), then again with that
directory (the second run: it reads the programs back). Printed per run: start-up, the
seconds from starting the process to the train step compiled (backends, data, the initial
state and the compiles; the run is stopped there), the CPU seconds the process took until then
(every thread: on a machine with more cores than the compiler's threads use, start-up hides
what CPU-bound machines and test runs pay), and the train step's compile time as the run logs
it. The rounds' medians are compared as ratios to the run without a cache.
"""

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ('no cache', 'first run (cache empty)', 'second run (cache filled)')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_once(config: str, overrides: list[str], cache: str,
             workdir: str) -> tuple[float, float, float, bool]:
  """Seconds from starting `python -m jaxllm.train` to its train step compiled (the process
  is stopped there: start-up is over), the CPU seconds it took, the compile seconds it logs,
  and whether it hit."""
  command = [sys.executable, '-m', 'jaxllm.train', f'--config={config}', *overrides,
             '--config.checkpoint.every=0', '--config.eval.every=0',
             f'--config.compilation_cache={cache}', f'--workdir={workdir}']
  start, cpu = time.perf_counter(), _children_cpu()
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  for line in process.stdout:
    found = re.match(r'compiled the train step in ([\d.]+)s( \(cache hit\))?', line)
    if found:
      startup = time.perf_counter() - start
      process.kill()
      process.wait()  # its CPU time is counted once it is waited for
      return startup, _children_cpu() - cpu, float(found.group(1)), bool(found.group(2))
  sys.exit(f'the run failed:\n{process.stderr.read()[-2000:]}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', required=True, help='The config file.')
  parser.add_argument('--rounds', type=int, default=2, help='Times to run the three cases.')
  args, overrides = parser.parse_known_args()
  if any(not a.startswith('--config.') for a in overrides):
    parser.error(f'unknown arguments {overrides}; config overrides start with --config.')
  walls = {case: [] for case in CASES}
  cpus = {case: [] for case in CASES}
  compiles = {case: [] for case in CASES}
  print(f'config {args.config} {" ".join(overrides)}')
  for round_ in range(args.rounds):
    with tempfile.TemporaryDirectory() as tmp:
      caches = ('', os.path.join(tmp, 'cache'), os.path.join(tmp, 'cache'))
      for i, (case, cache) in enumerate(zip(CASES, caches)):
        wall, cpu, compiled, hit = run_once(args.config, overrides, cache,
                                            os.path.join(tmp, f'run{i}'))
        if hit != (i == 2):
          sys.exit(f'{case}: the cache was {"hit" if hit else "missed"}, which it should not be.')
        walls[case].append(wall)
        cpus[case].append(cpu)
        compiles[case].append(compiled)
        print(f'round {round_ + 1}  {case:26s} start-up {wall:6.1f}s  CPU {cpu:6.1f}s  '
              f'train step compiled in {compiled:5.1f}s' + ('  (cache hit)' if hit else ''))
  base_wall, base_cpu, base_compile = (statistics.median(walls[CASES[0]]),
                                       statistics.median(cpus[CASES[0]]),
                                       statistics.median(compiles[CASES[0]]))
  print(f'\nmedians over {args.rounds} round(s), ratio to no cache:')
  for case in CASES:
    wall, cpu = statistics.median(walls[case]), statistics.median(cpus[case])
    compiled = statistics.median(compiles[case])
    print(f'  {case:26s} start-up {wall:6.1f}s ({wall / base_wall:.2f}×)  '
          f'CPU {cpu:6.1f}s ({cpu / base_cpu:.2f}×)  '
          f'train step {compiled:5.1f}s ({compiled / base_compile:.2f}×)')


if __name__ == '__main__':
  main()
