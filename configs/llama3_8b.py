"""Llama-3-8B shapes: 32 layers, d=4096, 32 query / 8 kv heads, untied head.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=128_256, embed_dim=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
                 dtype='bfloat16', remat='dots', attention='cudnn')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
