"""Every test runs on 8 simulated CPU devices, so every mesh axis can be exercised; GPU
programs are compiled for GPUs that are not there (`jaxllm.backends.gpu_devices`).

The suite has a time budget; tests/README.md says how it is kept (one compilation cache per
run, commands run in this process, costly fixtures built once per run)."""

import atexit
import contextlib
import fcntl
import functools
import gc
import importlib
import importlib.util
import io
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import tempfile
import types

# The reference models tests run in torch (transformers') are small: with a thread pool of its
# own on the 2 cores the workers share, torch spins waiting more than it computes (a tiny Llama's
# forward took 2-3x the CPU time on 2 threads as on 1, in the same wall time; test_families'
# comparisons with transformers 16.3-17.0 CPU-s against 16.9-18.4, alternating). Set before torch
# is imported; the workers and the commands tests start inherit it (numpy's BLAS there reads it
# too). XLA's thread pools do not read it.
os.environ.setdefault('OMP_NUM_THREADS', '1')

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from absl import logging as absl_logging
from grain._src.python.dataset.transformations import shuffle as grain_shuffle

from jaxllm import backends
from jaxllm.backends import start_backends, use_compilation_cache
from jaxllm.config import default_config

# The CPU programs the tests compile run a few steps: LLVM's optimisations and XLA's CPU fusion
# emitters take most of a compile (a mesh step compiles in a third of the CPU time without
# them) and make each step ~2.5x slower, so a process that runs many steps (a notebook's 40,
# the CLI's 20) goes without them: USER_XLA_FLAGS. The CPU program fuses differently without
# the emitters (the collectives and shardings tests read are the same); GPU programs
# are the same, byte for byte. Set before the backends start; commands a test starts inherit.
CHEAP_CPU_COMPILES = ('--xla_backend_optimization_level=0 '
                      '--xla_llvm_disable_expensive_passes=true '
                      '--xla_cpu_use_fusion_emitters=false '
                      '--xla_cpu_parallel_codegen_split_count=1')
USER_XLA_FLAGS = os.environ.get('XLA_FLAGS', '').replace(CHEAP_CPU_COMPILES, '').strip()
os.environ['XLA_FLAGS'] = f'{USER_XLA_FLAGS} {CHEAP_CPU_COMPILES}'.strip()
_BACKENDS = default_config()
_BACKENDS.cpu_devices = 8
start_backends(_BACKENDS)  # as every command starts them

# One directory for the whole run, made by the first process (pytest; under xdist, the process
# that starts the workers) and inherited by the workers and every command a test starts: it
# holds the run's compilation cache (XDG_CACHE_HOME, where `compilation_cache='auto'` keeps
# programs, not the user's cache) and what `once_per_run` computed.
if 'JAXLLM_TEST_RUN_DIR' not in os.environ:
  os.environ['JAXLLM_TEST_RUN_DIR'] = tempfile.mkdtemp(prefix='jaxllm-test-run-')
  atexit.register(shutil.rmtree, os.environ['JAXLLM_TEST_RUN_DIR'], ignore_errors=True)
RUN_DIR = os.environ['JAXLLM_TEST_RUN_DIR']
os.environ['XDG_CACHE_HOME'] = os.path.join(RUN_DIR, 'cache')
# Programs this process compiles for its CPU devices (train(), setup(), compile_step) are kept
# there too and read back by every other process of the run; those compiled for GPUs that are
# not there are left out (`backends.compiling_for`).
use_compilation_cache('auto')

# grain's shuffle asks its index_shuffle for each element of each epoch, one call each, and a
# call over a small dataset costs milliseconds (3.7 ms an element at the tests' 12 documents,
# 40 µs at 1,000): the tests' small corpora, shuffled with the same seeds by run after run,
# took minutes of the suite. The function is pure; remembering its answers in this process
# leaves every order as it was.
_grain_index_shuffle = grain_shuffle.index_shuffle
grain_shuffle.index_shuffle = types.SimpleNamespace(
    index_shuffle=functools.lru_cache(maxsize=1 << 20)(_grain_index_shuffle.index_shuffle))

