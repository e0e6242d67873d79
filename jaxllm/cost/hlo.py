"""What a compiled step does, read from its optimized HLO text: its collectives, its matmul
and attention FLOPs (and those of the forward work it reruns), its fused attention kernels,
its Pallas-Triton kernels and its largest values.

For each collective: its kind, element type, the mesh axes its device groups span, how many
times it runs per step (loop trip counts multiplied through) and the bytes each device sends,
by the ring formulas of a collective over N devices holding S bytes (result size):
all-reduce 2(N−1)/N·S; all-gather and all-to-all (N−1)/N·S; reduce-scatter (N−1)·S (S is the
scattered piece); collective-permute, send and collective-broadcast S; ragged-all-to-all at
most (N−1)/N of its output buffer (what it sends is known only when it runs). GPU programs run collectives asynchronously
(`all-gather-start` … `-done`), several of them combined into one op; both forms are read.

The CPU compiler has no reduce-scatter rewrite: it emits an all-reduce whose result is only
ever sliced down to 1/N, where GPU and TPU compilers emit a reduce-scatter. Read from a CPU
program (`cpu=True`), such all-reduces are reported as reduce-scatters
(`from_all_reduce=True`) so that the bytes match what an accelerator moves.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute',
         'collective-broadcast', 'ragged-all-to-all', 'send')
# Point to point: a pair of devices each (the bytes a device receives are its peer's send).
PAIRWISE = ('collective-permute', 'send')
DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2,
               'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
# Ops that pass a value on whole (same elements), looked through when following a result.
# `convert` too: the CPU compiler computes bf16 arithmetic in f32 and converts around it.
PASS_THROUGH = ('bitcast', 'copy', 'reshape', 'transpose', 'convert')
# A fusion kernel, as XLA runs it in line or, from jax 0.11, as `fusion-start` (its `fusion-done`
# launches nothing): a dynamic-update-slice fusion of a loop's stacked values, say.
FUSIONS = ('fusion', 'fusion-start')


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str       # e.g. 'f32[4,8]{1,0}' or a tuple '(f32[4]{0}, s32[])'
  opcode: str
  operands: list[str]
  args: str        # the text inside the parentheses (a parameter's number)
  attrs: str
  is_root: bool = False


@dataclasses.dataclass
class Collective:
  kind: str                 # one of KINDS
  dtype: str                # element type of what moves, e.g. 'bf16'
  axes: tuple[str, ...]     # mesh axes the device groups span
  group_size: int
  count: int                # executions per step
  bytes_per_call: float     # bytes one device sends per execution
  from_all_reduce: bool = False  # compiled as an all-reduce whose result is only sliced
  summed: int = 0                # all-reduced values left out: only added to another one
  op: str = ''                   # the JAX operation it came from (its op_name)

  @property
  def bytes(self) -> float:
    return self.count * self.bytes_per_call


def called(inst: Instruction) -> str | None:
  """The computation a fusion (or an asynchronous op) calls."""
  m = re.search(r'calls=%?([\w.\-]+)', inst.attrs)
  return m.group(1) if m else None


def op_name(inst: Instruction) -> str:
  """The JAX operation that made `inst` (its metadata's op_name), else its opcode."""
  m = re.search(r'op_name="([^"]*)"', inst.attrs)
  return m.group(1) if m else inst.opcode


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '({[':
      depth += 1
    elif text[i] in ')}]':
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f'unbalanced: {text[start:start + 80]}')


def _parse_instruction(line: str) -> Instruction | None:
  m = re.match(r'\s*(ROOT )?%?([\w.\-]+) = ', line)
  if not m:
    return None
  rest = line[m.end():]
  end = _balanced(rest, 0) if rest.startswith('(') else rest.index(' ')
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  args = rest[op.end():close - 1]
  return Instruction(m.group(2), shape, op.group(1), re.findall(r'%([\w.\-]+)', args), args,
                     rest[close:], is_root=bool(m.group(1)))


# How a program written out with its XLA flags says them: a first line of this, then the
# flags (`benchmarks/maxtext.py` writes its programs so).
FLAGS_LINE = '// XLA_FLAGS: '


