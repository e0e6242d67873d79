"""The rules a run shards by: `derive` against the cases written out, validation that leaves
the config as it found it, and the check that no mesh axis splits two dimensions of an array."""

import copy
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import small_config
from jaxllm.checkpoint import restore_target
from jaxllm.config import ConfigError, default_config
from jaxllm.model import LOGICAL_SHAPES, Transformer
from jaxllm.optim import make_optimizer
from jaxllm.parallel import mesh as mesh_lib
from jaxllm.parallel.mesh import batch_sharding, make_mesh, sharding_context
from jaxllm.parallel.rules import derive, kv_heads_fit, mesh_axes
from jaxllm.pipeline.spec import pipeline_spec
from jaxllm.step import state_shapes, train_step_for
from jaxllm.validate import resolve_mesh, validate

MESH = dict(data=1, fsdp=1, pipe=1, tensor=1)


@pytest.mark.parametrize('kv_heads, tensor, replicated', [
    (2, 4, True),    # two devices share each K/V head (tiny over tensor=4)
    (8, 16, True),   # Llama-3-8B over tensor=16
    (1, 2, True),
    (4, 2, False),   # each device holds two whole K/V heads
    (4, 4, False),
    (3, 2, False),   # neither: left for the parameter check to name
])
def test_kv_heads_are_kept_whole_where_devices_share_them(kv_heads, tensor, replicated):
  model = default_config().model
  model.update(num_heads=4 * kv_heads, num_kv_heads=kv_heads)
  rules = default_config().sharding.rules
  before = copy.deepcopy(rules)
  layout = derive(rules, {**MESH, 'tensor': tensor}, model)
  kv = () if replicated else ('tensor',)
  assert (layout.rules['kv_heads'], layout.rules['act_kv_heads']) == (kv, kv)
  # Everything else is the configured table, and the configured table is untouched.
  assert {k: v for k, v in layout.rules.items() if 'kv_heads' not in k} == {
      k: mesh_axes(v) for k, v in before.items() if 'kv_heads' not in k}
  assert rules == before


def test_the_batch_shards_and_zero_follow_the_mesh():
  rules = default_config().sharding.rules
  model = default_config().model
  layout = derive(rules, dict(data=2, fsdp=4, pipe=1, tensor=1), model, zero=1)
  assert (layout.batch_shards, layout.zero) == (8, 1)
  # ZeRO splits over data: with one data device there is nothing to split.
  assert derive(rules, dict(data=1, fsdp=8, pipe=1, tensor=1), model, zero=2).zero == 0


def test_kv_heads_fit_is_the_one_rule():
  assert [p for p in range(1, 17) if kv_heads_fit(8, p)] == [1, 2, 4, 8, 16]
  assert [p for p in range(1, 13) if kv_heads_fit(3, p)] == [1, 3, 6, 9, 12]


def test_validation_never_changes_the_config():
  """K/V heads fewer than tensor: validation accepts the config and leaves every field as it
  was (what follows for the run is `derive`'s, on its own copy)."""
  cfg = small_config(fsdp=1, tensor=8)
  before = copy.deepcopy(cfg)
  validate(cfg, dict(cfg.mesh))
  assert cfg.to_dict() == before.to_dict()


@pytest.mark.parametrize('rules, message', [
    (dict(mlp=('fsdp',)), "sharding.rules.embed=('fsdp',) and sharding.rules.mlp=('fsdp',) "
     "both split over 'fsdp', but one array has both axes ([layers, embed, mlp])"),
    (dict(act_heads=('data',)), "sharding.rules.batch=('data', 'fsdp') and sharding.rules."
     "act_heads=('data',) both split over 'data', but one array has both axes ([batch, seq, "
     'act_heads, -])'),
    (dict(layers=('tensor',)), "sharding.rules.layers=('tensor',) and sharding.rules.heads="
     "('tensor',) both split over 'tensor'"),
    (dict(seq=('tensor',), act_seq=('tensor',)), "sharding.rules.seq=('tensor',) and sharding."
     "rules.act_seq=('tensor',) both split over 'tensor', but one array has both axes ([batch, "
     'seq·act_seq, act_embed])'),
    (dict(vocab=('tensor', 'tensor')), "sharding.rules.vocab=('tensor', 'tensor') names "
     "'tensor' twice"),
], ids=['weight', 'activation', 'stacked_layers', 'one_dimension', 'one_rule'])
def test_a_mesh_axis_on_two_dimensions_of_one_array_names_the_rules(rules, message):
  """JAX refuses a sharding that splits two dimensions of an array over one mesh axis (a
  traceback when the step is built): validation names the two rules, in one line."""
  cfg = small_config(data=2, fsdp=2, tensor=2)
  cfg.sharding.rules.update(rules)
  with pytest.raises(ConfigError) as error:
    validate(cfg, dict(cfg.mesh))
  assert str(error.value).startswith(message) and '\n' not in str(error.value)


