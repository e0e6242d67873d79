"""What a pipeline is: its shape (stages, repeats, micro-batches, schedule) from the config, and
the stage-major order the block parameters are stored in under the circular schedules."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.config import ONE_F_ONE_B_SCHEDULES, pipeline_shape
from jaxllm.pipeline.ticks import one_f_one_b_ticks


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  stages: int              # S: devices on the pipe axis
  repeats: int             # R: trips round the ring (1: GPipe)
  microbatches: int        # M
  gather_weights: str      # 'step': all-gather fsdp-split stage weights once per step;
                           # 'iteration': let each iteration gather what it uses
  schedule: str = 'gpipe'  # pipeline.schedule
  bubble_fill: float = 0.0  # what bubble iterations' state starts as (tests poison it with NaN)

  @property
  def one_f_one_b(self) -> bool:
    """Whether each stage interleaves forwards and backwards (`jaxllm.pipeline.one_f_one_b`);
    otherwise autodiff runs the backward after every forward."""
    return self.schedule in ONE_F_ONE_B_SCHEDULES

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    return (self.stages - 1) / self.iterations


def residual_items(spec: PipelineSpec) -> int:
  """How many stage visits (a micro-batch through one of a stage's R chunks) a stage keeps
  residuals for at once: under GPipe and circular every iteration's, R·M+S−1 (the scan keeps
  the bubble iterations' too); under 1F1B its tick table's slots."""
  if spec.one_f_one_b:
    return one_f_one_b_ticks(spec.stages, spec.repeats, spec.microbatches).slots()[2]
  return spec.iterations


def pipeline_spec(cfg, stages: int) -> PipelineSpec | None:
  """The pipeline a validated config asks for on `stages` pipe devices; None without one."""
  if stages == 1:
    return None
  repeats, microbatches = pipeline_shape(cfg, stages)
  return PipelineSpec(stages, repeats, microbatches, cfg.pipeline.gather_weights,
                      cfg.pipeline.schedule)


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


def chunk_first_layer(stage, repeat, stages: int, layers_per_chunk: int):
  """The layer (in layer order) that chunk `repeat` of stage `stage` starts with, either
  possibly traced: stored stage-major (`to_stage_order`), stage s's chunk r holds the
  `layers_per_chunk` layers from (r·S + s)·layers_per_chunk on. Per-layer settings
  (`jaxllm.model.transformer.sliding_flags`) are taken from here."""
  return (repeat * stages + stage) * layers_per_chunk


def stage_split(stacked, S: int, R: int):
  """(staged, specs): the stacked block parameters as [S, R, L/(S·R), ...] (stored
  stage-major, each stage's layers stay where they are) and their specs over the mesh."""
  staged = jax.tree.map(lambda w: w.reshape(S, R, -1, *w.shape[1:]), stacked)
  specs = jax.tree.map(lambda s: P(s[0], None, None, *s[1:]), nnx.get_partition_spec(stacked))
  return staged, specs