def written_flags(text: str) -> tuple[str, str]:
  """The XLA flags a program's text was written out with (`FLAGS_LINE`; '' without), and the
  module's own text after them."""
  if not text.startswith(FLAGS_LINE):
    return '', text
  line, _, module = text.partition('\n')
  return line[len(FLAGS_LINE):], module


def parse_module(text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
  """{computation: {instruction name: Instruction}} (in order), and the entry's name."""
  computations, current = {}, None
  for line in text.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$', line)
    if header:
      current = computations.setdefault(header.group(1), {})
      continue
    if current is not None and (inst := _parse_instruction(line)):
      current[inst.name] = inst
  return computations, entry_name(text)


def entry_name(hlo_text: str) -> str:
  """The name of the module's entry computation, read from its line alone (the timing model
  asks for it on every report, without parsing the rest)."""
  return re.search(r'^ENTRY %?([\w.\-]+) ', hlo_text, re.M).group(1)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of every array in a shape, tuples flattened in order."""
  return [(dtype, tuple(int(d) for d in dims.split(',') if d))
          for dtype, dims in re.findall(r'([a-z]\w*)\[([\d,]*)\]', shape)]


def nbytes(shape: str) -> int:
  return sum(DTYPE_BYTES.get(t, 4) * math.prod(d) for t, d in arrays(shape))


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape."""
  inner, parts, depth, start = shape[1:-1], [], 0, 0
  for i, ch in enumerate(inner):
    depth += ch in '([{'
    depth -= ch in ')]}'
    if ch == ',' and depth == 0:
      parts.append(inner[start:i])
      start = i + 1
  parts.append(inner[start:])
  return [re.sub(r'/\*.*?\*/', '', p).strip() for p in parts if p.strip()]


# A conditional's branch that says how often it runs: JAX code names it with a scope ending in
# `_runs_N_of_M` (jax.named_scope), which its ops' op_name carries: it runs N of every M
# executions of the conditional (the attention of layer scans whose layers differ,
# `jaxllm.model.attention.per_layer_window`).
BRANCH_SHARE = re.compile(r'_runs_(\d+)_of_(\d+)/')


def branch_shares(computations, inst: Instruction) -> list[tuple[str, float]]:
  """(computation, share of the executions it runs) of each branch of conditional `inst`: the
  shares its branches' op names declare (`BRANCH_SHARE`), where every branch declares one;
  else 1 each, every branch counted as if it always ran (an upper bound)."""
  names = re.findall(r'(?:true_computation|false_computation)=%?([\w.\-]+)', inst.attrs)
  branches = re.search(r'branch_computations=\{([^}]*)\}', inst.attrs)
  names += re.findall(r'%?([\w.\-]+)', branches.group(1)) if branches else []
  declared = []
  for name in names:
    found = next((m for i in computations.get(name, {}).values()
                  if (m := BRANCH_SHARE.search(i.attrs))), None)
    declared.append(int(found.group(1)) / int(found.group(2)) if found else None)
  if None in declared:
    return [(name, 1.0) for name in names]
  return list(zip(names, declared))


def call_counts(computations, entry: str) -> dict[str, float]:
  """How many times each computation runs per execution of the entry: while bodies times
  their known trip count, a conditional's branches the share they declare
  (`branch_shares`), everything else once per call site."""
  counts: dict[str, float] = {}

  def visit(name: str, times: float):
    counts[name] = counts.get(name, 0) + times
    for inst in computations.get(name, {}).values():
      trips = 1
      if inst.opcode == 'while':
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
        trips = int(n.group(1)) if n else 1
      for key, callee in re.findall(r'(body|condition|calls|to_apply)=%?([\w.\-]+)',
                                    inst.attrs):
        # Reductions' little adders hold nothing of interest; an asynchronous op's wrapped
        # computation runs once, for its start (its done may name it too).
        if key != 'to_apply' and inst.opcode not in ('async-update', 'async-done'):
          visit(callee, times * (trips if key in ('body', 'condition') else 1))
      if inst.opcode == 'conditional':
        for callee, share in branch_shares(computations, inst):
          runs = times * share
          visit(callee, int(runs) if float(runs).is_integer() else runs)

  visit(entry, 1)
  return counts


def _braced(attrs: str, key: str) -> list[list[int]] | None:
  """The integer lists of `key={{0,1},{2,3}}`, or None when `attrs` has no such field."""
  at = attrs.find(key + '{')
  if at < 0:
    return None
  start = at + len(key)
  text = attrs[start:_balanced(attrs, start)]
  return [[int(x) for x in g.split(',') if x] for g in re.findall(r'\{([\d,]*)\}', text)]


def _iota(text: str) -> np.ndarray:
  """Device ids written as `[4,2]T(1,0)` (an iota of that shape, transposed) or `0,2,4`,
  flattened."""
  m = re.fullmatch(r'\[([\d,]+)\](?:T\(([\d,]+)\))?', text.strip())
  if not m:
    return np.array([int(x) for x in text.split(',')])
  dims = [int(x) for x in m.group(1).split(',')]
  ids = np.arange(math.prod(dims)).reshape(dims)
  return (ids.transpose([int(x) for x in m.group(2).split(',')]) if m.group(2) else ids).ravel()


def _mesh_groups(mesh: str, device_ids: str | None, chosen: str) -> list[list[int]]:
  """Groups along the `chosen` axes of a named mesh: whole axes ('axis_1') or sub-axes
  ('axis_0':(2)2, the size-2 factor of axis_0 below a major factor of 2)."""
  axes = [(a, int(n)) for a, n in re.findall(r"'?(\w+)'?=(\d+)", mesh)]
  picks = [(a, int(pre) if pre else None, int(n) if n else None)
           for a, pre, n in re.findall(r"'?(\w+)'?(?::\((\d+)\)(\d+))?", chosen)]
  # Each axis cut into factors at its chosen sub-axes' bounds, major first.
  dims, chosen_dims = [], []
  for a, size in axes:
    cuts = sorted({1, size, *(c for b, pre, n in picks if b == a and pre
                              for c in (pre, pre * n))})
    for lo, hi in zip(cuts, cuts[1:]):
      if any(b == a and (pre is None or pre <= lo and hi <= pre * n) for b, pre, n in picks):
        chosen_dims.append(len(dims))
      dims.append(hi // lo)
  ids = _iota(device_ids) if device_ids else np.arange(math.prod(dims))
  ids = ids.reshape(dims).transpose(
      [i for i in range(len(dims)) if i not in chosen_dims] + chosen_dims)
  return ids.reshape(-1, math.prod(dims[i] for i in chosen_dims)).tolist()


def device_groups(attrs: str) -> list[list[int]] | None:
  """The device (partition) groups of a collective's `replica_groups` or permute pairs."""
  pairs = _braced(attrs, 'source_target_pairs=')
  if pairs is not None:
    return pairs
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?\)?)\))? \{([^}]*)\}", attrs)
  if m:  # mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_1'}: grouped along named axes
    return _mesh_groups(m.group(1), m.group(2), m.group(3))
  m = re.search(r'replica_groups=\[([\d,]+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)', attrs)
  if m:  # iota form: [groups, size] <= [dims] with an optional transpose
    return _iota(m.group(2)).reshape(int(m.group(1).split(',')[0]), -1).tolist()
  groups = _braced(attrs, 'replica_groups=')
  return groups or None  # {} means every device in one group


