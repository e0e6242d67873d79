"""Where each jaxllm parameter lives in a Hugging Face checkpoint's tensors (Llama's names, those
the other families add, and Mixtral's or Qwen3-MoE's experts).

The two layouts differ only in how tensors are arranged: torch `Linear` weights are [out, in]
with the heads flattened, ours are [in, out] with heads as their own axis and the layers
stacked on a leading axis. The rotary embedding needs no change: ours rotates the two halves
of each head, as Hugging Face's `rotate_half` does. With experts, our layers are in more than
one stack (`stacks`), and a layer's experts are a tensor each or one fused tensor there
(`jaxllm.hf.experts`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxllm.hf.experts import EXPERT_FAMILIES, expert_family, moe_layers_pattern


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where one of our parameters lives in a Hugging Face tensor.

  Viewed through `hf_dims` (each HF axis split into the sizes of our axes it holds, e.g.
  q_proj's [N·H, D] as ((N, H), (D,))), the HF tensor has our axes in another order: our
  axis i is axis `order[i]` of that view. Stacked parameters have a tensor per layer, '{}'
  in `hf_name` standing for the HF index of the layer, `layers[i]` for our stack's i-th.
  Per-expert parameters ([E, ...] in a layer) have a tensor per expert too, '{expert}' in
  `hf_name` standing for its index; the layout then describes one expert's tensor. A part of
  a larger tensor (gate in a fused gate_up) starts at `offset` in a tensor of `tensor_shape`.
  """
  hf_name: str
  hf_dims: tuple[tuple[int, ...], ...]
  order: tuple[int, ...]
  layers: tuple[int, ...] = ()
  experts: int = 0
  offset: tuple[int, ...] = ()
  tensor_shape: tuple[int, ...] = ()

  @property
  def stacked(self) -> bool:
    return '{}' in self.hf_name

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """The shape of the tensor (one expert's where per expert) holding this parameter."""
    return self.tensor_shape or tuple(math.prod(sizes) for sizes in self.hf_dims)

  def name(self, layer: int | None = None, expert: int | None = None) -> str:
    return self.hf_name.format(layer, expert=expert)

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    """One layer's (or an unstacked) parameter in the HF layout."""
    return np.transpose(ours, np.argsort(self.order)).reshape(self.hf_shape)

  def read(self, read_hf, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` of our layout (one layer's axes), from `read_hf(hf_index)` which reads
    part of the HF tensor: only the rows and columns that hold the block."""
    view_dims = [size for sizes in self.hf_dims for size in sizes]
    view_index = [None] * len(view_dims)
    for ours, axis in enumerate(self.order):
      view_index[axis] = index[ours]
    # Per HF axis: the range its outermost view axis asks for, inner view axes whole
    # (contiguous in the file); the inner axes' own slices are taken after reshaping.
    hf_index, block_shape, inner_index, axis = [], [], [], 0
    for sizes in self.hf_dims:
      start, stop, _ = view_index[axis].indices(sizes[0])
      inner = math.prod(sizes[1:])
      hf_index.append(slice(start * inner, stop * inner))
      block_shape += [stop - start, *sizes[1:]]
      inner_index += [slice(None), *view_index[axis + 1:axis + len(sizes)]]
      axis += len(sizes)
    if self.offset:
      hf_index = [slice(s.start + o, s.stop + o) for s, o in zip(hf_index, self.offset)]
    block = read_hf(tuple(hf_index))
    return block.reshape(block_shape)[tuple(inner_index)].transpose(self.order)


def layouts(model_cfg: ConfigDict, family: str | None = None,
            fused_experts: bool = False) -> dict[str, Layout]:
  """Our parameters by dotted name ('blocks.attn.wq_DNH') → their place in a HF checkpoint of
  the model's family: the Llama names, and what the family's options add (q/k/v biases,
  q/k norms, Gemma's four norms a layer); with experts, those of a `family` checkpoint
  (default `experts.expert_family`), whose experts are fused tensors or one tensor each."""
  m = model_cfg
  V, D, N, K, H, F = m.vocab_size, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  layer = 'model.layers.{}.'
  block = {
      'attn_norm.scale': Layout(layer + 'input_layernorm.weight', ((D,),), (0,)),
      'mlp_norm.scale': Layout(layer + 'post_attention_layernorm.weight', ((D,),), (0,)),
      # torch Linear weights are [out, in]; the heads are flattened into `out` head-major.
      'attn.wq_DNH': Layout(layer + 'self_attn.q_proj.weight', ((N, H), (D,)), (2, 0, 1)),
      'attn.wk_DKH': Layout(layer + 'self_attn.k_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'attn.wv_DKH': Layout(layer + 'self_attn.v_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'attn.wo_NHD': Layout(layer + 'self_attn.o_proj.weight', ((D,), (N, H)), (1, 2, 0)),
  }
  dense_mlp = {
      'mlp.w_gate_DF': Layout(layer + 'mlp.gate_proj.weight', ((F,), (D,)), (1, 0)),
      'mlp.w_up_DF': Layout(layer + 'mlp.up_proj.weight', ((F,), (D,)), (1, 0)),
      'mlp.w_down_FD': Layout(layer + 'mlp.down_proj.weight', ((D,), (F,)), (1, 0)),
  }
  found = {
      'embed_VD': Layout('model.embed_tokens.weight', ((V,), (D,)), (0, 1)),
      'final_norm.scale': Layout('model.norm.weight', ((D,),), (0,)),
  }
  if m.qkv_bias:
    for name, heads, ours in (('q', N, 'bias_q_NH'), ('k', K, 'bias_k_KH'), ('v', K, 'bias_v_KH')):
      block[f'attn.{ours}'] = Layout(layer + f'self_attn.{name}_proj.bias', ((heads, H),), (0, 1))
  if m.qk_norm:
    for name in ('q', 'k'):
      block[f'attn.{name}_norm.scale'] = Layout(layer + f'self_attn.{name}_norm.weight',
                                                ((H,),), (0,))
  if m.post_norms:  # Gemma's names: post_attention_layernorm follows attention here
    norm = lambda name: Layout(layer + f'{name}.weight', ((D,),), (0,))
    block.update({'attn_out_norm.scale': norm('post_attention_layernorm'),
                  'mlp_norm.scale': norm('pre_feedforward_layernorm'),
                  'mlp_out_norm.scale': norm('post_feedforward_layernorm')})
  moe = _expert_layouts(m, family or expert_family(m), fused_experts) if m.moe.experts else {}
  for prefix, layers, experts in stacks(m):
    for name, layout in {**block, **(moe if experts else dense_mlp)}.items():
      found[f'{prefix}.{name}'] = dataclasses.replace(layout, layers=layers)
  if not m.tie_embeddings:
    found['head_DV'] = Layout('lm_head.weight', ((V,), (D,)), (1, 0))
  return found


def stacks(model_cfg: ConfigDict) -> list[tuple[str, tuple[int, ...], bool]]:
  """(the name of a stack of our layers, the HF index of each of its layers, whether they are
  MoE) for each stack: `blocks`, or with experts (jaxllm.model.transformer) `dense_blocks`
  for the first dense layers and, where only every n-th layer is MoE, `blocks.layers.{j}`
  for the j-th of each group."""
  m = model_cfg
  L = m.num_layers
  if not m.moe.experts:
    return [('blocks', tuple(range(L)), False)]
  first, every = m.moe.first_dense, m.moe.every
  moe_at = moe_layers_pattern(L, first, every)
  found = [('dense_blocks', tuple(range(first)), False)] if first else []
  if every == 1:
    return found + [('blocks', tuple(range(first, L)), True)]
  return found + [(f'blocks.layers.{j}', tuple(range(first + j, L, every)), moe_at[first + j])
                  for j in range(every)]


def _expert_layouts(model_cfg: ConfigDict, family: str, fused: bool) -> dict[str, Layout]:
  """A MoE layer's router and experts (names below the block) in a `family` checkpoint."""
  m = model_cfg
  D, E, F = m.embed_dim, m.moe.experts, m.moe.mlp_dim or m.mlp_dim
  names = EXPERT_FAMILIES[family]
  if fused:
    experts = f'model.layers.{{}}.{names.fused_module}.experts.'
    gate_up = lambda offset: Layout(experts + 'gate_up_proj', ((E,), (F,), (D,)), (0, 2, 1),
                                    offset=(0, offset, 0), tensor_shape=(E, 2 * F, D))
    return {
        'mlp.router_DE': Layout(f'model.layers.{{}}.{names.fused_module}.gate.weight',
                                ((E,), (D,)), (1, 0)),
        'mlp.w_gate_EDF': gate_up(0),
        'mlp.w_up_EDF': gate_up(F),
        'mlp.w_down_EFD': Layout(experts + 'down_proj', ((E,), (D,), (F,)), (0, 2, 1)),
    }
  module = f'model.layers.{{}}.{names.module}.'
  expert = lambda name: module + 'experts.{expert}.' + name + '.weight'
  return {
      'mlp.router_DE': Layout(module + 'gate.weight', ((E,), (D,)), (1, 0)),
      'mlp.w_gate_EDF': Layout(expert(names.gate), ((F,), (D,)), (1, 0), experts=E),
      'mlp.w_up_EDF': Layout(expert(names.up), ((F,), (D,)), (1, 0), experts=E),
      'mlp.w_down_EFD': Layout(expert(names.down), ((D,), (F,)), (1, 0), experts=E),
  }


def hf_names(layout: Layout) -> list[str]:
  """The names of the HF tensors that hold `layout`'s parameter."""
  layers = layout.layers if layout.stacked else [None]
  experts = range(layout.experts) if layout.experts else [None]
  return [layout.name(i, e) for i in layers for e in experts]


def param_name(path) -> str:
  """'blocks.attn.wq_DNH' for a tree path (of an nnx.State or a plain nested dict)."""
  return '.'.join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
