"""The published model shapes: their parameter counts, and a train step that compiles for
8 H100s (for the CPU where JAX's CUDA plugin is missing)."""

import os

import jax
import pytest

from conftest import REPO
from jaxllm import backends, hlo
from jaxllm.analyze import compile_step
from jaxllm.hardware import PROFILES
from jaxllm.config import load_config, resolve_mesh
from jaxllm.mesh import make_mesh
from jaxllm.metrics import param_counts
from jaxllm.optim import make_optimizer
from jaxllm.step import state_shapes

# Parameter counts of the released checkpoints.
PUBLISHED = {
    'llama3_1b': 1_235_814_400,
    'llama2_7b': 6_738_415_616,
    'llama3_8b': 8_030_261_248,
    'llama3_70b': 70_553_706_496,
}


@pytest.mark.parametrize('name', PUBLISHED)
def test_published_shape_compiles_from_shapes_alone(name):
  cfg = load_config(os.path.join(REPO, 'configs', f'{name}.py'))
  cfg.mesh.update(data=2, fsdp=-1, tensor=2)
  mesh = make_mesh(resolve_mesh(cfg.mesh, jax.device_count()))
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  _, abstract, _ = state_shapes(cfg.model, tx, mesh, cfg.sharding.rules)
  assert sum(x.size for x in jax.tree.leaves(abstract.params)) == PUBLISHED[name]
  assert param_counts(cfg.model)['total'] == PUBLISHED[name]

  gpu = backends.cuda_plugin_installed()
  compiled = compile_step(cfg, backends.gpu_devices(PROFILES['h100-nvlink'], 8) if gpu else None)
  assert 'all-gather' in compiled.text
  # cuDNN flash attention on the GPU; XLA's stands in for it on the CPU.
  flash = [k.flash for k in hlo.fused_attention(compiled.text)]
  assert (flash and all(flash)) if gpu and cfg.model.attention == 'cudnn' else not flash
