"""The published model shapes: their parameter counts, and a train step that compiles."""

import os

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO
from jaxllm.config import load_config, resolve_mesh, validate
from jaxllm.mesh import batch_sharding, make_mesh, sharding_context
from jaxllm.metrics import param_counts
from jaxllm.optim import lr_schedule, make_optimizer
from jaxllm.step import make_train_step, state_shapes

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
  cfg.model.attention = 'xla'  # the test machine has no GPU
  cfg.mesh.update(data=2, fsdp=-1, tensor=2)
  shape = resolve_mesh(cfg.mesh, jax.device_count())
  validate(cfg, shape)
  mesh = make_mesh(shape)
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  graphdef, abstract, shardings = state_shapes(cfg.model, tx, mesh, cfg.sharding.rules)
  assert sum(x.size for x in jax.tree.leaves(abstract.params)) == PUBLISHED[name]
  assert param_counts(cfg.model)['total'] == PUBLISHED[name]

  step = make_train_step(graphdef, tx, lr_schedule(cfg.optim, cfg.train.steps),
                         cfg.train.micro_batches)
  rows = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len), jnp.int32,
                              sharding=batch_sharding(mesh, cfg.sharding.rules, 2))
  batch = {'inputs': rows, 'targets': rows, 'mask': rows}
  with sharding_context(mesh, cfg.sharding.rules):
    compiled = jax.jit(step, out_shardings=(shardings, None)).lower(abstract, batch).compile()
  assert 'all-gather' in compiled.as_text()
