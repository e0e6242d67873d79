"""`python -m jaxllm.train --config configs/X.py [--config.a.b=v ...] [--workdir DIR]`

Wires config, mesh, model, data and step together; no math lives here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import threading
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from jaxllm import distributed, hf, metrics
from jaxllm.backends import (compiler_options, counting_cache_hits, start_backends,
                             use_compilation_cache)
from jaxllm.checkpoint import Checkpoints, restore_params, restore_router_bias, restore_target
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import TrainingError, default_config, moe_layers
from jaxllm.data import Streams, make_batches, make_eval_batches
from jaxllm.model import fp8, with_available_attention
from jaxllm.optim import make_optimizer, warmup_steps
from jaxllm.parallel.mesh import host_split, hosts, make_mesh, sharding_context
from jaxllm.parallel.rules import Layout, derive, mesh_axes, parts
from jaxllm.pipeline.spec import (PipelineSpec, from_stage_order, pipeline_spec, residual_items,
                                  to_stage_order)
from jaxllm.step import TrainState, init_state, loss_terms, state_shapes, train_step_for
from jaxllm.validate import resolve_mesh, validate


@dataclasses.dataclass
class Run:
  """Everything a training loop needs, built and checked from one config."""
  cfg: ConfigDict
  mesh: jax.sharding.Mesh
  layout: Layout             # the rules the run shards by (`jaxllm.parallel.rules.derive`)
  graphdef: nnx.GraphDef
  state: TrainState
  origin: str                # where `state` came from, in words
  train_step: Callable       # jitted (state, batch) -> (state, metrics); state is donated
  batches: Iterator[dict[str, jax.Array]]
  eval_batches: Callable[[], Iterator[dict[str, jax.Array]]] | None
  pipeline: PipelineSpec | None  # None when mesh.pipe == 1
  checkpoints: Checkpoints | None


def setup(cfg: ConfigDict, devices=None, workdir: str | None = None) -> Run:
  """Validates the config against the devices, then builds mesh, data, state and step.

  `devices`: the devices to run on (default: all of them). With a `workdir` (or
  `checkpoint.dir`) the run has checkpoints, and the state resumes from the newest.
  """
  cfg = copy.deepcopy(cfg)  # our own: resolving fallbacks below must not leak back
  devices = jax.devices() if devices is None else devices
  mesh_shape = resolve_mesh(cfg.mesh, len(devices))
  validate(cfg, mesh_shape)
  layout = derive(cfg.sharding.rules, mesh_shape, cfg.model, cfg.sharding.zero)
  platform = devices[0].platform
  model_cfg = with_available_attention(cfg.model, platform)
  if model_cfg.attention != cfg.model.attention:
    if metrics.is_logging_process():
      print(f"note: model.attention='cudnn' needs an NVIDIA GPU, but the devices are "
            f"{platform} devices; using 'xla' attention.")
    cfg.model = model_cfg
  if metrics.is_logging_process():
    if cfg.sharding.zero and mesh_shape['data'] == 1:
      print(f'note: sharding.zero={cfg.sharding.zero} splits over the data axis, but '
            'mesh.data=1: nothing is split.')
    for name in ('seq', 'act_seq'):
      axes = mesh_axes(cfg.sharding.rules[name])
      if axes and all(mesh_shape[a] == 1 for a in axes):
        print(f'note: sharding.rules.{name}={axes} splits the sequence over axes of size 1: '
              'nothing is split.')
    unused = _pipeline_settings(cfg.pipeline) if mesh_shape['pipe'] == 1 else ''
    if unused:
      print(f'note: mesh.pipe=1 runs no pipeline, so these settings do nothing: {unused}.')
    if warmup_steps(cfg.optim, cfg.train.steps) < cfg.optim.warmup_steps:
      print(f'note: optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run '
            f'(train.steps={cfg.train.steps}): the lr warms up over its {cfg.train.steps} steps '
            f'and reaches optim.lr={cfg.optim.lr:g} on the last.')
  mesh = make_mesh(mesh_shape, devices, cfg.mesh.across_hosts)
  batches = make_batches(cfg, mesh)
  eval_batches = make_eval_batches(cfg, mesh) if cfg.eval.every else None
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  pipeline = pipeline_spec(cfg, mesh_shape['pipe'])
  # Shapes first: they check the model against the mesh before anything touches the disk.
  graphdef, abstract, shardings = state_shapes(cfg.model, tx, mesh, layout.rules,
                                               cfg.train.seed, pipeline, layout.zero)
  ckpt_dir = cfg.checkpoint.dir or (workdir and os.path.join(workdir, 'checkpoints'))
  checkpoints = Checkpoints(ckpt_dir, cfg.checkpoint) if ckpt_dir else None
  state, origin = _initial_state(cfg, mesh, layout, tx, pipeline, abstract, shardings,
                                 checkpoints, batches)
  step = train_step_for(cfg, graphdef, tx, pipeline)
  options = compiler_options(cfg.model, mesh.devices.flat[0].platform, pipeline is not None)
  train_step = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None),
                       compiler_options=options)
  return Run(cfg, mesh, layout, graphdef, state, origin, train_step, batches, eval_batches,
             pipeline, checkpoints)


def _pipeline_settings(pipeline: ConfigDict) -> str:
  """The pipeline.* fields set away from their defaults, as `pipeline.a=v, ...`; '' if none."""
  defaults = default_config().pipeline
  return ', '.join(f'pipeline.{k}={v!r}' for k, v in pipeline.items() if v != defaults[k])


def _initial_state(cfg: ConfigDict, mesh, layout: Layout, tx, pipeline: PipelineSpec | None,
                   abstract, shardings, checkpoints: Checkpoints | None, batches):
  """The run's newest checkpoint if it has one, else `init_from`'s parameters with a fresh
  optimizer, else a fresh state. Checkpoints hold layer order; a circular pipeline's state
  is converted to stage order on the way in (and back on the way out, see `_layer_order`)."""
  rules = layout.rules
  stages = (pipeline.stages, pipeline.repeats) if pipeline else (1, 1)
  with sharding_context(mesh, rules):
    if checkpoints:
      restored = checkpoints.restore_latest(restore_target(abstract, shardings), batches,
                                            cfg.model)
      if restored is not None:
        if stages[1] > 1:
          restored = jax.jit(lambda s: to_stage_order(s, *stages), out_shardings=shardings)(restored)
        return restored, (f'resumed from the checkpoint of step {int(restored.step)} in '
                          f'{checkpoints.directory}')
    if cfg.init_from:
      target = restore_target(abstract.params, shardings.params)
      biases = None  # the sigmoid routers': zeros unless the checkpoint has them
      if cfg.init_from.startswith('hf:'):  # a Hugging Face checkpoint directory
        params = hf.load_params(cfg.init_from[len('hf:'):], target, cfg.model)
      else:
        params = restore_params(cfg.init_from, target, cfg.model)
        if abstract.router_bias is not None:  # they route to the parameters: they go together
          biases = restore_router_bias(
              cfg.init_from, restore_target(abstract.router_bias, shardings.router_bias),
              cfg.model)

      def fresh_optimizer(params, biases):
        if biases is None:
          biases = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract.router_bias)
        params, biases = to_stage_order((params, biases), *stages)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                          fp8.initial_state_like(abstract.fp8), biases)

      state = jax.jit(fresh_optimizer, out_shardings=shardings)(params, biases)
      return state, f'parameters from {cfg.init_from}, fresh optimizer state'
  _, state, _ = init_state(cfg.model, tx, mesh, rules, cfg.train.seed, pipeline, layout.zero,
                          shardings)
  return state, f'initialised from train.seed={cfg.train.seed}'


def _layer_order(run: Run, state: TrainState) -> TrainState:
  """The state as checkpoints hold it: blocks in layer order (a copy under circular)."""
  if not run.pipeline or run.pipeline.repeats == 1:
    return state
  stages = run.pipeline.stages, run.pipeline.repeats
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.jit(lambda s: from_stage_order(s, *stages), out_shardings=shardings)(state)


def describe(cfg: ConfigDict, mesh: jax.sharding.Mesh, layout: Layout,
             pipeline: PipelineSpec | None, batches=None) -> str:
  """The derived numbers a user should see before the first step."""
  t, m = cfg.train, cfg.model
  shards = layout.batch_shards
  params = metrics.param_counts(m)
  flops = metrics.flops_per_token(m, cfg.data.seq_len)
  micro = t.global_batch // t.micro_batches
  devices = list(mesh.devices.flat)
  lines = [f'devices  {mesh.size} × {devices[0].device_kind}   mesh  ' +
           ' '.join(f'{a}={n}' for a, n in mesh.shape.items())]
  groups, _ = hosts(devices)
  if len(groups) > 1:
    between = host_split(mesh.shape, len(groups), cfg.mesh.across_hosts)
    lines.append(f'hosts    {len(groups)} × {len(groups[0])} devices, {jax.process_count()} '
                 'processes; split between hosts: ' +
                 ' '.join(f'{a}={n}' for a, n in between.items() if n > 1))
  lines += [
      f'model    {params["total"] / 1e6:,.2f}M parameters ({params["embedding"] / 1e6:,.2f}M '
      f'embedding); {flops["full"] / 1e6:,.1f} MFLOP/token (6N + 12LHQT, full attention), '
      f'{flops["causal"] / 1e6:,.1f} with causal halving',
      f'batch    global {t.global_batch} sequences × {cfg.data.seq_len} tokens = '
      f'{t.global_batch * cfg.data.seq_len:,} tokens/step; {t.global_batch // shards} sequences '
      f'per data×fsdp shard ({shards} shards); {t.micro_batches} micro-batch(es) of {micro} '
      f'({micro // shards} per shard)',
      f'compute  {m.dtype} (params {m.param_dtype}, moments {cfg.optim.state_dtype}'
      + (f' split over data, ZeRO-{layout.zero}' if layout.zero else '')
      + f'), attention {m.attention}, remat {m.remat}'
      + (f', layer matmuls in FP8 ({m.fp8} scaling)' if m.fp8 != 'none' else '')]
  moe = m.moe
  if moe.experts:
    axes = layout.rules['experts']
    split = '×'.join(f'{a}={mesh.shape[a]}' for a in axes) or 'no axis'
    lines.append(
        f'experts  {moe.experts} in {moe_layers(m)} of {m.num_layers} layers, top-{moe.top_k} '
        f'{moe.router} router' + (f', {moe.shared_experts} shared' if moe.shared_experts else '')
        + f'; {params["active"] / 1e6:,.2f}M parameters active per token; split over {split} '
        f'({moe.experts // parts(axes, mesh.shape)} per device), {moe.dispatch} dispatch, '
        + (f'capacity factor {moe.capacity_factor}' if moe.capacity_factor else 'dropless'))
  if isinstance(batches, Streams):
    lines.append(f'data     read as {batches.streams} stream(s) of '
                 f'{t.global_batch // batches.streams} rows per batch (data.streams)')
  if pipeline:
    lines.append(
        f'pipeline {cfg.pipeline.schedule}: S={pipeline.stages} stages × R={pipeline.repeats} '
        f'repeats, M={pipeline.microbatches} micro-batches of {micro // pipeline.microbatches}, '
        f'{m.num_layers // (pipeline.stages * pipeline.repeats)} layers per stage visit, '
        f'bubble (S-1)/(R·M+S-1) = {pipeline.bubble_fraction:.1%}, stage weights gathered '
        f'once per {cfg.pipeline.gather_weights}, residuals kept for '
        f'{residual_items(pipeline)} stage visits at once')
  return '\n'.join(lines)


@contextlib.contextmanager
def preemption_signals():
  """SIGTERM and SIGINT ask the run to stop: the loop finishes its step, saves and stops.
  Yields `stop(step)`, true for the step to stop after. A second SIGINT interrupts at once
  (an impatient Ctrl-C).

  Over several processes all must stop after the same step, wherever the signal landed:
  JAX's preemption service (which catches SIGTERM itself) agrees on that step, so SIGINT is
  passed on to it as SIGTERM."""
  asked = threading.Event()
  several = jax.process_count() > 1

  def on_signal(signum, frame):
    if signum == signal.SIGINT and asked.is_set():
      raise KeyboardInterrupt
    asked.set()
    if several:
      os.kill(os.getpid(), signal.SIGTERM)

  signals = (signal.SIGINT,) if several else (signal.SIGTERM, signal.SIGINT)
  previous = {sig: signal.signal(sig, on_signal) for sig in signals}
  try:
    yield multihost_utils.reached_preemption_sync_point if several else (lambda step: asked.is_set())
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _check_finite(values: list[dict], first_step: int, cfg: ConfigDict, last_saved: int | None):
  """Raises at the first step with a non-finite loss or gradient norm, unless such updates
  are skipped. Returns the number skipped."""
  bad = [i for i, v in enumerate(values) if not v['finite']]
  if bad and not cfg.train.skip_nonfinite:
    v = values[bad[0]]
    kept = (f'the checkpoint of step {last_saved} is untouched' if last_saved
            else 'no checkpoint was written')
    raise TrainingError(
        f'step {first_step + bad[0]}: loss {float(v["loss"])}, gradient norm '
        f'{float(v["grad_norm"])} are not finite; stopped ({kept}). Lower optim.lr, or set '
        'train.skip_nonfinite=True to skip such updates.')
  return len(bad)


class StepTrace:
  """A jax.profiler trace of steps profile.start_step … start_step+steps-1 into
  `<workdir>/profile`, on process 0 only. As a context manager it also ends a trace the loop
  left running (the run stopped or failed inside the traced steps).

  `before(step)` and `after(step, state)` return the seconds they spent starting and writing
  the trace, which the loop keeps out of step_time as it does evaluation."""

  def __init__(self, profile: ConfigDict, workdir: str | None, log: metrics.MetricsLog):
    self.first, self.last = profile.start_step, profile.start_step + profile.steps - 1
    self.directory = os.path.join(workdir, 'profile') if workdir else None
    self.log = log
    self.enabled = bool(self.first and workdir) and metrics.is_logging_process()
    self.tracing = False
    self.state, self.step = None, None  # the newest traced step and its state
    if self.first and not workdir:
      log.info(f'profile  no trace: profile.start_step={self.first} needs a run with a workdir')

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    if self.tracing:
      self._stop(block=exc_type is None)  # after an error the state may already be donated

  def before(self, step: int) -> float:
    if not (self.enabled and step == self.first):
      return 0.0
    start = time.perf_counter()
    # create_perfetto_trace also writes perfetto_trace.json.gz, which ui.perfetto.dev opens.
    jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
    self.tracing, self.step = True, step
    return time.perf_counter() - start

  def after(self, step: int, state) -> float:
    if not self.tracing:
      return 0.0
    self.state, self.step = state, step
    return self._stop(block=True) if step == self.last else 0.0

  def _stop(self, block: bool) -> float:
    """Ends the trace once the traced device work is done; returns the seconds spent writing."""
    if block and self.state is not None:
      jax.block_until_ready(self.state)  # device time, counted as the step's
    start = time.perf_counter()
    jax.profiler.stop_trace()
    self.tracing, self.state = False, None
    self.log.info(f'profile  steps {self.first}–{self.step} traced into {self.directory} '
                  "(open in Perfetto: ui.perfetto.dev, or TensorBoard's profile plugin)")
    return time.perf_counter() - start


def evaluate(run: Run, eval_step, state: TrainState) -> dict[str, float]:
  """Token-mean loss and perplexity over the eval split's batches."""
  with sharding_context(run.mesh, run.layout.rules):
    scales = None if state.fp8 is None else state.fp8.scales
    sums = [eval_step(state.params, scales, state.router_bias, batch)
            for batch in run.eval_batches()]
  loss_sum, tokens = np.sum(jax.device_get(sums), axis=0)
  loss = float(loss_sum / max(tokens, 1.0))
  return {'eval_loss': loss, 'eval_perplexity': float(np.exp(loss))}


