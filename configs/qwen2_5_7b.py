"""Qwen2.5-7B shapes: 28 layers, d=3584, 28 query / 4 kv heads of 128, biases on q, k and v,
untied head.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=152_064, embed_dim=3584, num_layers=28, num_heads=28,
                 num_kv_heads=4, head_dim=128, mlp_dim=18_944, rope_theta=1_000_000.0,
                 norm_eps=1e-6, qkv_bias=True, max_position=131_072,
                 dtype='bfloat16', remat='dots', attention='cudnn')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
