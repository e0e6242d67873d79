"""What a compiled step says of itself, per device: memory, FLOPs, attention kernels, the
collectives by mesh axes beside the analytic bytes, the largest arrays, and a predicted step
time and MFU on a hardware profile; as a JSON-ready dict and as text."""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from jaxllm import metrics
from jaxllm.backends import is_compile_only
from jaxllm.config import moe_layers
from jaxllm.cost import experts, hlo, timing
from jaxllm.cost.compile import Compiled, compile_step
from jaxllm.cost.hardware import Hardware, axes_across_nodes, usable_memory
from jaxllm.cost.traffic import expected_bytes


def collective_table(c: Compiled, hardware: Hardware) -> tuple[list[dict], list[dict]]:
  """The compiled collectives grouped by (mesh axes, kind, element type) with count, bytes
  and time (latency + bytes ÷ bus bandwidth, as `timing` takes them; None on a profile
  without rates); and their bytes per mesh-axes group beside the analytic figure.

  A combined op moving several element types counts once in each of their rows (and so does
  its latency)."""
  groups = collections.defaultdict(lambda: {'count': 0, 'bytes': 0.0, 'rewritten': 0,
                                            'seconds': 0.0})
  spanning = axes_across_nodes(c.mesh_shape, c.cfg.mesh.across_hosts, hardware.devices_per_node)
  rates = hardware.rates
  for x in hlo.collectives(c.text, c.mesh_shape, cpu=c.cpu):
    g = groups[(x.axes, x.kind, x.dtype)]
    g['count'] += x.count
    g['bytes'] += x.bytes
    g['rewritten'] += x.count if (x.from_all_reduce or x.summed) else 0
    if rates:
      g['seconds'] += rates.collective_seconds(x.kind, x.group_size, bool(spanning & set(x.axes)),
                                               x.bytes, x.count)
  expected = expected_bytes(c)
  per_axes = collections.Counter()
  for (axes, _, _), g in groups.items():
    per_axes[axes] += g['bytes']
  rows = []
  for (axes, kind, dtype), g in sorted(groups.items()):
    rows.append({'axes': list(axes), 'kind': kind, 'dtype': dtype, 'count': g['count'],
                 'bytes': g['bytes'], 'rewritten': g['rewritten'],
                 'crosses_nodes': bool(spanning & set(axes)),
                 'seconds': g['seconds'] if rates else None})
  totals = []
  for axes, compiled in sorted(per_axes.items()):
    analytic = expected.get(axes)
    totals.append({'axes': list(axes), 'bytes': compiled, 'analytic': analytic,
                   'ratio': compiled / analytic if analytic else None})
  return rows, totals


def memory(c: Compiled) -> dict[str, float]:
  """Per-device bytes: state from its shardings, the rest from the compiler's buffer
  assignment."""
  gradients = c.state_bytes['params']  # as the params; held among the temporaries
  if c.layout.zero == 2 and c.cfg.train.micro_batches > 1:  # split as the moments are
    gradients -= c.zero_split_bytes * (1 - 1 / c.mesh_shape['data'])
  return {'params': c.state_bytes['params'], 'optimizer': c.state_bytes['optimizer'],
          'gradients': gradients,
          'temporaries': c.memory.temporaries, 'peak': c.memory.peak}


def attention(c: Compiled) -> dict:
  """How attention runs in the program: cuDNN's fused kernels (with their masks and sliding
  windows, any bias operand, FLOPs from shapes, and apart the forwards rerun in the
  backward), or XLA's ops, which hold the [B, N, T, S] scores."""
  kernels = collections.defaultdict(lambda: {'count': 0, 'flops': 0.0})
  for k in hlo.fused_attention(c.text):
    row = kernels[(k.target, k.flash, k.mask, k.window, k.bias, k.recomputed_by)]
    row['count'] += k.count
    row['flops'] += k.count * k.flops
  rows = sorted(kernels.items(), key=lambda kv: kv[0][5] is not None)  # reruns last
  return {'implementation': c.cfg.model.attention,
          'kernels': [{'target': t, 'flash': f, 'mask': m, 'window': w, 'bias': b,
                       'recomputed_by': r, **v} for (t, f, m, w, b, r), v in rows],
          'flops_per_device': sum(v['flops'] for v in kernels.values())}


