"""The embedded default: a small byte-level Llama on 8 simulated CPU devices.

Trains on the Python standard library's own sources, which every Python install has,
so it needs no download. A mesh of data=2 × fsdp=2 × tensor=2 exercises three axes.
"""

import os
import sysconfig

from jaxllm.config import default_config


def get_config():
  c = default_config()
  c.cpu_devices = 8
  c.model.update(vocab_size=320, embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=32, mlp_dim=384)
  c.mesh.update(data=2, fsdp=2, pipe=1, tensor=2)
  c.train.update(steps=300, log_every=20, global_batch=16, micro_batches=1)
  c.optim.update(lr=3e-3, warmup_steps=20)
  c.data.update(source='files', seq_len=128, eval_fraction=0.02,
                path=os.path.join(sysconfig.get_paths()['stdlib'], '*.py'))
  c.eval.every = 100
  c.checkpoint.every = 100
  return c
