"""Mistral-7B-v0.1 shapes: 32 layers, d=4096, 32 query / 8 kv heads, every layer's attention
a sliding window of 4,096 positions, untied head.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=10_000.0,
                 norm_eps=1e-5, layer_types=('sliding',), sliding_window=4096,
                 max_position=32_768, dtype='bfloat16', remat='dots', attention='cudnn')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
