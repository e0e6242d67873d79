"""What a mixture of experts costs in a compiled step: its grouped-GEMM kernels' FLOPs and
time, and the bytes its dispatch moves, beside the analytic figures.

The grouped GEMMs (`jaxllm.model.grouped_matmul_triton`, Triton custom calls) run on buffers
sized for the worst routing (dropless: every token of the expert group could pick this
device's experts), but compute only the rows routed to them: which is known when the step
runs. They are priced at the rows an even router gives each device's experts, N·top_k for N
tokens on the device (`routed_rows`), as one GEMM of those rows at the GEMM table's rates:
cuBLAS's, which the kernels, their tiles not yet tuned on a device, do not reach
(`KERNELS_MEASURED`).
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp

from jaxllm.config import moe_layers
from jaxllm.cost import hlo
from jaxllm.cost.timing import CustomCallCost
from jaxllm.model.grouped_matmul_triton import FORWARD, KERNELS, WEIGHT_GRAD
from jaxllm.parallel.rules import parts

TRITON_TARGET = '__gpu$xla.gpu.triton'
# The collectives of the dispatch carry this JAX name scope (jaxllm.model.moe.dispatch).
DISPATCH_SCOPE = 'moe_dispatch'
# What the grouped GEMMs' cuBLAS rates leave out, as measured (benchmarks/README.md, kernels.py).
KERNELS_MEASURED = 'in a step on one H200 the kernels ran at 0.62-0.66 of those rates'


def tokens_per_device(cfg, batch_shards: int) -> int:
  """The tokens one device routes in one micro-batch's forward (those of its rows)."""
  t = cfg.train
  return t.global_batch // t.micro_batches // batch_shards * cfg.data.seq_len


def routed_rows(cfg, batch_shards: int) -> int:
  """The rows a device's experts get in one layer when the router spreads its tokens evenly:
  N·top_k (over the expert group, each device's experts get as many rows as its own tokens
  send out, in either dispatch)."""
  return tokens_per_device(cfg, batch_shards) * cfg.model.moe.top_k


def triton_call(inst: hlo.Instruction) -> tuple[str, list, list] | None:
  """(kernel name, operands' (dtype, dims), result's) of a Triton custom call; None for other
  instructions."""
  if inst.opcode != 'custom-call' or hlo.TRITON_TARGET not in inst.attrs:
    return None
  name = re.search(r'\bname = "([^"]*)"', inst.attrs)
  start = inst.attrs.find('operand_layout_constraints=')
  operands = (hlo.arrays(inst.attrs[start:hlo._balanced(inst.attrs, inst.attrs.index('{', start))])
              if start >= 0 else [])
  return (name.group(1) if name else ''), operands, hlo.arrays(inst.shape)


def grouped_gemm(name: str, operands: list, result: list, rows: int | None
                 ) -> tuple[str, int, int, int, int] | None:
  """The grouped-GEMM call as one GEMM (types, batch, m, n, k) of `rows` routed rows (None: the
  buffer's rows, every one computed); None for another kernel."""
  if name not in KERNELS:
    return None
  dtype = result[0][0]
  types = f'{dtype}x{dtype}->{dtype}'
  if name == WEIGHT_GRAD:  # (lo, hi, x[R, K], dy[R, N]) -> dw[G, K, N]: rows contracted
    _, k, n = result[0][1]
    return types, 1, k, n, rows or operands[2][1][0]
  _, k, n = operands[-1][1]  # (tile, group, lo, hi, x or dy, w[G, K, N])
  m = rows or result[0][1][0]
  return (types, 1, m, n, k) if name == FORWARD else (types, 1, m, k, n)


def grouped_gemm_cost(rows: int | None):
  """A `timing.step_time` custom-call cost for the Triton target: the grouped-GEMM kernels as
  GEMMs of `rows` rows (`grouped_gemm`); any other Triton kernel as memory-bound on its
  operands and result."""
  def cost(insts, inst) -> CustomCallCost:
    name, operands, result = triton_call(inst)
    if gemm := grouped_gemm(name, operands, result, rows):
      return CustomCallCost(gemms=(gemm,))
    size = lambda arrays: sum(hlo.DTYPE_BYTES.get(t, 4) * math.prod(d) for t, d in arrays)
    return CustomCallCost(bytes=float(size(operands) + size(result)))
  return cost


def custom_call_costs(cfg, batch_shards: int) -> dict:
  """`timing.step_time`'s costs of the model's own kernels: the grouped GEMMs at the rows an
  even router gives them; none for a dense model."""
  if not cfg.model.moe.experts:
    return {}
  return {TRITON_TARGET: grouped_gemm_cost(routed_rows(cfg, batch_shards))}


