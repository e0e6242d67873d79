"""Training state, loss and the jitted train step with gradient accumulation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from jaxllm.model import Transformer, fp8, sequence_positions
from jaxllm.model.moe import RouterBias, next_router_bias, router_losses, routing_metrics
from jaxllm.optim import lr_schedule
from jaxllm.parallel.mesh import (check_divisible, logical_spec, sharding_context,
                                  split_micro_batches)
from jaxllm.parallel.rules import mesh_axes
from jaxllm.parallel.zero import optimizer_shardings, zero_specs
from jaxllm.pipeline.gpipe import pipeline_layers, stage_row_order
from jaxllm.pipeline.one_f_one_b import pipeline_loss
from jaxllm.pipeline.spec import PipelineSpec, to_stage_order


class TrainState(NamedTuple):
  step: jax.Array        # optimizer steps taken
  params: nnx.State      # master weights (model.param_dtype), sharded by the rules
  opt_state: Any         # optax state; moments (optim.state_dtype) carry the params' shardings,
                         # split over data as well under ZeRO (sharding.zero ≥ 1, `over_data`)
  fp8: fp8.Fp8State | None = None  # delayed FP8 scaling's scales and amax histories, laid out
                                   # as the blocks' parameters (model.fp8='delayed')
  router_bias: nnx.State | None = None  # the sigmoid routers' biases (fp32), laid out as the
                                        # blocks' parameters, moved by the step
                                        # (model.moe.router='sigmoid')


def split_model(model: Transformer):
  """(graphdef, parameters, FP8 scales, router biases): the scales are empty but under
  delayed scaling, the biases but with sigmoid routers."""
  return nnx.split(model, nnx.Param, fp8.Fp8Scales, RouterBias)


def _create_fn(model_cfg: ConfigDict, tx: optax.GradientTransformation, seed: int,
               pipeline: PipelineSpec | None, keep_graphdef=lambda graphdef: None):
  def create():
    graphdef, params, scales, biases = split_model(Transformer(model_cfg, rngs=nnx.Rngs(seed)))
    keep_graphdef(graphdef)
    if pipeline:
      params, scales, biases = to_stage_order((params, scales, biases), pipeline.stages,
                                              pipeline.repeats)
    fp8_state = (fp8.initial_state(scales, model_cfg.fp8_history)
                 if model_cfg.fp8 == 'delayed' else None)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), fp8_state,
                      biases if jax.tree.leaves(biases) else None)
  return create


def state_shapes(model_cfg: ConfigDict, tx: optax.GradientTransformation, mesh, rules,
                 seed: int = 0, pipeline: PipelineSpec | None = None, zero: int = 0):
  """The train state as shapes and shardings only: nothing is allocated.

  Returns the model's graphdef (its static structure), the abstract state and its shardings.
  With `zero` ≥ 1 (sharding.zero) the optimizer state is split over data too.
  Raises ConfigError when a sharded dimension does not split evenly over its mesh axes.
  """
  graphdefs = []  # the model's structure, kept by the one trace of its creation
  with sharding_context(mesh, rules):
    abstract = jax.eval_shape(_create_fn(model_cfg, tx, seed, pipeline, graphdefs.append))
    check_divisible(abstract.params, mesh)  # stage order moves layers, never changes a shape
    shardings = nnx.get_named_sharding(abstract, mesh)
  if zero:
    shardings = shardings._replace(opt_state=optimizer_shardings(
        abstract.opt_state, shardings.opt_state, mesh))
  return graphdefs[0], abstract, shardings


def init_state(model_cfg: ConfigDict, tx: optax.GradientTransformation, mesh, rules, seed: int,
               pipeline: PipelineSpec | None = None, zero: int = 0, shardings=None):
  """Creates the train state already sharded (inside jit), never whole on one device.

  Under a circular pipeline the blocks are stored stage-major (see `jaxllm.pipeline.spec`).
  `shardings`: `state_shapes`' for these arguments, where the caller has them.
  """
  if shardings is None:
    _, _, shardings = state_shapes(model_cfg, tx, mesh, rules, seed, pipeline, zero)
  graphdefs = []
  with sharding_context(mesh, rules):
    state = jax.jit(_create_fn(model_cfg, tx, seed, pipeline, graphdefs.append),
                    out_shardings=shardings)()
  return graphdefs[0], state, shardings


def loss_terms(graphdef, params, batch, pipeline: PipelineSpec | None = None,
               z_loss: float = 0.0, fp8_scales: nnx.State | None = None,
               router_bias: nnx.State | None = None):
  """(objective, (cross-entropy, tokens, routing)): the objective and the next-token
  cross-entropy summed over unmasked targets, their count (fp32), and with experts the
  routers' `RoutingSums` (else None). The objective adds `z_loss`·log²Z and the router losses
  (`jaxllm.model.moe.router_losses`). `fp8_scales`: delayed FP8 scaling's (its gradient is
  the matmuls' amaxes); `router_bias`: the sigmoid routers' (TrainState.router_bias)."""
  model = nnx.merge(graphdef, params,
                    *(s for s in (fp8_scales, router_bias) if s is not None))
  tokens_BT = batch['inputs']
  # Packed rows say where each token sits in its document; plain rows are one sequence each.
  positions_BT = batch.get('positions', sequence_positions(tokens_BT))
  segment_ids_BT = batch.get('segment_ids')
  x_BTD = model.embed(tokens_BT)
  if pipeline and pipeline.one_f_one_b:  # the head and loss run inside the schedule
    objective, ce = pipeline_loss(model.blocks, model.final_norm, model.head(), x_BTD,
                                  positions_BT, segment_ids_BT, batch['targets'],
                                  batch['mask'], pipeline, model.cfg, z_loss)
    return objective, (ce, jnp.sum(batch['mask'].astype(jnp.float32)), None)
  if pipeline:
    x_BTD, stats = pipeline_layers(model.blocks, x_BTD, positions_BT, segment_ids_BT, pipeline,
                                   model.cfg)
    # The loss is a sum over rows: it takes them in the pipeline's order.
    targets_BT, mask_BT = (stage_row_order(batch[k], pipeline.microbatches)
                           for k in ('targets', 'mask'))
  else:
    x_BTD, stats = model.layers(x_BTD, positions_BT, segment_ids_BT)
    targets_BT, mask_BT = batch['targets'], batch['mask']
  objective, ce = model.loss_sum(x_BTD, targets_BT, mask_BT, z_loss)
  tokens = jnp.sum(mask_BT.astype(jnp.float32))
  if stats is None:
    return objective, (ce, tokens, None)
  router_objective, routing = router_losses(stats, model.cfg.moe, tokens)
  return objective + router_objective, (ce, tokens, routing)


def replicated_batch_axes(params) -> tuple[str, ...]:
  """The mesh axes (of more than one device) that split the batch but no parameter: each
  device there computes a partial sum of the same, whole gradients."""
  param_axes = {a for spec in jax.tree.leaves(nnx.get_partition_spec(params))
                for entry in spec for a in mesh_axes(entry)}
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a in mesh_axes(logical_spec('batch')[0])
               if mesh.shape[a] > 1 and a not in param_axes)


def skip_if(skip, new, old):
  """`old` where `skip`, else `new`, but for the learning-rate schedule's step count
  (`optax.ScaleByScheduleState`): it always advances, with `state.step`. Every other count
  stays: Adam's (`ScaleByAdamState.count`) is the number of updates its bias correction
  takes account of, and a skipped step is none."""
  is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)
  return jax.tree.map(lambda n, o: n if is_schedule(n) else jnp.where(skip, o, n), new, old,
                      is_leaf=is_schedule)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule, micro_batches: int,
                    pipeline: PipelineSpec | None = None, skip_nonfinite: bool = False,
                    zero: int = 0, z_loss: float = 0.0, router_bias_rate: float = 0.0):
  """`train_step(state, batch) -> (state, metrics)`; the loss is the token mean over the batch.

  With `skip_nonfinite`, a step whose loss or gradients are not finite leaves params,
  optimizer state and FP8 scales and histories as they were (Adam's count too), but for the
  schedule's step count: it advances with `state.step` (as does the data), so the schedule's
  lr stays the one the log shows (`skip_if`).
  `zero` (sharding.zero): 1 reduce-scatters the summed gradients over data once per step,
  updates each device's slice of the parameters with its slice of the moments and
  all-gathers the result; 2 also keeps the gradient sum split over data, each micro-batch's
  gradients reduce-scattered into it. `z_loss` (optim.z_loss) adds z_loss·log²Z per token to
  the objective; the loss in the metrics stays the cross-entropy. With experts the metrics
  hold the routers' (`routing_metrics`), and sigmoid routers' biases move by
  `router_bias_rate` (model.moe.bias_rate, `next_router_bias`) after each step, outside the
  optimizer (a skipped step leaves them too).
  """
  objective_grads = jax.value_and_grad(
      lambda p, s, r, b: loss_terms(graphdef, p, b, pipeline, z_loss, s, r), argnums=(0, 1),
      has_aux=True)

  def grad_fn(params, scales, biases, batch):
    """((cross-entropy sum, tokens, routing sums), the objective's gradients, the FP8 matmuls'
    amaxes (None without delayed scaling)). `biases`: the sigmoid routers' (or None)."""
    (_, sums), (grads, amaxes) = objective_grads(params, scales, biases, batch)
    return sums, grads, amaxes

  def accumulate(params, scales, biases, batch, micro_grads=grad_fn, specs=None):
    """Summed gradients (fp32), the amaxes' maxima, and the summed (loss, token count, routing
    sums) over the micro-batches, in turn: `micro_grads(params, scales, biases, micro_batch)`
    each, the gradients kept in `specs`' layout (the params')."""
    specs = nnx.get_partition_spec(params) if specs is None else specs
    pin = lambda g: jax.lax.with_sharding_constraint(g, specs)
    # fp32 whatever the parameters' dtype: bf16 sums of many micro-batches lose the small ones,
    # and so would the all-reduce over data of one micro-batch's (`gradients`)
    if micro_batches == 1:
      sums, grads, amaxes = micro_grads(params, scales, biases, batch)
      return pin(jax.tree.map(lambda g: g.astype(jnp.float32), grads)), amaxes, sums

    def add_micro_batch(carry, micro_batch):
      grads, amaxes, sums = carry
      mb_sums, mb_grads, mb_amaxes = micro_grads(params, scales, biases, micro_batch)
      grads = pin(jax.tree.map(jnp.add, grads, mb_grads))
      amaxes = jax.tree.map(jnp.maximum, amaxes, mb_amaxes)
      return (grads, amaxes, jax.tree.map(jnp.add, sums, mb_sums)), None

    zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    no_amaxes = jax.tree.map(jnp.zeros_like, scales)
    micro = jax.tree.map(lambda x: split_micro_batches(x, micro_batches), batch)
    routing = jax.eval_shape(lambda: loss_terms(graphdef, params, jax.tree.map(
        lambda x: x[0], micro), pipeline, z_loss, scales, biases)[1][2])
    no_sums = (jnp.float32(0), jnp.float32(0),
               jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), routing))
    carry, _ = jax.lax.scan(add_micro_batch, (zeros, no_amaxes, no_sums), micro)
    return carry

  def reduced(axes):
    """Sums over `axes` but for the amaxes (the second entry), which take their maximum."""
    return lambda grads, amaxes, sums: (jax.lax.psum(grads, axes),
                                        jax.lax.pmax(amaxes, axes), jax.lax.psum(sums, axes))

  def gradients(params, scales, biases, batch):
    """`accumulate` over the whole batch. Over the batch axes whose devices hold whole
    parameters (data), each device accumulates its own rows' gradients in fp32, and the sums
    are all-reduced once, after the last micro-batch: left to the compiler, they would be
    all-reduced per micro-batch (on GPUs in bf16, before the cast to fp32). fsdp and tensor
    stay with the compiler inside. ZeRO-2 reduces per micro-batch on purpose: `split_sum`."""
    axes = replicated_batch_axes(params)
    if not axes:
      return accumulate(params, scales, biases, batch)
    if zero == 2 and micro_batches > 1 and 'data' in axes:
      return split_sum(params, scales, biases, batch, axes)
    summed = lambda *args: reduced(axes)(*accumulate(*args))
    return jax.shard_map(summed, in_specs=(P(), P(), P(), P(axes)), out_specs=P(),
                         axis_names=set(axes), check_vma=False)(params, scales, biases, batch)

  def split_sum(params, scales, biases, batch, axes):
    """ZeRO-2's `gradients`: the fp32 sum split over data as the moments are, each
    micro-batch's gradients all-reduced over the batch axes and sliced into it, which the
    compilers make a reduce-scatter. (A psum_scatter inside the shard_map would first gather
    the shards of the axes left to the compiler.)"""
    param_specs = nnx.get_partition_spec(params)

    def summed(params, scales, biases, micro_batch):
      sums, grads, amaxes = grad_fn(params, scales, biases, micro_batch)
      grads = jax.lax.with_sharding_constraint(grads, param_specs)
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      grads, amaxes, sums = reduced(axes)(grads, amaxes, sums)
      return sums, grads, amaxes

    micro_grads = jax.shard_map(summed, in_specs=(P(), P(), P(), P(axes)), out_specs=P(),
                                axis_names=set(axes), check_vma=False)
    return accumulate(params, scales, biases, batch, micro_grads, zero_specs(params))

  def train_step(state: TrainState, batch):
    # Under ZeRO the moments' layout (split over data: `state_shapes`) alone makes the
    # all-reduce of the sums a reduce-scatter, the update run on each device's slice and the
    # new parameters all-gathered: pinning grads and updates to it too compiles the same program.
    scales = None if state.fp8 is None else state.fp8.scales
    grads, amaxes, (loss_sum, tokens, routing) = gradients(state.params, scales,
                                                           state.router_bias, batch)
    tokens = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    fp8_state = None if state.fp8 is None else fp8.next_delayed_state(state.fp8, amaxes)
    router_bias = state.router_bias
    if router_bias is not None and router_bias_rate:
      router_bias = next_router_bias(router_bias, routing.load_UE, router_bias_rate)
    loss, grad_norm = loss_sum / tokens, optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
      params, opt_state, fp8_state, router_bias = (
          skip_if(~finite, new, old) for new, old in
          ((params, state.params), (opt_state, state.opt_state), (fp8_state, state.fp8),
           (router_bias, state.router_bias)))
    metrics = dict(loss=loss, grad_norm=grad_norm, lr=schedule(state.step), finite=finite)
    if routing is not None:
      metrics.update(routing_metrics(routing, tokens))
    return TrainState(state.step + 1, params, opt_state, fp8_state, router_bias), metrics

  return train_step


def train_step_for(cfg: ConfigDict, graphdef, tx: optax.GradientTransformation,
                   pipeline: PipelineSpec | None):
  """`make_train_step` as the config sets it up (for train and analyze alike)."""
  return make_train_step(graphdef, tx, lr_schedule(cfg.optim, cfg.train.steps),
                         cfg.train.micro_batches, pipeline, cfg.train.skip_nonfinite,
                         cfg.sharding.zero, cfg.optim.z_loss, cfg.model.moe.bias_rate)
