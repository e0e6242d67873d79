"""What a numerics setting does to the training loss of a real run: one config field, several
values, the same seed and data order.

    python benchmarks/precision.py --out DIR --field FIELD --values REF,V[,V...] [--steps 300]
        [--log_every 5] [--table_every 25] [--plot FILE.png] [--config.a.b=v ...]

e.g. `--field model.grad_reduce_dtype --values float32,bfloat16` or `--field model.fp8
--values none,delayed,current`.

Trains `configs/comparison.py` (d=256, 4 layers, fp32 masters) on the text `configs/tiny.py`
reads (the Python standard library's *.py, byte tokenizer, so a 320-token vocabulary), sequence
256, computing in bf16 on 8 CPU devices with fsdp=8, once per value of `--field`. Each run is a
real `python -m jaxllm.train` in its own process and workdir (DIR/<value>, its log DIR/<value>.log),
one after the other; the `--config.*` arguments go to every run. The first value is the
reference. Prints, from each run's `metrics.jsonl`, the train loss every `--table_every` steps
and each other value's difference from the reference, the eval losses, and, over the last 100
steps, the differences' statistics beside the train loss's own noise from one logged row to the
next; then each run's wall time. `--plot` draws the loss curves and the differences.

The runs compute in bf16. Where a value asks for bf16 reductions (model.grad_reduce_dtype=
bfloat16, an FP8 model), the compiler options (`jaxllm.backends.compiler_options`) leave XLA's
all-reduce-promotion pass out of that run's CPU program, where the CPU compiler would abort.
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time

from absl import flags

from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError
from jaxllm.validate import resolve_mesh, validate

_OUT = flags.DEFINE_string('out', None, 'New directory for the runs\' workdirs and logs.')
_FIELD = flags.DEFINE_string('field', None, 'The config field compared, e.g. model.fp8.')
_VALUES = flags.DEFINE_list('values', None, 'Its values, comma-separated; the first is the '
                            'reference.')
_STEPS = flags.DEFINE_integer('steps', 300, 'Train steps per run.')
_LOG_EVERY = flags.DEFINE_integer('log_every', 5, 'Steps per metrics row.')
_EVERY = flags.DEFINE_integer('table_every', 25, 'Steps between the table\'s rows.')
_PLOT = flags.DEFINE_string('plot', None, 'PNG file for the loss curves (optional).')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST = 100  # steps the statistics are taken over


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


def check(out: str, field: str, values: list[str], args: list[str], plot: str | None) -> None:
  """Everything that can be wrong before the first run starts (minutes each): the flags, and
  each value's config as the trainer will parse and validate it."""
  if not out:
    raise ConfigError('--out DIR is required: a new directory for the runs.')
  if os.path.exists(out):
    raise ConfigError(f'--out {out}: exists; name a new directory.')
  if not field:
    raise ConfigError('--field is required: the config field to compare, e.g. model.fp8.')
  if len(values or []) < 2 or len({workdir_name(v) for v in values}) < len(values):
    raise ConfigError(f'--values {",".join(values or []) or "(none)"}: give two or more '
                      'different values, comma-separated; the first is the reference.')
  if plot and not os.path.isdir(os.path.dirname(os.path.abspath(plot))):
    raise ConfigError(f'--plot {plot}: its directory does not exist.')
  for v in values:
    cfg, _ = parse_command_line([sys.argv[0], *args, f'--config.{field}={v}'])
    validate(cfg, resolve_mesh(cfg.mesh, cfg.cpu_devices or 1))


def workdir_name(value: str) -> str:
  return re.sub(r'[^\w.+-]', '_', value)


def train(out: str, field: str, value: str, args: list[str]) -> tuple[list[dict], float]:
  name = workdir_name(value)
  workdir, log_path = os.path.join(out, name), os.path.join(out, f'{name}.log')
  cmd = [sys.executable, '-m', 'jaxllm.train', *args, f'--config.{field}={value}',
         '--workdir', workdir]
  start = time.perf_counter()
  with open(log_path, 'w') as log:
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
  wall = time.perf_counter() - start
  if rc:
    with open(log_path) as log:
      last = ([l.strip() for l in log if l.strip()] or [''])[-1]
    sys.exit(f'{field}={value} run failed (exit {rc}): {last}\nsee {log_path}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()], wall


def mean_se(xs: list[float]) -> tuple[float, float]:
  return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1
                               else float('nan'))


