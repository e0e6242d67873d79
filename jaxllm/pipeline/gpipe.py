"""Pipeline parallelism over the `pipe` mesh axis.

The layer stack is cut into S stages, one per `pipe` device. Inside `jax.shard_map` (manual
over 'pipe' and the batch axes data/fsdp; 'tensor' stays compiler-managed within each stage)
a `lax.scan` runs R·M + S − 1 iterations: in each, every stage runs its layers on what it
holds, then `ppermute` moves the activations one stage on. Stage 0 takes micro-batch inputs,
the last stage writes finished micro-batches, and at the end hands each stage M/S of them, so
the output head runs once per row, split over the stages.

Schedules: GPipe (R = 1), and circular with R repeats, where stage s holds the layer blocks
s, s+S, s+2S, ... and a micro-batch goes round the ring R times. Under circular, the layer
axis of the stored parameters is stage-major (each stage's blocks are contiguous, so they sit
on its device); `jaxllm.pipeline.spec.to_stage_order` and `from_stage_order` convert from and
to layer order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.model import fp8
from jaxllm.model.moe import RouterBias, has_experts
from jaxllm.model.remat import stack_policy
from jaxllm.model.transformer import scan_blocks, sliding_flags
from jaxllm.parallel.gather import batch_split_gatherer
from jaxllm.parallel.mesh import keep_axes, logical_spec, split_micro_batches
from jaxllm.parallel.rules import mesh_axes, spec_entry
from jaxllm.pipeline.spec import PipelineSpec, chunk_first_layer, stage_split


def pipeline_layers(blocks: nnx.Module, x_BTD, positions_BT, segment_ids_BT, spec: PipelineSpec,
                    model_cfg):
  """The block stack run as a pipeline; equals `scan_blocks` over the layers in order, with
  the rows in `stage_row_order`: split over pipe, each stage holding M/S of the micro-batches.
  Returns that output and the MoE layers' `RouterStats` summed over the micro-batches and
  devices, stacked over the layers in their stored order (stage-major under circular; None
  without experts).

  `segment_ids_BT` may be None (one sequence per row). Weights are gathered in the model's
  compute dtype and their gradients reduced in its grad_reduce_dtype; the routers' biases
  (fp32, never differentiated) are not gathered."""
  remat, compute_dtype, grad_dtype = model_cfg.remat, model_cfg.dtype, model_cfg.grad_reduce_dtype
  S, R, M = spec.stages, spec.repeats, spec.microbatches
  graphdef, stacked, scales, biases = nnx.split(blocks, nnx.Param, fp8.Fp8Scales, RouterBias)
  # The pipeline is manual over 'pipe' and the batch axes (data, fsdp) not manual already (the
  # train step makes data manual: `step.gradients`): each device then sums its weight gradients
  # over all micro-batches locally, and they are reduced across those axes once per pipeline
  # run, where they leave the shard_map. 'tensor' stays with the compiler.
  batch_axes = mesh_axes(logical_spec('batch')[0])
  manual = {'pipe', *batch_axes}
  staged, specs = stage_split(stacked, S, R)
  staged_biases, bias_specs = stage_split(biases, S, R)
  in_specs = jax.tree.map(lambda s: keep_axes(s, manual), (specs, bias_specs))
  gather = batch_split_gatherer(compute_dtype, grad_dtype)

  def run_stage(staged, scales, biases, repeat, x_BTD, rows_info):
    if spec.gather_weights == 'iteration':
      # Tie the gather to this iteration's input, or the compiler hoists it out of the loop.
      staged, x_BTD = jax.lax.optimization_barrier((staged, x_BTD))
      staged = jax.tree.map(gather, staged, specs)
    # This device's stage. With one repeat the slice is fixed: the weights stay loop
    # invariants, which the backward pass reads without a copy per iteration.
    layers = jax.tree.map(lambda w: w[0, 0] if R == 1 else w[0, repeat],
                          (staged, scales, biases))
    # Per-layer flags only where layer types mix, which validate refuses with experts: a chunk
    # is then per_chunk layers.
    per_chunk = model_cfg.num_layers // (S * R)
    sliding = sliding_flags(model_cfg, chunk_first_layer(jax.lax.axis_index('pipe'), repeat, S,
                                                         per_chunk), per_chunk)
    return scan_blocks(graphdef, nnx.merge_state(*layers), x_BTD, *rows_info, remat,
                       sliding_L=sliding)

  if R > 1 or spec.gather_weights == 'iteration':
    # Weights sliced or gathered anew in every iteration are recomputed for the backward pass
    # instead of kept once per iteration; everything else is kept as model.remat says.
    run_stage = jax.checkpoint(run_stage, policy=stack_policy(remat), prevent_cse=False)

  def stages_fn(staged, biases, scales, x_M, info_M):
    if spec.gather_weights == 'step':  # once, for every iteration
      staged = jax.tree.map(gather, staged, specs)
    # One copy of the FP8 scales per iteration (each device has its own: `fan_out` below), so
    # their gradients, the amaxes, are each iteration's and the largest is taken.
    scales = jax.tree.map(lambda s: fp8.fan_out(s[0], spec.iterations), scales)
    # The routers' statistics of this stage's R chunks, summed over the micro-batches (their
    # shapes from a trace of the stage, which only layers with experts need).
    stats = None
    if has_experts(model_cfg):
      _, stats = jax.eval_shape(run_stage, staged, jax.tree.map(lambda s: s[0], scales),
                                biases, 0, x_M[0], jax.tree.map(lambda a: a[0], info_M))
      stats = jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), stats)
    stage = jax.lax.axis_index('pipe')
    is_first, is_last = stage == 0, stage == S - 1
    ring = [(i, (i + 1) % S) for i in range(S)]

    def iteration(carry, t_scales):
      t, scales = t_scales
      incoming, loop_buffer, outputs, stats = carry
      item = t - stage                      # the micro-batch entry this stage works on now
      valid = (item >= 0) & (item < R * M)
      item = jnp.clip(item, 0, R * M - 1)
      repeat, mb = item // M, item % M
      first_input = x_M[mb] if R == 1 else jnp.where(repeat == 0, x_M[mb], loop_buffer[mb])
      x = jnp.where(is_first, first_input, incoming)
      x = jnp.where(valid, x, 0)            # bubbles compute on zeros: what they hold can't leak
      y, y_stats = run_stage(staged, scales, biases, repeat, x,
                             jax.tree.map(lambda a: a[mb], info_M))
      stats = jax.tree.map(lambda a, s: a.at[repeat].add(jnp.where(valid, s, 0)), stats, y_stats)
      done = is_last & valid & (repeat == R - 1)
      outputs = outputs.at[mb].set(jnp.where(done, y, outputs[mb]))
      incoming = jax.lax.ppermute(y, 'pipe', ring)
      if R > 1:
        # What the last stage finished just now arrived at stage 0; keep it for its next trip.
        back = t - (S - 1)
        keep = is_first & (back >= 0) & (back < (R - 1) * M)
        back_mb = jnp.clip(back, 0, R * M - 1) % M
        loop_buffer = loop_buffer.at[back_mb].set(
            jnp.where(keep, incoming, loop_buffer[back_mb]))
      return (incoming, loop_buffer, outputs, stats), None

    fill = jnp.full(x_M.shape[1:], spec.bubble_fill, x_M.dtype)
    loop_buffer = jnp.broadcast_to(fill, x_M.shape) if R > 1 else jnp.zeros((), x_M.dtype)
    init = (fill, loop_buffer, jnp.zeros_like(x_M), stats)
    (_, _, outputs, stats), _ = jax.lax.scan(iteration, init,
                                             (jnp.arange(spec.iterations), scales))
    # The last stage holds every output (the others zeros): each stage takes M/S of them, so
    # what follows (the output head and loss) runs once per row, split over the stages.
    mine = jax.lax.psum_scatter(outputs, 'pipe', scatter_dimension=0, tiled=True)
    return mine.reshape(-1, *mine.shape[2:]), jax.tree.map(lambda a: a[None, None], stats)

  rows = P(None, batch_axes)
  # Positions and segment ids of each micro-batch's rows (a None segment_ids has no leaves).
  info_M = jax.tree.map(lambda a: split_micro_batches(a, M), (positions_BT, segment_ids_BT))
  # Delayed FP8 scaling's scales, one copy per device of the batch axes (as the stage's).
  devices = [a for a in batch_axes if a not in jax.sharding.get_abstract_mesh().manual_axes]
  copies = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in devices)
  scales = jax.tree.map(lambda s: fp8.fan_out(s.reshape(S, R, -1, *s.shape[1:]), copies), scales)
  scale_specs = jax.tree.map(lambda s: P(tuple(devices), 'pipe'), scales)
  # Each device's statistics [1, 1, R, L/(S·R), ...], summed over the batch axes' devices below.
  stats_spec = P(spec_entry(batch_axes), 'pipe')
  y_BTD, stats = jax.shard_map(
      stages_fn, in_specs=(*in_specs, scale_specs, rows, rows),
      out_specs=(P(('pipe', *batch_axes)), stats_spec), axis_names=manual, check_vma=False)(
          staged, staged_biases, scales, split_micro_batches(x_BTD, M), info_M)
  return y_BTD, jax.tree.map(lambda a: jnp.sum(a, axis=0).reshape(-1, *a.shape[4:]), stats)


def stage_row_order(a, micro_batches: int):
  """The rows of `a` [B, ...] as `pipeline_layers` returns them: split over pipe, then the
  batch axes, each device holding its stage's M/S micro-batches of its own rows, micro-batch by
  micro-batch. Rearranged where they are: nothing moves between devices."""
  batch_axes = mesh_axes(logical_spec('batch')[0])

  def local(a):
    a_M = a.reshape(-1, micro_batches, *a.shape[1:]).swapaxes(0, 1)  # as split_micro_batches
    per_stage = micro_batches // jax.lax.axis_size('pipe')
    mine = jax.lax.dynamic_slice_in_dim(a_M, jax.lax.axis_index('pipe') * per_stage, per_stage)
    return mine.reshape(-1, *a.shape[1:])

  return jax.shard_map(local, in_specs=P(batch_axes), out_specs=P(('pipe', *batch_axes)),
                       axis_names={'pipe', *batch_axes})(a)
