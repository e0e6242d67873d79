"""The analytic bytes each device sends per step over each mesh axis, beside which the
report sets the compiled program's."""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.config import moe_layers
from jaxllm.cost import experts
from jaxllm.cost.compile import Step
from jaxllm.model.loss import splits_vocabulary
from jaxllm.parallel.rules import parts


def expected_bytes(c: Step) -> dict[tuple[str, ...], float]:
  """Analytic bytes each device sends per step over each single mesh axis (ring collectives, as
  README.md's "See before you launch" tabulates them; 2(N−1)/N is nccl-tests' bus-bandwidth
  factor for all-reduce, doc/PERFORMANCE.md).

  Weights move in the compute dtype, gradients in model.grad_reduce_dtype (`g·` below scales
  parameter bytes to it; `a·` to the compute dtype).
  data: a ring all-reduce of the gradients, 2(N−1)/N·g·P, once per step. Under ZeRO the
    gradients of the parameters whose update it splits (Z of P) are reduce-scattered and the
    updated parameters all-gathered instead, (N−1)/N·(g + 1)·Z: the all-reduce's bytes when
    g = 1 (the ZeRO paper's "same traffic as data parallelism"); with sharding.zero=2 the
    reduce-scatter runs per micro-batch, (N−1)/N·(M·g + 1)·Z.
  fsdp, per micro-batch: the layers' weights all-gathered in forward and backward and their
    gradients reduce-scattered, (N−1)/N·(2a + g)·P (with model.fp8 the layers' matmul
    weights are quantized before they are gathered: there a is 1 byte per parameter byte);
    the loss (`model.loss.splits_vocabulary` says which) either gathers the output head once
    (it takes its gradients as it goes) and reduce-scatters its gradient, (N−1)/N·(a + g)·P,
    or splits the vocabulary over fsdp:
    the head moved to the slices and its gradient back, (N−1)/N·(a + g)·P/N, and the rows
    instead, b·s·h gathered and its gradient reduce-scattered, (N−1)·(1 + g')·b·s·h (g' the
    gradient's bytes per activation byte), the targets and mask, (N−1)·8·b·s, and each row's
    log-sum-exp from every slice, (N−1)·N·4·b·s (b·s·h / S after a pipeline of S stages);
    under a pipeline with gather_weights='step' the stage weights likewise, once for all
    iterations; the embedding lookup moves rows, not weights: the looked-up b·s·h forward and
    backward, 2(N−1)/N·b·s·h; the parameters fsdp does not split (norm scales) are
    all-reduced, 2(N−1)/N·g·P.
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
    the scanned schedule (bubble iterations shift too; 1F1B's ticks with forwards and those
    with backwards are as many); under GPipe and circular the last stage's outputs handed
    out, M/S micro-batches to each stage (a reduce-scatter, an all-gather backward),
    2(S−1)/S·b·s·h; the first stage's input gradient, all-reduced for the embedding every
    stage holds, 2(S−1)/S·b·s·h; and once per step (XLA sums the micro-batches' first), the
    output head's gradient, which each stage makes from its rows (under 1F1B the last stage
    from all), all-reduced, 2(S−1)/S·g·H (H the head's bytes on one device). Under 1F1B
    fsdp gathers the head once for the last stage's loss, (N−1)/N·(a + g)·P.
  experts (model.moe): the experts' weights split over fsdp are never gathered (out of P
    above); the tokens move to them instead, over the axes the experts split that split the
    tokens too (`experts.expected_dispatch_bytes`).
  P is the parameter bytes on one device before the axis' own split; b the rows on one device,
  s its part of the sequence (all of it unless rules.seq splits it).
  """
  cfg, shape = c.cfg, c.mesh_shape
  m, t = cfg.model, cfg.train
  act_bytes = jnp.dtype(m.dtype).itemsize
  a = act_bytes / jnp.dtype(m.param_dtype).itemsize
  g = jnp.dtype(m.grad_reduce_dtype).itemsize / jnp.dtype(m.param_dtype).itemsize
  rules = c.layout.rules
  rows = t.global_batch // t.micro_batches // c.layout.batch_shards  # b per micro-batch, device
  seq_parts = parts(rules['seq'], shape)
  bsh = rows * cfg.data.seq_len // seq_parts * m.embed_dim * act_bytes  # s: this device's
  params = c.state_bytes['params']
  expected = {}
  n = shape['data']
  if n > 1:
    split = c.zero_split_bytes
    scatters = t.micro_batches if c.layout.zero == 2 else 1
    expected[('data',)] = (n - 1) / n * (2 * g * (params - split) + (scatters * g + 1) * split)
  n = shape['fsdp']
  if n > 1 and not (c.pipeline and c.pipeline.gather_weights == 'iteration'):
    # Whole bytes (before the fsdp split) of what is gathered twice and what once.
    blocks, head = n * c.block_split_bytes, n * c.head_split_bytes
    # Experts split over fsdp stay where they are: the tokens move to them instead.
    blocks -= n * experts.fsdp_expert_bytes(c)
    unsplit = params - c.fsdp_split_bytes
    # With gather_weights='step' the stage weights are gathered once for all iterations.
    loss_bsh = bsh / shape['pipe']  # after a pipeline, the loss takes rows split over pipe
    tokens = loss_bsh / m.embed_dim / act_bytes
    if c.pipeline and c.pipeline.one_f_one_b:  # the last stage's head, gathered once
      loss = (a + g) * head
    elif splits_vocabulary(n, parts(rules['vocab'], shape), tokens, m.vocab_size, act_bytes,
                           jnp.dtype(m.grad_reduce_dtype).itemsize):
      loss = (a + g) * head / n + n * ((1 + g / a) * loss_bsh + 8 * tokens) + n * n * 4 * tokens
    else:
      loss = (a + g) * head
    # FP8 weights are quantized where they lie and gathered in 1 byte (not in the pipeline,
    # whose stage gather runs first, in the compute dtype).
    w = 1 / jnp.dtype(m.param_dtype).itemsize if m.fp8 != 'none' and not c.pipeline else a
    per_micro = ((a + g if c.pipeline else 2 * w + g) * blocks + loss + 2 * g * unsplit +
                 2 * bsh)
    expected[('fsdp',)] = (n - 1) / n * t.micro_batches * per_micro
  if m.moe.experts and (axes := experts.dispatch_axes(c)):
    expected[axes] = expected.get(axes, 0.0) + experts.expected_dispatch_bytes(
        cfg, shape, axes, c.layout.batch_shards, moe_layers(m))
  n = shape['tensor']
  if n > 1:
    per_layer = 5 if 'tensor' in rules['act_seq'] else 4
    expected[('tensor',)] = per_layer * m.num_layers * t.micro_batches * 2 * (n - 1) / n * bsh
    if 'tensor' in rules['heads'] and 'tensor' not in rules['kv_heads']:
      fsdp = parts(rules['embed'], shape)
      kv_weights = (2 * m.num_layers // shape['pipe'] * m.embed_dim // fsdp * m.num_kv_heads *
                    m.head_dim * jnp.dtype(m.param_dtype).itemsize)
      expected[('tensor',)] += t.micro_batches * 2 * (n - 1) / n * g * kv_weights
  for axis in rules['seq']:
    n = shape[axis]
    if n > 1:
      kv_parts = parts(rules['act_kv_heads'], shape)
      bSk = bsh * seq_parts / m.embed_dim * m.num_kv_heads * m.head_dim / kv_parts
      expected[(axis,)] = (expected.get((axis,), 0) +
                           4 * m.num_layers * t.micro_batches * (n - 1) / n * bSk)
  if c.pipeline:
    p = c.pipeline
    shifts = 2 * p.iterations * bsh / p.microbatches
    # The input gradient; GPipe's also the outputs handed out (1F1B's head is on the last stage).
    ends = (1 if p.one_f_one_b else 2) * 2 * (p.stages - 1) / p.stages * bsh
    head = 2 * (p.stages - 1) / p.stages * g * c.head_bytes
    expected[('pipe',)] = t.micro_batches * (shifts + ends) + head
  return expected