def row_noise(loss: dict[int, float], steps: list[int]) -> float:
  """The train loss's own noise: successive rows differ by batch (and trend); /√2 for one
  row's spread."""
  deltas = [loss[b] - loss[a] for a, b in zip(steps, steps[1:])]
  return statistics.stdev(deltas) / math.sqrt(2) if len(deltas) > 1 else float('nan')


def plot(path: str, field: str, values: list[str], loss: dict[str, dict[int, float]],
         steps: list[int], log_every: int) -> None:
  import matplotlib
  matplotlib.use('Agg')  # no display needed
  import matplotlib.pyplot as plt
  ref = values[0]
  fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6.5),
                                    gridspec_kw={'height_ratios': [2, 1]})
  for i, v in enumerate(values):  # one colour per value in both panels
    top.plot(steps, [loss[v][s] for s in steps], f'C{i}', label=f'{field}={v}', lw=1)
    if i:
      bottom.plot(steps, [loss[v][s] - loss[ref][s] for s in steps], f'C{i}',
                  label=f'{v} − {ref}', lw=1)
  bottom.axhline(0, color='gray', lw=0.5)
  top.set_ylabel(f'train loss (mean of {log_every} steps)')
  top.set_title(f'{field}: same seed and data order')
  top.legend()
  bottom.set_ylabel(f'difference from {ref}')
  bottom.set_xlabel('step')
  bottom.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f'\nwrote {path}')


def main(argv: list[str]) -> None:
  flags.FLAGS(argv, known_only=True)
  # parse_command_line (in check) resets these flags: read them first.
  out, field, values, plot_path = _OUT.value, _FIELD.value, _VALUES.value, _PLOT.value
  steps_wanted, log_every, every = _STEPS.value, _LOG_EVERY.value, _EVERY.value
  args = overrides(steps_wanted, log_every) + [a for a in argv[1:] if a.startswith('--config.')]
  check(out, field, values, args, plot_path)
  os.makedirs(out)
  print('command: python -m jaxllm.train ' + ' '.join(args)
        + f' --config.{field}={{{",".join(values)}}}\n', flush=True)

  rows, walls = {}, {}
  for v in values:
    rows[v], walls[v] = train(out, field, v, args)
    print(f'{field}={v}: trained {steps_wanted} steps in {walls[v]:.0f}s', flush=True)
  loss = {v: {r['step']: r['loss'] for r in rows[v] if 'loss' in r} for v in values}
  eval_loss = {v: {r['step']: r['eval_loss'] for r in rows[v] if 'eval_loss' in r}
               for v in values}
  ref, others = values[0], values[1:]
  steps = sorted(set.intersection(*(set(loss[v]) for v in values)))

  print(f'\n| step | {ref} loss | ' + ' | '.join(f'{v} loss | {v} − {ref}' for v in others)
        + ' |')
  print('|---:|---:|' + '---:|---:|' * len(others))

  def table_row(label: str, by_value: dict[str, dict[int, float]], s: int) -> None:
    a = by_value[ref][s]
    print(f'| {label} | {a:.4f} | '
          + ' | '.join(f'{by_value[v][s]:.4f} | {by_value[v][s] - a:+.4f}' for v in others) + ' |')

  for s in steps:
    if s % every == 0 or s == steps[-1]:
      table_row(str(s), loss, s)
  for s in sorted(set.intersection(*(set(eval_loss[v]) for v in values))):
    table_row(f'eval @ {s}', eval_loss, s)

  last = [s for s in steps if s > steps[-1] - LAST]
  print(f'\nlast {LAST} steps ({len(last)} rows of {log_every} steps), against {ref}:')
  for v in others:
    diffs = [loss[v][s] - loss[ref][s] for s in last]
    mean, se = mean_se(diffs)
    print(f'  {v}: mean |{v} − {ref}| {statistics.mean(abs(d) for d in diffs):.4f}, '
          f'mean {v} − {ref} {mean:+.4f} (± {se:.4f} s.e.), '
          f'max |diff| {max(abs(d) for d in diffs):.4f}')
  print('row-to-row noise of the train loss over the same steps (std of successive differences '
        '/ √2): ' + ', '.join(f'{v} {row_noise(loss[v], last):.4f}' for v in values))
  for v in values:
    step_time = statistics.median(r['step_time'] for r in rows[v] if 'step_time' in r)
    print(f'wall time {field}={v}: {walls[v]:.0f}s (median step {step_time:.2f}s)')
  print(f'total wall time {sum(walls.values()):.0f}s')
  if plot_path:
    plot(plot_path, field, values, loss, steps, log_every)


if __name__ == '__main__':
  main_guard(main)
