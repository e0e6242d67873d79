"""Text generation with the KV cache: a library function and `python -m jaxllm.generate`.

    python -m jaxllm.generate (--checkpoint DIR | --hf DIR) (--prompt TEXT | --prompt_file PATH | --prompt_ids 1,2,3)
        --max_new_tokens N [--greedy | --temperature T --top_k K --top_p P] [--seed S]
        [--context N] [--mesh fsdp=2,tensor=2] [--print_ids]

The prompts (one, or a file's lines) run as one batch, left-padded to the longest; they fill
the cache in one forward pass, then tokens are decoded one at a time inside one jitted
`lax.while_loop`, until `max_new_tokens` or until every row has produced EOS.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict

from jaxllm.backends import start_backends
from jaxllm.checkpoint import params_target, restore_params, saved_config
from jaxllm.config import (ConfigError, batch_shards, context_length, default_config,
                           main_guard)
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.mesh import batch_sharding, flax_rules, make_mesh, sharding_context
from jaxllm.model import KVCache, Transformer, sequence_positions

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
  rules = default_config().sharding.rules if rules is None else rules
  _refuse_a_pipeline(mesh)
  shards = batch_shards(rules, mesh.shape)
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


# ----------------------------------------------------------------------------- command line

_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'A jaxllm checkpoint directory (its '
                                  'newest step) or one step directory in it.')
_HF = flags.DEFINE_string('hf', None, 'A Hugging Face Llama directory (config.json, '
                          'safetensors, and tokenizer.json for --prompt).')
_PROMPT = flags.DEFINE_string('prompt', None, 'The prompt text.')
_PROMPT_IDS = flags.DEFINE_string('prompt_ids', None, 'The prompt as comma-separated token ids.')
_PROMPT_FILE = flags.DEFINE_string('prompt_file', None, 'A text file of prompts, one per '
                                   'non-empty line, generated as one batch.')
_MESH = flags.DEFINE_string('mesh', None, 'Devices to split the model over, as training does: '
                            'e.g. tensor=2 or fsdp=2,tensor=2 (axes data, fsdp, tensor; the '
                            'others 1). Default: one device.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', None, 'Tokens to generate at most.')
_GREEDY = flags.DEFINE_bool('greedy', False, 'Take the likeliest token at every step.')
_TEMPERATURE = flags.DEFINE_float('temperature', None, 'Sampling temperature (default 1).')
_TOP_K = flags.DEFINE_integer('top_k', None, 'Sample from the k likeliest tokens only.')
_TOP_P = flags.DEFINE_float('top_p', None, 'Sample from the nucleus of this probability mass.')
_SEED = flags.DEFINE_integer('seed', 0, 'Random seed of the sampling.')
_CONTEXT = flags.DEFINE_integer('context', None, 'Positions the prompt and the new tokens may '
                                'fill (default: model.max_position or data.seq_len of the checkpoint, '
                                'max_position_embeddings of a Hugging Face model).')
_PRINT_IDS = flags.DEFINE_bool('print_ids', False, 'Print the new ids, comma-separated, after '
                                'the text.')
MESH_AXES = ('data', 'fsdp', 'tensor')  # a pipeline does not decode

USAGE = __doc__.split('\n\n')[1]


@dataclasses.dataclass
class Model:
  """A model to generate with, as the command line names it."""
  cfg: ConfigDict
  params: nnx.State | None   # None until read (a checkpoint's, after the prompt is checked)
  rules: ConfigDict
  tokenizer: object | None   # a jaxllm.data.tokenizer.Tokenizer; None: ids only
  context: int | None        # positions the model was made for
  context_source: str        # where that figure comes from, for errors
  eos_id: int | Sequence[int] | None


def parse_flags(argv: list[str]) -> Sampling:
  """Parses and checks the command line; returns the sampling it asks for."""
  if '--help' in argv or '-h' in argv:
    print('usage:\n' + USAGE)
    sys.exit(0)
  flags.FLAGS.unparse_flags()  # a second main() in one process starts from the defaults
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None
  if len(rest) > 1:
    raise ConfigError(f'unexpected argument {rest[1]!r}; quote a --prompt with spaces.')
  if (_CHECKPOINT.value is None) == (_HF.value is None):
    raise ConfigError('give exactly one of --checkpoint DIR (a jaxllm checkpoint) and --hf DIR '
                      '(a Hugging Face Llama directory).')
  if [_PROMPT.value, _PROMPT_IDS.value, _PROMPT_FILE.value].count(None) != 2:
    raise ConfigError('give exactly one of --prompt TEXT, --prompt_file PATH and '
                      '--prompt_ids 1,2,3.')
  if _MAX_NEW_TOKENS.value is None or _MAX_NEW_TOKENS.value < 1:
    raise ConfigError(f'--max_new_tokens={_MAX_NEW_TOKENS.value}: give the number of tokens '
                      'to generate, at least 1.')
  if _CONTEXT.value is not None and _CONTEXT.value < 1:
    raise ConfigError(f'--context={_CONTEXT.value} must be at least 1.')
  if not -2**63 <= _SEED.value < 2**63:  # what a JAX key is made from
    raise ConfigError(f'--seed={_SEED.value} must fit in 64 bits, e.g. 0.')
  chosen = [f'--{f.name}' for f in (_TEMPERATURE, _TOP_K, _TOP_P) if f.value is not None]
  if _GREEDY.value and chosen:
    raise ConfigError(f'--greedy takes the likeliest token, so {", ".join(chosen)} would be '
                      'ignored; give one or the other.')
  sampling = Sampling(_GREEDY.value, 1.0 if _TEMPERATURE.value is None else _TEMPERATURE.value,
                      _TOP_K.value, 1.0 if _TOP_P.value is None else _TOP_P.value)
  sampling.check()
  return sampling


def open_checkpoint(path: str) -> Model:
  """A jaxllm checkpoint's saved config and tokenizer; its parameters are read later."""
  cfg = saved_config(path, '--checkpoint')
  tokenizer = load_tokenizer(cfg.data)
  source = 'model.max_position' if cfg.model.max_position else 'data.seq_len'
  return Model(cfg.model, None, cfg.sharding.rules, tokenizer, context_length(cfg),
               f"{source} of the checkpoint's config", tokenizer.eos_id)


