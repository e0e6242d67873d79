"""What reducing gradients in bfloat16 instead of float32 does to the training loss of a real run.

    python benchmarks/grad_reduce.py --out DIR [--steps 300] [--log_every 5] [--config.a.b=v ...]

Trains `configs/comparison.py` (d=256, 4 layers, fp32 masters) on the text `configs/tiny.py`
reads (the Python standard library's *.py, byte tokenizer, so a 320-token vocabulary), sequence
256, computing in bf16 on 8 CPU devices with fsdp=8, twice: `model.grad_reduce_dtype=float32`
(the default) and `bfloat16`, which makes each weight gradient in bf16 straight out of its
matmul, so the fsdp reduce-scatter sums bf16. Same seed, same data order. Each run is a real
`python -m jaxllm.train` in its own process and workdir (DIR/float32, DIR/bfloat16), one after
the other; the rest of the arguments go to both. Prints, from each run's `metrics.jsonl`, the
train loss every 25 steps side by side, the final eval loss, the mean |difference| over the
last 100 steps against the loss's own step-to-step noise, and each run's wall time; then the
collectives each variant's compiled CPU program runs (`jaxllm.analyze --compiler cpu`).

XLA's CPU compiler aborts on the bf16 program in its all-reduce-promotion pass ("Invalid binary
instruction opcode copy"), which `jaxllm.backends.start_backends` therefore leaves out of bf16
runs on a CPU; here both runs and both analyses leave it out (XLA_FLAGS), so that the two CPU
programs are compiled alike. The CPU program still moves f32: the bf16 variant rounds each
device's partial gradient to bf16 before the collective and sums in f32, where a GPU's NCCL
would also round every partial sum (its program reduce-scatters bf16: `jaxllm.analyze`).
"""

import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time

from absl import flags

from jaxllm.cli import main_guard
from jaxllm.config import ConfigError

_OUT = flags.DEFINE_string('out', None, 'New directory for the two runs\' workdirs.')
_STEPS = flags.DEFINE_integer('steps', 300, 'Train steps per run.')
_LOG_EVERY = flags.DEFINE_integer('log_every', 5, 'Steps per metrics row.')
_EVERY = flags.DEFINE_integer('table_every', 25, 'Steps between the table\'s rows.')

VARIANTS = ('float32', 'bfloat16')
XLA_FLAGS = '--xla_disable_hlo_passes=all-reduce-promotion'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(steps: int, log_every: int) -> list[str]:
  stdlib = os.path.join(sysconfig.get_paths()['stdlib'], '*.py')
  return ['--config', os.path.join(ROOT, 'configs/comparison.py'),
          '--config.cpu_devices=8', '--config.mesh.data=1', '--config.mesh.fsdp=8',
          '--config.mesh.tensor=1', '--config.mesh.pipe=1',
          '--config.model.vocab_size=320', '--config.model.dtype=bfloat16',
          '--config.data.source=files', f'--config.data.path={stdlib}',
          '--config.data.tokenizer=byte', '--config.data.seq_len=256',
          '--config.data.eval_fraction=0.02', '--config.eval.every=100',
          f'--config.train.steps={steps}', f'--config.train.log_every={log_every}',
          f'--config.checkpoint.every={steps}', '--config.metrics.tensorboard=False']


def env() -> dict[str, str]:
  e = dict(os.environ)
  e['XLA_FLAGS'] = f"{XLA_FLAGS} {e.get('XLA_FLAGS', '')}".strip()
  return e


def train(variant: str, args: list[str]) -> tuple[list[dict], float]:
  workdir = os.path.join(_OUT.value, variant)
  cmd = [sys.executable, '-m', 'jaxllm.train', *args,
         f'--config.model.grad_reduce_dtype={variant}', '--workdir', workdir]
  start = time.perf_counter()
  with open(os.path.join(_OUT.value, f'{variant}.log'), 'w') as log:
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT).returncode
  wall = time.perf_counter() - start
  if rc:
    sys.exit(f'{variant} run failed (exit {rc}); see {_OUT.value}/{variant}.log')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()], wall


