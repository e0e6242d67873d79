"""Kernel times measured in a `jax.profiler` trace, joined to the timing model's prediction of
the same HLO instructions (`jaxllm.cost.timing`): predicted against measured per category
(GEMMs, attention, memory-bound kernels, collectives, the gaps between kernels) and per kernel.

XLA names each kernel it launches after the HLO instruction it runs (the `hlo_op` and
`hlo_module` of the trace's events): on a GPU, the CUPTI kernel events of a device's streams
(an instruction may launch several kernels; a collective's NCCL kernel carries its start's
name); on a CPU, the thunks the runtime executes. The join is by that name, which is unique in
a module; loop bodies' instructions count once per iteration in both.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

from jaxllm.cost import hlo
from jaxllm.cost.timing import Timing

CATEGORIES = ('gemm', 'attention', 'memory', 'collective', 'gaps')
LABELS = {'gemm': 'GEMMs', 'attention': 'attention', 'memory': 'memory-bound',
          'collective': 'collectives', 'gaps': 'gaps between kernels'}


@dataclasses.dataclass
class Measured:
  """One module's kernels in a trace, on one device: each HLO instruction's kernel durations
  (seconds) and the intervals they ran in."""
  module: str
  durations: dict[str, list[float]]
  intervals: list[tuple[float, float]]  # (start, end) seconds of every kernel

  def span_s(self) -> float:
    """From the first kernel's start to the last one's end."""
    return max(e for _, e in self.intervals) - min(s for s, _ in self.intervals)

  def busy_s(self) -> float:
    """Time in which some kernel ran (on any stream or thread)."""
    busy, end = 0.0, float('-inf')
    for s, e in sorted(self.intervals):
      if e > end:
        busy += e - max(s, end)
        end = e
    return busy


def module_name(hlo_text: str) -> str:
  """The name a program's kernels carry in a trace: its HLO module's."""
  return re.match(r'\s*(?://[^\n]*\n)?HloModule ([\w.\-]+)', hlo_text).group(1)


def trace_file(directory: str) -> str:
  """The newest `.xplane.pb` that `jax.profiler` wrote under `directory`."""
  found = glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True)
  if not found:
    raise FileNotFoundError(f'no *.xplane.pb under {directory}')
  return max(found, key=os.path.getmtime)


def containers(hlo_text: str) -> set[str]:
  """The program's loops, calls and conditionals: a CPU traces each as a thunk around its
  body's, which are the kernels (a GPU's host runs them and traces nothing)."""
  computations, _ = hlo.program(hlo_text)
  return {i.name for insts in computations.values() for i in insts.values()
          if i.opcode in ('while', 'conditional', 'call')}


def read(path: str, module: str, skip: set[str] = frozenset()) -> Measured:
  """The kernels of HLO module `module` in the trace at `path` (an `.xplane.pb`, or the
  directory `jax.profiler` traced into), but for the instructions in `skip` (`containers`):
  on a GPU, device 0's streams; on a CPU, the thunks of device 0."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(trace_file(path) if os.path.isdir(path) else path)
  planes = {p.name: p for p in data.planes}
  gpus = sorted(n for n in planes if n.startswith('/device:GPU:'))
  plane = planes[gpus[0]] if gpus else planes['/host:CPU']
  durations, intervals = collections.defaultdict(list), []
  for line in plane.lines:
    for event in line.events:
      stats = dict(event.stats)
      if stats.get('hlo_module') != module or stats.get('hlo_op', '') in skip | {''}:
        continue
      if not gpus and stats.get('device_ordinal', 0) != 0:
        continue
      start, seconds = event.start_ns * 1e-9, event.duration_ns * 1e-9
      durations[stats['hlo_op']].append(seconds)
      intervals.append((start, start + seconds))
  if not intervals:
    raise ValueError(f'the trace {path} holds no kernel of module {module}')
  return Measured(module, dict(durations), intervals)


