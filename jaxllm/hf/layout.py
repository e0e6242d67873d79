"""Where each jaxllm parameter lives in a Hugging Face checkpoint's tensors (Llama's names, and
those the other families add).

The two layouts differ only in how tensors are arranged: torch `Linear` weights are [out, in]
with the heads flattened, ours are [in, out] with heads as their own axis and the layers
stacked on a leading axis. The rotary embedding needs no change: ours rotates the two halves
of each head, as Hugging Face's `rotate_half` does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from ml_collections import ConfigDict


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where one of our parameters lives in a Hugging Face tensor.

  Viewed through `hf_dims` (each HF axis split into the sizes of our axes it holds, e.g.
  q_proj's [N·H, D] as ((N, H), (D,))), the HF tensor has our axes in another order: our
  axis i is axis `order[i]` of that view. Stacked parameters have a tensor per layer, '{}'
  in `hf_name` standing for the layer index.
  """
  hf_name: str
  hf_dims: tuple[tuple[int, ...], ...]
  order: tuple[int, ...]

  @property
  def stacked(self) -> bool:
    return '{}' in self.hf_name

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(sizes) for sizes in self.hf_dims)

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
    block = read_hf(tuple(hf_index))
    return block.reshape(block_shape)[tuple(inner_index)].transpose(self.order)


def layouts(model_cfg: ConfigDict) -> dict[str, Layout]:
  """Our parameters by dotted name ('blocks.attn.wq_DNH') → their place in a HF checkpoint of
  the model's family: the Llama names, and what the family's options add (q/k/v biases,
  q/k norms, Gemma's four norms a layer)."""
  m = model_cfg
  V, D, N, K, H, F = m.vocab_size, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  layer = 'model.layers.{}.'
  found = {
      'embed_VD': Layout('model.embed_tokens.weight', ((V,), (D,)), (0, 1)),
      'final_norm.scale': Layout('model.norm.weight', ((D,),), (0,)),
      'blocks.attn_norm.scale': Layout(layer + 'input_layernorm.weight', ((D,),), (0,)),
      'blocks.mlp_norm.scale': Layout(layer + 'post_attention_layernorm.weight', ((D,),), (0,)),
      # torch Linear weights are [out, in]; the heads are flattened into `out` head-major.
      'blocks.attn.wq_DNH': Layout(layer + 'self_attn.q_proj.weight', ((N, H), (D,)), (2, 0, 1)),
      'blocks.attn.wk_DKH': Layout(layer + 'self_attn.k_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'blocks.attn.wv_DKH': Layout(layer + 'self_attn.v_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'blocks.attn.wo_NHD': Layout(layer + 'self_attn.o_proj.weight', ((D,), (N, H)), (1, 2, 0)),
      'blocks.mlp.w_gate_DF': Layout(layer + 'mlp.gate_proj.weight', ((F,), (D,)), (1, 0)),
      'blocks.mlp.w_up_DF': Layout(layer + 'mlp.up_proj.weight', ((F,), (D,)), (1, 0)),
      'blocks.mlp.w_down_FD': Layout(layer + 'mlp.down_proj.weight', ((D,), (F,)), (1, 0)),
  }
  if m.qkv_bias:
    for name, heads, ours in (('q', N, 'bias_q_NH'), ('k', K, 'bias_k_KH'), ('v', K, 'bias_v_KH')):
      found[f'blocks.attn.{ours}'] = Layout(layer + f'self_attn.{name}_proj.bias',
                                            ((heads, H),), (0, 1))
  if m.qk_norm:
    for name in ('q', 'k'):
      found[f'blocks.attn.{name}_norm.scale'] = Layout(layer + f'self_attn.{name}_norm.weight',
                                                       ((H,),), (0,))
  if m.post_norms:  # Gemma's names: post_attention_layernorm follows attention here
    norm = lambda name: Layout(layer + f'{name}.weight', ((D,),), (0,))
    found.update({'blocks.attn_out_norm.scale': norm('post_attention_layernorm'),
                  'blocks.mlp_norm.scale': norm('pre_feedforward_layernorm'),
                  'blocks.mlp_out_norm.scale': norm('post_feedforward_layernorm')})
  if not m.tie_embeddings:
    found['head_DV'] = Layout('lm_head.weight', ((V,), (D,)), (1, 0))
  return found


def hf_names(layout: Layout, num_layers: int) -> list[str]:
  layers = range(num_layers) if layout.stacked else [None]
  return [layout.hf_name.format(i) for i in layers]


def param_name(path) -> str:
  """'blocks.attn.wq_DNH' for a tree path (of an nnx.State or a plain nested dict)."""
  return '.'.join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
