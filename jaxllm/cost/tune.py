"""Every mesh data·fsdp·pipe·tensor of N devices the model allows, with each micro-batch
count, remat policy, (pipe > 1) pipeline schedule and (with experts) dispatch, capacity and
expert placement: compiled from shapes, those that do not fit left out, the rest ranked by
predicted step time (`python -m jaxllm.tune` also times the best for a few real steps)."""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import itertools
import math
import sys

from ml_collections import ConfigDict

from jaxllm.backends import is_compile_only
from jaxllm.config import MESH_AXES, ROUND_TRIP_SCHEDULES, ConfigError
from jaxllm.cost.compile import step_shapes
from jaxllm.cost.compilers import Compilers, Target
from jaxllm.cost.estimate import Calibration, Estimate, estimate
from jaxllm.cost.hardware import Hardware, usable_memory
from jaxllm.cost.report import program_text, seconds_text, size_text
from jaxllm.parallel.mesh import host_split, hosts
from jaxllm.pipeline.spec import pipeline_spec
from jaxllm.validate import validate


def factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
  """Every ordered way to write n as a product of `parts` positive integers."""
  if parts == 1:
    return [(n,)]
  return [(d, *rest) for d in range(1, n + 1) if n % d == 0
          for rest in factorisations(n // d, parts - 1)]


SEQUENCE_PARALLEL = {'sharding.rules.act_seq': ('tensor',)}
CONTEXT_PARALLEL = {'sharding.rules.batch': ('data',), 'sharding.rules.seq': ('fsdp',)}
SPLITS = {  # name: (what a row says, the config fields it sets)
    'none': ('', {}),
    'sp': ('sequence parallel (tensor)', SEQUENCE_PARALLEL),
    'sp_cm': ('sequence parallel (tensor), collective matmul',
              {**SEQUENCE_PARALLEL, 'model.collective_matmul': True}),
    'cp': ('context parallel (fsdp)', CONTEXT_PARALLEL),
    'cp_sp': ('context (fsdp) + sequence (tensor) parallel',
              {**CONTEXT_PARALLEL, **SEQUENCE_PARALLEL}),
}


def with_fields(cfg: ConfigDict, fields: dict) -> ConfigDict:
  """A copy of `cfg` with the fields given by dotted paths set."""
  cfg = copy.deepcopy(cfg)
  for path, value in fields.items():
    *sections, name = path.split('.')
    node = cfg
    for section in sections:
      node = node[section]
    node[name] = value
  return cfg


@dataclasses.dataclass(frozen=True)
class Space:
  """What tune tries beside the mesh: each field's values (zero, loss_chunk and schedules
  empty: the config's). The schedules apply to meshes with pipe > 1 only."""
  remat: tuple[str, ...]
  micro_batches: tuple[int, ...] = (1,)
  zero: tuple[int, ...] = ()
  splits: tuple[str, ...] = ('none',)
  loss_chunk: tuple[int, ...] = ()
  schedules: tuple[str, ...] = ()
  # A model with experts: how tokens reach them, the capacity factor (0: dropless) and the
  # mesh axes the experts split over (sharding.rules.experts).
  dispatch: tuple[str, ...] = ()
  capacity: tuple[float, ...] = ()
  expert_axes: tuple[tuple[str, ...], ...] = ()

  def expert_fields(self, cfg: ConfigDict) -> list[dict]:
    """The expert settings to try, as config fields (the config's own where none are asked,
    and for a dense model)."""
    if not cfg.model.moe.experts:
      return [{}]
    return [{'model.moe.dispatch': d, 'model.moe.capacity_factor': f,
             'sharding.rules.experts': tuple(a)}
            for d, f, a in itertools.product(
                self.dispatch or (cfg.model.moe.dispatch,),
                self.capacity or (cfg.model.moe.capacity_factor,),
                self.expert_axes or (tuple(cfg.sharding.rules.experts),))]


def candidates(cfg: ConfigDict, devices: int, space: Space, hosts: int = 1):
  """(config, split, reason) for every combination on `devices` devices of `hosts` hosts:
  reason is None when the config is valid."""
  pipe = MESH_AXES.index('pipe')
  # A mesh with pipe=1 runs no schedule: one candidate each, the config's (None).
  meshes = [(sizes, schedule) for sizes in factorisations(devices, len(MESH_AXES))
            for schedule in (space.schedules if sizes[pipe] > 1 else ()) or (None,)]
  for (sizes, schedule), remat, micro, zero, split, chunk, experts in itertools.product(
      meshes, space.remat, space.micro_batches,
      space.zero or (cfg.sharding.zero,), space.splits,
      space.loss_chunk or (cfg.model.loss_chunk,), space.expert_fields(cfg)):
    c = with_fields(cfg, {**SPLITS[split][1], 'model.remat': remat,
                          'train.micro_batches': micro, 'sharding.zero': zero,
                          'model.loss_chunk': chunk, **experts})
    c.mesh.update(dict(zip(MESH_AXES, sizes)))
    if c.mesh.pipe > 1:
      c.pipeline.microbatches = 0  # the default, 2 × stages
    if schedule:  # validate says when the layers do not split into pipe × repeats
      # The round-trip schedules at their fewest trips, R = 2.
      c.pipeline.update(schedule=schedule, repeats=2 if schedule in ROUND_TRIP_SCHEDULES else 1)
    # The axes a split puts the sequence over: one of size 1 makes a program another split
    # (or none) already makes.
    seq_axes = {a for path, rule in SPLITS[split][1].items() if path.endswith('seq') for a in rule}
    if any(c.mesh[a] == 1 for a in seq_axes):
      yield c, split, f'{split} splits the sequence over an axis of size 1'
      continue
    if zero and c.mesh.data == 1:  # ZeRO splits over data
      yield c, split, f'sharding.zero={zero} on data=1: the same program as zero=0'
      continue
    try:
      validate(c, dict(c.mesh))
      host_split(dict(c.mesh), hosts, c.mesh.across_hosts)  # the mesh laid out over the hosts
    except ConfigError as e:
      yield c, split, str(e)
      continue
    yield c, split, None


def experts_text(c: ConfigDict) -> str:
  """A row's expert settings: '-' for a dense model, else e.g. 'ring 1.25 fsdp' (the dispatch,
  the capacity factor or 'dropless', the axes the experts split over)."""
  m = c.model.moe
  if not m.experts:
    return '-'
  capacity = f'{m.capacity_factor:g}' if m.capacity_factor else 'dropless'
  return f'{m.dispatch} {capacity} {"+".join(c.sharding.rules.experts) or "-"}'


def pipeline_text(c: ConfigDict) -> str:
  """A row's schedule: '-' without a pipeline, else e.g. '1f1b' or 'circular×2'."""
  p = c.pipeline
  if c.mesh.pipe == 1:
    return '-'
  return p.schedule + (f'×{p.repeats}' if p.repeats > 1 else '')


LEFT_OUT = {  # why a candidate is not ranked, as the table counts them
    'invalid': 'the config refuses it, or it does not compile',
    'state does not fit': 'its parameters and optimizer state alone do not fit',
    'cannot fit': 'estimated, as the compiled of its kind show the estimate errs: does not fit',
    'does not fit': 'compiled: its peak does not fit',
    'cannot win': 'estimated, as the compiled of its kind show the estimate errs: slower than '
                  'the best compiled',
}


@dataclasses.dataclass
class Outcome:
  """One candidate and what became of it: ranked (`why` empty, `report` set) or left out."""
  config: ConfigDict
  split: str
  why: str = ''                 # a LEFT_OUT key
  reason: str = ''              # the details
  report: dict | None = None    # analyze's, once compiled
  estimate: Estimate | None = None
  compile_s: float = 0.0        # CPU seconds its compile took (when it was made)
  cached: bool = False          # its program was read from the cache

  def settings(self) -> dict:
    c = self.config
    return {'mesh': {a: c.mesh[a] for a in MESH_AXES}, 'remat': c.model.remat,
            'micro_batches': c.train.micro_batches, 'zero': c.sharding.zero,
            'split': self.split, 'loss_chunk': c.model.loss_chunk, 'pipeline': pipeline_text(c),
            'experts': experts_text(c)}

  def row(self) -> dict:
    """A ranked candidate as the table and --json show it."""
    r = self.report
    return {'config': self.config, **self.settings(), 'memory': r['memory']['peak'],
            **r['prediction']}


@dataclasses.dataclass
class Ranking:
  """Every candidate's outcome; the ranked ones best first."""
  outcomes: list[Outcome]
  top: int                      # how many best are certain to be in order

  @property
  def rows(self) -> list[dict]:
    ranked = [o for o in self.outcomes if o.report and not o.why]
    return [o.row() for o in sorted(ranked, key=lambda o: o.report['prediction']['step_s'])]

  def counts(self) -> dict[str, int]:
    """How many were left out, by LEFT_OUT key (those with none left out)."""
    counts = collections.Counter(o.why for o in self.outcomes if o.why)
    return {k: counts[k] for k in LEFT_OUT if counts[k]}


def state_key(c: ConfigDict) -> str:
  """What decides the shapes of `c`'s state (not its remat policy, micro-batches, loss chunk or
  schedule): candidates that share it share `step_shapes`' state bytes."""
  c = with_fields(c, {'model.remat': '', 'model.loss_chunk': 0, 'train.micro_batches': 1,
                      'pipeline.schedule': '', 'pipeline.microbatches': 0})
  return c.to_json(sort_keys=True)


def rank(cfg: ConfigDict, hardware: Hardware, space: Space, devices, *, exhaustive: bool = False,
         top: int = 5, workers: int = 1, cache_dir: str | None = None,
         progress: Progress | None = None) -> Ranking:
  """Every candidate of `space` on `devices` (a GPU's, or CPU devices), the ones that fit
  ranked by predicted step. Each is estimated from its shapes first (`jaxllm.cost.estimate`,
  on a profile with kernel rates) and compiled best estimate first, `workers` at a time (and
  read from the program cache in `cache_dir`). `exhaustive` compiles every one whose state
  fits; otherwise, as the compiled ones show how far the estimates err
  (`estimate.Calibration`), those left whose estimate says they cannot fit, or cannot be among
  the `top` best compiled, are left out uncompiled. `progress` hears of each outcome decided,
  and of what a compiler wrote that a search does not expect."""
  progress = progress or Progress()
  usable = usable_memory(hardware)[0]
  outcomes = [Outcome(c, split, 'invalid' if reason else '', reason or '')
              for c, split, reason in candidates(cfg, len(devices), space, len(hosts(devices)[0]))]
  shapes = {}
  for o in outcomes:
    if o.why:
      continue
    key = state_key(o.config)
    if key not in shapes:
      try:
        shapes[key] = step_shapes(o.config, devices)
      except ConfigError as e:  # a dimension that does not split over its mesh axes
        shapes[key] = e
    if isinstance(step := shapes[key], ConfigError):
      o.why, o.reason = 'invalid', str(step)
      continue
    state = sum(step.state_bytes.values())
    if state > usable:
      o.why, o.reason = 'state does not fit', f'{size_text(state)} of {size_text(usable)}'
    elif hardware.rates is not None:
      o.estimate = estimate(dataclasses.replace(
          step, cfg=o.config, pipeline=pipeline_spec(o.config, o.config.mesh.pipe)), hardware)
  progress.update(outcomes)
  pending = [o for o in outcomes if not o.why]
  workers = max(1, min(workers, len(pending)))  # a process per compile at most
  compilers = Compilers(Target(hardware, len(devices), devices[0].platform), workers,
                        cache_dir, devices)
  try:
    Search(outcomes, usable, None if exhaustive else top, progress).run(pending, compilers,
                                                                        workers)
  finally:
    compilers.close()
  return Ranking(outcomes, top)


class Progress:
  """What a search tells as it goes: here nothing, and the compilers' unexpected lines on
  stderr (`jaxllm.tune` shows a progress bar)."""

  def update(self, outcomes: list[Outcome]) -> None:
    pass

  def log(self, line: str) -> None:
    print(line, file=sys.stderr)


def kind(o: Outcome) -> tuple[str, str, str]:
  """What the estimate errs alike on: the remat policy, the pipeline schedule and the experts'
  dispatch and capacity (the estimate does not see the experts' work)."""
  c = o.config
  m = c.model.moe
  return (c.model.remat, c.pipeline.schedule if c.mesh.pipe > 1 else '-',
          f'{m.dispatch} {m.capacity_factor:g}' if m.experts else '-')


@dataclasses.dataclass
class Search:
  """Compiles candidates, the most promising first; with `top`, leaves out uncompiled those
  that cannot fit or cannot be among the `top` best (see `rank`)."""
  outcomes: list[Outcome]
  usable: float
  top: int | None
  progress: Progress
  calibration: Calibration = dataclasses.field(default_factory=Calibration)

  def run(self, pending: list[Outcome], compilers: Compilers, workers: int) -> None:
    running: dict[concurrent.futures.Future, Outcome] = {}
    while pending or running:
      while pending and len(running) < workers:
        if (o := self._next(pending)) is not None:
          running[compilers.submit(o.config)] = o
      if running:
        done, _ = concurrent.futures.wait(running,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          self._record(running.pop(future), future.result())

  def _next(self, pending: list[Outcome]) -> Outcome | None:
    """Takes the candidate of least estimate (as calibrated) from `pending`; None when it
    is left out instead."""
    least = lambda o: (self.calibration.least_step(kind(o), o.estimate) or o.estimate.step_s
                       ) if o.estimate else 0.0
    o = min(pending, key=least)
    pending.remove(o)
    if self.top and o.estimate:
      peak = self.calibration.least_peak(kind(o), o.estimate)
      step = self.calibration.least_step(kind(o), o.estimate)
      if peak and peak > self.usable:
        o.why, o.reason = 'cannot fit', f'estimated at least {size_text(peak)}'
      elif step and step > self._best():
        o.why, o.reason = 'cannot win', f'estimated at least {seconds_text(step)}'
      if o.why:
        self.progress.update(self.outcomes)
        return None
    return o

  def _record(self, o: Outcome, attempt) -> None:
    for line in attempt.log:
      self.progress.log(line)
    o.compile_s, o.cached = attempt.compile_s, attempt.cached
    if attempt.report is None:
      o.why, o.reason = 'invalid', attempt.error
    else:
      o.report = attempt.report
      peak, step = attempt.report['memory']['peak'], attempt.report['prediction']['step_s']
      if o.estimate:
        self.calibration.add(kind(o), o.estimate, step, peak)
      if not attempt.report['fits']:
        o.why, o.reason = 'does not fit', f'{size_text(peak)} of {size_text(self.usable)}'
    self.progress.update(self.outcomes)

  def _best(self) -> float:
    """The `top`-th best compiled step that fits (infinity until there are as many)."""
    steps = sorted(o.report['prediction']['step_s'] for o in self.outcomes
                   if o.report and not o.why)
    return steps[self.top - 1] if len(steps) >= self.top else math.inf


def format_table(rows: list[dict], skipped: dict, hardware: Hardware, devices) -> str:
  """The ranked rows, under a line that says how many were left out and why (`skipped`:
  counts by LEFT_OUT key)."""
  program = program_text(devices[0].platform, len(devices), devices[0].device_kind,
                         is_compile_only(devices[0]))
  lines = [f'{len(rows)} candidates fit {hardware.name} '
           f'({", ".join(f"{v} {k}" for k, v in skipped.items() if v) or "none left out"}); '
           f'{program}; predicted, best first:',
           f'{"#":>3}  {"data":>4} {"fsdp":>4} {"pipe":>4} {"tensor":>6}  {"remat":15} '
           f'{"micro":>5} {"zero":>4} {"split":5} {"chunk":>5} {"pipeline":18}  '
           f'{"memory/device":>13}  {"step":>10}  {"tokens/s":>12}  {"MFU":>6}  {"matmul":>6} '
           f'{"memory":>6} {"comm":>6}']
  experts = any(r['experts'] != '-' for r in rows)  # a column for a model with experts
  if experts:
    lines[1] += f'  {"experts":20}'
  for i, r in enumerate(rows, 1):
    m, step = r['mesh'], r['step_s']
    lines.append(
        f'{i:>3}  {m["data"]:>4} {m["fsdp"]:>4} {m["pipe"]:>4} {m["tensor"]:>6}  '
        f'{r["remat"]:15} {r["micro_batches"]:>5} {r["zero"]:>4} {r["split"]:5} '
        f'{r["loss_chunk"]:>5} {r["pipeline"]:18}  {size_text(r["memory"]):>13}  '
        f'{seconds_text(step):>10}  {r["tokens_per_s"]:>12,.0f}  {r["mfu"]:>6.1%}  '
        f'{(r["gemm_s"] + r["attention_s"]) / step:>6.0%} '
        f'{(r["memory_s"] + r["launch_s"]) / step:>6.0%} {r["exposed_comm_s"] / step:>6.0%}'
        + (f'  {r["experts"]:20}' if experts else ''))
  lines.append('matmul: GEMMs and attention; memory: memory-bound kernels and launches; comm: '
               'communication not hidden behind kernels (shares of the step)')
  return '\n'.join(lines)
