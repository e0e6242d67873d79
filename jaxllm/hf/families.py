"""The Hugging Face model families jaxllm reads and writes, and what each adds to the Llama
block: `block_fields` reads it from a config.json into model fields, `family_json` writes it
back for the family `family_of` a model section belongs to.

| family (model_type)  | architecture        | model fields it sets                                |
|----------------------|---------------------|-----------------------------------------------------|
| llama                | LlamaForCausalLM    | (none: the defaults)                                |
| qwen2 (Qwen2, 2.5)   | Qwen2ForCausalLM    | qkv_bias; sliding layers where use_sliding_window   |
| qwen3                | Qwen3ForCausalLM    | qk_norm; sliding layers where use_sliding_window    |
| mistral              | MistralForCausalLM  | every layer sliding where sliding_window is set     |
| gemma3_text (Gemma 3)| Gemma3ForCausalLM   | qk_norm, mlp_activation='gelu_tanh',                |
|                      |                     | norm_zero_centered, post_norms, scale_embeddings,   |
|                      |                     | attention_scale, layer_types, sliding_rope_theta    |
| mixtral              | MixtralForCausalLM  | Llama's block with experts (`experts`)              |
| qwen3_moe            | Qwen3MoeForCausalLM | Qwen3's block with experts (`experts`)              |
"""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from jaxllm.config import ConfigError, default_config, layer_types

# model_type → the architecture of its causal LM, as config.json names them.
FAMILIES = {
    'llama': 'LlamaForCausalLM',
    'qwen2': 'Qwen2ForCausalLM',
    'qwen3': 'Qwen3ForCausalLM',
    'mistral': 'MistralForCausalLM',
    'gemma3_text': 'Gemma3ForCausalLM',
    'mixtral': 'MixtralForCausalLM',  # with experts: `experts.EXPERT_FAMILIES`
    'qwen3_moe': 'Qwen3MoeForCausalLM',
}
SUPPORTED = ', '.join(f'{arch} ({kind})' for kind, arch in FAMILIES.items())
# transformers' names of the layer types, and ours.
HF_LAYER_TYPES = {'full_attention': 'full', 'sliding_attention': 'sliding'}
# What Gemma 3 sets, all together (`family_of`); its attention_scale comes from
# query_pre_attn_scalar.
GEMMA = dict(qk_norm=True, qkv_bias=False, mlp_activation='gelu_tanh', norm_zero_centered=True,
             post_norms=True, scale_embeddings=True)


def check_supported(hf: dict, where: str) -> str:
  """The checkpoint's model_type, one of FAMILIES with its causal-LM architecture; a
  ConfigError naming the supported ones otherwise."""
  kind = hf.get('model_type')
  architectures = hf.get('architectures') or [FAMILIES.get(kind)]
  if kind not in FAMILIES or FAMILIES[kind] not in architectures:
    raise ConfigError(f'{where}: model_type={kind!r}, architectures={architectures} is not '
                      f'supported; jaxllm reads and writes {SUPPORTED}.')
  activation = hf.get('hidden_activation' if kind == 'gemma3_text' else 'hidden_act')
  unsupported = [('hidden_activation', activation, 'gelu_pytorch_tanh')
                 if kind == 'gemma3_text' else ('hidden_act', activation, 'silu'),
                 ('mlp_bias', hf.get('mlp_bias', False), False),
                 ('attn_logit_softcapping', hf.get('attn_logit_softcapping'), None),
                 ('final_logit_softcapping', hf.get('final_logit_softcapping'), None),
                 ('use_bidirectional_attention', hf.get('use_bidirectional_attention', False),
                  False)]
  if kind != 'qwen2':  # Qwen2's q, k and v always have biases, its output projection none
    unsupported.append(('attention_bias', hf.get('attention_bias', False), False))
  for key, value, supported in unsupported:
    if value is not None and value != supported:
      raise ConfigError(f'{where}: {key}={value!r} is not supported; jaxllm reads {kind} '
                        f'checkpoints with {key}={supported!r}.')
  return kind