def group_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int],
               permute: bool = False) -> tuple[tuple[str, ...], int]:
  """The mesh axes a collective's groups span, and its group size. Partition p is the mesh's
  p-th device in row-major order over `mesh_shape`."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  if groups is None:
    return tuple(n for n, s in zip(names, sizes) if s > 1), math.prod(sizes)
  spanned = set()
  for group in groups:
    coords = np.array(np.unravel_index(group, sizes)).T  # [members, axes]
    spanned |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
  size = 2 if permute else max(len(g) for g in groups)
  return tuple(n for n in names if n in spanned), size


def _sliced_to(computations, comp: str, name: str, elements: int, parts: int,
               depth: int = 0, outside: tuple[str, str] | None = None) -> bool:
  """Whether every use of `name` in `comp` (looking through bitcasts, converts and fusions)
  only slices out 1/`parts` of its `elements` elements. `outside` is the (computation,
  fusion) a fused computation was entered from: a value that reaches its root goes on there."""
  users = [u for u in computations[comp].values() if name in u.operands]
  if outside and not users and computations[comp][name].is_root:
    return _sliced_to(computations, *outside, elements, parts, depth + 1)
  if not users or depth > 12:
    return False
  for user in users:
    if user.opcode in ('dynamic-slice', 'slice'):
      if user.operands[0] != name or math.prod(arrays(user.shape)[0][1]) * parts != elements:
        return False
    elif user.opcode in PASS_THROUGH:
      if not _sliced_to(computations, comp, user.name, elements, parts, depth + 1, outside):
        return False
    elif user.opcode in FUSIONS:
      fused = called(user)
      params = {int(i.args): i.name for i in computations[fused].values()
                if i.opcode == 'parameter'}
      if not all(_sliced_to(computations, fused, params[k], elements, parts, depth + 1,
                            (comp, user.name))
                 for k, operand in enumerate(user.operands) if operand == name):
        return False
    else:
      return False
  return True


def _only_added(computations, comp: str, user: Instruction, values: set[str]) -> bool:
  """Whether `user` (an add, or a fusion) uses `values` only by adding them up."""
  if user.opcode == 'add':
    return True
  if user.opcode not in FUSIONS:
    return False
  fused = called(user)
  params = {int(i.args): i.name for i in computations[fused].values() if i.opcode == 'parameter'}
  inside = {params[k] for k, operand in enumerate(user.operands) if operand in values}
  while True:  # follow the values through ops that only pass them on
    passed = {u.name for u in computations[fused].values()
              if u.opcode in PASS_THROUGH and inside & set(u.operands)} - inside
    if not passed:
      break
    inside |= passed
  return all(u.opcode == 'add' or (u.opcode in PASS_THROUGH and u.name in inside)
             for u in computations[fused].values() if inside & set(u.operands))


# Bytes one device sends per byte of a collective's result, in a group of n (ring formulas).
RING = {'all-reduce': lambda n: 2 * (n - 1) / n, 'all-gather': lambda n: (n - 1) / n,
        'all-to-all': lambda n: (n - 1) / n, 'reduce-scatter': lambda n: n - 1,
        'collective-permute': lambda n: 1, 'collective-broadcast': lambda n: 1,
        'ragged-all-to-all': lambda n: (n - 1) / n, 'send': lambda n: 1}


def bytes_by_dtype(shape: str) -> dict[str, int]:
  """Bytes of each element type among a shape's arrays."""
  found = collections.Counter()
  for dtype, dims in arrays(shape):
    found[dtype] += DTYPE_BYTES.get(dtype, 4) * math.prod(dims)
  return dict(found)


