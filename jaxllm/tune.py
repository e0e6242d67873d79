"""`python -m jaxllm.tune --config configs/X.py --devices N [--hardware h100-nvlink] [--measure K]`

Tries every mesh data·fsdp·pipe·tensor = N that the model allows, with each micro-batch count
and remat policy asked for: compiles each from shapes for the profile's GPU (as
`jaxllm.analyze` does, with its --compiler and --devices), drops those that do not fit what a
process may use of the device's memory, and ranks the rest by predicted step time.
`--measure K` then runs the best K for a few real steps on the devices present, beside the
prediction.
"""

from __future__ import annotations

import copy
import itertools
import time

import jax
from absl import flags
from ml_collections import ConfigDict

from jaxllm import analyze
from jaxllm.backends import is_compile_only
from jaxllm.config import MESH_AXES, REMAT_POLICIES, ConfigError, main_guard, validate
from jaxllm.hardware import Hardware, usable_memory
from jaxllm.mesh import make_mesh, sharding_context
from jaxllm.optim import make_optimizer
from jaxllm.pipeline import pipeline_spec
from jaxllm.checkpoint import restore_target
from jaxllm.step import state_shapes

_MEASURE = flags.DEFINE_integer('measure', 0, 'Run the best K candidates for a few steps.')
_MEASURE_STEPS = flags.DEFINE_integer('measure-steps', 3, 'Timed steps per measured candidate.')
_REMAT = flags.DEFINE_list('remat', ['none', 'full'], 'Remat policies to try.')
_MICRO_BATCHES = flags.DEFINE_list('micro-batches', ['1', '2'], 'train.micro_batches to try.')


def factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
  """Every ordered way to write n as a product of `parts` positive integers."""
  if parts == 1:
    return [(n,)]
  return [(d, *rest) for d in range(1, n + 1) if n % d == 0
          for rest in factorisations(n // d, parts - 1)]


def candidates(cfg: ConfigDict, devices: int, remats, micro_batches):
  """(config, reason) for every combination: reason is None when the config is valid."""
  for sizes, remat, micro in itertools.product(factorisations(devices, len(MESH_AXES)),
                                               remats, micro_batches):
    c = copy.deepcopy(cfg)  # each candidate its own (validate may change its rules)
    c.mesh.update(dict(zip(MESH_AXES, sizes)))
    c.model.remat, c.train.micro_batches = remat, micro
    if c.mesh.pipe > 1:
      c.pipeline.microbatches = 0  # the default, 2 × stages
    try:
      validate(c, dict(c.mesh))
    except ConfigError as e:
      yield c, str(e)
      continue
    yield c, None


def state_fits(c: ConfigDict, hardware: Hardware, devices) -> bool:
  """Whether parameters and optimizer state alone fit (from shapes, without compiling)."""
  mesh = make_mesh(dict(c.mesh), devices)
  tx = make_optimizer(c.optim, c.train.steps)
  _, abstract, shardings = state_shapes(c.model, tx, mesh, c.sharding.rules, c.train.seed,
                                        pipeline_spec(c, c.mesh.pipe), c.sharding.zero)
  state = restore_target(abstract, shardings)
  return analyze.shard_bytes(state) <= usable_memory(hardware)[0]


def rank(cfg: ConfigDict, hardware: Hardware, remats, micro_batches, devices):
  """The candidates that fit, best first, as rows; and how many were left out, and why.
  `devices`: those to compile for (a GPU's, or CPU devices)."""
  rows, skipped = [], {'invalid': 0, 'state does not fit': 0, 'does not fit': 0}
  for c, reason in candidates(cfg, len(devices), remats, micro_batches):
    if reason:
      skipped['invalid'] += 1
      continue
    try:
      fits = state_fits(c, hardware, devices)
    except ConfigError:  # a dimension that does not split over its mesh axes
      skipped['invalid'] += 1
      continue
    if not fits:
      skipped['state does not fit'] += 1
      continue
    report = analyze.analyze(c, hardware, devices)
    if not report['fits']:
      skipped['does not fit'] += 1
      continue
    rows.append({'config': c, 'mesh': report['mesh'], 'remat': c.model.remat,
                 'micro_batches': c.train.micro_batches, 'memory': report['memory']['peak'],
                 **report['prediction']})
  rows.sort(key=lambda r: r['step_s'])
  return rows, skipped


def measure(c: ConfigDict, steps: int, devices=None) -> float:
  """Seconds per train step of `c` on `devices` (default: all present), after two warm-up
  steps."""
  from jaxllm.train import setup  # the real run: data, state and all
  run = setup(c, devices)
  state, batch = run.state, next(run.batches)
  with sharding_context(run.mesh, c.sharding.rules):
    step = run.train_step.lower(state, batch).compile()
  for _ in range(2):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, _ = step(state, next(run.batches))
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / steps


def format_table(rows: list[dict], skipped: dict, hardware: Hardware, devices) -> str:
  program = analyze.program_text(devices[0].platform, len(devices), devices[0].device_kind,
                                 is_compile_only(devices[0]))
  lines = [f'{len(rows)} candidates fit {hardware.name} '
           f'({", ".join(f"{v} {k}" for k, v in skipped.items() if v) or "none left out"}); '
           f'{program}; predicted, best first:',
           f'{"#":>3}  {"data":>4} {"fsdp":>4} {"pipe":>4} {"tensor":>6}  {"remat":5} {"micro":>5}  '
           f'{"memory/device":>13}  {"step":>10}  {"tokens/s":>12}  {"MFU":>6}  '
           f'{"compute":>7} {"bubble":>6} {"comm":>6}']
  for i, r in enumerate(rows, 1):
    m, step = r['mesh'], r['step_s']
    lines.append(
        f'{i:>3}  {m["data"]:>4} {m["fsdp"]:>4} {m["pipe"]:>4} {m["tensor"]:>6}  '
        f'{r["remat"]:5} {r["micro_batches"]:>5}  {analyze.size_text(r["memory"]):>13}  '
        f'{analyze.seconds_text(step):>10}  {r["tokens_per_s"]:>12,.0f}  {r["mfu"]:>6.1%}  '
        f'{r["compute_s"] / step:>7.0%} {r["bubble_s"] / step:>6.0%} '
        f'{r["exposed_comm_s"] / step:>6.0%}')
  return '\n'.join(lines)


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
            f'{r["remat"]}  micro {r["micro_batches"]}: measured {analyze.seconds_text(seconds)}'
            f' per step, predicted {analyze.seconds_text(r["step_s"])} on {hardware.name}')


def cli() -> None:
  """The `jaxllm-tune` command (pyproject's console script): `python -m jaxllm.tune`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
