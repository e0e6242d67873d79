"""Mixtures of experts in Hugging Face checkpoints (Mixtral, Qwen3-MoE): the config.json keys
that say which layers route to experts and how, and the tensors that hold the experts.

transformers 5 keeps each layer's experts fused in memory (`mlp.experts.gate_up_proj`
[E, 2F, D], gate rows first, and `mlp.experts.down_proj` [E, D, F]) but `save_pretrained`
writes the older per-expert tensors (Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`,
Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj`, each a torch Linear [out, in]);
checkpoints written from the fused state hold the fused ones. Both are read; the per-expert
ones are written, as `save_pretrained` does.

| family (model_type) | architecture         | router                                    |
|---------------------|----------------------|-------------------------------------------|
| mixtral             | MixtralForCausalLM   | softmax top-k, renormalised; every layer  |
| qwen3_moe           | Qwen3MoeForCausalLM  | softmax top-k, renormalised where         |
|                     |                      | norm_topk_prob; mlp_only_layers and       |
|                     |                      | decoder_sparse_step pick the MoE layers   |
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict

from jaxllm.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ExpertNames:
  """Where a family keeps a layer's router and experts: per-expert tensors under `module`
  ('{expert}' standing for the expert's index), fused ones under `fused_module`; and the
  family (`families.FAMILIES`) whose block it has around them."""
  block_family: str
  module: str              # 'block_sparse_moe' or 'mlp'
  gate: str                # the per-expert gate, up and down projections' names
  up: str
  down: str
  fused_module: str = 'mlp'


EXPERT_FAMILIES = {
    'mixtral': ExpertNames('llama', 'block_sparse_moe', 'w1', 'w3', 'w2'),
    'qwen3_moe': ExpertNames('qwen3', 'mlp', 'gate_proj', 'up_proj', 'down_proj'),
}


def _where_moe(hf: dict, kind: str) -> list[bool]:
  """Whether each layer routes to experts, as transformers' decoder layer decides it."""
  L = int(hf['num_hidden_layers'])
  if kind == 'mixtral':
    return [True] * L
  step = int(hf.get('decoder_sparse_step', 1))
  dense = set(hf.get('mlp_only_layers') or [])
  return [i not in dense and step > 0 and (i + 1) % step == 0 for i in range(L)]


def moe_layers_pattern(num_layers: int, first_dense: int, every: int) -> list[bool]:
  """Whether each layer of a jaxllm model is MoE: after the first `first_dense`, the last of
  every group of `every`."""
  return [i >= first_dense and (i - first_dense + 1) % every == 0 for i in range(num_layers)]


def _experts(hf: dict, kind: str) -> int:
  key = 'num_local_experts' if 'num_local_experts' in hf else 'num_experts'
  return int(hf.get(key) or 0)


def moe_fields(hf: dict, kind: str, where: str) -> dict:
  """model.moe's fields for a `kind` checkpoint's config.json (ConfigError for what jaxllm's
  MoE layer cannot compute)."""
  experts = _experts(hf, kind)
  if experts < 1:
    raise ConfigError(f'{where}: num_local_experts={experts}; a {kind} checkpoint needs at least '
                      'one expert.')
  if float(hf.get('router_jitter_noise') or 0.0):
    raise ConfigError(f'{where}: router_jitter_noise={hf["router_jitter_noise"]} is not '
                      'supported; jaxllm routes without jitter: set it to 0.0.')
  wanted = _where_moe(hf, kind)
  L = len(wanted)
  layout = next(((k, n) for n in range(1, L + 1) for k in range(L + 1)
                 if (L - k) % n == 0 and moe_layers_pattern(L, k, n) == wanted), None)
  if layout is None or not any(wanted):
    moe_at = [i for i, w in enumerate(wanted) if w]
    raise ConfigError(f'{where}: the MoE layers {moe_at} (from mlp_only_layers and '
                      'decoder_sparse_step) are not some first dense layers followed by every '
                      "n-th layer, which is all jaxllm's model.moe.first_dense and "
                      'model.moe.every can say; no jaxllm model computes this checkpoint.')
  first_dense, every = layout
  mixtral = kind == 'mixtral'
  return dict(experts=experts, top_k=int(hf.get('num_experts_per_tok', 2)),
              # Mixtral's experts have the model's intermediate_size; Qwen3-MoE's their own.
              mlp_dim=0 if mixtral else int(hf['moe_intermediate_size']),
              router='softmax', renormalize=mixtral or bool(hf.get('norm_topk_prob', False)),
              route_scale=1.0, shared_experts=0, shared_mlp_dim=0,
              aux_loss=float(hf.get('router_aux_loss_coef', 0.001)),
              first_dense=first_dense, every=every)


def expert_family(m: ConfigDict) -> str | None:
  """The MoE family whose architecture computes `m`'s experts (None without experts); a
  ConfigError naming the field where none does."""
  moe = m.moe
  if not moe.experts:
    return None
  unsupported = [('router', 'softmax'), ('route_scale', 1.0), ('shared_experts', 0)]
  for field, supported in unsupported:
    if moe[field] != supported:
      raise ConfigError(f'model.moe.{field}={moe[field]!r}: no Hugging Face architecture jaxllm '
                        f'writes (Mixtral, Qwen3-MoE) has it; they need model.moe.{field}='
                        f'{supported!r}.')
  if m.qk_norm:  # Qwen3's attention: any experts' width, routing and MoE layers
    return 'qwen3_moe'
  if moe.first_dense == 0 and moe.every == 1 and moe.renormalize and not moe.mlp_dim:
    return 'mixtral'
  raise ConfigError('model.moe.first_dense, every, mlp_dim or renormalize differ from '
                    "Mixtral's (0, 1, 0, True): only Qwen3-MoE writes such a model, whose "
                    'attention normalises q and k per head; set model.qk_norm=True.')


def moe_json(m: ConfigDict, kind: str) -> dict:
  """The config.json keys of a `kind` checkpoint's experts."""
  moe = m.moe
  common = dict(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss,
                output_router_logits=False)
  if kind == 'mixtral':
    return dict(common, num_local_experts=moe.experts, router_jitter_noise=0.0,
                sliding_window=None)
  moe_at = moe_layers_pattern(m.num_layers, moe.first_dense, moe.every)
  return dict(common, num_experts=moe.experts, moe_intermediate_size=moe.mlp_dim or m.mlp_dim,
              norm_topk_prob=moe.renormalize, decoder_sparse_step=1,
              mlp_only_layers=[i for i, is_moe in enumerate(moe_at) if not is_moe])


def check_experts_supported(hf: dict, kind: str, where: str) -> None:
  """ConfigError for what jaxllm cannot compute in a `kind` checkpoint's attention: sliding
  windows (jaxllm's expert stacks run one attention type in every layer, the full one here)."""
  if hf.get('sliding_window') and (kind == 'mixtral' or hf.get('use_sliding_window')):
    raise ConfigError(f'{where}: sliding_window={hf["sliding_window"]} is not supported; jaxllm '
                      f'reads {kind} checkpoints whose attention sees the whole context '
                      '(sliding_window null, as Mixtral 8x7B v0.1 releases it; '
                      'use_sliding_window false, as Qwen3-MoE does).')
