"""The published model shapes: their parameter counts, and a train step that compiles for
8 H100s (for the CPU where JAX's CUDA plugin is missing)."""

import glob
import json
import os
import subprocess
import sys

import jax
import pytest

from conftest import REPO
from jaxllm import backends
from jaxllm.cli import load_config
from jaxllm.cost import hlo
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import PROFILES
from jaxllm.metrics import param_counts
from jaxllm.optim import make_optimizer
from jaxllm.parallel.mesh import make_mesh
from jaxllm.step import state_shapes
from jaxllm.validate import resolve_mesh

# Parameter counts of the released checkpoints.
PUBLISHED = {
    'llama3_1b': 1_235_814_400,
    'llama2_7b': 6_738_415_616,
    'llama3_8b': 8_030_261_248,
    'llama3_70b': 70_553_706_496,
}


# The other families' released checkpoints (their programs: docs/families.md's analyses).
# Gemma 3 4B's is its language model, the vision tower aside.
PUBLISHED_FAMILIES = {
    'qwen3_8b': 8_190_735_360,
    'qwen2_5_7b': 7_615_616_512,
    'mistral_7b': 7_241_732_096,
    'gemma3_4b': 3_880_263_168,
}


@pytest.mark.parametrize('name', PUBLISHED_FAMILIES)
def test_family_shapes_have_the_released_parameter_counts(name):
  cfg = load_config(os.path.join(REPO, 'configs', f'{name}.py'))
  mesh = make_mesh(resolve_mesh(cfg.mesh, 1), jax.devices()[:1])
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  _, abstract, _ = state_shapes(cfg.model, tx, mesh, cfg.sharding.rules)
  assert sum(x.size for x in jax.tree.leaves(abstract.params)) == PUBLISHED_FAMILIES[name]
  assert param_counts(cfg.model)['total'] == PUBLISHED_FAMILIES[name]


@pytest.mark.slow
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


HF_RECIPE = '''
from jaxllm import hf
from jaxllm.config import default_config

def get_config():
  c = default_config()
  c.model = hf.model_config({path!r})
  c.init_from = 'hf:' + {path!r}
  return c
'''


def test_loading_a_config_starts_no_backend(tmp_path):
  """Every config in configs/, and one that reads a Hugging Face config.json (bfloat16, so
  cuDNN attention), load without starting JAX's backends: `train` sets them up afterwards
  (simulated CPU devices, jax.distributed), which a started backend would refuse."""
  hf_dir = tmp_path / 'hf'
  hf_dir.mkdir()
  (hf_dir / 'config.json').write_text(json.dumps(dict(
      model_type='llama', vocab_size=300, hidden_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
      torch_dtype='bfloat16')))
  recipe = tmp_path / 'hf_recipe.py'
  recipe.write_text(HF_RECIPE.format(path=str(hf_dir)))
  paths = sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))) + [str(recipe)]
  script = ('import sys\nfrom jax._src import xla_bridge\nfrom jaxllm.cli import load_config\n'
            'for path in sys.argv[1:]:\n  cfg = load_config(path)\n'
            '  print(path, cfg.model.attention, xla_bridge.backends_are_initialized())\n')
  out = subprocess.run([sys.executable, '-c', script, *paths], capture_output=True, text=True,
                       check=True).stdout.splitlines()
  assert len(out) == len(paths)
  assert all(line.endswith(' False') for line in out), out
  # The attention path is left for start-up to choose on the run's devices.
  assert out[-1] == f'{recipe} cudnn False'


# (total, active per token) parameters of the released mixtures of experts.
PUBLISHED_MOE = {
    'mixtral_8x7b': (46_702_792_704, 12_879_925_248),
    'qwen3_30b_a3b': (30_532_122_624, 3_353_032_704),
}


@pytest.mark.parametrize('name', PUBLISHED_MOE)
def test_published_mixture_of_experts_has_its_parameters(name):
  """The model built from the config holds the release's parameters, and the count the FLOPs
  use (active: the router, top_k of each layer's experts) is the release's activated size:
  Mixtral 12.9B of 46.7B, Qwen3-30B-A3B 3.3B of 30.5B."""
  cfg = load_config(os.path.join(REPO, 'configs', f'{name}.py'))
  cfg.mesh.update(data=2, fsdp=-1, tensor=2)
  mesh = make_mesh(resolve_mesh(cfg.mesh, jax.device_count()))
  _, abstract, _ = state_shapes(cfg.model, make_optimizer(cfg.optim, cfg.train.steps), mesh,
                                cfg.sharding.rules)
  total, active = PUBLISHED_MOE[name]
  assert sum(x.size for x in jax.tree.leaves(abstract.params)) == total
  counts = param_counts(cfg.model)
  assert (counts['total'], counts['active']) == (total, active)
