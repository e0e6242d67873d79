"""How long a checkpoint save holds up the training loop: async (the default) against sync.

    python benchmarks/checkpoint.py [--config configs/comparison.py] [--saves 5] [--config.a.b=v ...]

For each mode, trains a step, waits for it, then times the `save` call the loop makes (the
time the loop is blocked) and, for async, how long the files take to land behind it. Both
modes run in this one process, in turn, so their ratio is measured under the same load.
"""

import statistics
import tempfile
import time

import jax
from absl import flags

from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.parallel.mesh import sharding_context
from jaxllm.train import setup

_SAVES = flags.DEFINE_integer('saves', 5, 'Saves timed per mode (after one untimed).')


def time_saves(cfg, async_save: bool, saves: int) -> tuple[float, float, int]:
  """Median seconds the loop is blocked per save, median seconds until the files are written
  (with one train step running meanwhile), and the state's bytes."""
  cfg.checkpoint.async_save = async_save
  with tempfile.TemporaryDirectory() as workdir:
    run = setup(cfg, workdir=workdir)
    state, batch = run.state, next(run.batches)
    with sharding_context(run.mesh, run.layout.rules):
      step = run.train_step.lower(state, batch).compile()
    blocked, written = [], []
    for i in range(saves + 1):
      state, _ = step(state, batch)
      jax.block_until_ready(state)
      start = time.perf_counter()
      run.checkpoints.save(i + 1, state, run.batches, cfg)
      returned = time.perf_counter()
      state, _ = step(state, batch)  # the loop goes on while the files are written
      run.checkpoints.wait()
      if i:  # the first save also starts orbax's machinery
        blocked.append(returned - start)
        written.append(time.perf_counter() - start)
    run.checkpoints.close()
    size = sum(x.nbytes for x in jax.tree.leaves(state))
  return statistics.median(blocked), statistics.median(written), size


def main(argv):
  if not any(a.startswith('--config') and not a.startswith('--config.') for a in argv[1:]):
    argv = [argv[0], '--config', 'configs/comparison.py', *argv[1:]]
  cfg, _ = parse_command_line(argv, __doc__)
  start_backends(cfg)
  results = {mode: time_saves(cfg, mode == 'async', _SAVES.value) for mode in ('sync', 'async')}
  size = results['sync'][2]
  print(f'state {size / 2**20:,.0f} MiB (params + optimizer) on {jax.device_count()} × '
        f'{jax.devices()[0].device_kind}, {_SAVES.value} saves per mode, medians')
  for mode, (blocked, written, _) in results.items():
    landed = f'; on disk {written * 1e3:.1f} ms after the save began' if mode == 'async' else ''
    print(f'{mode:>5}: loop blocked {blocked * 1e3:8.1f} ms per save{landed}')
  print(f'async blocks the loop {results["sync"][0] / results["async"][0]:.1f}× less than sync')


if __name__ == '__main__':
  main_guard(main)
