"""A Llama-style decoder in Flax NNX, written once for every mesh and for the families that
change its block (Qwen, Mistral, Gemma 3: fields of the model config): `transformer` puts
together `layers`, `attention`, `embedding`, `loss`, `kv_cache`, `remat` and, for mixtures of
experts, `moe` (with `grouped_matmul`)."""

from jaxllm.model.attention import with_available_attention
from jaxllm.model.kv_cache import KVCache
from jaxllm.model.transformer import LOGICAL_SHAPES, Transformer, sequence_positions

__all__ = ['KVCache', 'LOGICAL_SHAPES', 'Transformer', 'sequence_positions',
           'with_available_attention']
