"""The train step compiled ahead of time from shapes alone, nothing allocated: for CPU
devices, or for a GPU's on a machine that has none (`jaxllm.backends.gpu_devices`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxllm.backends import compiler_options, compiling_for, lowering_for
from jaxllm.checkpoint import restore_target
from jaxllm.config import ConfigError
from jaxllm.model import with_available_attention
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import batch_sharding, make_mesh, sharding_context
from jaxllm.parallel.rules import Layout, derive, mesh_axes
from jaxllm.parallel.zero import over_data
from jaxllm.pipeline.spec import PipelineSpec, pipeline_spec
from jaxllm.step import state_shapes, train_step_for
from jaxllm.validate import resolve_mesh, validate

# The program is compiled to be read, never run: skip the backend's code optimisation, which
# leaves the HLO (collectives, memory, FLOPs) as it is and takes ~40% of the compile time.
COMPILE_OPTIONS = {'xla_backend_optimization_level': 0}


@dataclasses.dataclass
class Compiled:
  """A train step compiled from shapes, and what it was compiled for."""
  cfg: ConfigDict
  mesh_shape: dict[str, int]
  layout: Layout               # the rules it was compiled under
  pipeline: PipelineSpec | None
  state_bytes: dict[str, int]  # per device: 'params', 'optimizer'
  head_bytes: int              # per device: the output head's (the embedding table when tied)
  fsdp_split_bytes: int        # per device: of the params, those split over fsdp
  head_split_bytes: int        # of those, the output head's (the embedding table when tied)
  block_split_bytes: int       # of those, the layer stack's
  zero_split_bytes: int        # per device: of the params, those whose update ZeRO splits over data
  executable: jax.stages.Compiled
  device: jax.Device           # one of the devices it was compiled for (their kind, platform)
  xla_flags: str = ''          # XLA_FLAGS as the compiler read them (the run's xla_flags too)

  @property
  def cpu(self) -> bool:
    """Whether the CPU compiler made the program (see `hlo.collectives`)."""
    return self.device.platform == 'cpu'

  @functools.cached_property
  def text(self) -> str:
    """The optimized HLO of the program (made once: every reader of `jaxllm.cost.hlo` takes it)."""
    return self.executable.as_text()


def shard_bytes(tree) -> int:
  """Bytes of `tree`'s abstract arrays that one device holds (the largest shard of each)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def compile_step(cfg: ConfigDict, devices=None) -> Compiled:
  """The train step compiled ahead of time from abstract state and batch shapes, for
  `devices` (default: those present): CPU devices, or a GPU's (`backends.gpu_devices`)."""
  cfg = copy.deepcopy(cfg)  # our own: the attention fallback below must not leak back
  devices = jax.devices() if devices is None else devices
  cfg.model = with_available_attention(cfg.model, devices[0].platform)
  mesh_shape = resolve_mesh(cfg.mesh, len(devices))
  validate(cfg, mesh_shape)
  layout = derive(cfg.sharding.rules, mesh_shape, cfg.model, cfg.sharding.zero)
  mesh = make_mesh(mesh_shape, devices, cfg.mesh.across_hosts)
  pipeline = pipeline_spec(cfg, mesh_shape['pipe'])
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  graphdef, abstract, shardings = state_shapes(cfg.model, tx, mesh, layout.rules,
                                               cfg.train.seed, pipeline, layout.zero)
  state = restore_target(abstract, shardings)
  rows = (cfg.train.global_batch, cfg.data.seq_len)
  sharding = batch_sharding(mesh, layout.rules, 2)
  ints = jax.ShapeDtypeStruct(rows, jnp.int32, sharding=sharding)
  batch = {'inputs': ints, 'targets': ints, 'positions': ints,
           'mask': jax.ShapeDtypeStruct(rows, jnp.float32, sharding=sharding)}
  if cfg.data.packing and cfg.data.source == 'files':
    batch['segment_ids'] = ints
  step = train_step_for(cfg, graphdef, tx, pipeline)
  try:
    with sharding_context(mesh, layout.rules), lowering_for(devices):
      lowered = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None)).lower(
          state, batch)
  except NotImplementedError as e:
    if cfg.model.attention != 'cudnn':
      raise
    # cuDNN's attention refuses the model's shapes on this GPU.
    raise ConfigError(f"model.attention='cudnn' on {devices[0].device_kind}: "
                      f"{str(e).rstrip('.')}; use model.attention='xla' or change the model's "
                      'shapes.') from None
  with compiling_for(devices):
    executable = lowered.compile({**COMPILE_OPTIONS,
                                  **compiler_options(cfg.model, devices[0].platform,
                                                     pipeline is not None)})
  split = lambda xs: shard_bytes([x for x in xs if 'fsdp' in mesh_axes(x.sharding.spec)])
  head = state.params['embed_VD' if cfg.model.tie_embeddings else 'head_DV']
  zero_split = [x for x in jax.tree.leaves(state.params) if layout.zero and
                over_data(x.sharding.spec, x.shape, mesh.shape) != x.sharding.spec]
  return Compiled(cfg, mesh_shape, layout, pipeline,
                  {'params': shard_bytes(state.params), 'optimizer': shard_bytes(state.opt_state)},
                  shard_bytes([head]), split(jax.tree.leaves(state.params)), split([head]),
                  split(jax.tree.leaves(state.params['blocks'])), shard_bytes(zero_split),
                  executable, devices[0], os.environ.get('XLA_FLAGS', ''))
