"""A compiled GPU program's step time, kernel by kernel.

Every instruction of the optimized HLO is one kernel (or none: tuples, bitcasts, parameters),
timed from its own shapes on a hardware profile (`jaxllm.cost.hardware`), at the clocks the
profile assumes (a step's sustained clocks, by default):
- GEMMs (Triton GEMM fusions, cuBLAS/cuBLASLt calls, plain dots): FLOPs at the rate XLA's own
  measured table gives for that shape and element type (`KernelRates.gemm_rate`);
- cuDNN attention, forward and backward: FLOPs (from the shapes, as `hlo.fused_attention`
  counts them) at the published throughput of the profile's cuDNN;
- custom calls the caller names a cost for (`step_time`'s `custom_calls`: a grouped GEMM's
  FLOPs and shapes, say), at those;
- every other fusion, copy or transpose: the larger of its bytes read and written at the
  memory bandwidth measured for a transfer of that size, and its FLOPs at the CUDA cores'
  peak;
- collectives: latency + bytes one device sends ÷ bus bandwidth, inside a node or across.

The kernels then run, in program order (loops for their trip counts), on two streams as on
the GPU: compute kernels one after another, and collectives in turn on a communication
stream. An asynchronous collective starts when the compute stream reaches its start (and the
previous collective is done) and the compute stream waits at its done: it is hidden by the
kernels the schedule put between the two and exposed for the rest. A synchronous one stops
both. While a collective runs, NCCL holds some of the SMs: GEMMs and attention beside it run
on the rest, slower (`contention`). Each kernel leaves a gap behind it (`launch`); without
command buffers the host launches every kernel itself, one after another, and after kernels
shorter than a launch the GPU waits for the next one (`launch` too).

What this leaves out: contention for memory bandwidth, autotuning's choice of GEMM kernel (a
deviceless compile does not autotune: the table's measured rate stands for the kernel a run
would pick), and the host beyond launches. A loop whose trip count XLA does not know runs its
body once, and the timing names it (`Timing.untimed`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
from typing import Callable, Mapping

from jaxllm.cost import hlo
from jaxllm.cost.hardware import KernelRates

# Instructions that launch nothing: they name, bundle or wait for values made elsewhere.
NO_KERNEL = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
             'partition-id', 'replica-id', 'opt-barrier', 'add-dependency', 'domain',
             'all-gather-done', 'all-reduce-done', 'collective-permute-done', 'async-done',
             'async-update', 'reduce-scatter-done', 'all-to-all-done', 'copy-done', 'send-done',
             'recv-done', 'fusion-done', 'while', 'conditional', 'call'}
CATEGORIES = ('gemm', 'attention', 'memory', 'launch', 'contention', 'exposed_comm')
# Kernels that need every SM they can get, and run slower on those NCCL leaves them.
SM_BOUND = ('gemm', 'attention')
# Ops inside a fusion that move or reshape values and compute nothing; every other op is one
# FLOP per element on the CUDA cores.
STRUCTURAL = NO_KERNEL | {'broadcast', 'reshape', 'transpose', 'slice', 'dynamic-slice',
                          'dynamic-update-slice', 'concatenate', 'pad', 'iota', 'copy',
                          'convert', 'gather', 'scatter', 'select', 'reverse'}


@dataclasses.dataclass
class Kernel:
  """One instruction of the program as the GPU runs it, per execution."""
  name: str
  op: str           # the JAX operation that made it (its op_name), or its opcode
  category: str     # 'gemm', 'attention', 'memory' or 'collective'
  seconds: float    # per execution: work only, the launch cost apart
  count: int = 0    # executions per step
  flops: float = 0.0
  bytes: float = 0.0
  slowed_s: float = 0.0  # per step: what it lost to SMs NCCL held beside it


@dataclasses.dataclass
class Timing:
  """Where a step's time goes (seconds per step): `by_category` sums to `step_s`, the
  collectives' hidden time apart; `kernels`, every kernel with its executions per step;
  `untimed`, what the model could not time as it runs (said, not guessed)."""
  step_s: float
  by_category: dict[str, float]
  hidden_comm_s: float
  comm_s: float
  kernels: list[Kernel]
  untimed: list[str] = dataclasses.field(default_factory=list)

  def top(self, k: int = 10) -> list[Kernel]:
    """The `k` kernels (collectives included) that take the most time per step."""
    return sorted(self.kernels, key=lambda x: -(x.seconds * x.count + x.slowed_s))[:k]


# --- one kernel's time -------------------------------------------------------------------

def _dots_in(computations, comp: str):
  """The dots of a fused computation, nested fusions included."""
  for inst in computations.get(comp, {}).values():
    if inst.opcode == 'dot':
      yield computations[comp], inst
    elif inst.opcode in hlo.FUSIONS:
      yield from _dots_in(computations, hlo.called(inst))


def _gemm(rates: KernelRates, shapes) -> tuple[float, float]:
  """(seconds, FLOPs) of GEMMs given as (types, batch, m, n, k)."""
  seconds = flops = 0.0
  for types, b, m, n, k in shapes:
    work = 2.0 * b * m * n * k
    flops += work
    seconds += work / rates.gemm_rate(types, b, m, n, k)
  return seconds, flops


def _read_bytes(computations, comp: str, param: str, size: int, depth: int = 0) -> int:
  """Bytes a fused computation reads of a parameter: only the slices it takes when every use
  slices it, nothing of a buffer it updates in place, else all of it."""
  users = [u for u in computations[comp].values() if param in u.operands]
  if not users or depth > 8:
    return size
  total = 0
  for u in users:
    if u.opcode in ('dynamic-slice', 'slice', 'gather') and u.operands[0] == param:
      total += hlo.nbytes(u.shape)
    elif u.opcode == 'dynamic-update-slice' and u.operands[0] == param:
      continue  # updated in place: only the update is written
    elif u.opcode == 'bitcast':
      total += _read_bytes(computations, comp, u.name, size, depth + 1)
    else:
      return size
  return min(total, size)


def _written_bytes(computations, comp: str, name: str) -> int:
  """Bytes a fused computation writes for its value `name`: the update of an in-place
  dynamic-update-slice, each element of a tuple, else the whole value."""
  inst = computations[comp][name]
  if inst.opcode == 'tuple':
    return sum(_written_bytes(computations, comp, o) for o in inst.operands)
  if inst.opcode == 'bitcast':
    return _written_bytes(computations, comp, inst.operands[0])
  if inst.opcode == 'dynamic-update-slice':
    return hlo.nbytes(computations[comp][inst.operands[1]].shape)
  return hlo.nbytes(inst.shape)


def _fusion_traffic(computations, inst: hlo.Instruction, insts: dict) -> tuple[float, float]:
  """(bytes read and written, CUDA-core FLOPs) of a fusion kernel."""
  comp = hlo.called(inst)
  body = computations[comp]
  params = {int(i.args): i for i in body.values() if i.opcode == 'parameter'}
  moved = sum(_read_bytes(computations, comp, params[i].name, hlo.nbytes(params[i].shape))
              for i in params)
  root = next(i for i in body.values() if i.is_root)
  moved += _written_bytes(computations, comp, root.name)
  flops = 0.0
  for i in body.values():
    if i.opcode not in STRUCTURAL and i.opcode != 'fusion':
      operand = body.get(i.operands[0]) if i.operands else None
      elements = hlo.arrays(operand.shape if i.opcode == 'reduce' and operand else i.shape)
      flops += sum(math.prod(d) for _, d in elements)
  return moved, flops


@dataclasses.dataclass(frozen=True)
class CustomCallCost:
  """What a custom-call kernel does, as its registered cost function reads it from the
  instruction: GEMMs it runs (timed at the GEMM table's rates), and otherwise bytes it reads
  and writes and CUDA-core FLOPs (timed as a memory-bound kernel)."""
  gemms: tuple = ()    # (element types, batch, m, n, k) of each GEMM it runs
  bytes: float = 0.0
  flops: float = 0.0


# custom_call_target -> cost function (the instructions of its computation, the instruction).
CustomCalls = Mapping[str, Callable[[dict, hlo.Instruction], CustomCallCost]]


def kernel_time(computations, comp: str, inst: hlo.Instruction, rates: KernelRates,
                custom_calls: CustomCalls) -> Kernel | None:
  """`inst` as a kernel, or None when it launches none (or is a collective). Custom calls
  without a cost in `custom_calls` are timed as memory-bound on their operands and results."""
  insts = computations[comp]
  if (inst.opcode in NO_KERNEL or inst.opcode == 'recv'
      or hlo.collective_kind(inst) is not None):
    return None
  kernel = Kernel(inst.name, hlo.op_name(inst), 'memory', 0.0)
  target = re.search(r'custom_call_target="([^"]+)"', inst.attrs)
  target = target.group(1) if target else ''
  if shape := hlo.gemm_shape(insts, inst):
    kernel.category = 'gemm'
    kernel.seconds, kernel.flops = _gemm(rates, [shape])
    return kernel
  if target in custom_calls:
    cost = custom_calls[target](insts, inst)
    kernel.bytes = cost.bytes
    if cost.gemms:
      kernel.category = 'gemm'
      kernel.seconds, kernel.flops = _gemm(rates, cost.gemms)
      return kernel
    kernel.flops = cost.flops
    kernel.seconds = max(rates.memory_seconds(cost.bytes), cost.flops / rates.vector_flops)
    return kernel
  if target.startswith('__cudnn$fmha'):
    attention = hlo.attention_kernel(inst, 1, None)
    kernel.category, kernel.flops = 'attention', attention.flops
    kernel.seconds = attention.flops / rates.attention_rate(
        attention.backward, attention.head_dim, attention.length, 'CAUSAL' in attention.mask,
        attention.window)
    return kernel
  if inst.opcode in hlo.FUSIONS:
    dots = [hlo.gemm_shape(body, dot) for body, dot in _dots_in(computations, hlo.called(inst))]
    if any(dots):
      kernel.category = 'gemm'
      kernel.seconds, kernel.flops = _gemm(rates, [d for d in dots if d])
      return kernel
    kernel.bytes, flops = _fusion_traffic(computations, inst, insts)
  else:
    written = hlo.nbytes(inst.shape)
    if inst.opcode == 'dynamic-update-slice':
      written = hlo.nbytes(insts[inst.operands[1]].shape)
      read = written
    elif inst.opcode in ('dynamic-slice', 'slice'):
      read = written
    else:
      read = sum(hlo.nbytes(insts[o].shape) for o in inst.operands if o in insts)
    kernel.bytes, flops = read + written, 0.0
  kernel.flops = flops
  kernel.seconds = max(rates.memory_seconds(kernel.bytes), flops / rates.vector_flops)
  return kernel


# --- collectives --------------------------------------------------------------------------

@dataclasses.dataclass
class Transfer:
  """One collective call: what it sends and how long that takes."""
  name: str
  kind: str
  bytes: float
  crosses_nodes: bool
  seconds: float
  asynchronous: bool


def transfer(computations, inst: hlo.Instruction, rates: KernelRates, devices: int,
             crosses: Callable[[list[list[int]] | None], bool]) -> Transfer | None:
  """`inst` as a collective call, or None when it is none (or one device's). A recv takes
  as long as its peer's send of the same bytes."""
  found = inst
  if inst.opcode == 'async-start':  # an asynchronous collective wraps a synchronous one
    found = next((i for i in computations.get(hlo.called(inst), {}).values()
                  if hlo.collective_kind(i) is not None), inst)
  kind = 'recv' if inst.opcode == 'recv' else hlo.collective_kind(found)
  if kind is None:
    return None
  groups = hlo.device_groups(found.attrs)
  pairwise = kind in hlo.PAIRWISE or kind == 'recv'
  size = 2 if pairwise else (max(len(g) for g in groups) if groups else devices)
  if size <= 1:
    return None
  sent = sum(hlo.sent_by_dtype(found, 'send' if kind == 'recv' else kind, size).values())
  across = crosses(groups)
  return Transfer(inst.name, kind, sent, across,
                  rates.collective_seconds(kind, size, across, sent),
                  inst.opcode.endswith('-start') or inst.opcode in ('send', 'recv'))


# --- the two streams ----------------------------------------------------------------------

@dataclasses.dataclass
class Streams:
  compute: float = 0.0   # when the compute stream is free
  comm: float = 0.0      # when the communication stream is free
  host: float = 0.0      # when the host has launched the last kernel (no command buffers)
  pending: dict = dataclasses.field(default_factory=dict)  # collective id -> its end

  def shift(self, seconds: float) -> None:
    self.compute += seconds
    self.comm += seconds
    self.host += seconds
    self.pending = {k: v + seconds for k, v in self.pending.items()}

  def copy(self) -> Streams:
    return Streams(self.compute, self.comm, self.host, dict(self.pending))


class Simulator:
  """Runs a program's kernels on the two streams (see the module's docstring), tallying how
  often each runs per step, what each lost beside NCCL and what the host made the GPU wait."""

  def __init__(self, text: str, rates: KernelRates, devices: int,
               crosses: Callable[[list[list[int]] | None], bool], custom_calls: CustomCalls):
    self.computations, _ = hlo.program(text)
    self.rates, self.devices, self.crosses = rates, devices, crosses
    self.custom_calls = custom_calls
    self.kernels: dict[tuple[str, str], Kernel | None] = {}
    self.transfers: dict[tuple[str, str], Transfer | None] = {}
    self.tally = collections.Counter()  # (computation, instruction) -> executions per step
    self.slowed = collections.Counter()  # (computation, instruction) -> seconds per step
    self.host_waits = 0.0                # seconds per step the GPU waited for launches
    self.untimed: list[str] = []
    self.ids = itertools.count()

  def kernel(self, comp: str, inst: hlo.Instruction) -> Kernel | None:
    key = (comp, inst.name)
    if key not in self.kernels:
      self.kernels[key] = kernel_time(self.computations, comp, inst, self.rates,
                                       self.custom_calls)
    return self.kernels[key]

  def transfer(self, comp: str, inst: hlo.Instruction) -> Transfer | None:
    key = (comp, inst.name)
    if key not in self.transfers:
      self.transfers[key] = transfer(self.computations, inst, self.rates, self.devices,
                                     self.crosses)
    return self.transfers[key]

  def launch(self, streams: Streams, times: int, compute: bool = True) -> float:
    """When the next kernel may start: at once from a command buffer; else once the host,
    launching one kernel after another, has launched it. The compute stream's wait for it is
    booked to `launch` (a collective's kernel waits on its own stream)."""
    if self.rates.command_buffers:
      return streams.compute
    streams.host += self.rates.host_launch_s
    if streams.host > streams.compute:
      self.host_waits += (streams.host - streams.compute) * times if compute else 0.0
      return streams.host
    return streams.compute

  def execute(self, comp: str, k: Kernel, streams: Streams, times: int) -> None:
    """Runs kernel `k` on the compute stream. An SM-bound kernel runs on the SMs NCCL leaves
    while the communication stream is busy, at full speed after."""
    start = self.launch(streams, times)
    end = start + k.seconds
    busy_until = streams.comm if k.category in SM_BOUND else start
    if busy_until > start:
      share = 1 - self.rates.collective_sms / self.rates.sm_count
      beside = (busy_until - start) * share  # work done while NCCL runs
      end = start + k.seconds / share if k.seconds <= beside else (
          busy_until + k.seconds - beside)
      self.slowed[comp, k.name] += (end - start - k.seconds) * times
    streams.compute = end + self.rates.launch_s

  def run(self, comp: str, streams: Streams, arguments=(), times: int = 1):
    """Runs computation `comp` once, standing for `times` executions in the tally; each
    parameter carries its argument's pending collectives (an id, or a list for a tuple);
    returns what its root carries."""
    carried = {}  # value name -> a pending collective's id, or a list of them for a tuple
    for inst in self.computations[comp].values():
      ops = inst.operands
      first = carried.get(ops[0]) if ops else None
      if inst.opcode == 'parameter':
        index = int(inst.args) if inst.args.isdigit() else 0
        carried[inst.name] = arguments[index] if index < len(arguments) else None
      elif inst.opcode == 'tuple':
        carried[inst.name] = [carried.get(o) for o in ops]
      elif inst.opcode == 'get-tuple-element':
        index = int(re.search(r'index=(\d+)', inst.attrs).group(1))
        carried[inst.name] = first[index] if isinstance(first, list) else None
      elif inst.opcode in ('bitcast', 'opt-barrier') or (inst.opcode == 'copy' and first):
        carried[inst.name] = first
      elif inst.opcode == 'while':
        carried[inst.name] = self.loop(inst, streams, first, times)
      elif inst.opcode in ('call', 'conditional'):
        carried[inst.name] = self.call(inst, streams, [carried.get(o) for o in ops], times)
      elif inst.opcode.endswith('-done'):
        for i in first if isinstance(first, list) else [first]:
          if i in streams.pending:
            streams.compute = max(streams.compute, streams.pending.pop(i))
      elif (t := self.transfer(comp, inst)) is not None:
        self.tally[comp, inst.name] += times
        issued = self.launch(streams, times, compute=False)
        carried[inst.name] = next(self.ids)
        if t.kind == 'recv':  # arrives as the peer's send goes, beside this device's own
          streams.pending[carried[inst.name]] = issued + t.seconds
          continue
        streams.comm = max(issued, streams.comm) + t.seconds
        if t.asynchronous:
          streams.pending[carried[inst.name]] = streams.comm
        else:
          streams.compute = streams.comm
      elif (k := self.kernel(comp, inst)) is not None:
        self.tally[comp, inst.name] += times
        self.execute(comp, k, streams, times)
    root = next((i for i in self.computations[comp].values() if i.is_root), None)
    return carried.get(root.name) if root else None

  def loop(self, inst: hlo.Instruction, streams: Streams, argument, times: int):
    """A while loop: its first two iterations run, the second standing for all but the first;
    the rest of the loop takes, per iteration, the longer of what the second took on either
    stream (the stream that limits a steady loop). A loop whose trip count XLA does not know
    runs once, and is named in `untimed`."""
    body = re.search(r'body=%?([\w.\-]+)', inst.attrs).group(1)
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
    if not trips:
      self.untimed.append(f'while loop %{inst.name}: trip count unknown, its body timed once')
    trips = int(trips.group(1)) if trips else 1
    carried = self.run(body, streams, [argument], times)
    if trips > 1:
      before = (streams.compute, streams.comm)
      carried = self.run(body, streams, [carried], times * (trips - 1))
      streams.shift((trips - 2) * max(streams.compute - before[0], streams.comm - before[1]))
    return carried

  def call(self, inst: hlo.Instruction, streams: Streams, arguments: list, times: int):
    """A call runs its computation on its operands. A conditional runs each branch on the
    operand that branch takes (the first operand picks the branch) for the share of its
    executions the branch declares (`hlo.branch_shares`), taking that share of its time;
    where they declare none, the branch that takes longest."""
    if inst.opcode == 'call':
      name = re.search(r'to_apply=%?([\w.\-]+)', inst.attrs).group(1)
      return self.run(name, streams, arguments, times)
    trials = []
    for i, (name, share) in enumerate(hlo.branch_shares(self.computations, inst)):
      trial = streams.copy()
      saved = self.tally, self.slowed, self.host_waits
      self.tally, self.slowed, self.host_waits = collections.Counter(), collections.Counter(), 0.0
      carried = self.run(name, trial, arguments[i + 1:i + 2], times * share)
      trials.append((trial, self.tally, self.slowed, self.host_waits, carried, share))
      self.tally, self.slowed, self.host_waits = saved
    if not trials:
      return None
    longest = max(trials, key=lambda t: t[0].compute)
    chosen = [longest] if all(t[-1] == 1 for t in trials) else trials
    if len(chosen) == 1:
      trial = longest[0]
      streams.compute, streams.comm, streams.host = trial.compute, trial.comm, trial.host
    else:
      start = (streams.compute, streams.comm, streams.host)
      streams.compute += sum(t[-1] * (t[0].compute - start[0]) for t in trials)
      streams.comm += sum(t[-1] * (t[0].comm - start[1]) for t in trials)
      streams.host += sum(t[-1] * (t[0].host - start[2]) for t in trials)
    streams.pending = longest[0].pending
    for _, tally, slowed, host_waits, _, _ in chosen:
      self.tally.update(tally)
      self.slowed.update(slowed)
      self.host_waits += host_waits
    return longest[4]
    return carried


def step_time(text: str, rates: KernelRates, devices: int,
              crosses: Callable[[list[list[int]] | None], bool],
              custom_calls: CustomCalls | None = None) -> Timing:
  """The program's step time for `devices` devices whose kernels run at `rates`;
  `crosses(device groups)` says whether a collective's groups span nodes (None: every
  device); `custom_calls` times the custom calls of those targets (a model's own kernels)."""
  sim = Simulator(text, rates, devices, crosses, custom_calls or {})
  streams = Streams()
  sim.run(hlo.entry_name(text), streams)
  step = max([streams.compute, streams.comm, *streams.pending.values()])
  by_category = dict.fromkeys(CATEGORIES, 0.0)
  by_category['launch'] = sim.host_waits
  kernels, comm = [], 0.0
  for key, count in sim.tally.items():
    if (k := sim.kernels.get(key)) is not None:
      kernels.append(dataclasses.replace(k, count=count, slowed_s=sim.slowed[key]))
      by_category[k.category] += k.seconds * count
      by_category['launch'] += rates.launch_s * count
      by_category['contention'] += sim.slowed[key]
    elif (t := sim.transfers.get(key)) is not None:
      comm += t.seconds * count
      kernels.append(Kernel(t.name, t.kind, 'collective', t.seconds, count, 0.0, t.bytes))
  busy = sum(by_category.values())
  by_category['exposed_comm'] = max(0.0, step - busy)
  return Timing(busy + by_category['exposed_comm'], by_category,
                max(0.0, comm - by_category['exposed_comm']), comm, kernels, sim.untimed)


def node_crossing(devices_per_node: int, devices: int):
  """`crosses` for a program whose partitions are devices numbered `devices_per_node` to a
  node."""
  def crosses(groups):
    if groups is None:
      return devices > devices_per_node
    return any(len({d // devices_per_node for d in g}) > 1 for g in groups)
  return crosses


LABELS = {'gemm': 'GEMMs', 'attention': 'attention', 'memory': 'memory-bound',
          'launch': 'launches', 'contention': 'beside NCCL', 'exposed_comm': 'exposed comm'}


def summary(t: Timing, top: int = 10) -> dict:
  """A timing as a JSON-ready dict: the step, its categories (`<category>_s`), the
  collectives' total and hidden time, kernel launches, and the `top` kernels."""
  launches = round(sum(k.count for k in t.kernels if k.category != 'collective'))
  return {'step_s': t.step_s, **{f'{c}_s': t.by_category[c] for c in CATEGORIES},
          'comm_s': t.comm_s, 'hidden_comm_s': t.hidden_comm_s, 'kernel_launches': launches,
          'top_kernels': [{'name': k.name, 'op': k.op, 'category': k.category, 'count': k.count,
                           'seconds': k.seconds * k.count + k.slowed_s,
                           'flops': k.flops * k.count, 'bytes': k.bytes * k.count}
                          for k in t.top(top)],
          'untimed': list(t.untimed)}


def breakdown_lines(p: dict) -> list[str]:
  """Where a predicted step's time goes, and its most expensive kernels, as text."""
  step = p['step_s']
  lines = []
  for c in CATEGORIES:
    note = {'launch': f'{p["kernel_launches"]:,} kernels',
            'contention': 'GEMMs and attention on the SMs NCCL leaves while it runs',
            'exposed_comm': f'of {p["comm_s"] * 1e3:,.2f} ms of collectives, '
                            f'{p["hidden_comm_s"] * 1e3:,.2f} ms hidden behind kernels'}.get(c, '')
    lines.append(f'  {LABELS[c]:13} {p[f"{c}_s"] * 1e3:>10,.2f} ms {p[f"{c}_s"] / step:>6.1%}'
                 + (f'   {note}' if note else ''))
  lines += [f'  not timed as it runs: {note}' for note in p.get('untimed', [])]
  lines.append(f'  the {len(p["top_kernels"])} most expensive kernels (per step):')
  for k in p['top_kernels']:
    lines.append(f'  {k["seconds"] * 1e3:>10,.2f} ms {k["seconds"] / step:>6.1%}  '
                 f'×{k["count"]:<5,} {k["category"]:10} {k["op"]}')
  return lines
