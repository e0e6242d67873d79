"""Every mesh data·fsdp·pipe·tensor of N devices the model allows, with each micro-batch
count and remat policy: compiled from shapes, those that do not fit left out, the rest ranked
by predicted step time; and the best timed for a few real steps."""

from __future__ import annotations

import copy
import itertools
import time

import jax
from ml_collections import ConfigDict

from jaxllm.backends import is_compile_only
from jaxllm.checkpoint import restore_target
from jaxllm.config import MESH_AXES, ConfigError
from jaxllm.cost.compile import shard_bytes
from jaxllm.cost.hardware import Hardware, usable_memory
from jaxllm.cost.report import analyze, program_text, seconds_text, size_text
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.parallel.pipeline import pipeline_spec
from jaxllm.parallel.rules import derive
from jaxllm.step import state_shapes
from jaxllm.validate import validate


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
    c = copy.deepcopy(cfg)  # each candidate its own
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
  layout = derive(c.sharding.rules, dict(c.mesh), c.model, c.sharding.zero)
  tx = make_optimizer(c.optim, c.train.steps)
  _, abstract, shardings = state_shapes(c.model, tx, mesh, layout.rules, c.train.seed,
                                        pipeline_spec(c, c.mesh.pipe), layout.zero)
  state = restore_target(abstract, shardings)
  return shard_bytes(state) <= usable_memory(hardware)[0]


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
    report = analyze(c, hardware, devices)
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


def format_table(rows: list[dict], skipped: dict, hardware: Hardware, devices) -> str:
  program = program_text(devices[0].platform, len(devices), devices[0].device_kind,
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
        f'{r["remat"]:5} {r["micro_batches"]:>5}  {size_text(r["memory"]):>13}  '
        f'{seconds_text(step):>10}  {r["tokens_per_s"]:>12,.0f}  {r["mfu"]:>6.1%}  '
        f'{r["compute_s"] / step:>7.0%} {r["bubble_s"] / step:>6.0%} '
        f'{r["exposed_comm_s"] / step:>6.0%}')
  return '\n'.join(lines)

