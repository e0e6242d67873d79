"""`python -m jaxllm.tune --config configs/X.py --devices N [--hardware h100-nvlink] [--measure K]`

Tries every mesh data·fsdp·pipe·tensor = N that the model allows, with each remat policy,
micro-batch count, ZeRO stage, sequence or context split, loss chunk, (on meshes with
pipe > 1) pipeline schedule and (with experts) dispatch, capacity factor and expert placement
asked for, and ranks those that fit what a process may use of the device's memory by
predicted step time. Each candidate is first estimated from its shapes
(`jaxllm.cost.estimate`); those the estimate rules out are left out, the rest are compiled from
shapes for the profile's GPU (as `jaxllm.analyze` does, with its --compiler and --devices), best
estimate first, in parallel processes, each compiled program kept in a cache. `--exhaustive`
compiles every one. A progress bar says how far it is; `--json` prints every candidate.
`--measure K` then runs the best K for a few real steps on the devices present, beside the
prediction.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time

import jax
from absl import flags
from ml_collections import ConfigDict
from tqdm import tqdm

from jaxllm import analyze
from jaxllm.backends import is_compile_only, user_cache
from jaxllm.cli import main_guard
from jaxllm.config import DISPATCHES, MESH_AXES, PIPELINE_SCHEDULES, REMAT_POLICIES, ConfigError
from jaxllm.cost.report import seconds_text
from jaxllm.cost.tune import LEFT_OUT, SPLITS, Outcome, Progress, Space, format_table, rank
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
_DISPATCH = flags.DEFINE_list('dispatch', [], 'A model with experts: model.moe.dispatch values '
                              f'to try, from {", ".join(DISPATCHES)} (default: the config\'s).')
_CAPACITY = flags.DEFINE_list('capacity', [], 'A model with experts: model.moe.capacity_factor '
                              'values to try, 0 for dropless (default: the config\'s).')
_EXPERT_AXES = flags.DEFINE_list('expert-axes', [], 'A model with experts: the mesh axes to '
                                 'split the experts over (sharding.rules.experts), joined by + '
                                 'within one placement, e.g. fsdp,data+fsdp (default: the '
                                 'config\'s).')
_EXHAUSTIVE = flags.DEFINE_bool('exhaustive', False, 'Compile every candidate whose state fits, '
                                'none left out by its estimate.')
_TOP = flags.DEFINE_integer('top', 5, 'The best this many are ranked in their exact order (the '
                            'rest of the table may lack candidates the estimate left out).')
_WORKERS = flags.DEFINE_integer('workers', 0, 'Compile in this many processes (default: one '
                                'per CPU core, at most 4).')
_CACHE = flags.DEFINE_string('cache', 'auto', 'Where compiled programs are kept and read back '
                             "('auto': jaxllm/programs in the user's cache directory; '': "
                             'nowhere).')


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
  if _TOP.value < 1:
    raise ConfigError(f'--top={_TOP.value} must be at least 1.')
  if _WORKERS.value < 0:
    raise ConfigError(f'--workers={_WORKERS.value} must be at least 1 (0: one per CPU core).')
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
  for dispatch in _DISPATCH.value:
    if dispatch not in DISPATCHES:
      raise ConfigError(f'--dispatch={dispatch!r} is unknown; model.moe.dispatch takes '
                        f'{", ".join(DISPATCHES)}.')
  try:
    capacity = tuple(float(v) for v in _CAPACITY.value)
  except ValueError:
    capacity = (-1.0,)
  if any(not (math.isfinite(f) and f >= 0) for f in capacity):
    raise ConfigError(f'--capacity={",".join(_CAPACITY.value)} must be capacity factors of at '
                      'least 0 (0: dropless), e.g. 0,1.25.')
  expert_axes = tuple(tuple(a.split('+')) for a in _EXPERT_AXES.value)
  for axes in expert_axes:
    if not set(axes) <= set(MESH_AXES) or len(set(axes)) < len(axes):
      raise ConfigError(f'--expert-axes={"+".join(axes)} must name mesh axes from '
                        f'{", ".join(MESH_AXES)}, each once, joined by +, e.g. fsdp,data+fsdp.')
  return Space(tuple(remats), _integers(_MICRO_BATCHES, 1, '1,2,4'), zero, tuple(_SPLITS.value),
               chunks, tuple(_SCHEDULES.value), tuple(_DISPATCH.value), capacity, expert_axes)


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
  cfg, hardware, devices = analyze.parse_and_place(argv, __doc__)
  space = check_flags()
  if not cfg.model.moe.experts and (space.dispatch or space.capacity or space.expert_axes):
    raise ConfigError('--dispatch, --capacity and --expert-axes search a model with experts; '
                      'this config has none (model.moe.experts=0): leave them out.')
  if hardware.rates is None:
    raise ConfigError(f'--hardware={hardware.name} has no measured kernel rates to rank by; use '
                      'h100-nvlink or h200-nvlink (analyze still reads its memory and traffic).')
  # --measure runs the candidates on devices present: those ranked for (--compiler=cpu), or
  # as many as the GPUs compiled for.
  present = jax.devices() if is_compile_only(devices[0]) else devices
  if _MEASURE.value and len(present) != len(devices):
    raise ConfigError(f'--measure runs the candidates on the devices present, '
                      f'{len(present)} × {present[0].device_kind}; rank for as many '
                      f'(--devices {len(present)}) or leave --measure out.')
  start = time.perf_counter()
  with ProgressBar() as bar:
    ranking = rank(cfg, hardware, space, devices, exhaustive=_EXHAUSTIVE.value, top=_TOP.value,
                   workers=_WORKERS.value or min(4, len(os.sched_getaffinity(0))),
                   cache_dir=cache_directory(_CACHE.value), progress=bar)
  rows, skipped = ranking.rows, ranking.counts()
  if analyze.JSON.value:
    print(json.dumps(search_json(ranking, hardware, len(devices), time.perf_counter() - start),
                     indent=1))
  if not rows:
    left = ", ".join(f"{v} {k}" for k, v in skipped.items() if v)
    if list(skipped) == ['invalid']:  # the config's own errors: the commonest says what to fix
      reasons = collections.Counter(o.reason for o in ranking.outcomes)
      raise ConfigError(f'no mesh of {len(devices)} devices fits {hardware.name} ({left}, most '
                        f'often: {reasons.most_common(1)[0][0]})')
    raise ConfigError(f'no mesh of {len(devices)} devices fits {hardware.name} ({left}); use '
                      'more devices, a larger --device-memory, or a smaller model or batch.')
  if analyze.JSON.value:
    return
  print(format_table(rows, skipped, hardware, devices))
  if _MEASURE.value:
    print(f'measured on {len(present)} × {present[0].device_kind}, '
          f'{_MEASURE_STEPS.value} steps each:')
    for i, r in enumerate(rows[:_MEASURE.value], 1):
      seconds = measure(r['config'], _MEASURE_STEPS.value, present)
      print(f'{i:>3}  {" ".join(f"{a}={n}" for a, n in r["mesh"].items())}  remat '
            f'{r["remat"]}  micro {r["micro_batches"]}  zero {r["zero"]}  split {r["split"]}  '
            f'chunk {r["loss_chunk"]}  pipeline {r["pipeline"]}: measured {seconds_text(seconds)}'
            f' per step, predicted {seconds_text(r["step_s"])} on {hardware.name}')


def cache_directory(setting: str) -> str | None:
  """The directory --cache names ('auto': the user's cache; '': none)."""
  if not setting:
    return None
  return user_cache('programs') if setting == 'auto' else os.path.expanduser(setting)


def outcome_json(o: Outcome) -> dict:
  """One candidate for --json: its settings, and its report's figures or why it was left out."""
  d = o.settings()
  if o.why:
    d.update(left_out=o.why, reason=o.reason)
  if o.report:
    d.update(memory=o.report['memory']['peak'], fits=o.report['fits'],
             prediction={k: v for k, v in o.report['prediction'].items() if k != 'top_kernels'},
             compile_s=o.compile_s, cached=o.cached)
  if o.estimate:
    d['estimate'] = {'step_s': o.estimate.step_s, 'memory_floor': o.estimate.memory}
  return d


def search_json(ranking, hardware, devices: int, seconds: float) -> dict:
  """The whole search for --json: ranked candidates best first, then those left out."""
  ranked = {id(r['config']): i for i, r in enumerate(ranking.rows, 1)}
  candidates = []
  for o in ranking.outcomes:
    d = outcome_json(o)
    if id(o.config) in ranked:
      d['rank'] = ranked[id(o.config)]
    candidates.append(d)
  candidates.sort(key=lambda d: (d.get('rank', math.inf)))
  return {'hardware': hardware.name, 'devices': devices, 'top_in_order': ranking.top,
          'left_out': ranking.counts(), 'why': LEFT_OUT, 'seconds': seconds,
          'compiled': sum(1 for o in ranking.outcomes if o.report and not o.cached),
          'cached': sum(1 for o in ranking.outcomes if o.cached), 'candidates': candidates}


class ProgressBar(Progress):
  """tqdm over the candidates: how many are decided, compiled and left out (by why), and the
  best step so far; on a terminal only. It writes to its own copy of stderr, which the
  compilers' capture of file descriptor 2 leaves alone."""

  def __enter__(self):
    self.stream = os.fdopen(os.dup(2), 'w')
    self.bar = tqdm(total=0, unit=' candidates', file=self.stream, disable=None,
                    dynamic_ncols=True)
    return self

  def __exit__(self, *_):
    self.bar.close()
    self.stream.close()

  def update(self, outcomes: list[Outcome]) -> None:
    self.bar.total = len(outcomes)
    self.bar.n = sum(1 for o in outcomes if o.why or o.report)
    self.bar.set_postfix_str(progress_text(outcomes), refresh=True)

  def log(self, line: str) -> None:
    self.bar.write(line, file=sys.stderr)


def progress_text(outcomes: list[Outcome]) -> str:
  """What the progress bar says beside its count of candidates decided: how many were
  compiled, left out (by why) and the best predicted step of those that fit."""
  compiled = sum(1 for o in outcomes if o.report)
  left = collections.Counter(o.why for o in outcomes if o.why)
  ranked = [o.report['prediction']['step_s'] for o in outcomes if o.report and not o.why]
  return (f'compiled {compiled}, left out {sum(left.values())}'
          + (f' ({", ".join(f"{n} {k}" for k, n in left.items())})' if left else '')
          + f', best {seconds_text(min(ranked)) if ranked else "–"}')


def cli() -> None:
  """The `jaxllm-tune` command (pyproject's console script): `python -m jaxllm.tune`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