def _all_reduce(computations, comp: str, inst: Instruction, axes, n: int, times: int
                ) -> list[Collective]:
  """A CPU program's all-reduce as an accelerator runs it: elements only ever sliced to 1/n
  are a reduce-scatter; elements that are only summed with each other are reduced once."""
  insts = computations[comp]
  elements = _tuple_elements(inst.shape) if inst.shape.startswith('(') else [inst.shape]
  values = []  # per element: the names that carry it
  for index in range(len(elements)):
    values.append([inst.name] if len(elements) == 1 else [
        u.name for u in insts.values() if u.opcode == 'get-tuple-element'
        and u.operands == [inst.name] and re.search(rf'index={index}\b', u.attrs)])
  users = [[u for u in insts.values() if set(v) & set(u.operands)] for v in values]
  sums: dict[str, list[int]] = {}  # consumer that only adds elements up -> their indices
  for index, element_users in enumerate(users):
    if len(element_users) == 1 and len(values[index]) == 1:
      sums.setdefault(element_users[0].name, []).append(index)
  summed = set()
  for consumer, indices in sums.items():
    names = {values[i][0] for i in indices}
    if len(indices) > 1 and _only_added(computations, comp, insts[consumer], names):
      summed |= set(indices[1:])  # the first one stands for the sum
  whole, scattered = collections.Counter(), collections.Counter()
  for index, element in enumerate(elements):
    size = math.prod(arrays(element)[0][1])
    if index in summed:
      continue
    sliced = values[index] and all(_sliced_to(computations, comp, v, size, n)
                                   for v in values[index])
    (scattered if sliced else whole).update(bytes_by_dtype(element))
  return ([Collective('all-reduce', dtype, axes, n, times, RING['all-reduce'](n) * size,
                      summed=len(summed)) for dtype, size in whole.items()] +
          [Collective('reduce-scatter', dtype, axes, n, times,  # the piece kept is size / n
                      RING['reduce-scatter'](n) * size / n, from_all_reduce=True)
           for dtype, size in scattered.items()])