def predict(c: Compiled, hardware: Hardware) -> dict | None:
  """The step's time on `hardware`, kernel by kernel (`jaxllm.cost.timing`), with tokens/s
  and MFU; None on a profile without kernel rates. The pipeline's idle iterations run on
  zeros, so the bubble is inside the kernels' time: `bubble_s` is its share of them."""
  if hardware.rates is None:
    return None
  spanning = axes_across_nodes(c.mesh_shape, c.cfg.mesh.across_hosts, hardware.devices_per_node)
  crosses = lambda groups: bool(spanning & set(hlo.group_axes(groups, c.mesh_shape)[0]))
  devices = math.prod(c.mesh_shape.values())
  rates = hardware.rates.for_flags(c.xla_flags)
  t = timing.step_time(c.text, rates, devices, crosses,
                       experts.custom_call_costs(c.cfg, c.layout.batch_shards))
  cfg = c.cfg
  tokens = cfg.train.global_batch * cfg.data.seq_len
  model_flops = metrics.flops_per_token(cfg.model, cfg.data.seq_len)
  mfu = lambda convention: model_flops[convention] * tokens / (t.step_s * devices
                                                               * hardware.peak_flops)
  bubble = c.pipeline.bubble_fraction if c.pipeline else 0.0
  return {**timing.summary(t), 'tokens_per_s': tokens / t.step_s, 'mfu': mfu('full'),
          'mfu_causal': mfu('causal'),
          'bubble_s': bubble * (t.step_s - t.by_category['exposed_comm']),
          'assumes': rates.assumptions()}


