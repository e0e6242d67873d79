"""`python -m jaxllm.tune --config configs/X.py --devices N [--hardware h100-nvlink] [--measure K]`

Tries every mesh data·fsdp·pipe·tensor = N that the model allows, with each remat policy,
micro-batch count, ZeRO stage, sequence or context split, loss chunk and (on meshes with
pipe > 1) pipeline schedule asked for: compiles each from shapes for the profile's GPU (as
`jaxllm.analyze` does, with its --compiler and --devices), drops those that do not fit what a
process may use of the device's memory, and ranks the rest by predicted step time.
`--measure K` then runs the best K for a few real steps on the devices present, beside the
prediction.
"""

from __future__ import annotations

import time

import jax
from absl import flags
from ml_collections import ConfigDict

from jaxllm import analyze
from jaxllm.cli import main_guard
from jaxllm.config import PIPELINE_SCHEDULES, REMAT_POLICIES, ConfigError
from jaxllm.cost.report import seconds_text
from jaxllm.cost.tune import SPLITS, Space, format_table, rank
from jaxllm.parallel.mesh import sharding_context
from jaxllm.train import setup

_MEASURE = flags.DEFINE_integer('measure', 0, 'Run the best K candidates for a few steps.')
_MEASURE_STEPS = flags.DEFINE_integer('measure-steps', 3, 'Timed steps per measured candidate.')
_REMAT = flags.DEFINE_list('remat', ['none', 'full'], 'Remat policies to try.')
_MICRO_BATCHES = flags.DEFINE_list('micro-batches', ['1', '2'], 'train.micro_batches to try.')
_ZERO = flags.DEFINE_list('zero', [], 'sharding.zero stages to try (default: the config\'s).')
_SPLITS = flags.DEFINE_list('splits', ['none'], f'Sequence and context splits to try: '
                            f'{", ".join(SPLITS)}.')
_LOSS_CHUNK = flags.DEFINE_list('loss-chunk', [],
                                'model.loss_chunk values to try (default: the config\'s).')
_SCHEDULES = flags.DEFINE_list('schedules', list(PIPELINE_SCHEDULES),
                               'pipeline.schedule values to try on meshes with pipe > 1 '
                               '(circular and interleaved_1f1b with repeats=2).')


def _integers(flag, at_least: int, example: str) -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in flag.value)
  except ValueError:
    values = ()
  if not values or min(values) < at_least:
    raise ConfigError(f'--{flag.name}={",".join(flag.value)} must be integers of at least '
                      f'{at_least}, e.g. {example}.')
  return values


def check_flags() -> Space:
  """The ranges of tune's own flags; returns what to try beside the mesh (no ZeRO stages or
  loss chunks: the config's). (An empty list or a count of 0 would otherwise read as 'no
  mesh fits'.)"""
  if _MEASURE.value < 0:
    raise ConfigError(f'--measure={_MEASURE.value} must be at least 0 (0: rank only).')
  if _MEASURE_STEPS.value < 1:
    raise ConfigError(f'--measure-steps={_MEASURE_STEPS.value} must be at least 1.')
  remats = _REMAT.value
  if not remats:
    raise ConfigError(f'--remat is empty; give policies to try, from {", ".join(REMAT_POLICIES)}.')
  for remat in remats:
    if remat not in REMAT_POLICIES:
      raise ConfigError(f'--remat={remat!r} is unknown; use {", ".join(REMAT_POLICIES)}.')
  for split in _SPLITS.value or ['']:  # an empty list names the unknown split ''
    if split not in SPLITS:
      raise ConfigError(f'--splits={split!r} is unknown; use {", ".join(SPLITS)}.')
  for schedule in _SCHEDULES.value or ['']:
    if schedule not in PIPELINE_SCHEDULES:
      raise ConfigError(f'--schedules={schedule!r} is unknown; pipeline.schedule takes '
                        f'{", ".join(PIPELINE_SCHEDULES)}.')
  zero = _integers(_ZERO, 0, '0,1,2') if _ZERO.value else ()
  if zero and max(zero) > 2:
    raise ConfigError(f'--zero={",".join(_ZERO.value)}: ZeRO stages are 0, 1 and 2.')
  chunks = _integers(_LOSS_CHUNK, 0, '0,1024') if _LOSS_CHUNK.value else ()
  return Space(tuple(remats), _integers(_MICRO_BATCHES, 1, '1,2,4'), zero, tuple(_SPLITS.value),
               chunks, tuple(_SCHEDULES.value))


def measure(c: ConfigDict, steps: int, devices=None) -> float:
  """Seconds per train step of `c` on `devices` (default: all present), after two warm-up
  steps."""
  run = setup(c, devices)
  state, batch = run.state, next(run.batches)
  with sharding_context(run.mesh, run.layout.rules):
    step = run.train_step.lower(state, batch).compile()
  for _ in range(2):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, _ = step(state, next(run.batches))
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / steps


def main(argv: list[str]) -> None:
  cfg, hardware, devices = analyze.parse_and_place(argv)
  space = check_flags()
  if hardware.rates is None:
    raise ConfigError(f'--hardware={hardware.name} has no measured kernel rates to rank by; use '
                      'h100-nvlink or h200-nvlink (analyze still reads its memory and traffic).')
  if _MEASURE.value and len(devices) != jax.device_count():
    raise ConfigError(f'--measure runs the candidates on the devices present, '
                      f'{jax.device_count()} × {jax.devices()[0].device_kind}; rank for as many '
                      f'(--devices {jax.device_count()}) or leave --measure out.')
  rows, skipped = rank(cfg, hardware, space, devices)
  if not rows:
    raise ConfigError(f'no mesh of {len(devices)} devices fits {hardware.name} '
                      f'({", ".join(f"{v} {k}" for k, v in skipped.items() if v)}); use more '
                      'devices, a larger --device-memory, or a smaller model or batch.')
  print(format_table(rows, skipped, hardware, devices))
  if _MEASURE.value:
    print(f'measured on {jax.device_count()} × {jax.devices()[0].device_kind}, '
          f'{_MEASURE_STEPS.value} steps each:')
    for i, r in enumerate(rows[:_MEASURE.value], 1):
      seconds = measure(r['config'], _MEASURE_STEPS.value)
      print(f'{i:>3}  {" ".join(f"{a}={n}" for a, n in r["mesh"].items())}  remat '
            f'{r["remat"]}  micro {r["micro_batches"]}  zero {r["zero"]}  split {r["split"]}  '
            f'chunk {r["loss_chunk"]}  pipeline {r["pipeline"]}: measured {seconds_text(seconds)}'
            f' per step, predicted {seconds_text(r["step_s"])} on {hardware.name}')


def cli() -> None:
  """The `jaxllm-tune` command (pyproject's console script): `python -m jaxllm.tune`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
