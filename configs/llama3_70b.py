"""Llama-3-70B shapes: 80 layers, d=8192, 64 query / 8 kv heads, untied head.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=128_256, embed_dim=8192, num_layers=80, num_heads=64,
                 num_kv_heads=8, head_dim=128, mlp_dim=28_672, rope_theta=500_000.0,
                 dtype='bfloat16', remat='full', attention='cudnn')
  c.train.update(global_batch=32, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