def train(cfg: ConfigDict, workdir: str | None = None, devices=None):
  """Trains until `cfg.train.steps`, resuming from the run's newest checkpoint if there is
  one. Returns the final state and the logged training rows."""
  run = setup(cfg, devices, workdir)
  cfg, state = run.cfg, run.state
  log = metrics.MetricsLog(workdir, cfg, enabled=metrics.is_logging_process())
  log.info(describe(cfg, run.mesh, run.layout, run.pipeline, run.batches))
  log.info(f'state    {run.origin}')
  if workdir:
    log.info(f'workdir  {workdir}')

  first = int(state.step) + 1
  history = []
  try:
    if first > cfg.train.steps:
      log.info(f'nothing to do: the state is at step {first - 1} of train.steps='
               f'{cfg.train.steps}.')
      return state, history
    with preemption_signals() as stop, StepTrace(cfg.profile, workdir, log) as trace:
      state, history = _loop(run, state, first, log, stop, trace)
  finally:
    if run.checkpoints:
      run.checkpoints.wait()  # a save in flight completes even when the run stops on an error
      run.checkpoints.close()
    log.close()
  return state, history


def _interval_row(run: Run, step: int, values: list[dict], seconds: float,
                  data_seconds: float, save_seconds: float) -> dict:
  """The logged row of one interval: means over its steps (finite ones, if any were not).

  `seconds` is the loop's time for the interval less saving and evaluating; `save_time` is
  how long saves blocked the loop in the interval."""
  cfg = run.cfg
  step_time = seconds / len(values)
  good = [v for v in values if v['finite']] or values
  row = {'step': step,
         'loss': float(np.mean([v['loss'] for v in good])),
         'grad_norm': float(np.mean([v['grad_norm'] for v in good])),
         'lr': float(values[-1]['lr']),
         'step_time': step_time,
         'data_time': data_seconds / len(values),
         'save_time': save_seconds,
         'tokens_per_sec': cfg.train.global_batch * cfg.data.seq_len / step_time}
  if 'moe_load' in good[0]:
    row.update(metrics.routing_row(good))
  peak = metrics.peak_flops(run.mesh.devices.flat[0], cfg.train.peak_flops)
  if peak:
    flops = metrics.flops_per_token(cfg.model, cfg.data.seq_len)
    achieved = row['tokens_per_sec'] / run.mesh.size / peak
    row['mfu'] = flops['full'] * achieved
    row['mfu_causal'] = flops['causal'] * achieved
  return row


