"""A Hugging Face Llama (or Mixtral, Qwen3-MoE: `experts`) `config.json` and jaxllm's `model`
config section, each from the other."""

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

CONFIG_FILE = 'config.json'
# Fields that change the model's function but not its shapes: a run may differ on purpose.
BEHAVIOUR_FIELDS = ('rope_theta', 'rope_scaling', 'norm_eps')


def read_hf_config(path: str) -> dict:
  """config.json of a Llama, Mixtral or Qwen3-MoE checkpoint directory; ConfigError for
  anything else."""
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
  kind = hf.get('model_type')
  supported = {'llama': 'LlamaForCausalLM',
               **{k: names.architecture for k, names in EXPERT_FAMILIES.items()}}
  architectures = hf.get('architectures') or [supported.get(kind)]
  if kind not in supported or supported[kind] not in architectures:
    raise ConfigError(f'{config_path}: model_type={kind!r}, architectures={architectures} is '
                      'not supported; jaxllm reads '
                      f'{", ".join(f"{a} ({k})" for k, a in supported.items())} checkpoints.')
  if kind in EXPERT_FAMILIES:
    check_experts_supported(hf, kind, config_path)
  for key, supported in (('hidden_act', 'silu'), ('attention_bias', False), ('mlp_bias', False)):
    if hf.get(key, supported) != supported:
      raise ConfigError(f'{config_path}: {key}={hf[key]!r} is not supported; jaxllm\'s Llama '
                        f'needs {key}={supported!r}.')
  return hf


def _required(hf: dict, key: str, path: str):
  if hf.get(key) is None:
    raise ConfigError(f'{os.path.join(path, CONFIG_FILE)} has no {key!r}; add it (see the '
                      "model's original config.json).")
  return hf[key]


def _rope(hf: dict, path: str) -> tuple[float, dict]:
  """(rope_theta, llama3 scaling fields or {}), from transformers' old layout (rope_theta and
  rope_scaling) or its newer one (rope_parameters)."""
  rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10_000.0)))
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind == 'default':
    return theta, {}
  if kind != 'llama3':
    raise ConfigError(f'{os.path.join(path, CONFIG_FILE)}: rope_type={kind!r} is not supported; '
                      "jaxllm implements the plain rotary embedding and 'llama3' scaling.")
  return theta, dict(factor=float(rope['factor']),
                     low_freq_factor=float(rope['low_freq_factor']),
                     high_freq_factor=float(rope['high_freq_factor']),
                     original_max_position=int(rope['original_max_position_embeddings']))


def model_config(path: str) -> ConfigDict:
  """jaxllm's `model` config section for the checkpoint at `path`: the defaults, with every
  field the checkpoint decides set from its config.json. A bfloat16 checkpoint computes in
  bfloat16 (cuDNN's fused attention when JAX runs on GPUs), any other in float32; the master
  weights are float32 either way, so that fine-tuning's small updates are not rounded away."""
  hf = read_hf_config(path)
  req = lambda key: _required(hf, key, path)
  heads = int(req('num_attention_heads'))
  theta, scaling = _rope(hf, path)
  stored = hf.get('torch_dtype') or hf.get('dtype') or 'float32'
  dtype = 'bfloat16' if stored == 'bfloat16' else 'float32'
  cfg = default_config().model
  cfg.update(
      vocab_size=int(req('vocab_size')),
      embed_dim=int(req('hidden_size')),
      num_layers=int(req('num_hidden_layers')),
      num_heads=heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or heads),
      head_dim=int(hf.get('head_dim') or req('hidden_size') // heads),
      mlp_dim=int(req('intermediate_size')),
      rope_theta=theta,
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),  # transformers' default
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      max_position=int(hf.get('max_position_embeddings') or 0),
      param_dtype='float32',
      dtype=dtype,
      attention='cudnn' if dtype == 'bfloat16' else 'xla')
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
  """config.json of a LlamaForCausalLM (with experts, a MixtralForCausalLM) with jaxllm's
  `model_cfg`, stored in `dtype`. `model_cfg.max_position` must be set: transformers takes
  2048 for a config without it."""
  m = model_cfg
  experts = expert_family(m)
  hf = dict(architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=m.vocab_size,
            hidden_size=m.embed_dim, intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim, hidden_act='silu', rms_norm_eps=m.norm_eps,
            rope_theta=m.rope_theta, rope_scaling=None, tie_word_embeddings=m.tie_embeddings,
            attention_bias=False, mlp_bias=False, torch_dtype=dtype,
            max_position_embeddings=m.max_position, bos_token_id=vocabulary.bos_id,
            eos_token_id=vocabulary.eos_id)
  s = m.rope_scaling
  if s.factor > 0:
    hf['rope_scaling'] = dict(rope_type='llama3', factor=s.factor,
                              low_freq_factor=s.low_freq_factor,
                              high_freq_factor=s.high_freq_factor,
                              original_max_position_embeddings=s.original_max_position)
  if experts:
    hf.update(architectures=[EXPERT_FAMILIES[experts].architecture], model_type=experts,
              **moe_json(m, experts))
    for key in ('attention_bias', 'mlp_bias'):  # Llama's alone
      del hf[key]
  return hf


def check_model_matches(path: str, model_cfg: ConfigDict) -> None:
  """The run's `model_cfg` must have the checkpoint's shapes (ConfigError naming the field);
  a different RoPE or norm epsilon is allowed (e.g. a longer context) but noted."""
  hf_cfg = model_config(path)
  fields = [(f, hf_cfg[f], model_cfg[f]) for f in SHAPE_FIELDS
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
