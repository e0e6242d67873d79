"""The pipeline against the plain layer stack, and trained against one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (assert_params_close, model_on, paired_leaves, small_config,
                      step_gradients, text_config)
from jaxllm.config import ConfigError
from jaxllm.cost import hlo
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.pipeline.gpipe import pipeline_layers
from jaxllm.pipeline.spec import PipelineSpec, to_stage_order
from jaxllm.train import setup, train
from jaxllm.validate import resolve_mesh, validate

LAYERS = 8


def stack_config():
  cfg = small_config()
  cfg.model.num_layers = LAYERS
  return cfg


def loss_and_grads(cfg, mesh, layers_fn):
  """Loss and gradients (params, input) of sum(sin(stack(x))) for a fixed model and input.

  Rows are packed: row b holds a document of b % 7 + 1 tokens, then the next one, so every
  micro-batch must travel with its own positions and segment ids."""
  graphdef, params = model_on(cfg, mesh)
  with sharding_context(mesh, cfg.sharding.rules):
    x_BTD = jax.random.normal(jax.random.key(1), (16, 8, cfg.model.embed_dim))
    t, cut = np.arange(8), np.arange(16)[:, None] % 7 + 1
    segment_ids_BT = jnp.asarray(np.where(t < cut, 1, 2))
    positions_BT = jnp.asarray(np.where(t < cut, t, t - cut))

    def loss(params, x_BTD):
      y = layers_fn(graphdef, params, x_BTD, positions_BT, segment_ids_BT)
      return jnp.sum(jnp.sin(y))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x_BTD)


@pytest.fixture(scope='module')
def plain_stack():
  """The reference: the scanned layer stack on one device."""
  mesh = make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])
  return loss_and_grads(stack_config(), mesh,
                        lambda g, p, x, pos, seg: nnx.merge(g, p).layers(x, pos, seg)[0])


# Remat inside the pipeline: per layer under GPipe, and under circular also a checkpoint per
# iteration that recomputes the weights (`model.stack_policy`).
CASES = ([(S, R, M, 'none') for S in (2, 4) for R in (1, 2) for M in (S, 2 * S)]
         + [(2, 1, 2, 'dots_except_mlp'), (2, 2, 4, 'full')])


@pytest.mark.slow
@pytest.mark.parametrize('stages,repeats,microbatches,remat', CASES)
def test_pipeline_equals_plain_stack(stages, repeats, microbatches, remat, plain_stack):
  """Outputs and gradients match for GPipe and circular, whatever the remat; bubbles are fed
  NaN and must not leak."""
  cfg = stack_config()
  cfg.model.remat = remat
  cfg.mesh.update(pipe=stages, data=8 // stages // 2, tensor=2)
  mesh = make_mesh(resolve_mesh(cfg.mesh, jax.device_count()))
  spec = PipelineSpec(stages, repeats, microbatches, 'step', bubble_fill=float('nan'))

  def pipelined(graphdef, params, x_BTD, positions_BT, segment_ids_BT):
    # The pipeline stores circular layers stage-major; converting inside the loss returns
    # the gradients in layer order, comparable with the reference.
    model = nnx.merge(graphdef, to_stage_order(params, stages, repeats))
    return pipeline_layers(model.blocks, x_BTD, positions_BT, segment_ids_BT, spec,
                           model.cfg)[0]

  (loss, grads), (ref_loss, ref_grads) = loss_and_grads(cfg, mesh, pipelined), plain_stack
  assert np.isfinite(loss)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for got, want in paired_leaves(grads, ref_grads):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow
def test_a_bf16_pipeline_trains_on_the_cpu():
  """bf16 compute through GPipe on the CPU: XLA's CPU compiler aborted the process (exit 134)
  in its all-reduce-promotion pass, on the bf16 reduce-scatter of the pipeline's outputs over
  pipe; `jaxllm.backends.compiler_options` leaves that pass out of pipelined programs."""
  cfg = small_config(pipe=2, data=2, tensor=2)
  cfg.model.dtype = 'bfloat16'
  cfg.train.steps = 1
  _, history = train(cfg)
  assert [row['step'] for row in history] == [1] and np.isfinite(history[0]['loss'])


def test_stage_order_round_trips_and_interleaves():
  from jaxllm.pipeline.spec import from_stage_order
  tree = {'blocks': {'w': jnp.arange(8)}, 'embed': jnp.arange(3)}
  staged = to_stage_order(tree, stages=2, repeats=2)
  # Stage 0 holds blocks 0 and 2 (layers 0,1 and 4,5); stage 1 holds blocks 1 and 3.
  np.testing.assert_array_equal(staged['blocks']['w'], [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_array_equal(staged['embed'], [0, 1, 2])
  np.testing.assert_array_equal(from_stage_order(staged, 2, 2)['blocks']['w'], np.arange(8))


PIPE_MESHES = {  # mesh, pipeline settings, train.micro_batches, sharding.zero
    'pipe2_data2_tensor2': (dict(pipe=2, data=2, tensor=2), {}, 1, 0),
    'pipe4_fsdp2': (dict(pipe=4, fsdp=2), {}, 1, 0),
    'pipe2_fsdp2_tensor2': (dict(pipe=2, fsdp=2, tensor=2), {}, 1, 0),
    'pipe2_data2_tensor2_circular': (dict(pipe=2, data=2, tensor=2),
                                     dict(schedule='circular', repeats=2), 1, 0),
    'pipe2_fsdp4_per_iteration': (dict(pipe=2, fsdp=4), dict(gather_weights='iteration'), 1, 0),
    'pipe2_data2_tensor2_micro2': (dict(pipe=2, data=2, tensor=2), {}, 2, 0),
    'pipe2_data2_tensor2_1f1b_micro2_zero1': (dict(pipe=2, data=2, tensor=2),
                                              dict(schedule='1f1b'), 2, 1),
    'pipe2_fsdp2_tensor2_interleaved_1f1b': (dict(pipe=2, fsdp=2, tensor=2),
                                             dict(schedule='interleaved_1f1b', repeats=2), 1, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize('mesh,pipeline,micro_batches,zero', PIPE_MESHES.values(),
                         ids=PIPE_MESHES.keys())
def test_pipelined_training_matches_one_device(mesh, pipeline, micro_batches, zero, corpus,
                                               one_device_run):
  """Losses, gradient norms and trained params of 3 steps match one device's at 1e-5."""
  from jaxllm.pipeline.spec import from_stage_order
  ref_params, ref_losses, ref_norms = one_device_run
  cfg = text_config(corpus, **mesh)
  cfg.pipeline.update(microbatches=mesh['pipe'], **pipeline)
  cfg.train.micro_batches = micro_batches
  cfg.sharding.zero = zero
  state, history = train(cfg)
  np.testing.assert_allclose([r['loss'] for r in history], ref_losses, rtol=1e-5)
  np.testing.assert_allclose([r['grad_norm'] for r in history], ref_norms, rtol=1e-5)
  params = from_stage_order(jax.device_get(state.params), mesh['pipe'], cfg.pipeline.repeats)
  assert_params_close(params, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize('remat,pipeline', [('full', {}),
                                             ('dots', dict(schedule='circular', repeats=2))],
                         ids=['full_gpipe', 'dots_circular'])
def test_pipelined_step_gradients_match_one_device(remat, pipeline, corpus,
                                                   one_device_gradients):
  """The train step's loss and every parameter gradient, pipelined (pipe=2 × data=2 ×
  tensor=2, 2 pipeline micro-batches; circular adds the per-iteration checkpoint of
  `stack_policy`) under remat and summed over 2 micro-batches of the batch
  (train.micro_batches), against one device's step through the plain layer stack (no
  pipeline, no remat, one batch), in fp32. Gradients themselves, not trained params: AdamW's
  update is blind to a gradient's scale (see `one_device_run`)."""
  ref_loss, ref_grads = one_device_gradients
  cfg = text_config(corpus, pipe=2, data=2, tensor=2)
  cfg.model.remat = remat
  cfg.pipeline.update(microbatches=2, **pipeline)
  cfg.train.micro_batches = 2
  loss, grads = step_gradients(cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for got, want in paired_leaves(grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow
def test_each_device_holds_only_its_stage():
  """pipe=2 × fsdp=2 × tensor=2: a stacked weight is split 2 ways on layers, then fsdp/tensor."""
  cfg = small_config(pipe=2, fsdp=2, tensor=2)
  cfg.model.num_layers = 6  # no other dimension is 6, so a gathered stack is recognisable
  cfg.train.global_batch = 16
  run = setup(cfg)
  wq = run.state.params['blocks']['attn']['wq_DNH'][...]      # [L, D, N, H]
  assert {s.data.shape for s in wq.addressable_shards} == {(3, 32, 4, 8)}
  stack_bytes = sum(x.nbytes for x in jax.tree.leaves(run.state.params['blocks']))
  per_device = sum(x.addressable_shards[0].data.nbytes
                   for x in jax.tree.leaves(run.state.params['blocks']))
  # Matrices split 8 ways; the norm scales only 2 ways (pipe), so allow a little more.
  assert stack_bytes / 8 <= per_device <= stack_bytes / 8 * 1.05
  with sharding_context(run.mesh, run.layout.rules):
    text = run.train_step.lower(run.state, next(run.batches)).compile().as_text()
  found = hlo.collectives(text, dict(run.mesh.shape), cpu=True)
  assert any(c.kind == 'collective-permute' and c.axes == ('pipe',) for c in found)
  # Each stage gathers its own 3 layers' weights over fsdp, [stage, repeat, layer, ...] = [1,
  # 1, 3, ...]; nothing gathers all 6 (as XLA does over pipe for the same step unpipelined).
  gathered = all_gathers(text, dict(run.mesh.shape))
  assert any(axes == ('fsdp',) and dims[:3] == (1, 1, 3) for axes, dims in gathered), gathered
  assert not [dims for _, dims in gathered if 6 in dims[:3]], 'a whole layer stack was gathered'


def all_gathers(text: str, mesh_shape: dict[str, int]) -> list[tuple[tuple[str, ...], tuple]]:
  """(the mesh axes it spans, the dimensions it delivers) of each all-gather of a compiled
  program."""
  computations, _ = hlo.program(text)
  return [(hlo.group_axes(hlo.device_groups(inst.attrs), mesh_shape)[0], dims)
          for insts in computations.values() for inst in insts.values()
          if hlo.collective_kind(inst) == 'all-gather'
          for _, dims in hlo.arrays(hlo.delivered(inst))]


@pytest.mark.parametrize('rules,message,alone', [
    # every stage would run stage 0's blocks: the others' gradients 0.0, the loss still falling
    (dict(layers=()), "sharding.rules.layers=(): mesh.pipe=2 cuts the layer stack into stages "
                      "over 'pipe', so the layers rule must be ('pipe',) alone", True),
    (dict(layers=('data',)), "sharding.rules.layers=('data',): mesh.pipe=2", True),
    (dict(layers=('pipe', 'data')), "sharding.rules.layers=('pipe', 'data'): mesh.pipe=2", True),
    # fsdp splits the weights' embed dimension as well: refused without a pipeline too
    (dict(layers=('fsdp',)), "sharding.rules.layers=('fsdp',): mesh.pipe=2", False),
    # the head's vocabulary split by hand over the stages: a NaN loss
    (dict(vocab=('pipe',)), "sharding.rules.vocab=('pipe',) names 'pipe', which the pipeline "
                            "(mesh.pipe=2) keeps for the stages of the layer stack", True),
])
def test_a_pipeline_takes_the_layers_rule_on_pipe_alone(rules, message, alone):
  """A run refuses, in one line, a rules table that would pipeline the wrong blocks; without
  a pipeline the same rules are the user's to choose (where nothing else refuses them)."""
  cfg = small_config(pipe=2, data=2, fsdp=2)
  cfg.train.global_batch = 16
  cfg.sharding.rules.update(rules)
  with pytest.raises(ConfigError) as error:
    setup(cfg)
  assert message in str(error.value) and '\n' not in str(error.value)
  cfg.mesh.update(pipe=1, data=4)
  if alone:
    validate(cfg, dict(cfg.mesh))
  else:
    with pytest.raises(ConfigError, match="both split over 'fsdp'"):
      validate(cfg, dict(cfg.mesh))


def test_pipeline_settings_without_a_pipeline_are_a_note(capsys):
  """pipeline.* on mesh.pipe=1 change nothing: the run says which, and trains unpipelined."""
  cfg = small_config(data=2)
  cfg.pipeline.update(schedule='1f1b', microbatches=4)
  run = setup(cfg, jax.devices()[:2])
  assert run.pipeline is None
  assert ("note: mesh.pipe=1 runs no pipeline, so these settings do nothing: "
          "pipeline.microbatches=4, pipeline.schedule='1f1b'.") in capsys.readouterr().out
  setup(small_config(data=2), jax.devices()[:2])
  assert 'pipeline' not in capsys.readouterr().out


def loop_collectives(text: str) -> set[str]:
  """Kinds of collective inside while-loop bodies of a compiled HLO module."""
  bodies = set(re.findall(r'body=%?([\w.\-]+)', text))
  found, current = set(), None
  for line in text.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if header:
      current = header.group(1)
    elif current in bodies:
      found |= set(re.findall(
          r' (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(',
          line))
  return found


@pytest.mark.slow
@pytest.mark.parametrize('gather,in_loops', [
    ('step', {'collective-permute'}),
    ('iteration', {'collective-permute', 'all-gather', 'reduce-scatter'}),
])
def test_batch_axis_traffic_is_once_per_step(gather, in_loops):
  """data × fsdp gradients are reduced after the pipeline loop, not per micro-batch; only
  per-iteration gathering moves fsdp weights inside it."""
  cfg = small_config(pipe=2, data=2, fsdp=2)
  cfg.train.global_batch = 16
  cfg.pipeline.gather_weights = gather
  run = setup(cfg)
  with sharding_context(run.mesh, run.layout.rules):
    text = run.train_step.lower(run.state, next(run.batches)).compile().as_text()
  assert loop_collectives(text) == in_loops