def _hf_layer_types(hf: dict, kind: str) -> list[str]:
  """transformers' type of each layer, as its config class derives them."""
  L = int(hf['num_hidden_layers'])
  window = hf.get('sliding_window')
  if kind == 'mistral':  # every layer, where a window is set (layer_types is ignored)
    return ['sliding_attention' if window else 'full_attention'] * L
  if kind in ('qwen2', 'qwen3', 'qwen3_moe') and not hf.get('use_sliding_window', False):
    return ['full_attention'] * L
  if hf.get('layer_types'):
    return list(hf['layer_types'])
  if kind == 'gemma3_text':
    period = hf.get('sliding_window_pattern', hf.get('_sliding_window_pattern', 6))
    return ['sliding_attention' if (i + 1) % period else 'full_attention' for i in range(L)]
  if kind in ('qwen2', 'qwen3', 'qwen3_moe'):
    first = hf.get('max_window_layers', 28)
    return ['sliding_attention' if window and i >= first else 'full_attention' for i in range(L)]
  return ['full_attention'] * L


def _shortest_period(kinds: list[str]) -> tuple[str, ...]:
  """The shortest pattern that `kinds` repeats (model.layer_types)."""
  p = next(p for p in range(1, len(kinds) + 1)
           if all(k == kinds[i % p] for i, k in enumerate(kinds)))
  return tuple(kinds[:p])


def _rope_parameters(hf: dict, kind: str) -> dict[str, dict]:
  """The RoPE parameters of full and sliding layers, from transformers' nested or flat
  `rope_parameters` (5.x) or its older rope_theta, rope_scaling and rope_local_base_freq."""
  rope = hf.get('rope_parameters')
  if rope and all(isinstance(v, dict) for v in rope.values()):
    return rope
  if rope:
    return {'full_attention': rope, 'sliding_attention': rope}
  gemma = kind == 'gemma3_text'
  full = dict(hf.get('rope_scaling') or {},
              rope_theta=hf.get('rope_theta', 1_000_000.0 if gemma else 10_000.0))
  local = (dict(rope_theta=hf.get('rope_local_base_freq', 10_000.0)) if gemma else full)
  return {'full_attention': full, 'sliding_attention': local}


def _rope(rope: dict, where: str) -> tuple[float, dict]:
  """(base, model.rope_scaling fields or {}) of one layer type's RoPE parameters."""
  kind = rope.get('rope_type', rope.get('type', 'default'))
  theta = float(rope.get('rope_theta', 10_000.0))
  if kind == 'default':
    return theta, {}
  if kind == 'linear':
    return theta, dict(kind='linear', factor=float(rope['factor']))
  if kind == 'llama3':
    return theta, dict(kind='llama3', factor=float(rope['factor']),
                       low_freq_factor=float(rope['low_freq_factor']),
                       high_freq_factor=float(rope['high_freq_factor']),
                       original_max_position=int(rope['original_max_position_embeddings']))
  raise ConfigError(f"{where}: rope_type={kind!r} is not supported; jaxllm implements the plain "
                    "rotary embedding and 'linear' and 'llama3' scaling.")


def block_fields(hf: dict, kind: str, head_dim: int, where: str) -> dict:
  """The model fields (qk_norm ... sliding_rope_theta, rope_theta, rope_scaling) that
  config.json of a `kind` checkpoint sets; ConfigError for what the block cannot do."""
  hf_types = _hf_layer_types(hf, kind)
  unknown = sorted(set(hf_types) - set(HF_LAYER_TYPES))
  if unknown or len(hf_types) != int(hf['num_hidden_layers']):
    raise ConfigError(f'{where}: layer_types={hf_types} is not one of '
                      f'{", ".join(HF_LAYER_TYPES)} per layer; jaxllm runs those two.')
  window = int(hf.get('sliding_window') or 0)
  kinds = [HF_LAYER_TYPES[t] if window else 'full' for t in hf_types]
  rope = _rope_parameters(hf, kind)
  theta, scaling = _rope(rope['full_attention'], where)
  fields = dict(rope_theta=theta, rope_scaling=scaling, layer_types=_shortest_period(kinds),
                sliding_window=window if 'sliding' in kinds else 0, sliding_rope_theta=0.0)
  sliding_rope = rope.get('sliding_attention') or rope['full_attention']
  if 'sliding' in kinds and sliding_rope != rope['full_attention']:
    local_theta, local_scaling = _rope(sliding_rope, where)
    if local_scaling:
      raise ConfigError(f'{where}: rope scaling on the sliding layers ({sliding_rope}) is not '
                        'supported; jaxllm scales the full layers only.')
    fields['sliding_rope_theta'] = local_theta
  if kind == 'qwen2':
    fields['qkv_bias'] = True
  elif kind in ('qwen3', 'qwen3_moe'):
    fields['qk_norm'] = True
  elif kind == 'gemma3_text':
    fields.update(GEMMA, attention_scale=float(hf.get('query_pre_attn_scalar', head_dim))**-0.5)
  return fields


