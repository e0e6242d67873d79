"""Every test runs on 8 simulated CPU devices, so every mesh axis can be exercised; GPU
programs are compiled for GPUs that are not there (`jaxllm.backends.gpu_devices`)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxllm.backends import start_backends
from jaxllm.config import default_config

_BACKENDS = default_config()
_BACKENDS.cpu_devices = 8
start_backends(_BACKENDS)  # as every command starts them

from jaxllm import hlo  # noqa: E402
from jaxllm.mesh import make_mesh, sharding_context  # noqa: E402

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


def text_config(corpus, **mesh):
  """`small_config` reading the test corpus; lr kept small for equivalence checks (see
  `assert_params_close`)."""
  cfg = small_config(**mesh)
  cfg.data.update(source='files', path=corpus)
  cfg.optim.lr = 1e-3
  return cfg


def assert_params_close(got_tree, want_tree):
  """Each parameter tensor within 1e-5 relative (in norm) of the reference.

  Norm-wise because Adam divides each element's step by its own gradient scale, so an
  element whose gradient is ~0 turns reduction-order noise into a change of up to ~lr.
  """
  for got, want in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def data_reductions(compiled) -> list[hlo.Collective]:
  """The reductions of a compiled step (`jaxllm.analyze.Compiled`) whose device groups span
  the data axis."""
  return [c for c in hlo.collectives(compiled.text, compiled.mesh_shape, cpu=compiled.cpu)
          if 'data' in c.axes and c.kind in ('all-reduce', 'reduce-scatter')]


@pytest.fixture(scope='session')
def one_device_run(corpus):
  """The reference for every mesh: `text_config` trained 3 steps on a single device."""
  from jaxllm.train import train
  state, history = train(text_config(corpus), devices=jax.devices()[:1])
  return jax.device_get(state.params), [row['loss'] for row in history]


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


def run_cli(*args, module='jaxllm.train', timeout=300):
  """Runs `python -m <module> ...` in a fresh process from the repository root."""
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_config():
  from jaxllm.config import load_config
  return load_config(os.path.join(REPO, 'configs', 'tiny.py'))


def assert_same_paths(got_tree, want_tree):
  """The two trees hold leaves at the same paths (a dropped or extra parameter fails)."""
  paths = lambda tree: [jax.tree_util.keystr(p) for p, _ in
                        jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert paths(got_tree) == paths(want_tree)
