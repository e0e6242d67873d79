"""Gemma-3-4B's language model: 34 layers, d=2560, 8 query / 4 kv heads of 256, GeGLU, four
zero-centred norms a layer and QK-norm, embeddings × √d, tied; five sliding layers (a window
of 1,024, RoPE base 10⁴) to each full one (RoPE base 10⁶, linear scaling 8).

Set data.path (and a matching tokenizer) for real data; the default is a synthetic batch.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=262_208, embed_dim=2560, num_layers=34, num_heads=8,
                 num_kv_heads=4, head_dim=256, mlp_dim=10_240, norm_eps=1e-6,
                 tie_embeddings=True, qk_norm=True, mlp_activation='gelu_tanh',
                 norm_zero_centered=True, post_norms=True, scale_embeddings=True,
                 attention_scale=256**-0.5, layer_types=('sliding',) * 5 + ('full',),
                 sliding_window=1024, rope_theta=1_000_000.0, sliding_rope_theta=10_000.0,
                 max_position=131_072, dtype='bfloat16', remat='dots', attention='cudnn')
  c.model.rope_scaling.update(kind='linear', factor=8.0)
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=8192)
  return c
