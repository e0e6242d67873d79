"""The train step compiled ahead of time from shapes alone, nothing allocated: for CPU
devices, or for a GPU's on a machine that has none (`jaxllm.backends.gpu_devices`); with a
`ProgramCache`, a program compiled before is read back instead."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import resource

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxllm.backends import compiler_options, compiling_for, gpu_kernel_file, lowering_for
from jaxllm.checkpoint import restore_target
from jaxllm.config import ConfigError
from jaxllm.cost.cache import Entry, MemoryStats, ProgramCache
from jaxllm.model import with_available_attention
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import batch_sharding, make_mesh, sharding_context
from jaxllm.parallel.rules import Layout, derive, mesh_axes
from jaxllm.parallel.zero import over_data
from jaxllm.pipeline.spec import PipelineSpec, pipeline_spec
from jaxllm.step import state_shapes, train_step_for
from jaxllm.validate import resolve_mesh, validate

# The program is compiled to be read, never run: skip the backend's code optimisation (LLVM's,
# and on GPUs ptxas's, run once per kernel), which leaves the HLO (collectives, memory, FLOPs)
# as it is. Skipping LLVM's saves ~40% of a compile's time; skipping ptxas's 4–11% of a GPU
# compile's (ptxas itself, ~35% of a cold GPU compile, still runs: this plugin has no
# in-process assembler).
COMPILE_OPTIONS = {'xla_backend_optimization_level': 0,
                   'xla_gpu_disable_gpuasm_optimizations': True}


@dataclasses.dataclass
class Step:
  """A train step for a mesh as its shapes say, nothing compiled: per device, the bytes of its
  state and of the parts the traffic formulas (`jaxllm.cost.traffic`) take."""
  cfg: ConfigDict
  mesh_shape: dict[str, int]
  layout: Layout               # the rules it runs under
  pipeline: PipelineSpec | None
  state_bytes: dict[str, int]  # per device: 'params', 'optimizer'
  head_bytes: int              # per device: the output head's (the embedding table when tied)
  fsdp_split_bytes: int        # per device: of the params, those split over fsdp
  head_split_bytes: int        # of those, the output head's (the embedding table when tied)
  block_split_bytes: int       # of those, the layer stack's
  zero_split_bytes: int        # per device: of the params, those whose update ZeRO splits over data


@dataclasses.dataclass
class Compiled(Step):
  """A train step compiled from shapes, and what it was compiled for."""
  memory: MemoryStats          # the compiler's buffer assignment
  text: str                    # the optimized HLO (every reader of `jaxllm.cost.hlo` takes it)
  device: jax.Device           # one of the devices it was compiled for (their kind, platform)
  compile_s: float             # CPU seconds compiling it took (when it was compiled)
  cached: bool                 # read back from a ProgramCache, not compiled now
  xla_flags: str = ''          # XLA_FLAGS as the compiler read them (the run's xla_flags too)

  @property
  def cpu(self) -> bool:
    """Whether the CPU compiler made the program (see `hlo.collectives`)."""
    return self.device.platform == 'cpu'


def shard_bytes(tree) -> int:
  """Bytes of `tree`'s abstract arrays that one device holds (the largest shard of each)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def cpu_seconds() -> float:
  """CPU seconds this process and the processes it waited for (the GPU compiler's ptxas) have
  used."""
  own, children = (resource.getrusage(who)
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass
class _Prepared:
  """A step's shapes and what lowering it takes."""
  step: Step
  mesh: jax.sharding.Mesh
  graphdef: object
  tx: object
  state: object                # the abstract state, with its shardings
  shardings: object


def _prepare(cfg: ConfigDict, devices) -> _Prepared:
  cfg = copy.deepcopy(cfg)  # our own: the attention fallback below must not leak back
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
  split = lambda xs: shard_bytes([x for x in xs if 'fsdp' in mesh_axes(x.sharding.spec)])
  head = state.params['embed_VD' if cfg.model.tie_embeddings else 'head_DV']
  zero_split = [x for x in jax.tree.leaves(state.params) if layout.zero and
                over_data(x.sharding.spec, x.shape, mesh.shape) != x.sharding.spec]
  step = Step(cfg, mesh_shape, layout, pipeline,
              {'params': shard_bytes(state.params), 'optimizer': shard_bytes(state.opt_state)},
              shard_bytes([head]), split(jax.tree.leaves(state.params)), split([head]),
              split(jax.tree.leaves(state.params['blocks'])), shard_bytes(zero_split))
  return _Prepared(step, mesh, graphdef, tx, state, shardings)


def step_shapes(cfg: ConfigDict, devices=None) -> Step:
  """The train step's shapes for `devices` (default: those present), nothing compiled. Raises
  ConfigError where the config does not fit the mesh (or the mesh the devices' hosts)."""
  return _prepare(cfg, jax.devices() if devices is None else devices).step


def compile_step(cfg: ConfigDict, devices=None, cache: ProgramCache | None = None) -> Compiled:
  """The train step compiled ahead of time from abstract state and batch shapes, for
  `devices` (default: those present): CPU devices, or a GPU's (`backends.gpu_devices`); read
  from `cache` when the program is there (and kept there when it was not)."""
  devices = jax.devices() if devices is None else devices
  p = _prepare(cfg, devices)
  cfg, mesh, layout = p.step.cfg, p.mesh, p.step.layout
  rows = (cfg.train.global_batch, cfg.data.seq_len)
  sharding = batch_sharding(mesh, layout.rules, 2)
  ints = jax.ShapeDtypeStruct(rows, jnp.int32, sharding=sharding)
  batch = {'inputs': ints, 'targets': ints, 'positions': ints,
           'mask': jax.ShapeDtypeStruct(rows, jnp.float32, sharding=sharding)}
  if cfg.data.packing and cfg.data.source == 'files':
    batch['segment_ids'] = ints
  step = train_step_for(cfg, p.graphdef, p.tx, p.step.pipeline)
  try:
    with sharding_context(mesh, layout.rules), lowering_for(devices):
      lowered = jax.jit(step, donate_argnums=0, out_shardings=(p.shardings, None)).lower(
          p.state, batch)
  except NotImplementedError as e:
    if cfg.model.attention != 'cudnn':
      raise
    # cuDNN's attention refuses the model's shapes on this GPU.
    raise ConfigError(f"model.attention='cudnn' on {devices[0].device_kind}: "
                      f"{str(e).rstrip('.')}; use model.attention='xla' or change the model's "
                      'shapes.') from None
  options = {**COMPILE_OPTIONS, **compiler_options(cfg.model, devices[0].platform,
                                                    p.step.pipeline is not None)}
  entry = key = None
  if cache:
    key = cache.key(lowered.as_text(), options)
    entry = cache.get(key)
  if kernels := gpu_kernel_file(cfg.compilation_cache, devices[0]):
    options['xla_gpu_kernel_cache_file'] = kernels
  cached = entry is not None
  if not cached:
    start = cpu_seconds()
    with compiling_for(devices):
      executable = lowered.compile(options)
    memory = MemoryStats.of(executable)
    entry = Entry(memory, executable.as_text(), cpu_seconds() - start)
    if cache:
      cache.put(key, entry)
  fields = {f.name: getattr(p.step, f.name) for f in dataclasses.fields(Step)}
  return Compiled(**fields, memory=entry.memory, text=entry.text, device=devices[0],
                  compile_s=entry.compile_s, cached=cached,
                  xla_flags=os.environ.get('XLA_FLAGS', ''))