from jaxllm.cost import compile as compile_module  # noqa: E402
from jaxllm.cost import hlo  # noqa: E402
from jaxllm.parallel.mesh import make_mesh, sharding_context  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests' own GPU programs are compiled to be read, never run, and ptxas, started once per
# kernel (~180 processes for tiny), is a third of such a compile's CPU time for machine code
# nothing reads. Their compiles (`compile_step` in a test's process) take a stand-in assembler
# that writes an empty file for each kernel and reports the real one's version, so the PTX is
# the same; the HLO and the memory are the same, byte for byte (test_gpu_program's
# test_kernels_kept_in_the_cache_or_left_unassembled_make_the_same_program). Its kernels are
# kept apart from ptxas's in the run's cache. ptxas assembles, as for a user, the commands
# tests run (`run_main`, `run_cli`, the notebooks), the programs tests compile themselves
# (test_grouped_matmul's: our Triton kernels, at the published MoE model's shapes) and what
# runs under `real_ptxas` (the FP8 programs, the kernel cache's test).
PTXAS = shutil.which('ptxas') or '/usr/local/cuda/bin/ptxas'
PTXAS_STAND_IN = os.path.join(RUN_DIR, 'ptxas-stand-in')  # a CUDA directory: bin/ptxas
if os.path.exists(PTXAS) and not os.path.exists(PTXAS_STAND_IN):
  os.makedirs(os.path.join(PTXAS_STAND_IN + '.partial', 'bin'), exist_ok=True)
  with open(os.path.join(PTXAS_STAND_IN + '.partial', 'bin', 'ptxas'), 'w') as f:
    f.write('#!/bin/sh\n'
            '# An empty file where XLA asks ptxas for a kernel (-o FILE); the version is ptxas\'s.\n'
            f'[ "$1" = --version ] && exec {shlex.quote(PTXAS)} --version\n'
            'while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2" && exit 0; shift; done\n'
            'echo "ptxas stand-in: no -o FILE it could write" >&2; exit 1\n')
    os.fchmod(f.fileno(), 0o755)
  os.replace(PTXAS_STAND_IN + '.partial', PTXAS_STAND_IN)


def _stand_in_kernel_file(setting, device):
  path = backends.gpu_kernel_file(setting, device)
  return path and '{}.stand-in{}'.format(*os.path.splitext(path))


def _assemble_with_stand_in(on: bool):
  if on and os.access(os.path.join(PTXAS_STAND_IN, 'bin', 'ptxas'), os.X_OK):  # (not noexec)
    compile_module.COMPILE_OPTIONS['xla_gpu_cuda_data_dir'] = PTXAS_STAND_IN
    compile_module.gpu_kernel_file = _stand_in_kernel_file
  else:
    compile_module.COMPILE_OPTIONS.pop('xla_gpu_cuda_data_dir', None)
    compile_module.gpu_kernel_file = backends.gpu_kernel_file


@contextlib.contextmanager
def real_ptxas():
  """GPU programs compiled within have their kernels assembled by ptxas, as a user's are."""
  kept = 'xla_gpu_cuda_data_dir' in compile_module.COMPILE_OPTIONS
  _assemble_with_stand_in(False)
  try:
    yield
  finally:
    _assemble_with_stand_in(kept)


_assemble_with_stand_in(True)


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

  def run():
    state, history = train(text_config(corpus), devices=jax.devices()[:1])
    return (jax.device_get(state.params), [row['loss'] for row in history],
            [row['grad_norm'] for row in history])
  return once_per_run('one_device_run', run)


def first_step(cfg, devices=None):
  """The metrics (on the host) and the parameter gradients (summed over the batch, divided by
  its tokens) of the first step of `cfg` from its initial params, as its train step computes
  them on its mesh (its ZeRO stage, its routers' biases): `jaxllm.step.make_train_step` with
  an "optimizer" that stores the gradients it is given as its state. Blocks in layer order,
  on the host."""
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
                         run.pipeline, zero=run.layout.zero)
  with sharding_context(run.mesh, run.layout.rules):
    state = TrainState(run.state.step, run.state.params, jax.jit(keep.init)(run.state.params),
                       router_bias=run.state.router_bias)
    options = compiler_options(cfg.model, run.mesh.devices.flat[0].platform,
                               run.pipeline is not None)
    new_state, metrics = jax.jit(step, compiler_options=options)(state, next(run.batches))
  grads = jax.device_get(new_state.opt_state)
  if run.pipeline:
    grads = from_stage_order(grads, run.pipeline.stages, run.pipeline.repeats)
  return jax.device_get(metrics), grads