def _loop(run: Run, state: TrainState, first: int, log: metrics.MetricsLog,
          stop: Callable[[int], bool], trace: StepTrace | None = None):
  """Steps from `first` to train.steps: logs per interval, saves, evaluates, stops after the
  step `stop(step)` is true for; `trace` profiles the steps it asks for."""
  cfg, ckpt = run.cfg, run.checkpoints
  eval_step = jax.jit(
      lambda params, fp8_scales, router_bias, batch: loss_terms(
          run.graphdef, params, batch, run.pipeline, fp8_scales=fp8_scales,
          router_bias=router_bias)[1][:2],
      compiler_options=compiler_options(cfg.model, run.mesh.devices.flat[0].platform,
                                        run.pipeline is not None))

  batch = next(run.batches)
  start = time.perf_counter()
  with sharding_context(run.mesh, run.layout.rules), counting_cache_hits() as hits:
    step_fn = run.train_step.lower(state, batch).compile()
  log.info(f'compiled the train step in {time.perf_counter() - start:.1f}s' +
           (' (cache hit)' if hits else ''))

  history, pending, last_saved = [], [], None
  pending_first = first  # the step of pending[0]
  data_time = save_time = aside = 0.0  # seconds this interval; `aside`: evaluating, profiling
  interval_start = time.perf_counter()
  for step in range(first, cfg.train.steps + 1):
    if trace:
      aside += trace.before(step)
    state, step_metrics = step_fn(state, batch)
    if trace:
      aside += trace.after(step, state)
    pending.append(step_metrics)
    last = step == cfg.train.steps
    stopping = stop(step)  # asked once per step: a signal may land at any moment
    save = ckpt and (stopping or
                     (cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or last)))
    if save or stopping or step % cfg.train.log_every == 0 or last:
      values = jax.device_get(pending)  # the only host sync: once per interval or save
      skipped = _check_finite(values, pending_first, cfg, last_saved)
      if save:
        # Saved after `step` batches were drawn and before the next, so a resumed run reads
        # on from exactly here.
        save_start = time.perf_counter()
        ckpt.save(step, _layer_order(run, state), run.batches, cfg)
        save_time += time.perf_counter() - save_start
        last_saved = step
      if step % cfg.train.log_every == 0 or last or stopping:
        seconds = time.perf_counter() - interval_start - save_time - aside
        row = _interval_row(run, step, values, seconds, data_time, save_time)
        if cfg.train.skip_nonfinite:
          row['skipped'] = skipped
        history.append(row)
        log.write(row, len(values))
        pending, pending_first = [], step + 1
        data_time = save_time = aside = 0.0
        interval_start = time.perf_counter()
    if run.eval_batches and step % cfg.eval.every == 0:
      eval_start = time.perf_counter()
      log.write_eval({'step': step, **evaluate(run, eval_step, state)})
      aside += time.perf_counter() - eval_start
    if stopping:
      log.info(f'stopped by a signal after step {step}' +
               (f'; saved a checkpoint in {ckpt.directory}' if ckpt else ' (no checkpoint dir)'))
      break
    if not last:
      fetch_start = time.perf_counter()
      batch = next(run.batches)
      data_time += time.perf_counter() - fetch_start
  return state, history


def main(argv: list[str]) -> None:
  cfg, workdir = parse_command_line(argv, __doc__)
  start_backends(cfg)
  use_compilation_cache(cfg.compilation_cache)
  with distributed.session(cfg.distributed):
    train(cfg, workdir)


def cli() -> None:
  """The `jaxllm-train` command (pyproject's console script): `python -m jaxllm.train`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
