"""A tiny mixture of experts on 8 simulated CPU devices: configs/tiny.py's byte-level model and
data with 8 SwiGLU experts of width 96 in every layer, each token routed to 2 of them by
DeepSeek-V3's sigmoid router, balanced without an auxiliary loss: the train step moves each
expert's selection bias by 0.01 a step towards an even load.

The mesh fsdp=8 splits the experts over fsdp (expert parallelism: one expert per device, as
on a node of 8 GPUs), and tokens reach them round a ring (model.moe.dispatch='ring').
"""

import os
import sysconfig

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.cpu_devices = 8
  c.model.update(vocab_size=320, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=32, mlp_dim=384)
  c.model.moe.update(experts=8, top_k=2, mlp_dim=96, router='sigmoid', bias_rate=0.01,
                     aux_loss=0.0, z_loss=0.001)
  c.mesh.update(data=1, fsdp=8, pipe=1, tensor=1)
  c.train.update(steps=100, log_every=10, global_batch=16, micro_batches=1)
  c.optim.update(lr=3e-3, warmup_steps=10)
  c.data.update(source='files', seq_len=128, eval_fraction=0.02,
                path=os.path.join(sysconfig.get_paths()['stdlib'], '*.py'))
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
