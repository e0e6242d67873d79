"""`python -m jaxllm.train --config configs/X.py [--config.a.b=v ...] [--workdir DIR]`

Wires config, mesh, model, data and step together; no math lives here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Iterator

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxllm import metrics
from jaxllm.config import main_guard, parse_command_line, resolve_mesh, validate
from jaxllm.data import make_batches
from jaxllm.mesh import make_mesh, sharding_context
from jaxllm.optim import lr_schedule, make_optimizer
from jaxllm.pipeline import PipelineSpec, pipeline_spec
from jaxllm.step import TrainState, init_state, make_train_step


@dataclasses.dataclass
class Run:
  """Everything a training loop needs, built and checked from one config."""
  cfg: ConfigDict
  mesh: jax.sharding.Mesh
  state: TrainState
  train_step: Callable       # jitted (state, batch) -> (state, metrics); state is donated
  batches: Iterator[dict[str, jax.Array]]
  pipeline: PipelineSpec | None  # None when mesh.pipe == 1


def setup(cfg: ConfigDict, devices=None) -> Run:
  """Validates the config against the devices, then builds mesh, data, state and step.

  `devices`: the devices to run on (default: all of them).
  """
  cfg = ConfigDict(cfg)  # our own copy: resolving fallbacks below must not leak back
  devices = jax.devices() if devices is None else devices
  mesh_shape = resolve_mesh(cfg.mesh, len(devices))
  validate(cfg, mesh_shape)
  if cfg.model.attention == 'cudnn' and jax.default_backend() != 'gpu':
    print(f"note: model.attention='cudnn' needs an NVIDIA GPU, but the backend is "
          f"{jax.default_backend()}; using 'xla' attention.")
    cfg.model.attention = 'xla'
  mesh = make_mesh(mesh_shape, devices)
  batches = make_batches(cfg, mesh)
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  pipeline = pipeline_spec(cfg, mesh_shape['pipe'])
  graphdef, state, shardings = init_state(cfg.model, tx, mesh, cfg.sharding.rules,
                                          cfg.train.seed, pipeline)
  step = make_train_step(graphdef, tx, lr_schedule(cfg.optim, cfg.train.steps),
                         cfg.train.micro_batches, pipeline)
  train_step = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))
  return Run(cfg, mesh, state, train_step, batches, pipeline)


def describe(cfg: ConfigDict, mesh: jax.sharding.Mesh, pipeline: PipelineSpec | None) -> str:
  """The derived numbers a user should see before the first step."""
  t, m = cfg.train, cfg.model
  shards = mesh.shape['data'] * mesh.shape['fsdp']
  params = metrics.param_counts(m)
  flops = metrics.flops_per_token(m, cfg.data.seq_len)
  micro = t.global_batch // t.micro_batches
  devices = mesh.devices.flat
  return '\n'.join([
      f'devices  {mesh.size} × {devices[0].device_kind}   mesh  ' +
      ' '.join(f'{a}={n}' for a, n in mesh.shape.items()),
      f'model    {params["total"] / 1e6:,.2f}M parameters ({params["embedding"] / 1e6:,.2f}M '
      f'embedding); {flops["full"] / 1e6:,.1f} MFLOP/token (6N + 12LHQT, full attention), '
      f'{flops["causal"] / 1e6:,.1f} with causal halving',
      f'batch    global {t.global_batch} sequences × {cfg.data.seq_len} tokens = '
      f'{t.global_batch * cfg.data.seq_len:,} tokens/step; {t.global_batch // shards} sequences '
      f'per data×fsdp shard ({shards} shards); {t.micro_batches} micro-batch(es) of {micro} '
      f'({micro // shards} per shard)',
      f'compute  {m.dtype} (params {m.param_dtype}), attention {m.attention}, remat {m.remat}',
  ] + ([
      f'pipeline {cfg.pipeline.schedule}: S={pipeline.stages} stages × R={pipeline.repeats} '
      f'repeats, M={pipeline.microbatches} micro-batches of {micro // pipeline.microbatches}, '
      f'{m.num_layers // (pipeline.stages * pipeline.repeats)} layers per stage visit, '
      f'bubble (S-1)/(R·M+S-1) = {pipeline.bubble_fraction:.1%}, stage weights gathered '
      f'once per {cfg.pipeline.gather_weights}'] if pipeline else []))


def train(cfg: ConfigDict, workdir: str | None = None, devices=None):
  """Trains for `cfg.train.steps` steps. Returns the final state and the logged rows."""
  run = setup(cfg, devices)
  cfg, state = run.cfg, run.state
  log = metrics.MetricsLog(workdir, cfg.train.steps, enabled=metrics.is_logging_process())
  log.info(describe(cfg, run.mesh, run.pipeline))
  if workdir and metrics.is_logging_process():
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(cfg.to_json(indent=2))
    log.info(f'workdir  {workdir}')

  tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
  flops = metrics.flops_per_token(cfg.model, cfg.data.seq_len)
  peak = metrics.peak_flops(run.mesh.devices.flat[0], cfg.train.peak_flops)

  batch = next(run.batches)
  start = time.perf_counter()
  with sharding_context(run.mesh, cfg.sharding.rules):
    step_fn = run.train_step.lower(state, batch).compile()
  log.info(f'compiled the train step in {time.perf_counter() - start:.1f}s')

  history, pending, data_time = [], [], 0.0
  interval_start = time.perf_counter()
  for step in range(int(state.step) + 1, cfg.train.steps + 1):
    state, step_metrics = step_fn(state, batch)
    pending.append(step_metrics)
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
      values = jax.device_get(pending)  # the only host sync: once per logging interval
      step_time = (time.perf_counter() - interval_start) / len(values)
      row = {'step': step,
             'loss': float(np.mean([v['loss'] for v in values])),
             'grad_norm': float(np.mean([v['grad_norm'] for v in values])),
             'lr': float(values[-1]['lr']),
             'step_time': step_time,
             'data_time': data_time / len(values),
             'tokens_per_sec': tokens_per_step / step_time}
      if peak:
        achieved = row['tokens_per_sec'] / run.mesh.size / peak
        row['mfu'] = flops['full'] * achieved
        row['mfu_causal'] = flops['causal'] * achieved
      history.append(row)
      log.write(row, len(values))
      pending, data_time = [], 0.0
      interval_start = time.perf_counter()
    if step < cfg.train.steps:
      fetch_start = time.perf_counter()
      batch = next(run.batches)
      data_time += time.perf_counter() - fetch_start
  log.close()
  return state, history


def main(argv: list[str]) -> None:
  cfg, workdir = parse_command_line(argv)
  if cfg.cpu_devices:
    # Must happen before JAX starts its backends; only the CPU backend reads it.
    jax.config.update('jax_num_cpu_devices', cfg.cpu_devices)
  train(cfg, workdir)


if __name__ == '__main__':
  main_guard(main)
