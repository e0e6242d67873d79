"""Every mesh data·fsdp·pipe·tensor of N devices the model allows, with each micro-batch
count, remat policy and (pipe > 1) pipeline schedule: compiled from shapes, those that do not
fit left out, the rest ranked by predicted step time (`python -m jaxllm.tune` also times the best
for a few real steps)."""

from __future__ import annotations

import copy
import dataclasses
import itertools

from ml_collections import ConfigDict

from jaxllm.backends import is_compile_only
from jaxllm.checkpoint import restore_target
from jaxllm.config import MESH_AXES, ROUND_TRIP_SCHEDULES, ConfigError
from jaxllm.cost.compile import shard_bytes
from jaxllm.cost.hardware import Hardware, usable_memory
from jaxllm.cost.report import analyze, program_text, seconds_text, size_text
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import derive
from jaxllm.pipeline.spec import pipeline_spec
from jaxllm.step import state_shapes
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


def candidates(cfg: ConfigDict, devices: int, space: Space):
  """(config, split, reason) for every combination: reason is None when the config is valid."""
  pipe = MESH_AXES.index('pipe')
  # A mesh with pipe=1 runs no schedule: one candidate each, the config's (None).
  meshes = [(sizes, schedule) for sizes in factorisations(devices, len(MESH_AXES))
            for schedule in (space.schedules if sizes[pipe] > 1 else ()) or (None,)]
  for (sizes, schedule), remat, micro, zero, split, chunk in itertools.product(
      meshes, space.remat, space.micro_batches,
      space.zero or (cfg.sharding.zero,), space.splits,
      space.loss_chunk or (cfg.model.loss_chunk,)):
    c = with_fields(cfg, {**SPLITS[split][1], 'model.remat': remat,
                          'train.micro_batches': micro, 'sharding.zero': zero,
                          'model.loss_chunk': chunk})
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
    except ConfigError as e:
      yield c, split, str(e)
      continue
    yield c, split, None


def pipeline_text(c: ConfigDict) -> str:
  """A row's schedule: '-' without a pipeline, else e.g. '1f1b' or 'circular×2'."""
  p = c.pipeline
  if c.mesh.pipe == 1:
    return '-'
  return p.schedule + (f'×{p.repeats}' if p.repeats > 1 else '')


def state_fits(c: ConfigDict, hardware: Hardware, devices) -> bool:
  """Whether parameters and optimizer state alone fit (from shapes, without compiling)."""
  mesh = make_mesh(dict(c.mesh), devices)
  layout = derive(c.sharding.rules, dict(c.mesh), c.model, c.sharding.zero)
  tx = make_optimizer(c.optim, c.train.steps)
  _, abstract, shardings = state_shapes(c.model, tx, mesh, layout.rules, c.train.seed,
                                        pipeline_spec(c, c.mesh.pipe), layout.zero)
  state = restore_target(abstract, shardings)
  return shard_bytes(state) <= usable_memory(hardware)[0]


def rank(cfg: ConfigDict, hardware: Hardware, space: Space, devices):
  """The candidates that fit, best first, as rows; and how many were left out, and why.
  `devices`: those to compile for (a GPU's, or CPU devices)."""
  rows, skipped = [], {'invalid': 0, 'state does not fit': 0, 'does not fit': 0}
  for c, split, reason in candidates(cfg, len(devices), space):
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
    report = analyze(c, hardware, devices)
    if not report['fits']:
      skipped['does not fit'] += 1
      continue
    rows.append({'config': c, 'mesh': report['mesh'], 'remat': c.model.remat,
                 'micro_batches': c.train.micro_batches, 'zero': c.sharding.zero,
                 'split': split, 'loss_chunk': c.model.loss_chunk, 'pipeline': pipeline_text(c),
                 'memory': report['memory']['peak'], **report['prediction']})
  rows.sort(key=lambda r: r['step_s'])
  return rows, skipped


def format_table(rows: list[dict], skipped: dict, hardware: Hardware, devices) -> str:
  program = program_text(devices[0].platform, len(devices), devices[0].device_kind,
                         is_compile_only(devices[0]))
  lines = [f'{len(rows)} candidates fit {hardware.name} '
           f'({", ".join(f"{v} {k}" for k, v in skipped.items() if v) or "none left out"}); '
           f'{program}; predicted, best first:',
           f'{"#":>3}  {"data":>4} {"fsdp":>4} {"pipe":>4} {"tensor":>6}  {"remat":15} '
           f'{"micro":>5} {"zero":>4} {"split":5} {"chunk":>5} {"pipeline":18}  '
           f'{"memory/device":>13}  {"step":>10}  {"tokens/s":>12}  {"MFU":>6}  {"matmul":>6} '
           f'{"memory":>6} {"comm":>6}']
  for i, r in enumerate(rows, 1):
    m, step = r['mesh'], r['step_s']
    lines.append(
        f'{i:>3}  {m["data"]:>4} {m["fsdp"]:>4} {m["pipe"]:>4} {m["tensor"]:>6}  '
        f'{r["remat"]:15} {r["micro_batches"]:>5} {r["zero"]:>4} {r["split"]:5} '
        f'{r["loss_chunk"]:>5} {r["pipeline"]:18}  {size_text(r["memory"]):>13}  '
        f'{seconds_text(step):>10}  {r["tokens_per_s"]:>12,.0f}  {r["mfu"]:>6.1%}  '
        f'{(r["gemm_s"] + r["attention_s"]) / step:>6.0%} '
        f'{(r["memory_s"] + r["launch_s"]) / step:>6.0%} {r["exposed_comm_s"] / step:>6.0%}')
  lines.append('matmul: GEMMs and attention; memory: memory-bound kernels and launches; comm: '
               'communication not hidden behind kernels (shares of the step)')
  return '\n'.join(lines)