def step_gradients(cfg, devices=None):
  """`first_step`'s loss and gradients."""
  metrics, grads = first_step(cfg, devices)
  return float(metrics['loss']), grads


@pytest.fixture(scope='session')
def one_device_gradients(corpus):
  """`step_gradients` of `text_config` on one device: the reference for meshes in fp32."""
  return once_per_run('one_device_gradients',
                      lambda: step_gradients(text_config(corpus), jax.devices()[:1]))


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
  """Runs `python -m <module> ...` in a fresh process from the repository root: for what only
  a fresh process shows (its exit status and all it prints, signals, jax.distributed, the
  console scripts). Otherwise `run_cli_in_process`, which saves the seconds a process takes to
  start."""
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def run_cli_in_process(*args, module='jaxllm.train'):
  """`run_cli`'s command run in this process (`run_main`)."""
  return run_main(['python', '-m', module, *args])


def _started(cfg=None):
  """`jaxllm.backends.start_backends` in a process whose backends have started: 8 CPU devices,
  the default config's XLA flags. A command asking for what they cannot give needs a fresh
  process (`run_cli`); so does one that checks a mesh against the devices present and asks
  for fewer (it sees 8)."""
  if cfg is None:
    return
  assert cfg.cpu_devices <= jax.device_count(), (
      f'cpu_devices={cfg.cpu_devices}: more than this process has; run it with run_cli')
  flags_asked = (cfg.xla_flags or '').split()
  assert set(flags_asked) <= set(os.environ.get('XLA_FLAGS', '').split()), (
      f'xla_flags={cfg.xla_flags!r} are not those this process started with; run it with '
      'run_cli')


def run_main(argv: list[str], cwd=REPO) -> subprocess.CompletedProcess:
  """Runs the command `python -m <module> ...` (or `python <script.py> ...`) in this process,
  from `cwd`, as `main_guard` runs it: returns its exit status and what it printed. What a run
  changes is put back: the working directory, the environment, absl's flags and verbosity,
  the jax settings commands make.

  The backends of this process have started (8 CPU devices): the command's `start_backends`
  checks they are what it asks for (`_started`), and a `jaxllm.train` run joins no
  jax.distributed run (`--config.distributed.num_processes=1` is added: JAX would refuse to
  start it now). ptxas assembles its GPU programs' kernels, as for a user (`real_ptxas`).
  What only a fresh process shows is `run_cli`'s."""
  assert argv[0] == 'python', argv
  if argv[1] == '-m':
    name, args = argv[2], argv[3:]
    module = importlib.import_module(name + ('.__main__' if name == 'jaxllm.hf' else ''))
  else:
    name, args = argv[1], argv[2:]
    module = load_script(os.path.join(cwd, name))
  if name == 'jaxllm.train':
    args = [*args, '--config.distributed.num_processes=1']
  patched = [m for n, m in list(sys.modules.items()) if (n.startswith('jaxllm') or m is module)
             and getattr(m, 'start_backends', None) is start_backends]
  env, verbosity = dict(os.environ), absl_logging.get_verbosity()
  cache = {k: getattr(jax.config, k) for k in ('jax_compilation_cache_dir',
                                               'jax_persistent_cache_min_compile_time_secs')}
  out, err, argv_kept = io.StringIO(), io.StringIO(), sys.argv
  code = 0
  try:
    for m in patched:
      m.start_backends = _started
    sys.argv = [name, *args]
    with (contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
          real_ptxas()):
      try:
        module.main_guard(module.main)
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
  finally:
    for m in patched:
      m.start_backends = start_backends  # conftest's own import: jaxllm.backends is patched too
    sys.argv = argv_kept
    for key in set(os.environ) - set(env):
      del os.environ[key]
    os.environ.update(env)
    absl_logging.set_verbosity(verbosity)
    flags.FLAGS.unparse_flags()
    for k, v in cache.items():
      jax.config.update(k, v)
  return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def load_script(path: str):
  """A script (benchmarks/X.py) as a module, once: not through sys.path, where its neighbours
  (benchmarks/data.py, checkpoint.py) would shadow the modules of those names."""
  name = os.path.splitext(os.path.basename(path))[0]
  if getattr(sys.modules.get(name), '__file__', None) != path:
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  return sys.modules[name]


