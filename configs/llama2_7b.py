"""Llama-2-7B shapes: 32 layers, d=4096, 32 heads (no grouping), 32K vocabulary.

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32,
                 num_kv_heads=32, head_dim=128, mlp_dim=11_008, rope_theta=10_000.0,
                 dtype='bfloat16', remat='dots', attention='cudnn')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=4096)
  return c