def collectives(variant: str, args: list[str]) -> list[str]:
  """The 'collectives per step' lines of `jaxllm.analyze --compiler cpu` for the variant."""
  cmd = [sys.executable, '-m', 'jaxllm.analyze', *args, '--compiler', 'cpu', '--devices', '8',
         f'--config.model.grad_reduce_dtype={variant}']
  out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
  if out.returncode:
    return [f'analyze failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}']
  lines = out.stdout.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith('collectives per step'))
  end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith('  ')
             or lines[i].startswith('  *'))
  return lines[start + 1:end]


def main(argv: list[str]) -> None:
  flags.FLAGS(argv, known_only=True)
  if not _OUT.value:
    raise ConfigError('--out DIR is required: a new directory for the two runs.')
  if os.path.exists(_OUT.value):
    raise ConfigError(f'--out {_OUT.value}: exists; name a new directory.')
  os.makedirs(_OUT.value)
  passthrough = [a for a in argv[1:] if a.startswith('--config.')]
  args = overrides(_STEPS.value, _LOG_EVERY.value) + passthrough
  print('command: python -m jaxllm.train ' + ' '.join(args)
        + ' --config.model.grad_reduce_dtype={float32,bfloat16}', flush=True)
  print(f'XLA_FLAGS={XLA_FLAGS}\n', flush=True)

  rows, walls = {}, {}
  for v in VARIANTS:
    rows[v], walls[v] = train(v, args)
    print(f'{v}: trained {_STEPS.value} steps in {walls[v]:.0f}s', flush=True)
  train_loss = {v: {r['step']: r['loss'] for r in rows[v] if 'loss' in r} for v in VARIANTS}
  eval_loss = {v: {r['step']: r['eval_loss'] for r in rows[v] if 'eval_loss' in r}
               for v in VARIANTS}
  steps = sorted(set(train_loss['float32']) & set(train_loss['bfloat16']))

  print('\n| step | fp32 reduce loss | bf16 reduce loss | bf16 − fp32 |')
  print('|---:|---:|---:|---:|')
  for s in steps:
    if s % _EVERY.value == 0 or s == steps[-1]:
      a, b = train_loss['float32'][s], train_loss['bfloat16'][s]
      print(f'| {s} | {a:.4f} | {b:.4f} | {b - a:+.4f} |')
  for s in sorted(set(eval_loss['float32']) & set(eval_loss['bfloat16'])):
    a, b = eval_loss['float32'][s], eval_loss['bfloat16'][s]
    print(f'| eval @ {s} | {a:.4f} | {b:.4f} | {b - a:+.4f} |')

  last = [s for s in steps if s > steps[-1] - 100]
  diffs = [train_loss['bfloat16'][s] - train_loss['float32'][s] for s in last]
  # The loss's own noise: successive rows differ by batch (and trend); /√2 for one row's spread.
  noise = {v: statistics.stdev([train_loss[v][b] - train_loss[v][a]
                                for a, b in zip(last, last[1:])]) / math.sqrt(2)
           for v in VARIANTS}
  print(f'\nlast 100 steps ({len(last)} rows of {_LOG_EVERY.value} steps): '
        f'mean |bf16 − fp32| {statistics.mean(abs(d) for d in diffs):.4f}, '
        f'mean bf16 − fp32 {statistics.mean(diffs):+.4f} '
        f'(± {statistics.stdev(diffs) / math.sqrt(len(diffs)):.4f} s.e.), '
        f'max |diff| {max(abs(d) for d in diffs):.4f}')
  print('row-to-row noise of the train loss over the same steps (std of successive differences '
        '/ √2): ' + ', '.join(f'{v} {noise[v]:.4f}' for v in VARIANTS))
  for v in VARIANTS:
    step_time = statistics.median(r['step_time'] for r in rows[v] if 'step_time' in r)
    print(f'wall time {v}: {walls[v]:.0f}s (median step {step_time:.2f}s)')
  print(f'total wall time {sum(walls.values()):.0f}s')

  print('\ncollectives per step of each compiled CPU program (jaxllm.analyze --compiler cpu):')
  for v in VARIANTS:
    print(f'grad_reduce_dtype={v}:')
    for line in collectives(v, args):
      print(line)


if __name__ == '__main__':
  main_guard(main)
