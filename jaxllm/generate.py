"""`python -m jaxllm.generate`: text from a checkpoint or a Hugging Face checkpoint directory.

    python -m jaxllm.generate (--checkpoint DIR | --hf DIR) (--prompt TEXT | --prompt_file PATH | --prompt_ids 1,2,3)
        --max_new_tokens N [--greedy | --temperature T --top_k K --top_p P] [--seed S]
        [--context N] [--mesh fsdp=2,tensor=2] [--print_ids]

The prompts (one, or a file's lines) run as one batch through `jaxllm.decode.generate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Sequence

import jax
from absl import flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict

from jaxllm.backends import start_backends
from jaxllm.checkpoint import (params_target, restore_params, restore_router_bias,
                               router_bias_target, saved_config)
from jaxllm.cli import main_guard
from jaxllm.config import MESH_AXES, ConfigError, context_length, default_config
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.decode import Sampling, generate
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import derive

_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'A jaxllm checkpoint directory (its '
                                  'newest step) or one step directory in it.')
_HF = flags.DEFINE_string('hf', None, 'A Hugging Face checkpoint directory (config.json, '
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
DECODE_AXES = tuple(a for a in MESH_AXES if a != 'pipe')  # a pipeline does not decode

USAGE = __doc__.split('\n\n')[1]


@dataclasses.dataclass
class Model:
  """A model to generate with, as the command line names it."""
  cfg: ConfigDict
  params: nnx.State | None   # None until read (a checkpoint's, after the prompt is checked)
  rules: ConfigDict          # sharding.rules as configured (`derive` applies them to a mesh)
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
                      '(a Hugging Face checkpoint directory).')
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
  """A Hugging Face checkpoint directory, with its tokenizer.json if it has one."""
  if not os.path.isdir(path):
    raise ConfigError(f'--hf={path!r} is not a directory; give a Hugging Face checkpoint '
                      'directory (config.json and *.safetensors).')
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
                        f'{", ".join(DECODE_AXES)} instead.')
    if name not in DECODE_AXES or not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(f'--mesh={text}: give axis=size pairs with sizes of at least 1, e.g. '
                        f'--mesh=fsdp=2,tensor=2 (axes: {", ".join(DECODE_AXES)}).')
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
    rules = derive(model.rules, mesh.shape, model.cfg).rules
    model.params = restore_params(_CHECKPOINT.value, params_target(model.cfg, mesh, rules),
                                  model.cfg, '--checkpoint')
    biases = router_bias_target(model.cfg, mesh, rules)
    if biases is not None:  # sigmoid routers choose experts by them
      model.params = nnx.merge_state(model.params, restore_router_bias(
          _CHECKPOINT.value, biases, model.cfg, '--checkpoint'))
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
