"""Qwen3-30B-A3B shapes: 48 layers, d=2048, 32 query / 4 kv heads of 128, and in every layer
128 SwiGLU experts of width 768, each token routed to 8 (softmax top-8, renormalised):
30.5B parameters, 3.3B of them active per token.

With Qwen3's per-head RMSNorm of q and k (model.qk_norm) its parameters are the release's.
The experts split over fsdp (16 of them per GPU on a node of 8) and reach their tokens round a
ring, which at top-8 over 8 devices sends what an all-to-all would; the grouped matmuls are the
own Pallas-Triton kernels (on a CPU they run in Pallas' interpreter: set
model.moe.grouped_matmul='xla' there).

On 8 H100s (`python benchmarks/moe.py`): each layer rematerialised whole, and a capacity
factor of 1.25 (each expert takes at most 1.25× an even share of each device's tokens, as
MaxText's GPU configs do; the assignments past it are dropped and logged as moe_dropped),
which keeps the dispatch's static buffers small enough to fit: dropless (capacity_factor=0)
the step needs 62.4 GiB a GPU of the 59.7 GiB a process may use.
"""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.model.update(vocab_size=151_936, embed_dim=2048, num_layers=48, num_heads=32,
                 num_kv_heads=4, head_dim=128, mlp_dim=6144, qk_norm=True,
                 rope_theta=1_000_000.0, norm_eps=1e-6, max_position=40_960, dtype='bfloat16',
                 remat='full', attention='cudnn')
  c.model.moe.update(experts=128, top_k=8, mlp_dim=768, router='softmax', renormalize=True,
                     aux_loss=0.001, capacity_factor=1.25, grouped_matmul='triton')
  c.train.update(global_batch=8, steps=1000, log_every=10)
  c.data.update(source='synthetic', seq_len=4096)
  return c
