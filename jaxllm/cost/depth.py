"""A train step's peak memory and predicted time at its full depth, from compiles at two
shallow depths.

The layer stack is a scan (under a pipeline, each stage's chunk of layers is one), so what a
step holds and does grows by the same amount with each layer a chunk runs: the stacked
parameters, optimizer state and kept activations; each layer's kernels and collectives, timed
once per trip. Both are affine in the layers per chunk, and two depths fix the line. A
pipeline of pipe × repeats chunks is compiled at that many chunks of fewer layers, so its
schedule (stages, micro-batches, bubbles) stays what it is at full depth.

The depths are at least 2 layers a chunk: XLA removes a loop of one trip, which changes the
program around it. `jaxllm.tune` compiles its candidates at full depth: a scan's compile takes
as long at 2 layers as at 32, so two shallow compiles cost twice one full one (measured in
benchmarks/README.md).
"""

from __future__ import annotations

import copy
import dataclasses

from ml_collections import ConfigDict

from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import Hardware
from jaxllm.cost.report import report

DEPTHS = (2, 3)  # layers per chunk compiled


def chunks(cfg: ConfigDict) -> int:
  """How many chunks the layers split into: pipe × repeats under a pipeline, else one."""
  return cfg.mesh.pipe * cfg.pipeline.repeats if cfg.mesh.pipe > 1 else 1


def at_depth(cfg: ConfigDict, per_chunk: int) -> ConfigDict:
  """A copy of `cfg` whose chunks run `per_chunk` layers each."""
  cfg = copy.deepcopy(cfg)
  cfg.model.num_layers = chunks(cfg) * per_chunk
  return cfg


@dataclasses.dataclass(frozen=True)
class Extrapolated:
  """A step at full depth as the line through two shallow compiles puts it."""
  peak: float     # bytes per device, as the compiler's buffer assignment
  step_s: float   # predicted on the hardware profile
  depths: tuple[int, int]  # the layers per chunk compiled


def extrapolate(cfg: ConfigDict, hardware: Hardware, devices=None,
                depths: tuple[int, int] = DEPTHS) -> Extrapolated:
  """`cfg`'s step on `devices` (see `compile_step`) at its full depth, from compiles at
  `depths` layers per chunk and `hardware`'s timing model."""
  (a, b), full = depths, cfg.model.num_layers // chunks(cfg)
  shallow = [report(compile_step(at_depth(cfg, n), devices), hardware) for n in (a, b)]
  line = lambda ya, yb: ya + (yb - ya) * (full - a) / (b - a)
  return Extrapolated(line(*(r['memory']['peak'] for r in shallow)),
                      line(*(r['prediction']['step_s'] for r in shallow)), (a, b))
