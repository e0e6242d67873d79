"""A candidate's step estimated from its shapes alone, before anything is compiled: what tune
orders its candidates by and leaves out early those that cannot fit or cannot win.

The time is the timing model's (`jaxllm.cost.timing`) taken on the kernels the layers must run,
at the profile's own rates: each weight matmul of a layer (forward, its two gradients, and the
forward again where the remat policy reruns it) at the GEMM rate of its shape, cuDNN attention
at its rate, the memory-bound work as the bytes the layers, the loss and the optimizer move, and
the collectives of `jaxllm.cost.traffic.expected_bytes` at the links they cross; a pipeline's
bubble iterations run as the others do. The memory is a floor: the state, the gradients and the
activations the remat policy keeps for the backward, no workspace. Neither is a prediction to
print: `tune` compiles the candidates the estimate cannot rule out and ranks by their reports.
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
# What each keeps for the backward beside the layer's input (activations per token, by width).
KEPT = {'none': ('qkv', 'attention', 'up', 'mlp'), 'full': (), 'dots': ('qkv', 'embed', 'up'),
        'dots_except_mlp': ('qkv', 'attention'), 'attention': ('attention',)}


@dataclasses.dataclass(frozen=True)
class Estimate:
  step_s: float
  gemm_s: float
  attention_s: float
  memory_s: float
  comm_s: float      # the collectives, hidden or not
  exposed_s: float   # of those, what the estimate does not hide behind the layers' kernels
  memory: float      # bytes per device: the floor described above


def estimate(step: Step, hardware: Hardware) -> Estimate:
  """The step of `step`'s config on `hardware` (which must have kernel rates)."""
  cfg, shape, rules = step.cfg, step.mesh_shape, step.layout.rules
  m, t = cfg.model, cfg.train
  rates = hardware.rates
  act = jnp.dtype(m.dtype).itemsize
  rows = t.global_batch // t.micro_batches // parts(rules['batch'], shape)
  seq = cfg.data.seq_len // parts(rules['seq'], shape)
  tokens = rows * seq
  width = {  # per token, on one device
      'embed': m.embed_dim,
      'qkv': (m.num_heads // parts(rules['heads'], shape)
              + 2 * m.num_kv_heads // parts(rules['kv_heads'], shape)) * m.head_dim,
      'attention': m.num_heads // parts(rules['heads'], shape) * m.head_dim,
      'up': 2 * m.mlp_dim // parts(rules['mlp'], shape),
      'mlp': m.mlp_dim // parts(rules['mlp'], shape)}
  p = step.pipeline
  if p:  # every iteration runs each stage's layers of a chunk on one micro-batch
    chunk = m.num_layers // (p.stages * p.repeats)
    runs, tokens = p.iterations * chunk, tokens // p.microbatches
    kept_runs = residual_items(p) * chunk
  else:
    runs = kept_runs = m.num_layers
  runs *= t.micro_batches
  # The weight matmuls of a layer: (name, rows, output width, contraction).
  gemms = [('qkv', tokens, width['qkv'], m.embed_dim), ('o', tokens, m.embed_dim,
                                                        width['attention']),
           ('up', tokens, width['up'], m.embed_dim), ('down', tokens, m.embed_dim, width['mlp'])]
  rerun, rerun_attention = RERUNS[m.remat]
  types = 'bf16' if m.dtype == 'bfloat16' else 'f32'
  seconds = lambda r, n, k: 2 * r * n * k / rates.gemm_rate(types, 1, r, n, k)
  layer_gemm = sum(seconds(r, n, k) * (2 if name in rerun else 1) + seconds(r, k, n)
                   + seconds(k, n, r) for name, r, n, k in gemms)
  vocab = m.vocab_size // parts(rules['vocab'], shape)
  head_tokens = rows * seq // (p.stages if p else 1)  # after a pipeline, split over its stages
  head_gemm = t.micro_batches * (seconds(head_tokens, vocab, m.embed_dim)
                                 + seconds(head_tokens, m.embed_dim, vocab)
                                 + seconds(m.embed_dim, vocab, head_tokens))
  gemm_s = runs * layer_gemm + head_gemm
  causal_flops = 2 * tokens * cfg.data.seq_len * width['attention']  # 4·T·S·H·Q, halved
  forward = causal_flops / rates.attention_rate(False, m.head_dim, cfg.data.seq_len, True)
  backward = 2.5 * causal_flops / rates.attention_rate(True, m.head_dim, cfg.data.seq_len, True)
  attention_s = runs * (forward * (2 if rerun_attention else 1) + backward)
  # Memory-bound work: each layer reads and writes its activations a few times (norms,
  # rotary embedding, the MLP's gate, residual adds) forward and backward; the loss its
  # logits in fp32; the optimizer its state.
  layer_bytes = tokens * act * (12 * m.embed_dim + 6 * width['qkv'] + 4 * width['up'])
  loss_bytes = t.micro_batches * head_tokens * vocab * 4 * 6
  optimizer_bytes = 2 * (step.state_bytes['params'] + step.state_bytes['optimizer'])
  memory_s = (runs * rates.memory_seconds(layer_bytes) + rates.memory_seconds(loss_bytes)
              + rates.memory_seconds(optimizer_bytes))
  comm_s, exposed_s = _collectives(step, hardware, gemm_s + attention_s)
  kept = tokens * act * (m.embed_dim + sum(width[k] for k in KEPT[m.remat]))
  memory = (step.state_bytes['params'] * 2 + step.state_bytes['optimizer']
            + kept_runs * kept)
  return Estimate(gemm_s + attention_s + memory_s + exposed_s, gemm_s, attention_s, memory_s,
                  comm_s, exposed_s, memory)


KINDS = {'data': 'all-reduce', 'fsdp': 'all-gather', 'tensor': 'all-reduce',
         'pipe': 'collective-permute', 'seq': 'all-gather'}


def _collectives(step: Step, hardware: Hardware, overlappable: float) -> tuple[float, float]:
  """The collectives' seconds, and how many of them are exposed: the tensor all-reduces sit
  between dependent matmuls and the gradients' reduction over data ends the step, so they
  show whole; fsdp's gathers and the pipeline's shifts run beside the layers' kernels."""
  spanning = axes_across_nodes(step.mesh_shape, step.cfg.mesh.across_hosts,
                               hardware.devices_per_node)
  total = exposed = hidden = 0.0
  for axes, sent in expected_bytes(step).items():
    axis = axes[0]
    kind = KINDS.get(axis, 'all-gather')
    seconds = hardware.rates.collective_seconds(kind, step.mesh_shape[axis], axis in spanning,
                                                sent)
    total += seconds
    if axis in ('tensor', 'data'):
      exposed += seconds
    else:
      hidden += seconds
  return total, exposed + max(0.0, hidden - overlappable)
