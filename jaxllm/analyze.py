"""`python -m jaxllm.analyze --config configs/X.py [--devices N] [--hardware h100-nvlink]`

Compiles the train step ahead of time from shapes alone, nothing allocated, and reports per
device: memory by kind and whether it fits what a process may use of the device; model FLOPs
beside the compiled program's, and the forward work it reruns in the backward (by remat or by
XLA); whether attention runs as a fused kernel; every collective grouped by the mesh axes it
runs over, with its element type and the analytic bytes beside the compiled; the largest
arrays; the pipeline bubble; and a predicted step time and MFU.

The program read is the one the profile's GPU would run: XLA's GPU compiler (in JAX's CUDA
plugin) compiles for N GPUs on a machine that has none (`jaxllm.backends.gpu_devices`).
`--compiler=cpu` reads the CPU compiler's program on N simulated CPU devices instead.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from absl import flags
from ml_collections import ConfigDict

from jaxllm import hlo, metrics
from jaxllm.checkpoint import restore_target
from jaxllm.backends import gpu_devices, is_compile_only, lowering_for, start_backends
from jaxllm.config import (MESH_AXES, ConfigError, batch_shards, main_guard,
                           parse_command_line, resolve_mesh, rule_axes, validate)
from jaxllm.hardware import (PROFILES, Hardware, axes_across_nodes, hardware_profile,
                             usable_memory)
from jaxllm.mesh import batch_sharding, make_mesh, over_data, sharding_context, spec_axes
from jaxllm.model import available_attention
from jaxllm.optim import make_optimizer
from jaxllm.pipeline import PipelineSpec, pipeline_spec
from jaxllm.step import state_shapes, train_step_for

DEVICES = flags.DEFINE_integer(
    'devices', 0, 'Analyse for this many devices (default: the mesh\'s size when no axis is -1, '
    'else one node of the profile; with --compiler=cpu, the devices present).')
HARDWARE = flags.DEFINE_string('hardware', 'h100-nvlink',
                                f'Hardware profile: {", ".join(PROFILES)}.')
DEVICE_MEMORY = flags.DEFINE_float('device-memory', 0.0,
                                    'Memory of one device in GB (default: the profile\'s).')
COMPILER = flags.DEFINE_enum(
    'compiler', 'gpu', ['gpu', 'cpu'], "Whose program to read: 'gpu' compiles for the profile's "
    "GPU (no GPU needed), 'cpu' the CPU compiler's, on simulated CPU devices.")
_JSON = flags.DEFINE_bool('json', False, 'Print the report as JSON.')
_DUMP = flags.DEFINE_string('dump', '', 'Write the compiled program (HLO text) and the report '
                            'into this new directory.')


# The program is compiled to be read, never run: skip the backend's code optimisation, which
# leaves the HLO (collectives, memory, FLOPs) as it is and takes ~40% of the compile time.
COMPILE_OPTIONS = {'xla_backend_optimization_level': 0}


@dataclasses.dataclass
class Compiled:
  """A train step compiled from shapes, and what it was compiled for."""
  cfg: ConfigDict
  mesh_shape: dict[str, int]
  pipeline: PipelineSpec | None
  state_bytes: dict[str, int]  # per device: 'params', 'optimizer'
  head_bytes: int              # per device: the output head's (the embedding table when tied)
  fsdp_split_bytes: int        # per device: of the params, those split over fsdp
  head_split_bytes: int        # of those, the output head's (the embedding table when tied)
  block_split_bytes: int       # of those, the layer stack's
  zero_split_bytes: int        # per device: of the params, those whose update ZeRO splits over data
  executable: jax.stages.Compiled
  device: jax.Device           # one of the devices it was compiled for (their kind, platform)

  @property
  def cpu(self) -> bool:
    """Whether the CPU compiler made the program (see `hlo.collectives`)."""
    return self.device.platform == 'cpu'

  @functools.cached_property
  def text(self) -> str:
    """The optimized HLO of the program (made once: every reader of `jaxllm.hlo` takes it)."""
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
  cfg.model.attention = available_attention(cfg.model, devices[0].platform)
  mesh_shape = resolve_mesh(cfg.mesh, len(devices))
  validate(cfg, mesh_shape)
  mesh = make_mesh(mesh_shape, devices, cfg.mesh.across_hosts)
  pipeline = pipeline_spec(cfg, mesh_shape['pipe'])
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  graphdef, abstract, shardings = state_shapes(cfg.model, tx, mesh, cfg.sharding.rules,
                                               cfg.train.seed, pipeline, cfg.sharding.zero)
  state = restore_target(abstract, shardings)
  rows = (cfg.train.global_batch, cfg.data.seq_len)
  sharding = batch_sharding(mesh, cfg.sharding.rules, 2)
  ints = jax.ShapeDtypeStruct(rows, jnp.int32, sharding=sharding)
  batch = {'inputs': ints, 'targets': ints, 'positions': ints,
           'mask': jax.ShapeDtypeStruct(rows, jnp.float32, sharding=sharding)}
  if cfg.data.packing and cfg.data.source == 'files':
    batch['segment_ids'] = ints
  step = train_step_for(cfg, graphdef, tx, pipeline)
  try:
    with sharding_context(mesh, cfg.sharding.rules), lowering_for(devices):
      lowered = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None)).lower(
          state, batch)
  except NotImplementedError as e:
    if cfg.model.attention != 'cudnn':
      raise
    # cuDNN's attention refuses the model's shapes on this GPU.
    raise ConfigError(f"model.attention='cudnn' on {devices[0].device_kind}: "
                      f"{str(e).rstrip('.')}; use model.attention='xla' or change the model's "
                      'shapes.') from None
  executable = lowered.compile(COMPILE_OPTIONS)
  split = lambda xs: shard_bytes([x for x in xs if 'fsdp' in spec_axes_of(x.sharding)])
  head = state.params['embed_VD' if cfg.model.tie_embeddings else 'head_DV']
  zero_split = [x for x in jax.tree.leaves(state.params) if cfg.sharding.zero and
                over_data(x.sharding.spec, x.shape, mesh.shape) != x.sharding.spec]
  return Compiled(cfg, mesh_shape, pipeline,
                  {'params': shard_bytes(state.params), 'optimizer': shard_bytes(state.opt_state)},
                  shard_bytes([head]), split(jax.tree.leaves(state.params)), split([head]),
                  split(jax.tree.leaves(state.params['blocks'])), shard_bytes(zero_split),
                  executable, devices[0])


def spec_axes_of(sharding) -> set[str]:
  return {a for entry in sharding.spec for a in spec_axes(entry)}


def expected_bytes(c: Compiled) -> dict[tuple[str, ...], float]:
  """Analytic bytes each device sends per step over each single mesh axis (performance-model.md).

  Weights move in the compute dtype, gradients in model.grad_reduce_dtype (`g·` below scales
  parameter bytes to it; `a·` to the compute dtype).
  data: a ring all-reduce of the gradients, 2(N−1)/N·g·P, once per step. Under ZeRO the
    gradients of the parameters whose update it splits (Z of P) are reduce-scattered and the
    updated parameters all-gathered instead, (N−1)/N·(g + 1)·Z: the all-reduce's bytes when
    g = 1 (the ZeRO paper's "same traffic as data parallelism"); with sharding.zero=2 the
    reduce-scatter runs per micro-batch, (N−1)/N·(M·g + 1)·Z.
  fsdp, per micro-batch: the layers' weights all-gathered in forward and backward and their
    gradients reduce-scattered, (N−1)/N·(2a + g)·P; the output head gathered once (the loss
    takes its gradients as it goes) and reduced, (N−1)/N·(a + g)·P; under a pipeline with
    gather_weights='step' the stage weights likewise, once for all iterations; the embedding
    lookup moves rows, not weights: the looked-up b·s·h forward and backward, 2(N−1)/N·b·s·h; the
    parameters fsdp does not split (norm scales) are all-reduced, 2(N−1)/N·g·P.
    (No figure for gather_weights='iteration'.)
  tensor: 4 all-reduces of b·s·h per layer and micro-batch (2 forward, 2 backward), 2(N−1)/N
    each. With sequence parallelism (rules.act_seq over tensor) each is a reduce-scatter and an
    all-gather, the same bytes, and the backward all-gathers the two norms' outputs again for
    the weight gradients (Megatron-LM's figure): 5·2(N−1)/N·b·s·h per layer. With K/V heads
    replicated over tensor (fewer than it), their weights' gradients are all-reduced too,
    2(N−1)/N·g·W per micro-batch (W: the K/V weights' bytes on one device).
  seq (context parallelism, per axis of rules.seq, on top of its own traffic): per layer and
    micro-batch each device's keys and values all-gathered from the whole sequence S and their
    gradients reduce-scattered back, 4(N−1)/N·b·S·k (k: the K/V width on one device).
  pipe: per micro-batch, b·s·h/M forward and backward in each of the R·M+S−1 iterations of
    the scanned schedule (bubble iterations shift too); the last stage's outputs handed out,
    M/S micro-batches to each stage (a reduce-scatter, an all-gather backward),
    2(S−1)/S·b·s·h; the first stage's input gradient, all-reduced for the embedding every
    stage holds, 2(S−1)/S·b·s·h; and once per step (XLA sums the micro-batches' first), the
    output head's gradient, which each stage makes from its rows, all-reduced, 2(S−1)/S·g·H
    (H the head's bytes on one device).
  P is the parameter bytes on one device before the axis' own split; b the rows on one device,
  s its part of the sequence (all of it unless rules.seq splits it).
  """
  cfg, shape = c.cfg, c.mesh_shape
  m, t = cfg.model, cfg.train
  act_bytes = jnp.dtype(m.dtype).itemsize
  a = act_bytes / jnp.dtype(m.param_dtype).itemsize
  g = jnp.dtype(m.grad_reduce_dtype).itemsize / jnp.dtype(m.param_dtype).itemsize
  shards = batch_shards(cfg.sharding.rules, shape)
  rows = t.global_batch // t.micro_batches // shards  # b per micro-batch on one device
  seq_parts = math.prod(shape[a] for a in rule_axes(cfg.sharding.rules.seq))
  bsh = rows * cfg.data.seq_len // seq_parts * m.embed_dim * act_bytes  # s: this device's
  params = c.state_bytes['params']
  expected = {}
  n = shape['data']
  if n > 1:
    split = c.zero_split_bytes
    scatters = t.micro_batches if cfg.sharding.zero == 2 else 1
    expected[('data',)] = (n - 1) / n * (2 * g * (params - split) + (scatters * g + 1) * split)
  n = shape['fsdp']
  if n > 1 and not (c.pipeline and c.pipeline.gather_weights == 'iteration'):
    # Whole bytes (before the fsdp split) of what is gathered twice and what once.
    blocks, head = n * c.block_split_bytes, n * c.head_split_bytes
    unsplit = params - c.fsdp_split_bytes
    # With gather_weights='step' the stage weights are gathered once for all iterations.
    per_micro = ((a + g if c.pipeline else 2 * a + g) * blocks + (a + g) * head +
                 2 * g * unsplit + 2 * bsh)
    expected[('fsdp',)] = (n - 1) / n * t.micro_batches * per_micro
  rules = cfg.sharding.rules
  n = shape['tensor']
  if n > 1:
    per_layer = 5 if 'tensor' in rule_axes(rules.act_seq) else 4
    expected[('tensor',)] = per_layer * m.num_layers * t.micro_batches * 2 * (n - 1) / n * bsh
    if 'tensor' in rule_axes(rules.heads) and 'tensor' not in rule_axes(rules.kv_heads):
      fsdp = math.prod(shape[a] for a in rule_axes(rules.embed))
      kv_weights = (2 * m.num_layers // shape['pipe'] * m.embed_dim // fsdp * m.num_kv_heads *
                    m.head_dim * jnp.dtype(m.param_dtype).itemsize)
      expected[('tensor',)] += t.micro_batches * 2 * (n - 1) / n * g * kv_weights
  for axis in rule_axes(rules.seq):
    n = shape[axis]
    if n > 1:
      kv_parts = math.prod(shape[a] for a in rule_axes(rules.act_kv_heads))
      bSk = bsh * seq_parts / m.embed_dim * m.num_kv_heads * m.head_dim / kv_parts
      expected[(axis,)] = (expected.get((axis,), 0) +
                           4 * m.num_layers * t.micro_batches * (n - 1) / n * bSk)
  if c.pipeline:
    p = c.pipeline
    shifts = 2 * p.iterations * bsh / p.microbatches
    ends = 2 * (p.stages - 1) / p.stages * 2 * bsh
    head = 2 * (p.stages - 1) / p.stages * g * c.head_bytes
    expected[('pipe',)] = t.micro_batches * (shifts + ends) + head
  return expected


def collective_table(c: Compiled, hardware: Hardware) -> tuple[list[dict], list[dict]]:
  """The compiled collectives grouped by (mesh axes, kind, element type) with count, bytes
  and time; and their bytes per mesh-axes group beside the analytic figure.

  A combined op moving several element types counts once in each of their rows (and so does
  its latency)."""
  groups = collections.defaultdict(lambda: {'count': 0, 'bytes': 0.0, 'rewritten': 0})
  for x in hlo.collectives(c.text, c.mesh_shape, cpu=c.cpu):
    g = groups[(x.axes, x.kind, x.dtype)]
    g['count'] += x.count
    g['bytes'] += x.bytes
    g['rewritten'] += x.count if (x.from_all_reduce or x.summed) else 0
  expected = expected_bytes(c)
  per_axes = collections.Counter()
  for (axes, _, _), g in groups.items():
    per_axes[axes] += g['bytes']
  rows = []
  spanning = axes_across_nodes(c.mesh_shape, c.cfg.mesh.across_hosts, hardware.devices_per_node)
  for (axes, kind, dtype), g in sorted(groups.items()):
    crosses = bool(spanning & set(axes))
    bandwidth, latency = ((hardware.inter_node_bw, hardware.inter_node_latency) if crosses else
                          (hardware.intra_node_bw, hardware.intra_node_latency))
    rows.append({'axes': list(axes), 'kind': kind, 'dtype': dtype, 'count': g['count'],
                 'bytes': g['bytes'], 'rewritten': g['rewritten'], 'crosses_nodes': crosses,
                 'seconds': g['bytes'] / bandwidth + g['count'] * latency})
  totals = []
  for axes, compiled in sorted(per_axes.items()):
    analytic = expected.get(axes)
    totals.append({'axes': list(axes), 'bytes': compiled, 'analytic': analytic,
                   'ratio': compiled / analytic if analytic else None})
  return rows, totals


def peak_bytes(executable: jax.stages.Compiled) -> int:
  """A compiled program's peak bytes per device by the compiler's own analysis: arguments and
  outputs (donated ones once) plus temporaries."""
  stats = executable.memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def memory(c: Compiled) -> dict[str, float]:
  """Per-device bytes: state from its shardings, the rest from the compiler's buffer
  assignment."""
  gradients = c.state_bytes['params']  # as the params; held among the temporaries
  if c.cfg.sharding.zero == 2 and c.cfg.train.micro_batches > 1:  # split as the moments are
    gradients -= c.zero_split_bytes * (1 - 1 / c.mesh_shape['data'])
  return {'params': c.state_bytes['params'], 'optimizer': c.state_bytes['optimizer'],
          'gradients': gradients,
          'temporaries': c.executable.memory_analysis().temp_size_in_bytes,
          'peak': peak_bytes(c.executable)}


def attention(c: Compiled) -> dict:
  """How attention runs in the program: cuDNN's fused kernels (with their masks, any bias
  operand, FLOPs from shapes, and apart the forwards rerun in the backward), or XLA's ops,
  which hold the [B, N, T, S] scores."""
  kernels = collections.defaultdict(lambda: {'count': 0, 'flops': 0.0})
  for k in hlo.fused_attention(c.text):
    row = kernels[(k.target, k.flash, k.mask, k.bias, k.recomputed_by)]
    row['count'] += k.count
    row['flops'] += k.count * k.flops
  rows = sorted(kernels.items(), key=lambda kv: kv[0][4] is not None)  # reruns last
  return {'implementation': c.cfg.model.attention,
          'kernels': [{'target': t, 'flash': f, 'mask': m, 'bias': b, 'recomputed_by': r, **v}
                      for (t, f, m, b, r), v in rows],
          'flops_per_device': sum(v['flops'] for v in kernels.values())}


def predict(c: Compiled, collectives: list[dict], flops_per_device: float,
            hardware: Hardware) -> dict[str, float]:
  """Step time on `hardware`: compute at the profile's matmul rate; tensor and pipe traffic
  exposed (it sits between dependent matmuls); data and fsdp traffic overlapped with compute
  by XLA's scheduler, exposed only where it outlasts the compute. The bubble is the schedule's
  idle share of the compute (its iterations run on zeros)."""
  compute = flops_per_device / (hardware.peak_flops * hardware.matmul_efficiency)
  serial = sum(r['seconds'] for r in collectives if set(r['axes']) & {'tensor', 'pipe'})
  overlapped = sum(r['seconds'] for r in collectives if not set(r['axes']) & {'tensor', 'pipe'})
  bubble = compute * (c.pipeline.bubble_fraction if c.pipeline else 0.0)
  exposed = serial + max(0.0, overlapped - compute)
  step = compute + exposed
  cfg = c.cfg
  devices = math.prod(c.mesh_shape.values())
  tokens = cfg.train.global_batch * cfg.data.seq_len
  model_flops = metrics.flops_per_token(cfg.model, cfg.data.seq_len)
  mfu = lambda convention: model_flops[convention] * tokens / (step * devices * hardware.peak_flops)
  return {'compute_s': compute - bubble, 'bubble_s': bubble, 'exposed_comm_s': exposed,
          'step_s': step, 'tokens_per_s': tokens / step, 'mfu': mfu('full'),
          'mfu_causal': mfu('causal')}


def compiler(c: Compiled) -> dict:
  """Which compiler made the program, and for what."""
  return {'platform': c.device.platform, 'device': c.device.device_kind,
          'compile_only': is_compile_only(c.device), 'jax': jax.__version__}


def analyze(cfg: ConfigDict, hardware: Hardware, devices=None) -> dict:
  """The whole report as a JSON-ready dict, for `devices` (default: those present)."""
  return report(compile_step(cfg, devices), hardware)


def report(c: Compiled, hardware: Hardware) -> dict:
  """What `analyze` says of a compiled step, as a JSON-ready dict."""
  rows, totals = collective_table(c, hardware)
  cfg = c.cfg
  m, t = cfg.model, cfg.train
  devices_n = math.prod(c.mesh_shape.values())
  tokens = t.global_batch * cfg.data.seq_len
  flops = metrics.flops_per_token(m, cfg.data.seq_len)
  matmul_flops = hlo.dot_flops(c.text)
  attn = attention(c)
  compiled_flops = matmul_flops + attn['flops_per_device']
  recomputed = hlo.recomputed_flops(c.text)
  mem = memory(c)
  usable, fraction = usable_memory(hardware)
  counts = metrics.param_counts(m)
  return {
      'compiler': compiler(c), 'mesh': c.mesh_shape, 'hardware': dataclasses.asdict(hardware),
      'params': {'total': counts['total'],
                 'per_device': c.state_bytes['params'] // jnp.dtype(m.param_dtype).itemsize},
      'memory': {**mem, 'usable': usable, 'usable_fraction': fraction},
      'fits': mem['peak'] <= usable,
      'flops': {'model_per_token': flops['full'], 'model_per_token_causal': flops['causal'],
                'model_per_step': flops['full'] * tokens,
                'compiled_matmul_per_device': matmul_flops,
                'compiled_per_device': compiled_flops,
                'compiled_per_step': compiled_flops * devices_n,
                'remat': m.remat,
                # Forward work rerun in the backward, by the remat policy and by XLA.
                'recomputed_per_device': sum(recomputed.values()),
                'recomputed_per_step': sum(recomputed.values()) * devices_n,
                'recomputed_by_xla_per_step': recomputed['xla'] * devices_n},
      'attention': attn,
      'pipeline': (None if not c.pipeline else {
          'stages': c.pipeline.stages, 'repeats': c.pipeline.repeats,
          'microbatches': c.pipeline.microbatches, 'bubble': c.pipeline.bubble_fraction}),
      'collectives': rows, 'per_axis': totals,
      'largest_arrays': [{'bytes': b, 'shape': shape, 'op': op}
                         for b, shape, op in hlo.largest_values(c.text)],
      'prediction': predict(c, rows, compiled_flops, hardware),
  }


def seconds_text(s: float) -> str:
  return f'{s * 1e3:,.2f} ms' if s >= 1e-3 else f'{s * 1e6:,.2f} µs'


def size_text(n: float) -> str:
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(n) >= scale:
      return f'{n / scale:,.2f} {unit}'
  return f'{n:,.0f} B'


def program_text(platform: str, count: int, device_kind: str, compile_only: bool) -> str:
  """Whose program it is, for the text reports of analyze and tune."""
  if platform != 'gpu':
    return f'{platform.upper()} compiler\'s program for {count} devices'
  return (f'GPU: XLA\'s program for {count} × {device_kind}'
          + (', compiled without a GPU' if compile_only else ''))


def format_report(r: dict) -> str:
  hw, mem, fl, pr, comp = r['hardware'], r['memory'], r['flops'], r['prediction'], r['compiler']
  devices = math.prod(r['mesh'].values())
  program = program_text(comp['platform'], devices, comp['device'], comp['compile_only'])
  if comp['platform'] != 'gpu':
    program += ': memory, element types and fusions are its own, not a GPU\'s'
  fit = 'fits' if r['fits'] else 'does NOT fit'
  lines = [
      f'program  {program}; jax {comp["jax"]}',
      f'mesh     {" ".join(f"{a}={n}" for a, n in r["mesh"].items())}  ({devices} devices)',
      f'params   {r["params"]["total"] / 1e6:,.2f}M total, {r["params"]["per_device"] / 1e6:,.2f}M '
      'per device',
      'memory per device:',
      f'  params       {size_text(mem["params"]):>12}',
      f'  optimizer    {size_text(mem["optimizer"]):>12}',
      f'  gradients    {size_text(mem["gradients"]):>12}   (their sum; among the temporaries)',
      f'  temporaries  {size_text(mem["temporaries"]):>12}   (activations, gradients, workspace: '
      'the compiler\'s buffer assignment)',
      f'  peak         {size_text(mem["peak"]):>12}   {fit} the {size_text(mem["usable"])} a '
      f'process may use of {hw["name"]}\'s {size_text(hw["memory"])} '
      f'(XLA_PYTHON_CLIENT_MEM_FRACTION={mem["usable_fraction"]:g})',
      f'FLOPs    model {fl["model_per_token"] / 1e9:,.3f} GFLOP/token (6N + 12LHQT; '
      f'{fl["model_per_token_causal"] / 1e9:,.3f} with causal halving), '
      f'{fl["model_per_step"] / 1e12:,.3f} TFLOP/step; compiled '
      f'{fl["compiled_per_step"] / 1e12:,.3f} TFLOP/step '
      f'({fl["compiled_per_step"] / fl["model_per_step"]:.2f}× model; matmuls from the program'
      + (', fused attention from its shapes)' if r['attention']['kernels'] else ')'),
      recomputed_text(fl),
  ]
  lines += attention_lines(r['attention'])
  if r['pipeline']:
    p = r['pipeline']
    lines.append(f'pipeline S={p["stages"]} R={p["repeats"]} M={p["microbatches"]}: bubble '
                 f'{p["bubble"]:.1%}')
  lines.append('collectives per step, bytes sent by one device:')
  lines.append(f'  {"axes":16} {"kind":19} {"dtype":5} {"count":>7} {"bytes":>12} {"time":>10}'
               '  link')
  for c in r['collectives']:
    note = '*' if c['rewritten'] else ' '
    lines.append(f'  {",".join(c["axes"]):16} {c["kind"] + note:19} {c["dtype"]:5} '
                 f'{c["count"]:>7,} {size_text(c["bytes"]):>12} {seconds_text(c["seconds"]):>10}  '
                 f'{"inter-node" if c["crosses_nodes"] else "intra-node"}')
  if any(c['rewritten'] for c in r['collectives']):
    lines.append('  * counted as an accelerator runs it: an all-reduce whose result is only '
                 'sliced is a reduce-scatter; all-reduced values that are only summed are '
                 'reduced once')
  lines.append('per axis, compiled against analytic (see `expected_bytes`):')
  for a in r['per_axis']:
    analytic = (f'{size_text(a["analytic"]):>12}  ratio {a["ratio"]:.3f}' if a['analytic']
                else f'{"–":>12}')
    lines.append(f'  {",".join(a["axes"]):16} {size_text(a["bytes"]):>12}  analytic {analytic}')
  lines.append('largest arrays the program computes (not all live at once):')
  for a in r['largest_arrays']:
    lines.append(f'  {size_text(a["bytes"]):>12}  {a["shape"]:28} {a["op"]}')
  lines.append(
      f'predicted on {hw["name"]}: step {seconds_text(pr["step_s"])} = compute '
      f'{seconds_text(pr["compute_s"])} + bubble {seconds_text(pr["bubble_s"])} + exposed '
      f'communication {seconds_text(pr["exposed_comm_s"])}; {pr["tokens_per_s"]:,.0f} tokens/s, '
      f'MFU {pr["mfu"]:.1%} ({pr["mfu_causal"]:.1%} with causal halving). A model, not a '
      f'measurement: matmuls at {hw["matmul_efficiency"]:.0%} of peak, data and fsdp traffic '
      'hidden behind compute, tensor and pipe traffic exposed; tune --measure times it')
  return '\n'.join(lines)


def recomputed_text(fl: dict) -> str:
  """The forward work the backward reruns, for the text report."""
  total, by_xla = fl['recomputed_per_step'], fl['recomputed_by_xla_per_step']
  return (f'         recomputed {total / 1e12:,.3f} TFLOP/step ({total / fl["model_per_step"]:.1%} '
          f'of model), forward matmuls and attention rerun in the backward: '
          f'{(total - by_xla) / 1e12:,.3f} by remat {fl["remat"]!r}, {by_xla / 1e12:,.3f} by XLA '
          'to fit the memory')


def attention_lines(a: dict) -> list[str]:
  """How attention runs, for the text report."""
  if not a['kernels']:
    return [f'attention {a["implementation"]}: XLA\'s ops, no fused kernel; the [B, N, T, S] '
            'scores are held in memory']
  lines = ['attention cuDNN kernels per step (FLOPs from their shapes):']
  for k in a['kernels']:
    bias = f', bias operand {k["bias"]}' if k['bias'] else ''
    rerun = f' (recomputed by {k["recomputed_by"]})' if k['recomputed_by'] else ''
    lines.append(f'  {k["target"]:36} ×{k["count"]:<5,} {"flash" if k["flash"] else "not flash"}'
                 f', mask {k["mask"]}{bias}, {k["flops"] / 1e12:,.3f} TFLOP{rerun}')
  return lines


def parse_and_place(argv: list[str]):
  """The config, hardware profile and devices to analyse from the command line: N GPUs of the
  profile (compiled for, never present), or with --compiler=cpu N devices simulated on the
  CPU (default: those present, config.cpu_devices on a CPU). Starts JAX's backends."""
  cfg, _ = parse_command_line(argv)
  check_flags()
  hardware = hardware_profile(HARDWARE.value, DEVICE_MEMORY.value)
  if COMPILER.value == 'cpu' and DEVICES.value:  # before JAX starts its backends
    jax.config.update('jax_platforms', 'cpu')
    cfg.cpu_devices = DEVICES.value
  start_backends(cfg)
  if COMPILER.value == 'cpu':
    return cfg, hardware, jax.devices()
  sizes = [cfg.mesh[a] for a in MESH_AXES]
  count = DEVICES.value or (math.prod(sizes) if min(sizes) > 0 else hardware.devices_per_node)
  return cfg, hardware, gpu_devices(hardware, count)


def check_flags() -> None:
  """--devices and --device-memory, when given, must be positive: 0 is their default, which
  means the mesh's size and the profile's memory, so a 0 given would quietly mean those."""
  if DEVICES.present and DEVICES.value < 1:
    raise ConfigError(f'--devices={DEVICES.value} must be at least 1; leave it out for the '
                      "mesh's size.")
  memory = DEVICE_MEMORY.value
  if DEVICE_MEMORY.present and not (math.isfinite(memory) and memory > 0):
    raise ConfigError(f'--device-memory={memory} must be a positive number of GB; leave it out '
                      "for the profile's.")


def check_dump_directory(directory: str) -> None:
  """--dump writes only into a new (or empty) directory: nothing there is overwritten."""
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise ConfigError(f'--dump {directory}: exists and is not an empty directory; name a new '
                      'one.')


def write_dump(directory: str, c: Compiled, r: dict) -> None:
  """The compiled program and the report, for a person to read."""
  os.makedirs(directory, exist_ok=True)
  files = {'program.hlo.txt': c.text, 'report.json': json.dumps(r, indent=2) + '\n',
           'report.txt': format_report(r) + '\n'}
  for name, text in files.items():
    with open(os.path.join(directory, name), 'w') as f:
      f.write(text)


def main(argv: list[str]) -> None:
  cfg, hardware, devices = parse_and_place(argv)
  if _DUMP.value:
    check_dump_directory(_DUMP.value)  # before the long part
  compiled = compile_step(cfg, devices)
  r = report(compiled, hardware)
  print(json.dumps(r, indent=2) if _JSON.value else format_report(r))
  if _DUMP.value:
    write_dump(_DUMP.value, compiled, r)


def cli() -> None:
  """The `jaxllm-analyze` command (pyproject's console script): `python -m jaxllm.analyze`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
