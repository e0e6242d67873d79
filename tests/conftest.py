"""Every test runs on 8 simulated CPU devices, so every mesh axis can be exercised; GPU
programs are compiled for GPUs that are not there (`jaxllm.backends.gpu_devices`)."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.backends import start_backends
from jaxllm.config import default_config

_BACKENDS = default_config()
_BACKENDS.cpu_devices = 8
start_backends(_BACKENDS)  # as every command starts them
# The commands tests run keep their compiled programs here, not in the user's cache.
os.environ['XDG_CACHE_HOME'] = tempfile.mkdtemp(prefix='jaxllm-test-cache-')
atexit.register(shutil.rmtree, os.environ['XDG_CACHE_HOME'], ignore_errors=True)

from jaxllm.cost import hlo  # noqa: E402
from jaxllm.parallel.mesh import make_mesh, sharding_context  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**mesh):
  """A small fp32 model on a synthetic batch; `mesh` sets axis sizes (the rest are 1)."""
  c = default_config()
  c.model.update(vocab_size=264, embed_dim=64, num_layers=4, num_heads=8, num_kv_heads=4,
                 head_dim=8, mlp_dim=128)
  c.mesh.update(data=1, fsdp=1, pipe=1, tensor=1)
  c.mesh.update(**mesh)
  c.train.update(steps=3, log_every=1, global_batch=8, seed=0)
  c.optim.update(lr=1e-2, warmup_steps=0)
  c.data.update(source='synthetic', seq_len=32)
  return c


@pytest.fixture
def one_device():
  """Models live on a mesh: this one is a single device, with the default rules."""
  mesh = make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])
  with sharding_context(mesh, default_config().sharding.rules):
    yield mesh


_HOST_PARAMS = {}


def model_on(cfg, mesh):
  """(graphdef, params) of `Transformer(cfg.model, rngs=nnx.Rngs(0))` on `mesh`, laid out by
  cfg's rules. The values are made once per model (remat aside: it changes no parameter), on
  one device, and copied to each mesh: an eager init on a mesh of 8 takes seconds."""
  from flax import nnx
  from jaxllm.model import Transformer
  make = lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))
  key = tuple(sorted((k, str(v)) for k, v in cfg.model.items() if k != 'remat'))
  if key not in _HOST_PARAMS:
    one = make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])
    with sharding_context(one, cfg.sharding.rules):
      _HOST_PARAMS[key] = jax.device_get(nnx.split(make())[1])
  with sharding_context(mesh, cfg.sharding.rules):
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    return graphdef, jax.device_put(_HOST_PARAMS[key], nnx.get_named_sharding(abstract, mesh))


def text_config(corpus, **mesh):
  """`small_config` reading the test corpus; lr kept small for equivalence checks (see
  `assert_params_close`)."""
  cfg = small_config(**mesh)
  cfg.data.update(source='files', path=corpus)
  cfg.optim.lr = 1e-3
  return cfg


def leaf_paths(tree) -> list[str]:
  """The path of every leaf of `tree`, as `jax.tree_util.keystr` spells it, in leaf order."""
  return [jax.tree_util.keystr(path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_same_paths(got_tree, want_tree):
  """Both trees hold leaves at the same paths, in the same order: a dropped, extra or renamed
  parameter fails here, where a zip of their leaves would stop at the shorter one or pair
  tensors by position."""
  got, want = leaf_paths(got_tree), leaf_paths(want_tree)
  assert got == want, (f'missing {sorted(set(want) - set(got))}, '
                       f'extra {sorted(set(got) - set(want))}, or in another order')


def paired_leaves(got_tree, want_tree) -> list[tuple]:
  """The leaves of two trees side by side, once `assert_same_paths` has passed and each pair
  has the same shape (numpy would broadcast a [1, D] against a [L, D])."""
  assert_same_paths(got_tree, want_tree)
  pairs = list(zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree), strict=True))
  for (path, _), (got, want) in zip(jax.tree_util.tree_flatten_with_path(want_tree)[0], pairs):
    assert np.shape(got) == np.shape(want), (jax.tree_util.keystr(path), np.shape(got),
                                             np.shape(want))
  return pairs


def assert_params_close(got_tree, want_tree):
  """Same paths and shapes, and each parameter tensor within 1e-5 relative (in norm) of the
  reference.

  Norm-wise because Adam divides each element's step by its own gradient scale, so an
  element whose gradient is ~0 turns reduction-order noise into a change of up to ~lr.
  """
  for got, want in paired_leaves(got_tree, want_tree):
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def data_reductions(compiled) -> list[hlo.Collective]:
  """The reductions of a compiled step (`jaxllm.cost.compile.Compiled`) whose device groups span
  the data axis."""
  return [c for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=compiled.cpu)
          if 'data' in c.axes and c.kind in ('all-reduce', 'reduce-scatter')]


@pytest.fixture(scope='session')
def one_device_run(corpus):
  """The reference for every mesh: `text_config` trained 3 steps on a single device; its
  params, losses and gradient norms.

  Compare the gradient norms too: AdamW's update g/√v is the same for g and c·g, and
  clipping scales all of g alike, so a mesh whose gradients come out doubled (a reduction
  counted twice) or halved trains exactly like one device; only the norm shows it."""
  from jaxllm.train import train
  state, history = train(text_config(corpus), devices=jax.devices()[:1])
  return (jax.device_get(state.params), [row['loss'] for row in history],
          [row['grad_norm'] for row in history])


def step_gradients(cfg, devices=None):
  """The loss and the parameter gradients (summed over the batch, divided by its tokens) of
  the first step of `cfg` from its initial params, as its train step computes them on its
  mesh: `jaxllm.step.make_train_step` with an "optimizer" that stores the gradients it is
  given as its state. Blocks in layer order, on the host."""
  import optax
  from jaxllm.backends import compiler_options
  from jaxllm.pipeline.spec import from_stage_order
  from jaxllm.step import TrainState, make_train_step
  from jaxllm.train import setup

  keep = optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, _, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))
  run = setup(cfg, devices)
  step = make_train_step(run.graphdef, keep, lambda _: 0.0, cfg.train.micro_batches,
                         run.pipeline)
  with sharding_context(run.mesh, run.layout.rules):
    state = TrainState(run.state.step, run.state.params, keep.init(run.state.params))
    options = compiler_options(cfg.model, run.mesh.devices.flat[0].platform,
                               run.pipeline is not None)
    new_state, metrics = jax.jit(step, compiler_options=options)(state, next(run.batches))
  grads = jax.device_get(new_state.opt_state)
  if run.pipeline:
    grads = from_stage_order(grads, run.pipeline.stages, run.pipeline.repeats)
  return float(metrics['loss']), grads


@pytest.fixture(scope='session')
def one_device_gradients(corpus):
  """`step_gradients` of `text_config` on one device: the reference for meshes in fp32."""
  return step_gradients(text_config(corpus), jax.devices()[:1])


@pytest.fixture(scope='session')
def corpus(tmp_path_factory) -> str:
  """A directory of small text documents, made here (tests download nothing)."""
  root = tmp_path_factory.mktemp('corpus')
  words = ('the mesh splits every layer across devices while the compiler inserts '
           'collectives so that each shard computes its part of the batch').split()
  for i in range(12):
    text = ' '.join(words[(i * 7 + j * 3) % len(words)] for j in range(150 + 40 * i))
    (root / f'doc{i:02d}.txt').write_text(text + '\n')
  return str(root)


@pytest.fixture(scope='session')
def short_documents(tmp_path_factory) -> str:
  """Documents of 1 to 4 short words: packed into 32-token rows, every row holds several, so
  attention's document masks matter."""
  root = tmp_path_factory.mktemp('short_documents')
  words = 'a row of many small docs set end to end'.split()
  for i in range(60):
    (root / f'doc{i:02d}.txt').write_text(
        ' '.join(words[(i + j) % len(words)] for j in range(1 + i % 4)) + '\n')
  return str(root)


def run_cli(*args, module='jaxllm.train', timeout=300):
  """Runs `python -m <module> ...` in a fresh process from the repository root."""
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_config():
  from jaxllm.cli import load_config
  return load_config(os.path.join(REPO, 'configs', 'tiny.py'))

