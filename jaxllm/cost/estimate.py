"""A candidate's step estimated from its shapes alone, before anything is compiled: what tune
orders its candidates by, and what leaves out early those that cannot fit or cannot win.

The time takes the kernels the layers must run at the profile's own rates, as the timing model
(`jaxllm.cost.timing`) takes the compiled ones: each weight matmul of a layer (forward, its two
gradients, and the forward again where the remat policy reruns it) at the GEMM rate of its
shape, cuDNN attention at its rate, the memory-bound work as bytes moved per token and layer,
the optimizer's as its state read and written; a pipeline's bubble iterations run as the others
do. The collectives are `jaxllm.cost.traffic`'s bytes at the links they cross, all of them
exposed but the fsdp gathers a remat policy's recomputation hides. The memory is the state,
the gradients and the activations the policy keeps for the backward.

Neither is a prediction to print: the per-token bytes are what this model's compiled programs
move and keep (measured on Llama-3-8B's), and no estimate sees XLA's fusion and scheduling.
`jaxllm.cost.tune` scales them by what the candidates it compiles show, and ranks only
compiled ones.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxllm.cost.compile import Step
from jaxllm.cost.hardware import Hardware, axes_across_nodes
from jaxllm.cost.traffic import expected_bytes
from jaxllm.parallel.rules import parts
from jaxllm.pipeline.spec import residual_items

# What each remat policy reruns in the backward: (the weight matmuls, the attention forward).
RERUNS = {'none': ((), False), 'full': (('qkv', 'o', 'up', 'down'), True),
          'dots': ((), True), 'dots_except_mlp': (('up', 'down'), False),
          'attention': (('qkv', 'o', 'up', 'down'), False)}
# Bytes each policy keeps for the backward, per token and layer, per unit of width: the
# residual stream (embed, kept in fp32), the attention projections (qkv) and the MLP's hidden
# units (mlp, one device's). 'none' and 'full' as the 8B programs' buffer assignment holds
# them; the others as their kept values add to 'full'.
KEPT = {'none': {'embed': 20, 'qkv': 5, 'mlp': 11.5}, 'full': {'embed': 4},
        'dots': {'embed': 8, 'qkv': 2, 'mlp': 4}, 'dots_except_mlp': {'embed': 4, 'qkv': 4},
        'attention': {'embed': 4, 'qkv': 1}}
# Bytes the memory-bound kernels of a layer move per token, per unit of width (forward and
# backward: norms, rotary embedding, the MLP's gate, casts, residual adds, the stacking of
# kept values), as the 8B programs' kernels move them; a policy that reruns the forward moves
# its activations again.
MOVED = {'embed': 80, 'qkv': 40, 'mlp': 40}
# Of the fsdp gathers and reduce-scatters, what the rerun forward of these policies hides (as
# a share of the GEMMs' time), as the 8B programs' schedules overlap them; the rest of the
# collectives sit between dependent kernels or end the step.
HIDDEN = {'full': 0.25, 'attention': 0.25}
KINDS = {'data': 'all-reduce', 'fsdp': 'all-gather', 'tensor': 'all-reduce',
         'pipe': 'collective-permute'}


@dataclasses.dataclass(frozen=True)
class Estimate:
  step_s: float
  gemm_s: float
  attention_s: float
  memory_s: float
  comm_s: float      # the collectives, hidden or not
  exposed_s: float   # of those, what the estimate does not hide
  memory: float      # bytes per device: state, gradients, kept activations


def estimate(step: Step, hardware: Hardware) -> Estimate:
  """The step of `step`'s config on `hardware` (which must have kernel rates)."""
  cfg, shape, rules = step.cfg, step.mesh_shape, step.layout.rules
  m, t = cfg.model, cfg.train
  rates = hardware.rates
  act = jnp.dtype(m.dtype).itemsize
  rows = t.global_batch // t.micro_batches // parts(rules['batch'], shape)
  seq = cfg.data.seq_len // parts(rules['seq'], shape)
  width = {  # per token, on one device
      'embed': m.embed_dim,
      'qkv': (m.num_heads // parts(rules['heads'], shape)
              + 2 * m.num_kv_heads // parts(rules['kv_heads'], shape)) * m.head_dim,
      'attention': m.num_heads // parts(rules['heads'], shape) * m.head_dim,
      'mlp': m.mlp_dim // parts(rules['mlp'], shape)}
  tokens = rows * seq  # per layer run
  p = step.pipeline
  if p:  # every iteration runs each stage's layers of a chunk on one micro-batch
    chunk = m.num_layers // (p.stages * p.repeats)
    runs, tokens = p.iterations * chunk, tokens // p.microbatches
    kept_runs = residual_items(p) * chunk
  else:
    runs = kept_runs = m.num_layers
  all_runs = runs * t.micro_batches
  gemms = {'qkv': (width['qkv'], m.embed_dim), 'o': (m.embed_dim, width['attention']),
           'up': (2 * width['mlp'], m.embed_dim), 'down': (m.embed_dim, width['mlp'])}
  rerun, rerun_attention = RERUNS[m.remat]
  types = 'bf16' if m.dtype == 'bfloat16' else 'f32'
  seconds = lambda r, n, k: 2 * r * n * k / rates.gemm_rate(types, 1, r, n, k)
  layer = sum(seconds(tokens, n, k) * (2 if name in rerun else 1) + seconds(tokens, k, n)
              + seconds(k, n, tokens) for name, (n, k) in gemms.items())
  vocab = m.vocab_size // parts(rules['vocab'], shape)
  head_tokens = rows * seq // (p.stages if p else 1)  # after a pipeline, split over its stages
  head = (seconds(head_tokens, vocab, m.embed_dim) + seconds(head_tokens, m.embed_dim, vocab)
          + seconds(m.embed_dim, vocab, head_tokens))
  gemm_s = all_runs * layer + t.micro_batches * head
  causal_flops = 2 * tokens * cfg.data.seq_len * width['attention']  # 4·T·S·H·Q, halved
  forward = causal_flops / rates.attention_rate(False, m.head_dim, cfg.data.seq_len, True)
  backward = 2.5 * causal_flops / rates.attention_rate(True, m.head_dim, cfg.data.seq_len, True)
  attention_s = all_runs * (forward * (2 if rerun_attention else 1) + backward)
  moved = tokens * sum(n * width[k] for k, n in MOVED.items()) * (1.5 if rerun else 1)
  state = step.state_bytes['params'] + step.state_bytes['optimizer']
  memory_s = (all_runs * rates.memory_seconds(moved)
              + t.micro_batches * rates.memory_seconds(6 * 4 * head_tokens * vocab)
              + 7 * rates.memory_seconds(state))
  comm_s, exposed_s = collectives(step, hardware, runs / (m.num_layers * (p.microbatches if p
                                                                          else 1)),
                                  HIDDEN.get(m.remat, 0.0) * gemm_s)
  kept = tokens * sum(n * width[k] for k, n in KEPT[m.remat].items())
  memory = step.state_bytes['params'] * 2 + step.state_bytes['optimizer'] + kept_runs * kept
  return Estimate(gemm_s + attention_s + memory_s + exposed_s, gemm_s, attention_s, memory_s,
                  comm_s, exposed_s, memory)


def collectives(step: Step, hardware: Hardware, layer_share: float,
                hidden: float) -> tuple[float, float]:
  """The collectives' seconds, and those of them exposed: all but up to `hidden` seconds of
  fsdp's. `layer_share` scales the per-layer traffic (tensor, context) to the layers a device
  runs, bubbles included, under a pipeline."""
  spanning = axes_across_nodes(step.mesh_shape, step.cfg.mesh.across_hosts,
                               hardware.devices_per_node)
  total = fsdp = 0.0
  for axes, sent in expected_bytes(step).items():
    axis = axes[0]
    if axis == 'tensor':
      sent *= layer_share
    seconds = hardware.rates.collective_seconds(KINDS.get(axis, 'all-gather'),
                                                step.mesh_shape[axis], axis in spanning, sent)
    total += seconds
    fsdp += seconds if axis == 'fsdp' else 0.0
  return total, total - min(fsdp, hidden)


# What the smallest ratio of compiled to estimated seen so far is taken less of, for candidates
# not yet compiled whose ratio may be smaller still (the 8B programs' ratios within a kind
# spread by about this much).
MARGIN = 0.1


class Calibration:
  """How the estimates of candidates compiled so far compare with their reports, by kind (the
  remat policy and pipeline schedule, whose programs the estimate errs alike on): the least
  step and peak a candidate not yet compiled may have, from its estimate."""

  def __init__(self):
    self.step: dict[tuple, list[float]] = {}
    self.peak: dict[tuple, list[float]] = {}

  def add(self, kind: tuple, e: Estimate, step_s: float, peak: float) -> None:
    self.step.setdefault(kind, []).append(step_s / e.step_s)
    self.peak.setdefault(kind, []).append(peak / e.memory)

  def least_step(self, kind: tuple, e: Estimate) -> float | None:
    """Its kind's smallest ratio times its estimate, less MARGIN or less as much as the ratios
    within a kind have been seen to spread, whichever is more (a small model's steps are
    latency that the estimate does not see, and its ratios spread by several times); None
    before one of its kind is compiled (another kind's ratio says nothing of it)."""
    ratios = self.step.get(kind)
    if not ratios:
      return None
    spread = min(min(rs) / max(rs) for rs in self.step.values())
    return e.step_s * min(ratios) * min(spread, 1 - MARGIN)

  def least_peak(self, kind: tuple, e: Estimate) -> float | None:
    """As `least_step`, for the peak memory; None before one of its kind is compiled (the kept
    activations differ most between kinds), and under a pipeline, whose gathered stage weights
    and per-iteration buffers the estimate does not count."""
    ratios = self.peak.get(kind)
    return e.memory * min(ratios) * (1 - MARGIN) if ratios and kind[1] == '-' else None
