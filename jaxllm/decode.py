"""Text generation with the KV cache, in code: `generate(model_cfg, params, prompts, ...)`.

The prompts run as one batch, left-padded to the longest; they fill the cache in one forward
pass, then tokens are decoded one at a time inside one jitted `lax.while_loop`, until
`max_new_tokens` or until every row has produced EOS. The command is `jaxllm.generate`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from jaxllm.config import ConfigError, default_config
from jaxllm.model import KVCache, Transformer, sequence_positions, with_available_attention
from jaxllm.parallel.mesh import batch_sharding, flax_rules, make_mesh, sharding_context
from jaxllm.parallel.rules import derive

# Written into the output after a row's EOS, and cut off before the ids are returned.
_DONE = -1


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is picked: the argmax (`greedy`), or a draw at `temperature` from the
  `top_k` likeliest tokens (None: all), cut further to the nucleus of mass `top_p`."""
  greedy: bool = False
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float = 1.0

  def check(self) -> None:
    if not 0 < self.temperature < math.inf:  # inf would divide every logit to 0: uniform
      raise ConfigError(f'temperature={self.temperature} must be a positive number; use --greedy '
                        '(greedy=True) for the most likely token.')
    if self.top_k is not None and self.top_k < 1:
      raise ConfigError(f'top_k={self.top_k} must be at least 1; leave it out to sample from '
                        'the whole vocabulary.')
    if not 0 < self.top_p <= 1:
      raise ConfigError(f'top_p={self.top_p} must be in (0, 1]; e.g. 0.9, or 1 for no '
                        'nucleus cut.')


def nucleus(sorted_logits_BK, top_p: float):
  """Logits sorted in descending order, with those outside the nucleus set to -inf: the
  nucleus is the fewest likeliest tokens whose probabilities sum to `top_p` (at least one)."""
  probs_BK = jax.nn.softmax(sorted_logits_BK, axis=-1)
  mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
  return jnp.where(mass_before_BK < top_p, sorted_logits_BK, -jnp.inf)


def sample_next(logits_BV, rng, sampling: Sampling):
  """The next token [B] of each row from its logits [B, V]."""
  if sampling.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_k is None and sampling.top_p >= 1:
    return jax.random.categorical(rng, logits_BV).astype(jnp.int32)
  # The candidates in descending order (the top k, else all), so the nucleus is a prefix.
  k = min(sampling.top_k or logits_BV.shape[-1], logits_BV.shape[-1])
  top_logits_BK, top_ids_BK = jax.lax.top_k(logits_BV, k)
  if sampling.top_p < 1:
    top_logits_BK = nucleus(top_logits_BK, sampling.top_p)
  choice_B = jax.random.categorical(rng, top_logits_BK)
  return jnp.take_along_axis(top_ids_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new_tokens', 'sampling',
                                             'eos_ids', 'rules'))
def _decode(graphdef, params, prompt_BP, start_B, rng, *, max_new_tokens: int,
            sampling: Sampling, eos_ids: tuple[int, ...], rules: tuple):
  """[B, max_new_tokens] new ids; after a row's EOS, `_DONE`. Row b's prompt is left-padded:
  it starts at column `start_B[b]`. The rules are an argument so that a call under other
  rules compiles anew."""
  with nnx.logical_axis_rules(rules):
    model = nnx.merge(graphdef, params)
    B, P = prompt_BP.shape
    # The last new token is never fed back, so it needs no slot.
    cache = KVCache.empty(model.cfg, B, P + max_new_tokens - 1, start_B)

    def next_token(tokens_BT, cache, step):
      # Positions count from each row's first token, as they would alone (RoPE sees only
      # their differences, but the rounding would differ); the padding before it (never
      # attended to) sits at position 0.
      slots_BT = cache.length + sequence_positions(tokens_BT)
      positions_BT = jnp.maximum(slots_BT - cache.start_B[:, None], 0)
      x_BTD, cache = model.layers(model.embed(tokens_BT), positions_BT, cache=cache)
      logits_BV = model.logits(x_BTD[:, -1:])[:, 0]
      return sample_next(logits_BV, jax.random.fold_in(rng, step), sampling), cache

    is_eos = lambda t_B: jnp.isin(t_B, jnp.asarray(eos_ids, jnp.int32))
    token_B, cache = next_token(prompt_BP, cache, 0)  # the prefill: the whole prompt at once
    out_BN = jnp.full((B, max_new_tokens), _DONE, jnp.int32).at[:, 0].set(token_B)

    def unfinished(carry):
      step, _, _, done_B = carry
      return (step < max_new_tokens) & ~jnp.all(done_B)

    def decode_one(carry):
      step, out_BN, cache, done_B = carry
      last_B1 = jax.lax.dynamic_slice_in_dim(out_BN, step - 1, 1, axis=1)
      token_B, cache = next_token(last_B1, cache, step)
      token_B = jnp.where(done_B, _DONE, token_B)
      out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, token_B[:, None], step, axis=1)
      return step + 1, out_BN, cache, done_B | is_eos(token_B)

    _, out_BN, _, _ = jax.lax.while_loop(unfinished, decode_one,
                                         (jnp.int32(1), out_BN, cache, is_eos(token_B)))
  return out_BN


