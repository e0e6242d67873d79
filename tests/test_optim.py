"""The learning-rate schedules against their formulas, and the objective options."""

import math

import jax
import numpy as np
import pytest

from conftest import leaf_paths, paired_leaves, small_config
from jaxllm.config import default_config
from jaxllm.optim import lr_schedule
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


def test_the_first_update_moves_the_params_during_warmup():
  """Step 1 of a warmup applies lr/warmup_steps, not 0 (every weight matrix moves), and the
  log shows that lr."""
  cfg = small_config()
  cfg.optim.update(lr=1e-2, warmup_steps=10)
  cfg.train.steps = 1
  initial = jax.device_get(setup(cfg, jax.devices()[:1]).state.params)
  state, history = train(cfg, None, jax.devices()[:1])
  assert history[0]['lr'] == pytest.approx(1e-3)
  pairs = paired_leaves(jax.device_get(state.params), initial)
  for path, (got, want) in zip(leaf_paths(initial), pairs, strict=True):
    if 'scale' not in path:
      assert np.mean(got != want) > 0.9, path


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
