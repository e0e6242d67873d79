"""The 1F1B and interleaved 1F1B pipeline schedules in SPMD: each stage's backwards start as
soon as they reach it, so it holds a few micro-batches' residuals, not all of them.

Inside `jax.shard_map` over pipe and the batch axes (as `pipeline_layers`), scans over the
ticks of `ticks.one_f_one_b_ticks` run, in each tick on every stage, one item's forward (a
`jax.vjp` of the stage's chunk of layers, whose residuals go to a buffer slot) and one item's
backward (the pullback rebuilt from its slot), then `ppermute` activations one stage on and
gradients one back. The head and loss run on the last stage straight after each micro-batch's
last forward, and their gradient starts its backward in the same tick.

Autodiff cannot interleave like this, so the pipeline is a `jax.custom_vjp` that computes the
loss and all its gradients in its forward and scales them in its backward: the train step,
gradient accumulation, ZeRO and the data/fsdp/tensor axes see an ordinary differentiable loss.
Without differentiation (eval) only the forwards and head run.

The stage weights are not kept per slot: a residual that *is* the chunk's weights (their
forward is a scan over them) is left out of the buffer and the chunk's weights put back when
the pullback is rebuilt; the copies the layers make of them (cast to the compute dtype,
gathered over an axis that splits the sequence, laid out for a collective matmul's rings) are
remade in the backward (`_Stage`). Each tick's weight gradients come back in fp32 and are
summed in it, as GPipe's scan sums its iterations'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.model.remat import stack_policy
from jaxllm.model.transformer import head_loss_sum, scan_blocks, sliding_flags
from jaxllm.parallel.gather import batch_split_gatherer, compiler_axes
from jaxllm.parallel.mesh import keep_axes, logical_spec, split_micro_batches
from jaxllm.parallel.rules import mesh_axes
from jaxllm.pipeline.spec import PipelineSpec, chunk_first_layer, stage_split
from jaxllm.pipeline.ticks import one_f_one_b_ticks

# Per tick and stage: the forward's item and slot, the backward's item and slot.
_FIELDS = ('f_item', 'f_slot', 'b_item', 'b_slot')


def pipeline_loss(blocks: nnx.Module, final_norm: nnx.Module, w_DV, x_BTD, positions_BT,
                  segment_ids_BT, targets_BT, mask_BT, spec: PipelineSpec, model_cfg,
                  z_loss: float = 0.0):
  """(objective, cross-entropy) summed over the batch's unmasked targets, as
  `Transformer.loss_sum` of the block stack's output, through the pipeline `spec` (1F1B or
  interleaved 1F1B). Only the objective carries gradients; the cross-entropy is for the log."""
  S, R, M = spec.stages, spec.repeats, spec.microbatches
  graphdef, stacked = nnx.split(blocks, nnx.Param)
  norm_graph, norm_state = nnx.split(final_norm)
  batch_axes = mesh_axes(logical_spec('batch')[0])
  manual = {'pipe', *batch_axes}
  staged, staged_specs = stage_split(stacked, S, R)
  head_specs = (nnx.get_partition_spec(norm_state), logical_spec('embed', 'vocab'))
  in_specs = lambda specs: jax.tree.map(lambda s: keep_axes(s, manual), specs)
  gather = batch_split_gatherer(model_cfg.dtype, model_cfg.grad_reduce_dtype)
  # The gradient sums' layouts over the axes left to the compiler (tensor): the weights'.
  auto = compiler_axes()
  layouts = jax.tree.map(lambda s: keep_axes(s, auto),
                         (jax.tree.map(lambda s: P(*s[1:]), staged_specs), head_specs))
  stage = _Stage(graphdef, model_cfg, S, R)
  head = _Head(model_cfg, norm_graph, z_loss)
  schedule = _schedule_loss(stage, head, one_f_one_b_ticks(S, R, M), layouts, spec.bubble_fill)

  def local(staged, head_params, x_M, info_M, targets_M, mask_M):
    staged = jax.tree.map(gather, staged, staged_specs)  # once per step (gather_weights)
    head_params = jax.tree.map(gather, head_params, head_specs)
    objective, ce = schedule(staged, head_params, x_M, info_M, targets_M, mask_M)
    return objective[None], ce[None]

  rows = P(None, batch_axes)
  micro = lambda a: split_micro_batches(a, M)
  objective, ce = jax.shard_map(
      local, in_specs=(in_specs(staged_specs), in_specs(head_specs), rows, rows, rows, rows),
      out_specs=P(('pipe', *batch_axes)), axis_names=manual, check_vma=False)(
          staged, (norm_state, w_DV), micro(x_BTD),
          jax.tree.map(micro, (positions_BT, segment_ids_BT)), micro(targets_BT), micro(mask_BT))
  return jnp.sum(objective), jnp.sum(ce)


class _Stage:
  """A chunk of the layer stack, run forward, linearized and pulled back; `chunk` is which of
  this stage's R chunks (it says which layers they are: `chunk_first_layer`).

  Its weights come in their own dtype (fp32, holding the compute dtype's values), so that each
  tick's weight gradients come back in it, to be summed in fp32 as GPipe's scan sums them;
  the layers cast them to the compute dtype (and gather them where the sequence is split over
  an axis that splits them) as they use them. Those copies are new values every tick: the
  chunk runs under `stack_policy`, which never keeps them in a slot, but remakes them for the
  backward from the weights (what the slots keep besides is what model.remat says; under
  'none', the outputs of the weight matmuls and of attention)."""

  def __init__(self, graphdef, model_cfg, stages: int, repeats: int):
    self.graphdef, self.model_cfg, self.remat = graphdef, model_cfg, model_cfg.remat
    self.stages, self.per_chunk = stages, model_cfg.num_layers // (stages * repeats)

  def __call__(self, w, x_BTD, info, chunk):
    first = chunk_first_layer(jax.lax.axis_index('pipe'), chunk, self.stages, self.per_chunk)
    sliding_L = sliding_flags(self.model_cfg, first, self.per_chunk)
    run = lambda w, x_BTD: scan_blocks(self.graphdef, w, x_BTD, *info, self.remat,
                                       sliding_L=sliding_L)[0]  # no experts
    return jax.checkpoint(run, policy=stack_policy(self.remat), prevent_cse=False)(w, x_BTD)

  def linearize(self, w, x_BTD, info, chunk):
    """(output, residuals to keep, (pullback structure, where w's leaves go in it))."""
    y, pullback = jax.vjp(lambda w, x: self(w, x, info, chunk), w, x_BTD)
    leaves, treedef = jax.tree.flatten(pullback)
    weight_ids = {id(a): k for k, a in enumerate(jax.tree.leaves(w))}
    weight_at = tuple(weight_ids.get(id(a)) for a in leaves)
    kept = [a for a, k in zip(leaves, weight_at) if k is None]
    return y, kept, (treedef, weight_at)

  @staticmethod
  def pullback(structure, kept, w):
    treedef, weight_at = structure
    weights, kept = jax.tree.leaves(w), iter(kept)
    return jax.tree.unflatten(treedef, [next(kept) if k is None else weights[k]
                                        for k in weight_at])


class _Head:
  """The final norm, output head and loss of one micro-batch: (objective, cross-entropy)."""

  def __init__(self, model_cfg, norm_graph, z_loss: float):
    self.cfg, self.norm_graph, self.z_loss = model_cfg, norm_graph, z_loss

  def sums(self, head_params, y_BTD, targets_BT, mask_BT):
    """((objective, cross-entropy),)."""
    norm_state, w_DV = head_params
    return (head_loss_sum(self.cfg, nnx.merge(self.norm_graph, norm_state), w_DV, y_BTD,
                          targets_BT, mask_BT, self.z_loss),)

  def grads(self, head_params, y_BTD, targets_BT, mask_BT):
    """((objective, cross-entropy), the objective's gradients for head_params and y)."""
    (sums,), pullback = jax.vjp(
        lambda p, y: self.sums(p, y, targets_BT, mask_BT), head_params, y_BTD)
    return sums, *pullback(((jnp.ones_like(sums[0]), jnp.zeros_like(sums[1])),))


def _schedule_loss(stage: _Stage, head: _Head, ticks, layouts, fill: float):
  """The custom-VJP loss of one device's share: (objective, cross-entropy) of
  (staged weights [1, R, L/(S·R), ...], head params, x_M, info_M, targets_M, mask_M)."""

  @jax.custom_vjp
  def loss(staged, head_params, x_M, info_M, targets_M, mask_M):
    sums, _ = _run(stage, head, ticks, layouts, fill, staged, head_params, x_M, info_M,
                   targets_M, mask_M, backward=False)
    return sums

  def loss_fwd(*args):
    return _run(stage, head, ticks, layouts, fill, *args, backward=True)

  def loss_bwd(grads, cotangents):
    scale = cotangents[0]  # the objective's; the cross-entropy carries none
    staged, head_params, x_M = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    return staged, head_params, x_M, None, None, None

  loss.defvjp(loss_fwd, loss_bwd)
  return loss


def _run(stage: _Stage, head: _Head, ticks, layouts, fill: float, staged, head_params, x_M,
         info_M, targets_M, mask_M, backward: bool):
  """Runs the schedule: ((objective, cross-entropy), and with `backward` the gradients of
  the objective for (staged, head_params, x_M)), their fp32 sums kept in `layouts` (the
  weights' and the head's over the compiler's axes). What arrives in idle slots starts as
  `fill` (tests poison it with NaN)."""
  S, R, M = ticks.stages, ticks.repeats, ticks.microbatches
  here = jax.lax.axis_index('pipe')
  first, last = here == 0, here == S - 1
  f_slot, b_slot, slots = ticks.slots()
  table = {k: jnp.asarray(v, jnp.int32) for k, v in zip(
      _FIELDS, (ticks.forward, f_slot, ticks.backward, b_slot))}
  microbatch, chunk = (jnp.asarray(a, jnp.int32) for a in (ticks.microbatch, ticks.chunk))
  weights = jax.tree.map(lambda w: w[0], staged)  # [R, L/(S·R), ...]
  chunk_weights = lambda r: jax.tree.map(lambda w: w[0] if R == 1 else w[r], weights)
  info_of = lambda m: jax.tree.map(lambda a: a[m], info_M)
  forward_ring = [(i, (i + 1) % S) for i in range(S if R > 1 else S - 1)]
  backward_ring = [((i + 1) % S, i) for i in range(S if R > 1 else S - 1)]

  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
  pin = lambda tree, specs: jax.tree.map(jax.lax.with_sharding_constraint, tree, specs)
  carry = dict(
      activation=jnp.full(x_M.shape[1:], fill, x_M.dtype),
      gradient=jnp.full(x_M.shape[1:], fill, x_M.dtype),
      sums=(jnp.float32(0), jnp.float32(0)))
  if backward:
    # The stage's forward and its pullback are traced once each, and each tick kind's body
    # calls those traces (jit keeps them). The residuals' shapes and the pullback's structure
    # come from the forward's trace.
    found = []
    def forward(w, x, info, r):
      y, kept, structure = stage.linearize(w, x, info, r)
      found.append(structure)
      return y, kept
    forward = jax.jit(forward)
    _, kept_shapes = jax.eval_shape(forward, chunk_weights(0), x_M[0], info_of(0), jnp.int32(0))
    structure = found[0]
    pullback = jax.jit(lambda kept, w, g: stage.pullback(structure, kept, w)(g))
    carry.update(
        buffer=[jnp.zeros((slots, *a.shape), a.dtype) for a in kept_shapes],
        d_weights=pin(zeros(weights), layouts[0]), d_head=pin(zeros(head_params), layouts[1]),
        d_x=jnp.zeros_like(x_M))

  # Traced once, for the shapes of its zeros and for the branch that runs it (jit keeps it);
  # without the backward, the stage's forward is traced once for every tick kind too.
  run_head = jax.jit(head.grads if backward else head.sums)
  run_stage = jax.jit(stage.__call__)

  def tick(has_f: bool, has_b: bool, with_head: bool):
    """One tick's body: a forward, a backward or both on every stage (each masked where the
    stage's slot is idle); the head with the last stage's forward where it finishes a
    micro-batch."""
    def body(c, row):
      c = dict(c)
      mine = {k: v[here] for k, v in row.items()}
      if has_f:
        f_valid = mine['f_item'] >= 0
        item = jnp.maximum(mine['f_item'], 0)
        m, r = microbatch[item], chunk[item]
        x = jnp.where(first & (r == 0), x_M[m], c['activation'])
        x = jnp.where(f_valid, x, 0)  # idle slots run on zeros: what they hold can't leak
        if backward:
          y, kept = forward(chunk_weights(r), x, info_of(m), r)
          assert all(s[1] == structure[1] for s in found), 'the stage traced differently'
          c['buffer'] = [jax.lax.dynamic_update_index_in_dim(b, k, mine['f_slot'], 0)
                         for b, k in zip(c['buffer'], kept)]
        else:
          y = run_stage(chunk_weights(r), x, info_of(m), r)
        if with_head:  # on the last stage, where it ends a micro-batch; zeros elsewhere
          run = lambda y: run_head(head_params, y, targets_M[m], mask_M[m])
          nothing = lambda y: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                           jax.eval_shape(run, y))
          sums, *grads = jax.lax.cond(last & f_valid, run, nothing, y)
          c['sums'] = tuple(a + s for a, s in zip(c['sums'], sums))
          if backward:
            d_head, d_y = grads
            c['d_head'] = pin(jax.tree.map(jnp.add, c['d_head'], d_head), layouts[1])
        c['activation'] = jax.lax.ppermute(y, 'pipe', forward_ring)
      if has_b and backward:
        b_valid = mine['b_item'] >= 0
        item = jnp.maximum(mine['b_item'], 0)
        m, r = microbatch[item], chunk[item]
        g = c['gradient']
        if with_head:  # the last chunk's backward on the last stage starts from the loss
          g = jnp.where(last & (r == R - 1), d_y.astype(g.dtype), g)
        kept = [b[mine['b_slot']] for b in c['buffer']]
        d_w, d_x = pullback(kept, chunk_weights(r), g)
        add = lambda a, d: a + jnp.where(b_valid, d, 0)
        if R == 1:
          c['d_weights'] = jax.tree.map(add, c['d_weights'], d_w)
        else:
          c['d_weights'] = jax.tree.map(
              lambda a, d: jax.lax.dynamic_update_index_in_dim(a, add(a[r], d), r, 0),
              c['d_weights'], d_w)
        c['d_weights'] = pin(c['d_weights'], layouts[0])
        into_input = first & (r == 0) & b_valid
        c['d_x'] = jax.lax.dynamic_update_index_in_dim(
            c['d_x'], jnp.where(into_input, d_x, c['d_x'][m]), m, 0)
        c['gradient'] = jax.lax.ppermute(d_x, 'pipe', backward_ring)
      return c, None
    return body

  def run(c, start: int, length: int, *flags):
    if length == 0:
      return c
    rows = {k: v[start:start + length] for k, v in table.items()}
    return jax.lax.scan(tick(*flags), c, rows)[0]

  # The ticks fall into phases (checked against the table): forwards only, until the first
  # backward; both, the head on the ticks where the last stage ends a micro-batch; backwards
  # only. Under interleaving the steady phase repeats S ticks with the head, (R−1)·S without.
  warmup = R * S - 1 if R > 1 else S - 1
  steady = R * M + S - 1 - warmup
  _check_phases(ticks, warmup, steady)
  carry = run(carry, 0, warmup, True, False, False)
  if R == 1:
    carry = run(carry, warmup, steady, True, True, True)
  else:
    periods = M // S - 1
    def period(c, start):
      c = jax.lax.scan(tick(True, True, True), c,
                       {k: jax.lax.dynamic_slice_in_dim(v, start, S) for k, v in table.items()})[0]
      rest = {k: jax.lax.dynamic_slice_in_dim(v, start + S, (R - 1) * S)
              for k, v in table.items()}
      return jax.lax.scan(tick(True, True, False), c, rest)[0], None
    carry = jax.lax.scan(period, carry, warmup + R * S * jnp.arange(periods))[0]
    carry = run(carry, warmup + periods * R * S, S, True, True, True)
  if backward:
    carry = run(carry, warmup + steady, ticks.forward.shape[0] - warmup - steady,
                False, True, False)
    grads = (jax.tree.map(lambda g, w: g[None].astype(w.dtype), carry['d_weights'], staged),
             jax.tree.map(lambda g, p: g.astype(p.dtype), carry['d_head'], head_params),
             carry['d_x'])
    return carry['sums'], grads
  return carry['sums'], None


def _check_phases(ticks, warmup: int, steady: int) -> None:
  """That the table's ticks are: `warmup` forwards only; `steady` with both, the head (the
  last stage running a micro-batch's last chunk) in the first S of every R·S; backwards
  only."""
  has_f, has_b = ticks.busy.any(1).T
  S, R = ticks.stages, ticks.repeats
  last = ticks.forward[:, -1]
  heads = (last >= 0) & (ticks.chunk[np.maximum(last, 0)] == R - 1)
  steps = np.arange(len(has_f))
  phase = np.where(steps < warmup, 0, np.where(steps < warmup + steady, 1, 2))
  want_heads = (phase == 1) & ((steps - warmup) % (R * S) < S)
  if not (np.array_equal(has_f, phase < 2) and np.array_equal(has_b, phase > 0)
          and np.array_equal(heads, want_heads)):
    raise AssertionError('the 1F1B tick table does not fall into the phases its executor runs')