@dataclasses.dataclass
class Row:
  """One instruction: predicted and measured seconds per step, executions per step."""
  name: str
  op: str
  category: str
  predicted_s: float
  measured_s: float
  predicted_count: float
  measured_count: float


@dataclasses.dataclass
class Comparison:
  rows: list[Row]                         # joined, and each side's alone (the other at 0)
  predicted: dict[str, float]             # category -> seconds per step
  measured: dict[str, float]
  predicted_step_s: float
  measured_step_s: float

  def worst(self, k: int = 10) -> list[Row]:
    """The `k` kernels the model is furthest off, in seconds per step."""
    return sorted(self.rows, key=lambda r: -abs(r.predicted_s - r.measured_s))[:k]


def compare(t: Timing, measured: Measured, steps: int) -> Comparison:
  """The prediction `t` of a program beside `measured`, `steps` executions of it."""
  predicted = dict.fromkeys(CATEGORIES, 0.0)
  found = dict.fromkeys(CATEGORIES, 0.0)
  rows = []
  names = set()
  for k in t.kernels:
    names.add(k.name)
    seconds = k.seconds * k.count + k.slowed_s
    predicted[k.category] += seconds
    times = measured.durations.get(k.name, [])
    found[k.category] += sum(times) / steps
    rows.append(Row(k.name, k.op, k.category, seconds, sum(times) / steps, k.count,
                    len(times) / steps))
  for name, times in measured.durations.items():
    if name not in names:  # a kernel the model thought launches nothing
      found['memory'] += sum(times) / steps
      rows.append(Row(name, name, 'memory', 0.0, sum(times) / steps, 0, len(times) / steps))
  predicted['gaps'] = t.by_category['launch']
  found['gaps'] = (measured.span_s() - measured.busy_s()) / steps
  return Comparison(rows, predicted, found, t.step_s, measured.span_s() / steps)


def format_comparison(c: Comparison, top: int = 10) -> str:
  """Predicted against measured per category, then the `top` kernels furthest off."""
  ratio = lambda p, m: f'{p / m:.2f}' if m else '–'
  ms = lambda s: f'{s * 1e3:,.3f}'
  lines = [f'{"per step":22} {"predicted ms":>13} {"measured ms":>12} {"pred/meas":>9}']
  for cat in CATEGORIES:
    lines.append(f'{LABELS[cat]:22} {ms(c.predicted[cat]):>13} {ms(c.measured[cat]):>12} '
                 f'{ratio(c.predicted[cat], c.measured[cat]):>9}')
  lines.append(f'{"step (first to last kernel)":22} {ms(c.predicted_step_s):>13} '
               f'{ms(c.measured_step_s):>12} {ratio(c.predicted_step_s, c.measured_step_s):>9}')
  unmeasured = [r for r in c.rows if r.predicted_s and not r.measured_count]
  unpredicted = [r for r in c.rows if r.measured_s and not r.predicted_count]
  lines.append(f'joined {sum(1 for r in c.rows if r.predicted_count and r.measured_count)} '
               f'instructions; predicted but not in the trace {len(unmeasured)} '
               f'({ms(sum(r.predicted_s for r in unmeasured))} ms); in the trace but launching '
               f'nothing to the model {len(unpredicted)} '
               f'({ms(sum(r.measured_s for r in unpredicted))} ms)')
  lines.append(f'the {top} kernels furthest off (per step):')
  lines.append(f'  {"predicted ms":>12} {"measured ms":>12} {"pred/meas":>9} {"count":>11}  '
               f'{"category":10} instruction (op)')
  for r in c.worst(top):
    lines.append(f'  {ms(r.predicted_s):>12} {ms(r.measured_s):>12} '
                 f'{ratio(r.predicted_s, r.measured_s):>9} '
                 f'{r.predicted_count:>5g}/{r.measured_count:<5g}  {r.category:10} '
                 f'{r.name} ({r.op})')
  return '\n'.join(lines)