def load_hf(path: str, mesh: jax.sharding.Mesh) -> Model:
  """A Hugging Face Llama directory, with its tokenizer.json if it has one."""
  if not os.path.isdir(path):
    raise ConfigError(f'--hf={path!r} is not a directory; give a Hugging Face Llama directory '
                      '(config.json and *.safetensors).')
  from jaxllm import hf  # only this path needs the converter
  rules = default_config().sharding.rules
  model_cfg, params = hf.load(path, mesh, rules)
  config_path = os.path.join(path, 'config.json')
  with open(config_path) as f:
    hf_config = json.load(f)
  has_tokenizer = os.path.isfile(os.path.join(path, 'tokenizer.json'))
  tokenizer = load_tokenizer(ConfigDict(dict(tokenizer=path))) if has_tokenizer else None
  return Model(model_cfg, params, rules, tokenizer, hf_config.get('max_position_embeddings'),
               f'max_position_embeddings in {config_path}',
               tokenizer.eos_id if tokenizer else hf_config.get('eos_token_id'))


def parse_mesh(text: str | None) -> dict[str, int]:
  """--mesh as axis sizes: 'fsdp=2,tensor=2' -> data=1, fsdp=2, pipe=1, tensor=2."""
  shape = dict(data=1, fsdp=1, pipe=1, tensor=1)
  for part in (text or '').split(','):
    if not part.strip():
      continue
    name, _, size = part.partition('=')
    name = name.strip()
    if name == 'pipe':
      raise ConfigError(f'--mesh={text}: generation runs without a pipeline; split over '
                        f'{", ".join(MESH_AXES)} instead.')
    if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(f'--mesh={text}: give axis=size pairs with sizes of at least 1, e.g. '
                        f'--mesh=fsdp=2,tensor=2 (axes: {", ".join(MESH_AXES)}).')
    shape[name] = int(size)
  return shape


def mesh_devices(shape: dict[str, int], text: str) -> list:
  """The first devices, as many as the mesh `text` (--mesh) needs (on a CPU, the simulated
  ones made for it)."""
  count = math.prod(shape.values())
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(f'--mesh={text} needs {count} devices, but {len(devices)} '
                      f'{devices[0].platform} device(s) are present; use a smaller mesh.')
  return devices[:count]


def prompt_texts() -> list[tuple[str, str]]:
  """(text, what to call it in errors) of --prompt, or of each non-empty line of --prompt_file."""
  if _PROMPT_FILE.value is None:
    return [(_PROMPT.value, '--prompt')]
  try:
    with open(_PROMPT_FILE.value, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f'--prompt_file={_PROMPT_FILE.value!r} cannot be read '
                      f'({getattr(e, "strerror", None) or e}); give a UTF-8 text file.') from None
  prompts = [(line, f'--prompt_file line {i}') for i, line in enumerate(lines, 1) if line.strip()]
  if not prompts:
    raise ConfigError(f'--prompt_file={_PROMPT_FILE.value!r} has no prompts; write one per line.')
  return prompts


