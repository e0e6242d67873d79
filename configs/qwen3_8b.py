"""Qwen3-8B shapes: 36 layers, d=4096, 32 query / 8 kv heads of 128, QK-norm, untied head.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=151_936, embed_dim=4096, num_layers=36, num_heads=32,
                 num_kv_heads=8, head_dim=128, mlp_dim=12_288, rope_theta=1_000_000.0,
                 norm_eps=1e-6, qk_norm=True, max_position=40_960,
                 dtype='bfloat16', remat='dots', attention='cudnn')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
