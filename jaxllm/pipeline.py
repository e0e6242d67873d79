"""Pipeline parallelism over the `pipe` mesh axis.

The layer stack is cut into S stages, one per `pipe` device. Inside `jax.shard_map` (manual
over 'pipe' and the batch axes data/fsdp; 'tensor' stays compiler-managed within each stage)
a `lax.scan` runs R·M + S − 1 iterations: in each, every stage runs its layers on what it
holds, then `ppermute` moves the activations one stage on. Stage 0 takes micro-batch inputs,
the last stage writes finished micro-batches.

Schedules: GPipe (R = 1), and circular with R repeats, where stage s holds the layer blocks
s, s+S, s+2S, ... and a micro-batch goes round the ring R times. Under circular, the layer
axis of the stored parameters is stage-major (each stage's blocks are contiguous, so they sit
on its device); `to_stage_order` and `from_stage_order` convert from and to layer order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.config import MESH_AXES, pipeline_shape
from jaxllm.mesh import keep_axes, logical_spec, spec_axes, split_micro_batches
from jaxllm.model import scan_blocks


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  stages: int              # S: devices on the pipe axis
  repeats: int             # R: trips round the ring (1: GPipe)
  microbatches: int        # M
  gather_weights: str      # 'step': all-gather fsdp-split stage weights once per step;
                           # 'iteration': let each iteration gather what it uses
  bubble_fill: float = 0.0  # what bubble iterations' state starts as (tests poison it with NaN)

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    return (self.stages - 1) / self.iterations


def pipeline_spec(cfg, stages: int) -> PipelineSpec | None:
  """The pipeline a validated config asks for on `stages` pipe devices; None without one."""
  if stages == 1:
    return None
  repeats, microbatches = pipeline_shape(cfg, stages)
  return PipelineSpec(stages, repeats, microbatches, cfg.pipeline.gather_weights)


def _swap_layer_groups(tree, outer: int, inner: int):
  """Views each block parameter's layer axis as [outer, inner, rest] and swaps the two groups."""
  def swap(path, x):
    if "'blocks'" not in jax.tree_util.keystr(path):
      return x
    x = x.reshape(outer, inner, -1, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(-1, *x.shape[3:])
  return jax.tree_util.tree_map_with_path(swap, tree)


def to_stage_order(tree, stages: int, repeats: int):
  """Layer order -> stage-major: stage s's blocks s, s+S, ... become contiguous.

  Applies to every '.blocks' leaf of `tree` (parameters, optimizer moments)."""
  return _swap_layer_groups(tree, repeats, stages) if repeats > 1 else tree


def from_stage_order(tree, stages: int, repeats: int):
  """Stage-major -> layer order; inverse of `to_stage_order`."""
  return _swap_layer_groups(tree, stages, repeats) if repeats > 1 else tree


def pipeline_layers(blocks: nnx.Module, x_BTD, positions_BT, segment_ids_BT, spec: PipelineSpec,
                    remat: str):
  """The block stack run as a pipeline; equals `scan_blocks` over the layers in order.

  `segment_ids_BT` may be None (one sequence per row)."""
  S, R, M = spec.stages, spec.repeats, spec.microbatches
  graphdef, stacked = nnx.split(blocks)
  # The pipeline is manual over 'pipe' and the batch axes (data, fsdp) not manual already (the
  # train step makes data manual: `step.gradients`): each device then sums its weight gradients
  # over all micro-batches locally, and they are reduced across those axes once per pipeline
  # run, where they leave the shard_map. 'tensor' stays with the compiler.
  batch_axes = spec_axes(logical_spec('batch')[0])
  manual = {'pipe', *batch_axes}
  # Stored stage-major, so [L] -> [S, R, L/(S·R)] keeps each stage's layers where they are.
  staged = jax.tree.map(lambda w: w.reshape(S, R, -1, *w.shape[1:]), stacked)
  staged_specs = jax.tree.map(lambda s: P(s[0], None, None, *s[1:]),
                              nnx.get_partition_spec(stacked))
  if spec.gather_weights == 'step':
    # Gather what fsdp split once, here; its gradient is reduce-scattered once, here too.
    staged_specs = jax.tree.map(lambda s: keep_axes(s, set(MESH_AXES) - set(batch_axes)),
                                staged_specs)
    staged = jax.tree.map(jax.lax.with_sharding_constraint, staged, staged_specs)
  in_specs = jax.tree.map(lambda s: keep_axes(s, manual), staged_specs)

  def gather_layer(w, s: P):
    """All-gathers the batch-axis pieces of one layer's weight (per-iteration mode)."""
    for dim, entry in enumerate(s[3:], start=1):
      for axis in reversed(spec_axes(entry)):
        w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
    return w

  def run_stage(staged, repeat, x_BTD, rows_info):
    layers = jax.tree.map(lambda w: w[repeat], staged)
    if spec.gather_weights == 'iteration':
      # Tie the gather to this iteration's input, or the compiler hoists it out of the loop.
      layers, x_BTD = jax.lax.optimization_barrier((layers, x_BTD))
      layers = jax.tree.map(gather_layer, layers, in_specs)
    return scan_blocks(graphdef, layers, x_BTD, *rows_info, remat)

  # Keep only each iteration's stage input for the backward pass; the stage's own remat
  # policy applies when it is recomputed.
  run_stage = jax.checkpoint(run_stage, policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)

  def stages_fn(staged, x_M, info_M):
    staged = jax.tree.map(lambda w: w[0], staged)  # this device's stage: [R, L/(S·R), ...]
    stage = jax.lax.axis_index('pipe')
    is_first, is_last = stage == 0, stage == S - 1
    ring = [(i, (i + 1) % S) for i in range(S)]

    def iteration(carry, t):
      incoming, loop_buffer, outputs = carry
      item = t - stage                      # the micro-batch entry this stage works on now
      valid = (item >= 0) & (item < R * M)
      item = jnp.clip(item, 0, R * M - 1)
      repeat, mb = item // M, item % M
      first_input = x_M[mb] if R == 1 else jnp.where(repeat == 0, x_M[mb], loop_buffer[mb])
      x = jnp.where(is_first, first_input, incoming)
      x = jnp.where(valid, x, 0)            # bubbles compute on zeros: what they hold can't leak
      y = run_stage(staged, repeat, x, jax.tree.map(lambda a: a[mb], info_M))
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
      return (incoming, loop_buffer, outputs), None

    fill = jnp.full(x_M.shape[1:], spec.bubble_fill, x_M.dtype)
    loop_buffer = jnp.broadcast_to(fill, x_M.shape) if R > 1 else jnp.zeros((), x_M.dtype)
    init = (fill, loop_buffer, jnp.zeros_like(x_M))
    (_, _, outputs), _ = jax.lax.scan(iteration, init, jnp.arange(spec.iterations))
    return outputs[None]

  rows = P(None, batch_axes)
  # Positions and segment ids of each micro-batch's rows (a None segment_ids has no leaves).
  info_M = jax.tree.map(lambda a: split_micro_batches(a, M), (positions_BT, segment_ids_BT))
  out = jax.shard_map(stages_fn, in_specs=(in_specs, rows, rows),
                      out_specs=P('pipe', None, batch_axes), axis_names=manual,
                      check_vma=False)(staged, split_micro_batches(x_BTD, M), info_M)
  y_M = out[S - 1]
  return y_M.swapaxes(0, 1).reshape(x_BTD.shape)  # undoes split_micro_batches