def encode_prompts(model: Model) -> list[tuple[list[int], str]]:
  """Each prompt's ids and what to call it: --prompt_ids, or each text through the model's
  tokenizer (its BOS kept, the EOS it ends documents with dropped: the text goes on)."""
  if _PROMPT_IDS.value is not None:
    try:
      return [([int(i) for i in _PROMPT_IDS.value.split(',')], '--prompt_ids')]
    except ValueError:
      raise ConfigError(f'--prompt_ids={_PROMPT_IDS.value!r}: give comma-separated integers, '
                        'e.g. --prompt_ids=256,100,101.') from None
  if model.tokenizer is None:
    raise ConfigError(f'--prompt needs a tokenizer, and {_HF.value} has no tokenizer.json; '
                      'add one or give --prompt_ids.')
  encoded = []
  for text, name in prompt_texts():
    ids = model.tokenizer.encode(text).tolist()
    if ids and ids[-1] == model.tokenizer.eos_id:
      ids = ids[:-1]
    if not ids:
      raise ConfigError(f'{name} is empty and the tokenizer adds no BOS; give some text.')
    encoded.append((ids, name))
  return encoded


def check_fits(model: Model, prompt: list[int], name: str) -> None:
  """The prompt's ids are in the vocabulary and the prompt plus the new tokens fit the context."""
  outside = [i for i in prompt if not 0 <= i < model.cfg.vocab_size]
  if outside:
    raise ConfigError(f'{name}: token id {outside[0]} is outside the vocabulary '
                      f'[0, {model.cfg.vocab_size}) of the model; give ids below '
                      f'{model.cfg.vocab_size}.')
  context, source = ((_CONTEXT.value, '--context') if _CONTEXT.value is not None
                     else (model.context, model.context_source))
  if context is None:
    raise ConfigError(f'the model gives no context length ({model.context_source} is '
                      'missing); pass --context N.')
  need = len(prompt) + _MAX_NEW_TOKENS.value
  if need > context:
    raise ConfigError(f'{name} is {len(prompt)} tokens and --max_new_tokens='
                      f'{_MAX_NEW_TOKENS.value}: {need} positions, more than the context of '
                      f'{context} ({source}); shorten the prompt, lower --max_new_tokens or '
                      'pass --context N.')


def main(argv: list[str]) -> None:
  sampling = parse_flags(argv)
  shape = parse_mesh(_MESH.value)
  count = math.prod(shape.values())  # on a CPU, simulated devices are made for the mesh
  start_backends(ConfigDict(dict(cpu_devices=count if count > 1 else 0, xla_flags='')))
  # Orbax notes on stderr that it opens checkpoints read-only, as this command always does.
  absl_logging.set_verbosity(absl_logging.ERROR)
  mesh = make_mesh(shape, mesh_devices(shape, _MESH.value))
  model = open_checkpoint(_CHECKPOINT.value) if _CHECKPOINT.value else load_hf(_HF.value, mesh)
  prompts = encode_prompts(model)
  for ids, name in prompts:  # before a checkpoint's parameters are read: bad input fails fast
    check_fits(model, ids, name)
  if model.params is None:
    model.params = restore_params(_CHECKPOINT.value,
                                  params_target(model.cfg, mesh, model.rules), model.cfg,
                                  '--checkpoint')
  new_ids = generate(model.cfg, model.params, [ids for ids, _ in prompts],
                     _MAX_NEW_TOKENS.value, greedy=sampling.greedy,
                     temperature=sampling.temperature, top_k=sampling.top_k,
                     top_p=sampling.top_p, eos_id=model.eos_id, rng=_SEED.value, mesh=mesh,
                     rules=model.rules)
  for i, ((prompt, _), new) in enumerate(zip(prompts, new_ids), 1):
    if len(prompts) > 1:
      print(f'--- prompt {i} of {len(prompts)}')
    if model.tokenizer is not None:
      print(model.tokenizer.decode(prompt + new))
    if _PRINT_IDS.value:
      print(','.join(map(str, new)))


def cli() -> None:
  """The `jaxllm-generate` command (pyproject's console script): `python -m jaxllm.generate`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