def collective_kind(inst: Instruction) -> str | None:
  """Which of KINDS `inst` is (run synchronously, or the start of an asynchronous one)."""
  kind = inst.opcode.removesuffix('-start')
  return kind if kind in KINDS else None


def delivered(inst: Instruction) -> str:
  """The shape of what a collective delivers. A GPU program's asynchronous starts hold
  (operands, results, ...), except `all-reduce-start`, whose shape is its result; a send or
  recv holds (data, context, token)."""
  if inst.opcode in ('send', 'recv'):
    return _tuple_elements(inst.shape)[0]
  if inst.opcode.endswith('-start') and inst.opcode != 'all-reduce-start':
    return _tuple_elements(inst.shape)[1]
  return inst.shape


@functools.lru_cache(maxsize=2)
def program(hlo_text: str):
  """The parsed module, its entry and how often each computation runs (shared by the readers
  below, which are usually asked about the same program in turn)."""
  computations, entry = parse_module(hlo_text)
  return computations, call_counts(computations, entry)


def collectives(hlo_text: str, mesh_shape: dict[str, int], *, cpu: bool) -> list[Collective]:
  """Every collective of a compiled program (`compiled.as_text()`) on a mesh of `mesh_shape`
  (axis name → size, in the mesh's order), with its executions per step: one record per
  element type it moves. `cpu`: the program is the CPU compiler's, whose all-reduce
  patterns are counted as an accelerator runs them (see the module's docstring)."""
  computations, counts = program(hlo_text)
  found = []
  for comp, insts in computations.items():
    times = counts.get(comp, 0)
    for inst in insts.values() if times else ():
      kind = collective_kind(inst)
      if kind is None:
        continue
      axes, n = group_axes(device_groups(inst.attrs), mesh_shape, permute=kind in PAIRWISE)
      if n <= 1 or not axes:
        continue
      if kind == 'all-reduce' and cpu:
        found += _all_reduce(computations, comp, inst, axes, n, times)
        continue
      found += [Collective(kind, dtype, axes, n, times, sent, op=op_name(inst))
                for dtype, sent in sent_by_dtype(inst, kind, n).items()]
  return found


def sent_by_dtype(inst: Instruction, kind: str, n: int) -> dict[str, float]:
  """Bytes one device sends per call of collective `inst` (one of KINDS) over groups of `n`,
  by element type (ring formulas, `RING`)."""
  return {dtype: RING[kind](n) * size for dtype, size in bytes_by_dtype(delivered(inst)).items()}


# A GEMM that XLA hands to cuBLAS (where autotuning prefers it to a Triton fusion, always with
# --xla_gpu_enable_triton_gemm=false; FP8 GEMMs too) is a custom call whose first output is the
# product and whose backend config carries the dot's dimension numbers.
CUBLAS_TARGET = re.compile(r'custom_call_target="__cublas\$')


