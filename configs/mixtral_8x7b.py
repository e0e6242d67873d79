"""Mixtral 8x7B shapes: 32 layers, d=4096, 32 query / 8 kv heads, and in every layer 8 SwiGLU
experts of width 14,336, each token routed to 2 (softmax top-2, renormalised): 46.7B
parameters, 12.9B of them active per token.

The experts split over fsdp (expert parallelism inside a node) and reach their tokens round
a ring; the grouped matmuls are the own Pallas-Triton kernels (on a CPU they run in Pallas'
interpreter: set model.moe.grouped_matmul='xla' there). Start from the released weights with
`c.model = hf.model_config(DIR)` and `c.init_from = 'hf:' + DIR` (see the README).
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=1_000_000.0,
                 norm_eps=1e-5, max_position=32_768, dtype='bfloat16', remat='dots',
                 attention='cudnn')
  c.model.moe.update(experts=8, top_k=2, router='softmax', renormalize=True, aux_loss=0.02,
                     grouped_matmul='triton')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=4096)
  return c
