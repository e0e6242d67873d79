"""`python -m jaxllm.tune --config configs/X.py --devices N [--hardware h100-nvlink] [--measure K]`

Tries every mesh data·fsdp·pipe·tensor = N that the model allows, with each micro-batch count
and remat policy asked for: compiles each from shapes for the profile's GPU (as
`jaxllm.analyze` does, with its --compiler and --devices), drops those that do not fit what a
process may use of the device's memory, and ranks the rest by predicted step time.
`--measure K` then runs the best K for a few real steps on the devices present, beside the
prediction.
"""

from __future__ import annotations

import jax
from absl import flags

from jaxllm import analyze
from jaxllm.cli import main_guard
from jaxllm.config import REMAT_POLICIES, ConfigError
from jaxllm.cost.report import seconds_text
from jaxllm.cost.tune import format_table, measure, rank

_MEASURE = flags.DEFINE_integer('measure', 0, 'Run the best K candidates for a few steps.')
_MEASURE_STEPS = flags.DEFINE_integer('measure-steps', 3, 'Timed steps per measured candidate.')
_REMAT = flags.DEFINE_list('remat', ['none', 'full'], 'Remat policies to try.')
_MICRO_BATCHES = flags.DEFINE_list('micro-batches', ['1', '2'], 'train.micro_batches to try.')


def check_flags() -> tuple[list[str], list[int]]:
  """The ranges of tune's own flags; returns the remat policies and micro-batch counts. (An
  empty list or a count of 0 would otherwise read as 'no mesh fits'.)"""
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
  try:
    micro_batches = [int(m) for m in _MICRO_BATCHES.value]
  except ValueError:
    micro_batches = []
  if not micro_batches or min(micro_batches) < 1:
    raise ConfigError(f'--micro-batches={",".join(_MICRO_BATCHES.value)} must be integers of '
                      'at least 1, e.g. 1,2,4.')
  return remats, micro_batches


def main(argv: list[str]) -> None:
  cfg, hardware, devices = analyze.parse_and_place(argv)
  remats, micro_batches = check_flags()
  if _MEASURE.value and len(devices) != jax.device_count():
    raise ConfigError(f'--measure runs the candidates on the devices present, '
                      f'{jax.device_count()} × {jax.devices()[0].device_kind}; rank for as many '
                      f'(--devices {jax.device_count()}) or leave --measure out.')
  rows, skipped = rank(cfg, hardware, remats, micro_batches, devices)
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
            f'{r["remat"]}  micro {r["micro_batches"]}: measured {seconds_text(seconds)}'
            f' per step, predicted {seconds_text(r["step_s"])} on {hardware.name}')


def cli() -> None:
  """The `jaxllm-tune` command (pyproject's console script): `python -m jaxllm.tune`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
