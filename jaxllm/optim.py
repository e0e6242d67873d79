"""The optimizer: AdamW with a warmup-then-decay learning-rate schedule, global-norm
clipping and no weight decay on norm scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict


def warmup_steps(cfg: ConfigDict, train_steps: int) -> int:
  """The updates a run's lr warms up over: `warmup_steps`, or all `train_steps` where the run
  is shorter (a short try of a config made for a long run), so that its last step still takes
  the peak lr."""
  return min(cfg.warmup_steps, train_steps)


def lr_schedule(cfg: ConfigDict, train_steps: int) -> optax.Schedule:
  """The lr of each update, given how many came before it (optax's count, `state.step`).

  Update s = 1, 2, … takes lr·s/W during the W = `warmup_steps` (`warmup_steps()`: shortened
  to a shorter run; update W takes the peak), then `schedule`: 'constant' stays at lr;
  'cosine' and 'linear' fall to lr·min_lr_ratio over the D = `decay_steps` updates after
  warmup (0: the rest of `train_steps`) and stay there; 'wsd' (warmup-stable-decay) holds lr
  until the last D updates (0: the last fifth of `train_steps`) and falls linearly to
  lr·min_lr_ratio on the last one."""
  lr, final, warmup = cfg.lr, cfg.lr * cfg.min_lr_ratio, warmup_steps(cfg, train_steps)
  if cfg.schedule == 'wsd':
    decay = cfg.decay_steps or max(train_steps // 5, 1)
    stable_until = max(train_steps - decay, warmup)
    after = optax.join_schedules(
        [optax.constant_schedule(lr), optax.linear_schedule(lr, final, decay)],
        [stable_until - warmup])
  else:
    decay = max(cfg.decay_steps or train_steps - warmup, 1)
    after = {'constant': lambda _: lr,
             'cosine': optax.cosine_decay_schedule(lr, decay, alpha=cfg.min_lr_ratio),
             'linear': optax.linear_schedule(lr, final, decay)}[cfg.schedule]
  by_update = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])
  return lambda count: by_update(count + 1)


def decay_mask(params):
  """Weight decay applies to weight matrices, not to norm scales (the model has no biases)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: 'scale' not in jax.tree_util.keystr(path), params)


def moments_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`tx` with its Adam moments stored in `dtype` between steps, whatever the parameters'
  dtype; each update computes in the gradients' (fp32) precision before the cast."""
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
  cast = lambda state: jax.tree.map(
      lambda s: s._replace(mu=optax.tree.cast(s.mu, dtype), nu=optax.tree.cast(s.nu, dtype))
      if is_adam(s) else s, state, is_leaf=is_adam)

  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    return updates, cast(state)

  return optax.GradientTransformation(lambda params: cast(tx.init(params)), update)


def make_optimizer(cfg: ConfigDict, train_steps: int) -> optax.GradientTransformation:
  adamw = optax.adamw(lr_schedule(cfg, train_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.clip_norm > 0:
    adamw = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return moments_in(adamw, jnp.dtype(cfg.state_dtype))
