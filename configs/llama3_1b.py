"""Llama-3.2-1B shapes: 16 layers, d=2048, 32 query / 8 kv heads, tied embeddings.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=128_256, embed_dim=2048, num_layers=16, num_heads=32,
                 num_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500_000.0,
                 tie_embeddings=True, dtype='bfloat16', remat='dots', attention='cudnn')
  c.model.rope_scaling.update(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position=8192)
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=4096)
  return c