def grouped_gemm_flops(hlo_text: str, rows: int | None) -> tuple[dict[str, float],
                                                                  dict[str, float]]:
  """FLOPs per step of the program's grouped-GEMM kernels at `rows` routed rows a call (None:
  every row of their buffers): by kernel name, and of those the forward calls rerun in the
  backward, by who reruns them (`hlo.recomputed_by`: 'remat', 'xla')."""
  computations, counts = hlo.program(hlo_text)
  by_kernel, recomputed = dict.fromkeys(KERNELS, 0.0), {'remat': 0.0, 'xla': 0.0}
  for comp, insts in computations.items():
    for inst in insts.values() if counts.get(comp) else ():
      call = triton_call(inst)
      if call and (gemm := grouped_gemm(*call, rows)):
        _, b, m, n, k = gemm
        flops = counts[comp] * 2.0 * b * m * n * k
        by_kernel[call[0]] += flops
        if who := hlo.recomputed_by(hlo_text, comp, inst):
          recomputed[who] += flops
  return by_kernel, recomputed


def dispatch_collectives(hlo_text: str, mesh_shape: dict[str, int], cpu: bool):
  """The program's collectives that move tokens to the experts and back (`DISPATCH_SCOPE`)."""
  return [x for x in hlo.collectives(hlo_text, mesh_shape, cpu=cpu) if DISPATCH_SCOPE in x.op]


def dispatch_axes(c) -> tuple[str, ...]:
  """The mesh axes (of more than one device, in the mesh's order) the dispatch moves tokens
  over: the ring's, those of the experts' split that split the tokens too; the all-to-all's,
  all of the experts'."""
  rules, shape = c.layout.rules, c.mesh_shape
  split = set(rules['experts'])
  if c.cfg.model.moe.dispatch == 'ring':
    split &= set(rules['batch']) | set(rules['seq'])
  return tuple(a for a in shape if a in split and shape[a] > 1)


def fsdp_expert_bytes(c) -> float:
  """Bytes of the experts' weights one device holds split over fsdp (zero unless the rules
  split the experts over it)."""
  m, rules, shape = c.cfg.model, c.layout.rules, c.mesh_shape
  if not m.moe.experts or 'fsdp' not in rules['experts']:
    return 0.0
  whole = (3 * m.moe.experts * m.embed_dim * (m.moe.mlp_dim or m.mlp_dim) * moe_layers(m)
           * jnp.dtype(m.param_dtype).itemsize)
  return whole / (parts(rules['experts'], shape) * parts(rules['expert_mlp'], shape)
                  * parts(rules['layers'], shape))


def expected_dispatch_bytes(cfg, mesh_shape: dict[str, int], expert_axes: tuple[str, ...],
                            batch_shards: int, moe_layers: int) -> float:
  """Analytic bytes a device sends per step in the dispatch over the expert axes (a group of
  n devices), with N tokens of width D in the compute dtype (a bytes) per micro-batch and
  device, top-k K, in each MoE layer and micro-batch:
  ring: forward, the tokens all-gathered, (n−1)·N·D·a, with their expert ids and weights,
    (n−1)·N·K·8 (and with a capacity factor which assignments were kept, (n−1)·N·K), and the
    outputs reduce-scattered, (n−1)·N·D·a; backward, the output gradient all-gathered and the
    input gradient reduce-scattered, 2(n−1)·N·D·a, and the weights' gradient reduce-scattered,
    (n−1)·N·K·4: 4(n−1)·N·D·a + 12(n−1)·N·K.
  all_to_all: each device's buffer of B = min(N·K, E_local·C) rows per destination sent out
    and the outputs back, forward and backward: 4(n−1)·B·D·a, with the expert ids, (n−1)·B·4.
  Under a remat policy (model.remat not 'none') the backward reruns each layer's forward and
  gathers its tokens, ids and weights again: (n−1)·N·(D·a + 8K) more for the ring."""
  m, t = cfg.model, cfg.train
  n = math.prod(mesh_shape[a] for a in expert_axes)
  if n <= 1:
    return 0.0
  N, K, a = tokens_per_device(cfg, batch_shards), m.moe.top_k, jnp.dtype(m.dtype).itemsize
  D = m.embed_dim
  if m.moe.dispatch == 'ring':
    kept = 1 if m.moe.capacity_factor else 0
    per_layer = 4 * (n - 1) * N * D * a + (12 + kept) * (n - 1) * N * K
    if m.remat != 'none':
      per_layer += (n - 1) * N * (D * a + (8 + kept) * K)
  else:
    E_local = m.moe.experts // n
    C = (N if not m.moe.capacity_factor
         else min(N, math.ceil(m.moe.capacity_factor * N * K / m.moe.experts)))
    B = min(N * K, E_local * C)
    per_layer = 4 * (n - 1) * B * D * a + (n - 1) * B * 4
  return float(per_layer * moe_layers * t.micro_batches)
