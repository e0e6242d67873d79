"""A Hugging Face `config.json` (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3: `families`; Mixtral,
Qwen3-MoE: `experts`) and jaxllm's `model` config section, each from the other."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
from ml_collections import ConfigDict

from jaxllm.checkpoint import MOE_SHAPE_FIELDS, SHAPE_FIELDS
from jaxllm.config import ConfigError, default_config
from jaxllm.hf.experts import (EXPERT_FAMILIES, check_experts_supported, expert_family,
                               moe_fields, moe_json)
from jaxllm.hf.families import FAMILIES, block_fields, check_supported, family_json, family_of

CONFIG_FILE = 'config.json'
# Fields that change what the model computes beyond its parameters' shapes: a run must have
# the checkpoint's, or its weights would mean something else.
ARCHITECTURE_FIELDS = ('mlp_activation', 'norm_zero_centered', 'scale_embeddings')
# Fields that change the model's function but not what its weights mean: a run may differ on
# purpose (a longer context, another window).
BEHAVIOUR_FIELDS = ('rope_theta', 'rope_scaling', 'norm_eps', 'attention_scale', 'layer_types',
                    'sliding_window', 'sliding_rope_theta')


def read_hf_config(path: str) -> dict:
  """config.json of a checkpoint directory of a supported family; ConfigError for anything
  else."""
  if not os.path.isdir(path):
    raise ConfigError(f'{path!r} is not a directory; give a Hugging Face checkpoint directory '
                      '(config.json and *.safetensors, as save_pretrained writes it).')
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise ConfigError(f'{config_path} does not exist; give the directory save_pretrained wrote '
                      '(it holds config.json beside the *.safetensors files).')
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'{config_path} could not be read as JSON ({e}); fix or re-save it.'
                      ) from None
  kind = check_supported(hf, config_path)
  if kind in EXPERT_FAMILIES:
    check_experts_supported(hf, kind, config_path)
  return hf


def _required(hf: dict, key: str, path: str):
  if hf.get(key) is None:
    raise ConfigError(f'{os.path.join(path, CONFIG_FILE)} has no {key!r}; add it (see the '
                      "model's original config.json).")
  return hf[key]


def model_config(path: str) -> ConfigDict:
  """jaxllm's `model` config section for the checkpoint at `path`: the defaults, with every
  field the checkpoint decides set from its config.json (what its family adds to the Llama
  block included: `families.block_fields`). A bfloat16 checkpoint computes in bfloat16
  (cuDNN's fused attention when JAX runs on GPUs), any other in float32; the master weights
  are float32 either way, so that fine-tuning's small updates are not rounded away."""
  hf = read_hf_config(path)
  req = lambda key: _required(hf, key, path)
  heads, layers = int(req('num_attention_heads')), int(req('num_hidden_layers'))
  head_dim = int(hf.get('head_dim') or req('hidden_size') // heads)
  stored = hf.get('torch_dtype') or hf.get('dtype') or 'float32'
  dtype = 'bfloat16' if stored == 'bfloat16' else 'float32'
  block = block_fields(hf, hf['model_type'], head_dim, os.path.join(path, CONFIG_FILE))
  scaling = block.pop('rope_scaling')
  cfg = default_config().model
  cfg.update(
      vocab_size=int(req('vocab_size')),
      embed_dim=int(req('hidden_size')),
      num_layers=layers,
      num_heads=heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or heads),
      head_dim=head_dim,
      mlp_dim=int(req('intermediate_size')),
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),  # transformers' default
      tie_embeddings=bool(hf.get('tie_word_embeddings', hf['model_type'] == 'gemma3_text')),
      max_position=int(hf.get('max_position_embeddings') or 0),
      param_dtype='float32',
      dtype=dtype,
      attention='cudnn' if dtype == 'bfloat16' else 'xla',
      **block)
  cfg.rope_scaling.update(scaling)
  if hf['model_type'] in EXPERT_FAMILIES:
    cfg.moe.update(moe_fields(hf, hf['model_type'], os.path.join(path, CONFIG_FILE)))
  return cfg


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """What config.json says of the tokenizer: its begin- and end-of-text ids (None: it has none)."""
  bos_id: int | None = None
  eos_id: int | None = None


def hf_config(model_cfg: ConfigDict, dtype: str, vocabulary: Vocabulary) -> dict:
  """config.json of the causal LM of `model_cfg`'s family (`families.family_of`; with experts,
  `experts.expert_family`), stored in `dtype`. `model_cfg.max_position` must be set:
  transformers takes 2048 for a config without it."""
  m = model_cfg
  kind = family_of(m)
  experts = expert_family(m)
  if experts:  # the MoE family's attention is that of a block family: Mixtral's Llama's
    block_kind = EXPERT_FAMILIES[experts].block_family
    if kind != block_kind:
      raise ConfigError(f'model.moe.experts={m.moe.experts} with the block of a {kind} model: '
                        f'{FAMILIES[experts]} has the block of {FAMILIES[block_kind]}; no '
                        'Hugging Face architecture computes this model.')
    extra = {k: v for k, v in family_json(m, kind).items()
             if k not in ('attention_bias', 'mlp_bias') or experts != 'mixtral'}
    extra.update(moe_json(m, experts))
    kind = experts
  else:
    extra = family_json(m, kind)
  return dict(architectures=[FAMILIES[kind]], model_type=kind, vocab_size=m.vocab_size,
              hidden_size=m.embed_dim, intermediate_size=m.mlp_dim,
              num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
              num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.norm_eps,
              tie_word_embeddings=m.tie_embeddings, torch_dtype=dtype,
              max_position_embeddings=m.max_position, bos_token_id=vocabulary.bos_id,
              eos_token_id=vocabulary.eos_id, **extra)


def check_model_matches(path: str, model_cfg: ConfigDict) -> None:
  """The run's `model_cfg` must have the checkpoint's shapes and architecture (ConfigError
  naming the field); a different RoPE, norm epsilon or window is allowed (e.g. a longer
  context) but noted."""
  hf_cfg = model_config(path)
  fields = [(f, hf_cfg[f], model_cfg[f]) for f in SHAPE_FIELDS + ARCHITECTURE_FIELDS
            if f != 'param_dtype']  # tensors are converted to the run's storage dtype
  # The router's weighting too: the same weights routed otherwise compute another model.
  fields += [(f'moe.{f}', hf_cfg.moe[f], model_cfg.moe[f])
             for f in MOE_SHAPE_FIELDS + ('top_k', 'renormalize', 'route_scale')]
  for field, there, here in fields:
    if there != here:
      raise ConfigError(
          f'model.{field}={here!r} but the Hugging Face checkpoint {path} has '
          f'{field}={there!r}; set model.{field}={there!r}, or build the model '
          'section with jaxllm.hf.model_config (see the README).')
  plain = lambda v: v.to_dict() if isinstance(v, ConfigDict) else v
  for field in BEHAVIOUR_FIELDS:
    if hf_cfg[field] != model_cfg[field] and jax.process_index() == 0:
      print(f'note: model.{field} differs from the Hugging Face checkpoint {path} '
            f'({plain(model_cfg[field])} here, {plain(hf_cfg[field])} there).', file=sys.stderr)