def _mesh_of(params) -> jax.sharding.Mesh:
  """The mesh the parameters live on (one device when they carry no mesh)."""
  leaf = jax.tree.leaves(params)[0]
  sharding = getattr(leaf, 'sharding', None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding.mesh
  device = next(iter(sharding.device_set)) if sharding is not None else jax.devices()[0]
  return make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), [device])


def _prompt_rows(prompt_ids) -> tuple[list[list[int]], bool]:
  """The prompts as lists of ids, and whether one prompt (a flat list) was given."""
  rows = np.asarray(prompt_ids).tolist() if hasattr(prompt_ids, 'shape') else list(prompt_ids)
  is_id = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)
  if rows and all(is_id(i) for i in rows):
    return [[int(i) for i in rows]], True
  if not rows or not all(isinstance(row, (list, tuple)) and all(is_id(i) for i in row)
                         for row in rows):
    raise ConfigError('prompt_ids: give a list of ids, or a list of prompts (lists of ids).')
  return [[int(i) for i in row] for row in rows], False


def _check_prompts(rows: list[list[int]], vocab_size: int, max_new_tokens: int) -> None:
  for b, row in enumerate(rows):
    if not row:
      raise ConfigError(f'prompt_ids: prompt {b} is empty; every prompt needs a token '
                        '(e.g. BOS).')
    outside = [i for i in row if not 0 <= i < vocab_size]
    if outside:
      raise ConfigError(f'prompt_ids: token id {outside[0]} is outside the vocabulary '
                        f'[0, {vocab_size}) of the model; give ids below model.vocab_size.')
  if max_new_tokens < 1:
    raise ConfigError(f'max_new_tokens={max_new_tokens} must be at least 1.')


def _refuse_a_pipeline(mesh: jax.sharding.Mesh) -> None:
  if mesh.shape['pipe'] > 1:
    raise ConfigError(f'mesh pipe={mesh.shape["pipe"]}: generation runs without a pipeline; '
                      'use a mesh with pipe=1 (put the devices on data, fsdp or tensor).')


def generate(model_cfg: ConfigDict, params: nnx.State, prompt_ids, max_new_tokens: int, *,
             greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None,
             rng: jax.Array | int = 0, mesh: jax.sharding.Mesh | None = None,
             rules=None) -> list[int] | list[list[int]]:
  """New token ids after the prompt: up to `max_new_tokens`, ending at (and with) `eos_id`.

  `prompt_ids`: one prompt (a list of ids) or several, of any lengths (a list of lists, or an
  array [B, P]); the result is a list of ids, or a list per prompt. The prompts run as one
  batch, left-padded to the longest; each row computes what it would alone. `greedy` takes the
  likeliest token; otherwise tokens are drawn at `temperature`, from the `top_k` likeliest
  (None: all), within the nucleus of mass `top_p`. `rng`: a key or an int seed. Runs on `mesh`
  (default: the one `params` live on; its pipe axis must be 1) under the logical `rules`
  (default: `default_config()`'s), the batch split over the rules' batch axes (padded with
  copies of the first prompt to a multiple of their size). Raises ConfigError on bad input.
  """
  sampling = Sampling(greedy, temperature, top_k, top_p)
  sampling.check()
  rows, one_prompt = _prompt_rows(prompt_ids)
  _check_prompts(rows, model_cfg.vocab_size, max_new_tokens)
  mesh = _mesh_of(params) if mesh is None else mesh
  _refuse_a_pipeline(mesh)
  layout = derive(default_config().sharding.rules if rules is None else rules, mesh.shape,
                  model_cfg)
  rules, shards = layout.rules, layout.batch_shards
  model_cfg = with_available_attention(model_cfg, mesh.devices.flat[0].platform)
  if model_cfg.get('fp8', 'none') != 'none':  # a training recipe: generation takes `dtype`
    model_cfg = copy.deepcopy(model_cfg)
    model_cfg.fp8 = 'none'
  count = len(rows)
  rows += [rows[0]] * (-count % shards)
  P = max(len(row) for row in rows)
  start_B = np.array([P - len(row) for row in rows], np.int32)
  prompt_BP = np.array([[0] * (P - len(row)) + row for row in rows], np.int32)
  eos_ids = () if eos_id is None else tuple(np.atleast_1d(eos_id).astype(int).tolist())
  rng = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else rng
  with sharding_context(mesh, rules):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    prompt_BP = jax.device_put(prompt_BP, batch_sharding(mesh, rules, 2))
    start_B = jax.device_put(start_B, batch_sharding(mesh, rules, 1))
    out_BN = _decode(graphdef, params, prompt_BP, start_B, rng,
                     max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids,
                     rules=flax_rules(rules))
  new = [[int(t) for t in row if t != _DONE] for row in np.asarray(out_BN)[:count]]
  return new[0] if one_prompt else new
