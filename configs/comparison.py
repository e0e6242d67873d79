"""The CPU throughput comparison model: Llama-2 style, d=256, 4 layers of 4 heads × 64,
MLP 1024, 32K vocabulary (untied head), sequence 256, global batch 8, fp32, one fixed
synthetic batch. Used by the benchmarks in benchmarks/."""

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.cpu_devices = 8
  c.model.update(vocab_size=32_000, embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
                 head_dim=64, mlp_dim=1024, tie_embeddings=False, dtype='float32',
                 remat='none')
  c.mesh.update(data=1, fsdp=-1, pipe=1, tensor=1)
  c.train.update(global_batch=8, steps=50, log_every=10)
  c.data.update(source='synthetic', seq_len=256)
  return c