def family_of(m: ConfigDict) -> str:
  """The family (model_type) whose architecture computes what a model section does; a
  ConfigError naming the field where none does. A model with none of the options is a Llama
  (Mistral's later releases, without a window, are too)."""
  sliding = 'sliding' in layer_types(m)
  defaults = default_config().model
  gemma_only = [k for k in GEMMA if k not in ('qk_norm', 'qkv_bias') and m[k] != defaults[k]]
  if gemma_only:
    wrong = [k for k, v in GEMMA.items() if m[k] != v]
    if wrong:
      raise ConfigError(f'model.{gemma_only[0]}={m[gemma_only[0]]!r} is Gemma 3\'s, which has '
                        f'{wrong[0]}={GEMMA[wrong[0]]!r} too (model.{wrong[0]}='
                        f'{m[wrong[0]]!r} here); no Hugging Face architecture computes this '
                        'model.')
    return 'gemma3_text'
  if m.attention_scale or m.sliding_rope_theta:
    field = 'attention_scale' if m.attention_scale else 'sliding_rope_theta'
    raise ConfigError(f'model.{field}={m[field]} is Gemma 3\'s alone, and the rest of the model '
                      'is not Gemma 3; no Hugging Face architecture computes this model.')
  if m.qkv_bias and m.qk_norm:
    raise ConfigError('model.qkv_bias=True with model.qk_norm=True: Qwen2 has the biases, '
                      'Qwen3 the norm, no Hugging Face architecture both.')
  if m.qkv_bias:
    return 'qwen2'
  if m.qk_norm:
    return 'qwen3'
  if sliding and set(layer_types(m)) != {'sliding'}:
    raise ConfigError(f'model.layer_types={tuple(m.layer_types)} mixes full and sliding layers, '
                      'which among plain Llama-like models only Qwen2 and Qwen3 checkpoints '
                      'write; set model.qk_norm=True (Qwen3) or model.qkv_bias=True (Qwen2).')
  return 'mistral' if sliding else 'llama'


def family_json(m: ConfigDict, kind: str) -> dict:
  """The config.json keys a `kind` (`family_of`) checkpoint writes for what its block adds,
  besides the shapes every family shares."""
  hf_types = [{v: k for k, v in HF_LAYER_TYPES.items()}[t] for t in layer_types(m)]
  window = m.sliding_window or None
  if kind == 'gemma3_text':  # RoPE by layer type, as transformers 5 writes it
    sliding = (dict(rope_type='default', rope_theta=m.sliding_rope_theta)
               if m.sliding_rope_theta else _rope_json(m))
    scalar = m.attention_scale ** -2 if m.attention_scale else m.head_dim
    return dict(hidden_activation='gelu_pytorch_tanh', attention_bias=False,
                query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar))
                else scalar, sliding_window=window, layer_types=hf_types,
                rope_parameters=dict(full_attention=_rope_json(m), sliding_attention=sliding))
  s = m.rope_scaling
  common = dict(hidden_act='silu', rope_theta=m.rope_theta,
                rope_scaling={k: v for k, v in _rope_json(m).items() if k != 'rope_theta'}
                if s.factor > 0 else None)
  if kind == 'llama':
    return dict(common, attention_bias=False, mlp_bias=False)
  if kind == 'mistral':
    return dict(common, sliding_window=window)
  return dict(common, **({'attention_bias': False} if kind == 'qwen3' else {}),
              use_sliding_window=window is not None, sliding_window=window,
              layer_types=hf_types)


def _rope_json(m: ConfigDict) -> dict:
  """transformers' RoPE parameters of the full layers (rope_theta, rope_scaling)."""
  s = m.rope_scaling
  if s.factor <= 0:
    return dict(rope_type='default', rope_theta=m.rope_theta)
  if s.kind == 'linear':
    return dict(rope_type='linear', rope_theta=m.rope_theta, factor=s.factor)
  return dict(rope_type='llama3', rope_theta=m.rope_theta, factor=s.factor,
              low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
              original_max_position_embeddings=s.original_max_position)