def mixture_of_experts(c: Compiled, hardware: Hardware) -> dict | None:
  """The experts' grouped GEMMs (FLOPs per device and step, at the rows an even router gives
  them) and the dispatch's collectives per mesh axes beside the analytic bytes
  (`experts.expected_dispatch_bytes`); None without experts."""
  m = c.cfg.model
  if not m.moe.experts:
    return None
  rows = experts.routed_rows(c.cfg, c.layout.batch_shards)
  shape = c.mesh_shape
  expert_axes = experts.dispatch_axes(c)
  sent = collections.Counter()
  for x in experts.dispatch_collectives(c.text, shape, c.cpu):
    sent[(x.axes, x.kind)] += x.bytes
  analytic = experts.expected_dispatch_bytes(c.cfg, shape, expert_axes, c.layout.batch_shards,
                                             moe_layers(m))
  compiled = sum(b for (axes, _), b in sent.items() if set(axes) <= set(expert_axes))
  by_kernel, recomputed = experts.grouped_gemm_flops(c.text, rows)
  return {'dispatch': m.moe.dispatch, 'routed_rows_per_call': rows,
          'grouped_gemm_flops_per_device': by_kernel,
          'grouped_gemm_recomputed_per_device': recomputed,
          'collectives': [{'axes': list(axes), 'kind': kind, 'bytes': b}
                          for (axes, kind), b in sorted(sent.items())],
          'expert_axes': list(expert_axes), 'dispatch_bytes': compiled,
          'dispatch_bytes_analytic': analytic,
          'ratio': compiled / analytic if analytic else None}


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
  moe = mixture_of_experts(c, hardware)
  # The experts' grouped GEMMs are kernels of their own, beside XLA's dots.
  grouped_flops = sum(moe['grouped_gemm_flops_per_device'].values()) if moe else 0.0
  matmul_flops = hlo.dot_flops(c.text) + grouped_flops
  attn = attention(c)
  compiled_flops = matmul_flops + attn['flops_per_device']
  recomputed = hlo.recomputed_flops(c.text)
  for who, rerun in (moe['grouped_gemm_recomputed_per_device'] if moe else {}).items():
    recomputed[who] += rerun
  mem = memory(c)
  usable, fraction = usable_memory(hardware)
  counts = metrics.param_counts(m)
  return {
      'compiler': compiler(c), 'mesh': c.mesh_shape, 'hardware': hardware.summary(),
      'params': {'total': counts['total'], 'active': counts['active'],
                 'per_device': c.state_bytes['params'] // jnp.dtype(m.param_dtype).itemsize},
      'memory': {**mem, 'usable': usable, 'usable_fraction': fraction},
      'fits': mem['peak'] <= usable,
      'flops': {'model_per_token': flops['full'], 'model_per_token_causal': flops['causal'],
                'model_per_step': flops['full'] * tokens,
                'compiled_matmul_per_device': matmul_flops,
                'grouped_gemm_per_device': grouped_flops,
                'compiled_per_device': compiled_flops,
                'compiled_per_step': compiled_flops * devices_n,
                'remat': m.remat,
                # Forward work rerun in the backward, by the remat policy and by XLA.
                'recomputed_per_device': sum(recomputed.values()),
                'recomputed_per_step': sum(recomputed.values()) * devices_n,
                'recomputed_by_xla_per_step': recomputed['xla'] * devices_n},
      'attention': attn,
      'moe': moe,
      'pipeline': (None if not c.pipeline else {
          'schedule': c.pipeline.schedule, 'stages': c.pipeline.stages,
          'repeats': c.pipeline.repeats,
          'microbatches': c.pipeline.microbatches, 'bubble': c.pipeline.bubble_fraction}),
      'collectives': rows, 'per_axis': totals,
      'largest_arrays': [{'bytes': b, 'shape': shape, 'op': op}
                         for b, shape, op in hlo.largest_values(c.text)],
      'prediction': predict(c, hardware),
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
  lines += moe_lines(r.get('moe'), r['params'])
  if r['pipeline']:
    p = r['pipeline']
    lines.append(f'pipeline {p["schedule"]} S={p["stages"]} R={p["repeats"]} '
                 f'M={p["microbatches"]}: bubble {p["bubble"]:.1%}')
  lines.append('collectives per step, bytes sent by one device:')
  lines.append(f'  {"axes":16} {"kind":19} {"dtype":5} {"count":>7} {"bytes":>12} {"time":>10}'
               '  link')
  for c in r['collectives']:
    note = '*' if c['rewritten'] else ' '
    lines.append(f'  {",".join(c["axes"]):16} {c["kind"] + note:19} {c["dtype"]:5} '
                 f'{c["count"]:>7,} {size_text(c["bytes"]):>12} '
                 f'{seconds_text(c["seconds"]) if c["seconds"] is not None else "–":>10}  '
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
  lines += prediction_lines(pr, hw['name'])
  if speedup := r.get('fp8_speedup'):
    lines.append(f'FP8 (model.fp8={speedup["recipe"]!r}) against bf16 (model.fp8=\'none\', '
                 f'compiled and timed alike): predicted step {seconds_text(pr["step_s"])} against '
                 f'{seconds_text(speedup["bf16_step_s"])}, {speedup["speedup"]:.2f}× '
                 f'(bf16 MFU {speedup["bf16_mfu"]:.1%})')
  return '\n'.join(lines)


def moe_lines(moe: dict | None, params: dict) -> list[str]:
  """The experts' part of the text report."""
  if not moe:
    return []
  gg = moe['grouped_gemm_flops_per_device']
  ratio = f'ratio {moe["ratio"]:.3f}' if moe['ratio'] else 'no expert axis'
  return [f'experts  {params["active"] / 1e6:,.2f}M of the parameters active per token '
          f'(the model FLOPs count those); grouped GEMMs {sum(gg.values()) / 1e12:,.3f} '
          f'TFLOP/step per device at {moe["routed_rows_per_call"]:,} routed rows a call (an even '
          'router): ' + ', '.join(f'{k.removeprefix("grouped_matmul_")} {v / 1e12:,.3f}'
                                  for k, v in gg.items())
          + '; timed as cuBLAS GEMMs of those rows, a rate the own kernels do not reach yet '
          f'({experts.KERNELS_MEASURED}: benchmarks/README.md)',
          f'dispatch ({moe["dispatch"]}) over {",".join(moe["expert_axes"]) or "no axis"}: '
          f'{size_text(moe["dispatch_bytes"])} sent per device and step, analytic '
          f'{size_text(moe["dispatch_bytes_analytic"])} ({ratio}; see '
          '`experts.expected_dispatch_bytes`): '
          + ', '.join(f'{",".join(x["axes"])} {x["kind"]} {size_text(x["bytes"])}'
                      for x in moe['collectives'])]


def prediction_lines(pr: dict | None, hardware: str) -> list[str]:
  """The predicted step and where its time goes, for the text report."""
  if pr is None:
    return [f'predicted: nothing; {hardware} has no measured kernel rates to time the program '
            'with (h100-nvlink and h200-nvlink do)']
  bubble = (f'; the pipeline bubble is {seconds_text(pr["bubble_s"])} of the kernels\' time'
            if pr['bubble_s'] else '')
  return [f'predicted on {hardware}: step {seconds_text(pr["step_s"])}, '
          f'{pr["tokens_per_s"]:,.0f} tokens/s, MFU {pr["mfu"]:.1%} ({pr["mfu_causal"]:.1%} with '
          f'causal halving){bubble}. Each kernel timed from its shapes on measured rates '
          f'({assumptions_text(pr["assumes"])}), the collectives hidden where the program '
          'overlaps them (see `jaxllm.cost.timing`):',
          *timing.breakdown_lines(pr)]


def assumptions_text(assumes: dict) -> str:
  """What a prediction assumed of the run, in words."""
  return (f'{assumes["clocks"]} clocks, cuDNN {assumes["cudnn"]} attention, command buffers '
          f'{"on" if assumes["command_buffers"] else "off"}')


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
    window = f', window {k["window"]}' if k['window'] else ''
    lines.append(f'  {k["target"]:36} ×{k["count"]:<5,} {"flash" if k["flash"] else "not flash"}'
                 f', mask {k["mask"]}{window}{bias}, {k["flops"] / 1e12:,.3f} TFLOP{rerun}')
  return lines


def program_report(text: str, hardware: Hardware, devices: int, devices_per_node: int) -> dict:
  """What `analyze --hlo` says of any JAX program's optimized GPU HLO: its FLOPs, its
  collectives (bytes one device sends), and the predicted step, on `devices` devices
  numbered `devices_per_node` to a node."""
  crosses = timing.node_crossing(devices_per_node, devices)
  kinds = collections.defaultdict(lambda: {'count': 0, 'bytes': 0.0})
  for x in hlo.collectives(text, {'devices': devices}, cpu=False):
    row = kinds[x.kind, x.dtype, x.group_size]
    row['count'] += x.count
    row['bytes'] += x.bytes
  attention = sum(k.count * k.flops for k in hlo.fused_attention(text))
  flops = hlo.dot_flops(text) + attention
  rates = hardware.rates.for_flags(hlo.written_flags(text)[0])
  prediction = timing.summary(timing.step_time(text, rates, devices, crosses))
  prediction['flops_per_s_per_device'] = flops / prediction['step_s']
  prediction['assumes'] = rates.assumptions()
  return {'program': {'devices': devices, 'devices_per_node': devices_per_node},
          'hardware': hardware.summary(),
          'flops': {'compiled_per_device': flops, 'attention_per_device': attention},
          'collectives': [{'kind': k, 'dtype': t, 'group_size': n, **v}
                          for (k, t, n), v in sorted(kinds.items())],
          'prediction': prediction}


def format_program_report(r: dict) -> str:
  p, pr = r['program'], r['prediction']
  lines = [f'program  an optimized GPU HLO for {p["devices"]} devices, '
           f'{p["devices_per_node"]} to a node',
           f'FLOPs    {r["flops"]["compiled_per_device"] / 1e12:,.3f} TFLOP per device per step '
           f'(matmuls and cuDNN attention, {r["flops"]["attention_per_device"] / 1e12:,.3f} of '
           'it attention)',
           'collectives per step, bytes sent by one device:']
  for c in r['collectives']:
    lines.append(f'  {c["kind"]:19} {c["dtype"]:5} group {c["group_size"]:<4} ×{c["count"]:<7,} '
                 f'{size_text(c["bytes"]):>12}')
  lines.append(f'predicted on {r["hardware"]["name"]}: step {seconds_text(pr["step_s"])}, '
               f'{pr["flops_per_s_per_device"] / 1e12:,.1f} TFLOP/s per device of the '
               f'program\'s own FLOPs ({assumptions_text(pr["assumes"])})')
  return '\n'.join(lines + timing.breakdown_lines(pr))