def once_per_run(name: str, compute):
  """`compute()` computed by one process of the test run and read back by the others (under
  xdist each worker builds session fixtures of its own): pickled into the run's directory,
  under a lock that makes a second process wait for the first's result. For results that can
  be pickled (numpy trees, paths, printed text)."""
  path = os.path.join(RUN_DIR, 'once', f'{name}.pickle')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(f'{path}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(path):
      with open(path, 'rb') as f:
        return pickle.load(f)
    result = compute()
    with open(f'{path}.partial', 'wb') as f:
      pickle.dump(result, f)
    os.replace(f'{path}.partial', path)
    return result


def run_dir(name: str) -> str:
  """A new directory in the run's, for a `once_per_run` result that lives on disk."""
  return tempfile.mkdtemp(prefix=f'{name}-', dir=RUN_DIR)


# Fixtures that take seconds to build and hold what no file can (compiled programs keep their
# devices): every test that uses one of a group runs on the xdist worker that builds them
# (`--dist loadgroup`, pyproject.toml), so each is built once per run. What can be pickled is
# shared through `once_per_run` instead, and its tests spread over the workers; but where they
# only read it, a second worker asking for it would sit idle until the first has made it (the
# CLI's tiny runs: 23 s), so they are a group too.
ONE_WORKER = {
    'h100_programs': {'tiny_program', 'tiny_accumulating', 'one_b_programs', 'tiny_pipelines',
                      'pipeline_program', 'tiny_split'},
    'sequence_parallel_programs': {'tiny_programs'},
    'qwen3_moe_program': {'qwen3_moe'},
    'cli_tiny_runs': {'tiny_runs'},
    'fp8_one_device_runs': {'one_device_fp8'},  # (a mesh test on the other worker waited 6 s)
}

# The run ends on these modules' tests, ~70 of a few tenths of a second each. xdist hands each
# worker up to three tests ahead: a long test near the end keeps one worker busy while the
# other has nothing left (test_timing's command, 7 s, ended a run alone).
LAST_MODULES = ('test_data.py', 'test_chat.py', 'test_imports.py')
assert all(os.path.exists(os.path.join(REPO, 'tests', name)) for name in LAST_MODULES), (
    f'LAST_MODULES names a module tests/ does not have: {LAST_MODULES}')


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: item.path.name in LAST_MODULES)  # stable: each module in order
  for item in items:
    groups = {g for g, names in ONE_WORKER.items() if names & set(item.fixturenames)}
    assert len(groups) <= 1, f'{item.nodeid} uses fixtures of {groups}: make them one group'
    if groups:
      item.add_marker(pytest.mark.xdist_group(groups.pop()))


# Python collects its oldest generation after this many collections of the middle one (default
# 10); tests end with a full collection (below), and tracing a program sets off thousands of
# young ones, whose survivors are mostly the traced program's caches.
OLDEST_EVERY = 1000
gc.set_threshold(*gc.get_threshold()[:2], OLDEST_EVERY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """After each test (its fixtures torn down, the session's too after the last), its garbage
  is collected and what outlives it (caches of traced and compiled programs, the fixtures kept
  for later tests) is frozen out of Python's later collections: pytest's own five at the end
  (its check for exceptions raised in `__del__`) among them. Each collection of the oldest
  generation walked every object the process had kept: a run's workers spent 70 CPU-s
  collecting, 28 this way. (A frozen fixture's reference cycles outlive its teardown; the
  run's peak memory is the same.) Within a test the oldest generation is left alone
  (`OLDEST_EVERY`): tune's search of tiny spent 2.2 of its 25 CPU-s in 26 collections of it,
  0.2 in 6 this way."""
  yield
  gc.collect()
  gc.freeze()


@pytest.fixture
def tiny_config():
  from jaxllm.cli import load_config
  return load_config(os.path.join(REPO, 'configs', 'tiny.py'))