def gemm_shape(insts: dict[str, Instruction], inst: Instruction
               ) -> tuple[str, int, int, int, int] | None:
  """(element types such as 'bf16xbf16->f32', batch, m, n, k) of a `dot` or a cuBLAS GEMM call
  in a computation of instructions `insts`; None for any other op."""
  is_cublas = inst.opcode == 'custom-call' and CUBLAS_TARGET.search(inst.attrs)
  if not (inst.opcode == 'dot' or is_cublas) or len(inst.operands) < 2 or not all(
      o in insts for o in inst.operands[:2]):
    return None
  config = inst.attrs.replace(' ', '')  # a cuBLAS call's JSON backend config, spaces dropped
  dims = {}
  for side in ('lhs', 'rhs'):
    for what in ('contracting', 'batch'):
      found = (re.search(rf'{side}_{what}_dims=\{{([\d,]*)\}}', inst.attrs)
               or re.search(rf'"{side}_{what}_dimensions":\[([^\]]*)\]', config))
      dims[side, what] = [int(d) for d in re.findall(r'\d+', found.group(1))] if found else []
  (lhs_type, lhs), (rhs_type, rhs) = (arrays(insts[o].shape)[0] for o in inst.operands[:2])
  free = lambda shape, side: math.prod(
      n for d, n in enumerate(shape) if d not in dims[side, 'contracting'] + dims[side, 'batch'])
  return (f'{lhs_type}x{rhs_type}->{arrays(inst.shape)[0][0]}',
          math.prod(lhs[d] for d in dims['lhs', 'batch']), free(lhs, 'lhs'), free(rhs, 'rhs'),
          math.prod(lhs[d] for d in dims['lhs', 'contracting']))


def _dots(hlo_text: str):
  """(computation, instruction, FLOPs per execution of the program) of every matrix multiply,
  XLA's `dot`s and cuBLAS calls alike (2 FLOPs per multiply-add), loops multiplied through."""
  computations, counts = program(hlo_text)
  for comp, insts in computations.items():
    for inst in insts.values() if counts.get(comp) else ():
      if shape := gemm_shape(insts, inst):
        _, batch, m, n, k = shape
        yield comp, inst, counts[comp] * 2 * batch * m * n * k


def dot_flops(hlo_text: str) -> float:
  """FLOPs of the program's matrix multiplies per execution: what the device computes,
  recomputation and attention included."""
  return sum(flops for _, _, flops in _dots(hlo_text))


# XLA's rematerialization pass, when a program would not fit the device's memory, recomputes
# values instead of holding them: it clones their ops as `<op>.remat`, `<op>.remat2`, ...
XLA_REMAT_NAME = re.compile(r'\.remat(\d*)$')


@functools.lru_cache(maxsize=2)
def _xla_reruns(hlo_text: str) -> tuple[frozenset[str], frozenset[str]]:
  """The instructions XLA's rematerialization added, and the computations (fusion bodies)
  they call: of each op and its clones, all but the first (a clone whose original is gone
  only moved it)."""
  computations, _ = program(hlo_text)
  instructions, called = set(), set()
  for insts in computations.values():
    copies = collections.defaultdict(list)  # op's name -> [(clone number, instruction name)]
    for name in insts:
      clone = XLA_REMAT_NAME.search(name)
      copies[XLA_REMAT_NAME.sub('', name)].append((int(clone.group(1) or 1) if clone else 0,
                                                    name))
    for group in copies.values():
      for _, name in sorted(group)[1:]:
        instructions.add(name)
        called.update(re.findall(r'calls=%?([\w.\-]+)', insts[name].attrs))
  return frozenset(instructions), frozenset(called)


def recomputed_by(hlo_text: str, comp: str, inst: Instruction) -> str | None:
  """Who makes `inst`, in computation `comp`, rerun forward work: 'xla', its rematerialization
  pass (`_xla_reruns`); 'remat', a JAX checkpoint policy (JAX puts what it recomputes under
  'rematted_computation' in the op's name); None when it runs once."""
  instructions, called = _xla_reruns(hlo_text)
  if inst.name in instructions or comp in called:
    return 'xla'
  if re.search(r'op_name="[^"]*\brematted_computation/', inst.attrs):
    return 'remat'
  return None