def _names(shape) -> set[str]:
  """The logical names of a shape (a dimension's several each), Nones left out."""
  return {n for e in shape for n in (e if isinstance(e, tuple) else (e,)) if n}


def trace_step(cfg) -> None:
  """Traces `cfg`'s train step on the 8 devices from shapes, as `compile_step` builds it,
  without compiling it."""
  mesh_shape = resolve_mesh(cfg.mesh, jax.device_count())
  layout = derive(cfg.sharding.rules, mesh_shape, cfg.model, cfg.sharding.zero)
  mesh = make_mesh(mesh_shape)
  pipeline = pipeline_spec(cfg, mesh_shape['pipe'])
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  graphdef, abstract, shardings = state_shapes(cfg.model, tx, mesh, layout.rules, 0, pipeline)
  rows = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len), jnp.int32,
                              sharding=batch_sharding(mesh, layout.rules, 2))
  batch = {'inputs': rows, 'targets': rows, 'positions': rows, 'segment_ids': rows,
           'mask': rows.update(dtype=jnp.float32)}
  with sharding_context(mesh, layout.rules):
    jax.jit(train_step_for(cfg, graphdef, tx, pipeline)).trace(
        restore_target(abstract, shardings), batch)


@pytest.mark.slow
def test_the_logical_shapes_validation_checks_are_every_one_a_step_lays_out(monkeypatch):
  """`LOGICAL_SHAPES`, which validation checks the rules against, covers every array the
  model lays out (some entry has all of its logical names): its parameters', as the model
  names them, and every layout asked for by logical names (`logical_spec`) while train steps
  are traced: plain; with the sequence split (context and sequence parallelism, collective
  matmuls); pipelined by GPipe (weights gathered per iteration) and 1F1B; and with experts,
  plain and pipelined. A layout the list lacks fails here, before a rule can split it twice
  unchecked. (The decode step's KV cache is laid out by `KV_CACHE_AXES`, which the list
  names.)"""
  asked = set()
  original = mesh_lib.logical_spec

  def recording(*names):
    asked.add(names)
    return original(*names)

  for name, module in list(sys.modules.items()):
    if name.startswith('jaxllm') and getattr(module, 'logical_spec', None) is original:
      monkeypatch.setattr(module, 'logical_spec', recording)
  split, piped = dict(data=2, fsdp=2, tensor=2), dict(data=2, pipe=2, tensor=2)
  for mesh, rules, fields in [
      (split, {}, {}),
      (split, dict(batch=('data',), seq=('fsdp',), act_seq=('tensor',)),
       dict(model=dict(collective_matmul=True))),
      (piped, {}, dict(pipeline=dict(gather_weights='iteration'))),
      (piped, {}, dict(pipeline=dict(schedule='1f1b'))),
      (split, {}, dict(model=dict(moe=dict(experts=4, shared_experts=1)))),
      (piped, {}, dict(model=dict(moe=dict(experts=4, router='sigmoid'))))]:
    cfg = small_config(**mesh)
    cfg.model.num_layers = 2
    cfg.sharding.rules.update(rules)
    for section, values in fields.items():
      cfg[section].update(values)
    trace_step(cfg)
  named = set()
  for moe in (dict(), dict(experts=4, shared_experts=1, first_dense=1, router='sigmoid')):
    cfg = small_config()
    cfg.model.moe.update(moe)
    with sharding_context(make_mesh(dict(cfg.mesh), jax.devices()[:1]), cfg.sharding.rules):
      model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    named |= {tuple(v.get_metadata()['out_sharding']) for v in jax.tree.leaves(
        nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))}
  assert ('layers', 'embed', 'mlp') in named and ('batch', 'seq', 'act_mlp') in asked
  assert ('layers', 'experts', None, 'expert_mlp') in named
  uncovered = [s for s in named | asked
               if not any(_names(s) <= _names(entry) for entry in LOGICAL_SHAPES)]
  assert not uncovered, uncovered
