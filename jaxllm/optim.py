"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from ml_collections import ConfigDict


def lr_schedule(cfg: ConfigDict, train_steps: int) -> optax.Schedule:
  decay_steps = cfg.decay_steps or train_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(decay_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio)


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