def recomputed_flops(hlo_text: str) -> dict[str, float]:
  """FLOPs per execution of the forward work that the program reruns, matmuls and cuDNN
  attention kernels, by who reruns it (`recomputed_by`): {'remat': ..., 'xla': ...}."""
  found = {'remat': 0.0, 'xla': 0.0}
  for comp, inst, flops in _dots(hlo_text):
    if who := recomputed_by(hlo_text, comp, inst):
      found[who] += flops
  for kernel in fused_attention(hlo_text):
    if kernel.recomputed_by:
      found[kernel.recomputed_by] += kernel.count * kernel.flops
  return found


@dataclasses.dataclass
class FusedAttention:
  """A cuDNN attention kernel of a GPU program (a `__cudnn$fmha…` custom call)."""
  target: str          # e.g. '__cudnn$fmhaSoftmax', '__cudnn$fmhaScaleBiasSoftmaxBackward'
  count: int           # executions per step
  flash: bool          # cuDNN's flash-attention kernel, which never holds the T×S scores
  mask: str            # the kernel's own mask: 'CAUSAL', 'NO_MASK', 'PADDING_CAUSAL', ...
  bias: str | None     # a [.., T, S] bias operand (e.g. a dense mask made into one): its shape
  recomputed_by: str | None  # a forward rerun in the backward: by whom (see `recomputed_by`)
  flops: float         # per execution, from the shapes
  segments: int = 1    # spans of each row it attends within (cuDNN's packed layout when > 1)
  length: int = 0      # queries per sequence (T)
  head_dim: int = 0    # H
  window: int = 0      # keys a query sees, its own included, under a sliding window (0: none)

  @property
  def backward(self) -> bool:
    return self.target.endswith('Backward')


ATTENTION_TARGET = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)"')


def fused_attention(hlo_text: str) -> list[FusedAttention]:
  """The cuDNN attention kernels of a program (see `attention_kernel`)."""
  computations, counts = program(hlo_text)
  return [attention_kernel(inst, counts[comp], recomputed_by(hlo_text, comp, inst))
          for comp, insts in computations.items() if counts.get(comp)
          for inst in insts.values()
          if inst.opcode == 'custom-call' and ATTENTION_TARGET.search(inst.attrs)]


