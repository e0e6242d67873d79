"""The learning-rate schedules against their formulas, and the objective options."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import leaf_paths, paired_leaves, small_config
from jaxllm.config import default_config
from jaxllm.optim import decay_mask, lr_schedule
from jaxllm.parallel.mesh import sharding_context
from jaxllm.step import loss_terms
from jaxllm.train import setup, train

LR, FINAL = 2.0, 0.2  # peak and lr·min_lr_ratio


def _cosine(t, length):
  return FINAL + (LR - FINAL) * 0.5 * (1 + math.cos(math.pi * min(t / length, 1)))


def _linear(t, length):
  return LR + (FINAL - LR) * min(t / length, 1)


# schedule, warmup W, decay_steps, train steps -> lr of update s = 1, 2, … (written out)
SCHEDULES = {
    'cosine': ('cosine', 2, 0, 10, lambda s: LR * s / 2 if s <= 2 else _cosine(s - 2, 8)),
    'cosine_then_flat': ('cosine', 2, 4, 10, lambda s: LR * s / 2 if s <= 2 else _cosine(s - 2, 4)),
    'cosine_no_warmup': ('cosine', 0, 0, 5, lambda s: _cosine(s, 5)),
    'linear': ('linear', 3, 0, 9, lambda s: LR * s / 3 if s <= 3 else _linear(s - 3, 6)),
    'constant': ('constant', 4, 0, 8, lambda s: LR * s / 4 if s <= 4 else LR),
    'wsd': ('wsd', 2, 3, 10, lambda s: LR * s / 2 if s <= 2 else LR if s <= 7 else
            _linear(s - 7, 3)),
    'wsd_last_fifth': ('wsd', 1, 0, 10, lambda s: LR if s <= 8 else _linear(s - 8, 2)),
    # a warmup longer than the run is shortened to it: the last step takes the peak
    'warmup_past_the_run': ('cosine', 20, 0, 10, lambda s: LR * s / 10 if s <= 10 else FINAL),
    'constant_warmup_past_the_run': ('constant', 8, 0, 4, lambda s: LR * s / 4 if s <= 4 else LR),
}


@pytest.mark.parametrize('schedule, warmup, decay, steps, want', SCHEDULES.values(),
                         ids=SCHEDULES.keys())
def test_schedule_gives_each_update_its_lr(schedule, warmup, decay, steps, want):
  """Update s (count s - 1 before it) takes lr·s/W in warmup, the peak at W, and reaches the
  final lr on the last update of its decay; past train.steps it stays there."""
  cfg = default_config().optim
  cfg.update(lr=LR, min_lr_ratio=FINAL / LR, schedule=schedule, warmup_steps=warmup,
             decay_steps=decay)
  lr = lr_schedule(cfg, steps)
  got = [float(lr(s - 1)) for s in range(1, steps + 3)]
  np.testing.assert_allclose(got, [want(s) for s in range(1, steps + 3)], rtol=1e-6)


@pytest.mark.slow
def test_the_first_update_moves_the_params_during_warmup():
  """Step 1 of a warmup applies lr/warmup_steps, not 0 (every weight matrix moves), and the
  log shows that lr."""
  cfg = small_config()
  cfg.optim.update(lr=1e-2, warmup_steps=10)
  cfg.train.steps = 10
  run = setup(cfg, jax.devices()[:1])
  initial = jax.device_get(run.state.params)
  with sharding_context(run.mesh, run.layout.rules):
    state, row = run.train_step(run.state, next(run.batches))
  assert float(row['lr']) == pytest.approx(1e-3)
  pairs = paired_leaves(jax.device_get(state.params), initial)
  for path, (got, want) in zip(leaf_paths(initial), pairs, strict=True):
    if 'scale' not in path:
      assert np.mean(got != want) > 0.9, path


@pytest.mark.slow
def test_z_loss_reaches_the_gradients_not_the_logged_loss():
  """optim.z_loss > 0: the first step's logged loss is the same cross-entropy (same initial
  params), its gradients are not (the z term's are added)."""
  rows = {}
  for z_loss in (0.0, 1.0):
    cfg = small_config()
    cfg.optim.z_loss = z_loss
    cfg.train.steps = 1
    rows[z_loss] = train(cfg, None, jax.devices()[:1])[1][0]
  assert rows[1.0]['loss'] == pytest.approx(rows[0.0]['loss'], rel=1e-6)
  assert abs(rows[1.0]['grad_norm'] / rows[0.0]['grad_norm'] - 1) > 0.01


@pytest.mark.slow
def test_a_skipped_step_advances_the_schedule_not_adam():
  """train.skip_nonfinite: after a skipped step the next update is the one a run without it
  makes at the lr the log shows: Adam's bias correction counts updates taken (its count stays),
  the schedule counts steps (its count advances with state.step)."""
  cfg = small_config()
  cfg.optim.update(lr=1e-2, schedule='linear', min_lr_ratio=0.5, weight_decay=0.1)
  cfg.train.update(steps=3, skip_nonfinite=True)
  run = setup(cfg, jax.devices()[:1])
  good = next(run.batches)
  bad = dict(good, mask=jnp.full(good['mask'].shape, jnp.nan))  # loss and gradients NaN
  with sharding_context(run.mesh, run.layout.rules):
    state, row = run.train_step(run.state, good)
    after_one = jax.device_get(state)
    state, row = run.train_step(state, bad)
    assert not row['finite']
    state, row = run.train_step(state, good)
    grads, (_, tokens, _) = jax.jit(jax.grad(lambda p: loss_terms(run.graphdef, p, good),
                                             has_aux=True))(after_one.params)
  assert row['finite'] and float(row['lr']) == pytest.approx(float(lr_schedule(cfg.optim, 3)(2)))

  # The reference: optax's AdamW by hand, from the state after step 1, one update taken.
  optim = cfg.optim
  grads = jax.tree.map(lambda g: g / tokens, grads)
  adam = next(s for s in jax.tree.leaves(after_one.opt_state, is_leaf=_is_adam) if _is_adam(s))
  assert int(adam.count) == 1
  tx = optax.chain(optax.clip_by_global_norm(optim.clip_norm),
                   optax.adamw(float(row['lr']), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                               weight_decay=optim.weight_decay, mask=decay_mask))
  tx_state = jax.jit(tx.init)(after_one.params)
  tx_state = (tx_state[0], (adam, *tx_state[1][1:]))
  updates, _ = jax.jit(tx.update)(grads, tx_state, after_one.params)
  got = jax.device_get(state)
  moved = [(np.asarray(p3) - np.asarray(p1), np.asarray(u)) for (p3, p1), u in zip(
      paired_leaves(got.params, after_one.params), jax.tree.leaves(updates), strict=True)]
  ratio = (math.sqrt(sum(np.sum(m * m) for m, _ in moved))
           / math.sqrt(sum(np.sum(u * u) for _, u in moved)))
  assert ratio == pytest.approx(1, abs=1e-4), f'step 3 moved the params {ratio:.4f}× as far'
  for m, u in moved:
    np.testing.assert_allclose(m, u, rtol=1e-3, atol=1e-7)
  counts = {type(s).__name__: int(s.count)
            for s in jax.tree.leaves(got.opt_state, is_leaf=_is_count) if _is_count(s)}
  assert counts == {'ScaleByAdamState': 2, 'ScaleByScheduleState': 3} and int(got.step) == 3


def _is_adam(s):
  return isinstance(s, optax.ScaleByAdamState)


def _is_count(s):
  return isinstance(s, (optax.ScaleByAdamState, optax.ScaleByScheduleState))