def attention_kernel(inst: Instruction, count: int, recomputed: str | None) -> FusedAttention:
  """A cuDNN attention call as a kernel. FLOPs are counted from the shapes (the kernels
  report none): 4·B·N·T·S·H forward (Q·Kᵀ and P·V), 10·B·N·T·S·H backward (Q·Kᵀ again and
  four gradient matmuls), halved under a causal mask, whose upper triangle the kernel skips;
  under a causal mask with a sliding window of W < T keys, T·S is the band's W·T − W²/2
  query-key pairs. Packed rows count as one sequence each, an upper bound on their
  documents' work."""
  config = inst.attrs.replace(' ', '')  # the backend config's JSON, spaces dropped
  # The scores' shape: XLA of jax 0.10 writes its element type first and its dimensions as
  # numbers, of jax 0.11 its dimensions first and as strings.
  scores = re.search(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":\[([^\]]*)\]', config)
  dims = [int(d) for d in re.findall(r'\d+', scores.group(1))] if scores else []
  start = inst.attrs.find('operand_layout_constraints=')
  operands = arrays(inst.attrs[start:_balanced(inst.attrs, inst.attrs.index('{', start))])
  mask = re.search(r'"mask_type":\s*"(\w+)"', inst.attrs)
  mask = mask.group(1) if mask else 'NO_MASK'
  bias = next((f'{t}[{",".join(map(str, d))}]' for t, d in operands[3:]
               if dims and len(d) == len(dims) and d[-2:] == tuple(dims[-2:])), None)
  segments = re.search(r'"max_seg_per_batch":(\d+)', config)
  window = re.search(r'"sliding_window_length":(\d+)', config)
  kernel = FusedAttention(ATTENTION_TARGET.search(inst.attrs).group(1), count,
                          '"is_flash_attention":true' in config, mask, bias, recomputed, 0.0,
                          int(segments.group(1)) if segments else 1)
  kernel.window = int(window.group(1)) if window else 0
  if dims and operands:  # [B, N, T, S] scores, each of head dim H (q's last)
    kernel.length, kernel.head_dim = dims[-2], operands[0][1][-1]
    T, S = dims[-2:]
    pairs = T * S * (0.5 if 'CAUSAL' in mask else 1.0)
    if 'CAUSAL' in mask and 0 < kernel.window < T:
      pairs = kernel.window * T - kernel.window**2 / 2
    kernel.flops = ((10 if kernel.backward else 4) * math.prod(dims[:-2]) * pairs
                    * operands[0][1][-1])
  return kernel


@dataclasses.dataclass
class TritonKernel:
  """A Pallas-Triton kernel of a GPU program (a `__gpu$xla.gpu.triton` custom call), e.g. the
  grouped matmul's (`jaxllm.model.grouped_matmul_triton.call_cost` prices those)."""
  name: str                    # the kernel's name, as Pallas puts it in the backend config
  count: int                   # executions per step
  operands: list[tuple[str, tuple[int, ...]]]  # (dtype, dims) of each operand, in order
  result: list[tuple[str, tuple[int, ...]]]    # (dtype, dims) of each output
  grid: tuple[int, int, int]   # Triton's launch grid (programs along x, y, z)
  recomputed_by: str | None    # a forward rerun in the backward: by whom (`recomputed_by`)


TRITON_TARGET = 'custom_call_target="__gpu$xla.gpu.triton"'


def triton_kernels(hlo_text: str) -> list[TritonKernel]:
  """The Pallas-Triton kernels a GPU program runs, one entry per call site."""
  computations, counts = program(hlo_text)
  found = []
  for comp, insts in computations.items():
    for inst in insts.values() if counts.get(comp) else ():
      if inst.opcode != 'custom-call' or TRITON_TARGET not in inst.attrs:
        continue
      # The backend config's fields are in name order (debug, grid_*, ir, name, num_*); the
      # Triton module in `ir` is a string whose quotes are escaped (\22), so `name = "` and
      # the grid's fields read plainly around it.
      config = inst.attrs
      name = re.search(r'\bname = "([^"]*)"', config)
      grid = [re.search(rf'\bgrid_{axis} = (\d+)', config) for axis in 'xyz']
      start = config.find('operand_layout_constraints=')
      operands = (arrays(config[start:_balanced(config, config.index('{', start))])
                  if start >= 0 else [])
      found.append(TritonKernel(name.group(1) if name else '', counts[comp], operands,
                                arrays(inst.shape),
                                tuple(int(g.group(1)) if g else 1 for g in grid),
                                recomputed_by(hlo_text, comp, inst)))
  return found


def largest_values(hlo_text: str, k: int = 5) -> list[tuple[int, str, str]]:
  """The `k` largest arrays the program computes (outside fusions, whose insides are never
  held), as (bytes, shape, the JAX operation that made it), each shape and operation once."""
  computations, counts = program(hlo_text)
  fused = {m for insts in computations.values() for i in insts.values() if i.opcode in FUSIONS
           for m in re.findall(r'calls=%?([\w.\-]+)', i.attrs)}
  skip = ('parameter', 'get-tuple-element', 'tuple', 'bitcast', 'while', 'call', 'conditional',
          'constant', 'custom-call')
  seen = {}
  for comp, insts in computations.items():
    if comp in fused or not counts.get(comp):
      continue
    for inst in insts.values():
      if inst.opcode in skip or inst.opcode.endswith(('-start', '-done')):
        continue
      for dtype, dims in arrays(inst.shape):  # a multi-output fusion makes several arrays
        shape = f'{dtype}[{",".join(map(str, dims))}]'
        seen.setdefault((shape, op_name(inst)), nbytes(shape))
  return sorted(((size, *key) for key, size in seen.items()), reverse=True)[:k]
