"""Starting JAX's backends, the persistent compilation cache, and the GPUs a program is
compiled for when none is present.

XLA's GPU compiler ships in JAX's CUDA plugin and compiles for a GPU described by a target
config (`jaxllm.cost.hardware.Gpu`) on a machine that has no GPU at all ("deviceless"
compilation): what it makes is the program that GPU would run, with its fusions, its
collectives as they move and its buffer assignment. `analyze` and `tune` read that program.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import hashlib
import importlib.metadata
import importlib.util
import os

from ml_collections import ConfigDict

from jaxllm.config import ConfigError

CUDA_PLUGINS = ('jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12')
GPU_COMPILE_INSTALL = ('pip install "jaxllm[gpu-compile]" (in a checkout: '
                       'pip install -e ".[gpu-compile]")')


def start_backends(cfg: ConfigDict | None = None) -> None:
  """Applies what JAX reads once, when its backends start: the platform and, from a run's
  config, cpu_devices and xla_flags. Every command calls it before anything runs on a device,
  once its imports are done."""
  import jax
  if cfg and cfg.cpu_devices:
    jax.config.update('jax_num_cpu_devices', cfg.cpu_devices)
  flags = cfg.xla_flags if cfg and cfg.xla_flags else ''
  if flags.strip():
    os.environ['XLA_FLAGS'] = f"{flags.strip()} {os.environ.get('XLA_FLAGS', '')}".strip()
  if not jax.config.jax_platforms and cuda_plugin_installed() and not nvidia_gpu_present():
    # The plugin would fail its start-up check with a long traceback before JAX fell back to
    # the CPU. Left out of the platforms, it still compiles for GPUs (`gpu_devices`).
    jax.config.update('jax_platforms', 'cpu')
  # What the process holds by now (its modules, the config) lives as long as it does: frozen,
  # it is left out of every later garbage collection, and tracing a program sets off
  # thousands (a 2-step tiny run takes 5% less CPU compiling its programs, 13% reading them).
  gc.freeze()


def compiler_options(model_cfg: ConfigDict, platform: str, pipelined: bool = False) -> dict:
  """XLA's options for the programs of a model (its train and eval steps) on `platform`,
  `pipelined` where they run a pipeline (mesh.pipe > 1)."""
  bf16_reductions = model_cfg.grad_reduce_dtype == 'bfloat16' or (
      model_cfg.dtype == 'bfloat16' and (model_cfg.fp8 != 'none' or pipelined))
  if platform == 'cpu' and bf16_reductions:
    # XLA's CPU compiler aborts the process on some bf16 all-reduces (a bf16 gradient
    # reduce-scatter; an FP8 model's on a mesh; a bf16 pipeline's reduce-scatter of its
    # outputs over pipe) in its all-reduce-promotion pass ("Invalid binary instruction opcode
    # copy"); the pass only widens narrow reductions, which GPUs run as they are.
    return {'xla_disable_hlo_passes': 'all-reduce-promotion'}
  if platform == 'gpu' and model_cfg.fp8 != 'none':
    # FP8 matmuls as cuBLASLt FP8 calls, as NVIDIA's FP8 recipes for XLA run them, where
    # XLA's own Triton GEMMs would otherwise take them (and the bf16 ones). Unmerged: XLA's
    # merging of the matmuls of one input (q, k and v; gate and up) concatenates their
    # weights as scaled bf16 (`fp8._matmul`), and the merged matmul runs in bf16.
    return {'xla_gpu_enable_triton_gemm': False, 'xla_gpu_dot_merger_threshold_mb': 0}
  return {}


def use_compilation_cache(setting: str) -> None:
  """Keeps compiled programs in the directory `setting` names (config `compilation_cache`;
  '': none), and reads them back when the same program is compiled again. For commands that
  run their programs: compile-only devices' programs cannot be read back."""
  import jax
  if not setting:
    return
  jax.config.update('jax_compilation_cache_dir', _cache_directory(setting))
  # JAX's default keeps only programs that took a second or more to compile; the small
  # ones add up too (tiny's first save blocks 1.4 s without them, 0.3 s with).
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


@contextlib.contextmanager
def compiling_for(devices):
  """Compiles for `devices`. A program for compile-only devices (`gpu_devices`) stays out of
  the persistent compilation cache, when a process has it on: JAX would write it, but its
  compile-only client cannot load an executable, so reading it back fails (with a warning)
  each time the same program is compiled again."""
  import jax
  if not (devices and is_compile_only(devices[0])):
    yield
    return
  name = 'jax_persistent_cache_min_compile_time_secs'  # what JAX checks before it writes
  kept = getattr(jax.config, name)
  jax.config.update(name, float('inf'))
  try:
    yield
  finally:
    jax.config.update(name, kept)


def gpu_kernel_file(setting: str, device) -> str | None:
  """For a compile-only GPU (`gpu_devices`), the file in the compilation cache (config
  `compilation_cache`; '': none) where XLA's GPU compiler keeps the kernels it generates for
  that kind of GPU: a later compile, in any process, takes each kernel it finds there (by a
  fingerprint of the kernel's HLO and arguments) instead of generating it again, up to three
  quarters of a compile's CPU time (`benchmarks/gpu_kernels.py`). XLA replaces the file whole
  when it adds kernels, so processes may share it (one's additions may be lost to another's,
  never mixed)."""
  import jax
  if not setting or not is_compile_only(device):
    return None
  kind = f'jax {jax.__version__} {device.device_kind} sm {device.compute_capability}'
  name = hashlib.sha256(kind.encode()).hexdigest()[:16]
  return os.path.join(_cache_directory(setting, 'gpu-kernels'), f'{name}.bin')


def _cache_directory(setting: str, *under: str) -> str:
  """The compilation cache's directory (or one `under` it), made if it is not there."""
  directory = os.path.join(compilation_cache_dir(setting), *under)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise ConfigError(f'compilation_cache={setting!r}: cannot create {directory} '
                      f"({e.strerror}); set it to a writable directory, or to '' for no "
                      'cache.') from None
  return directory


def compilation_cache_dir(setting: str) -> str:
  """The directory `compilation_cache` names: 'auto' is jaxllm/compilation under the user's
  cache directory."""
  return user_cache('compilation') if setting == 'auto' else os.path.expanduser(setting)


def user_cache(name: str) -> str:
  """jaxllm/`name` under the user's cache directory (XDG_CACHE_HOME, else ~/.cache)."""
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join('~', '.cache')
  return os.path.expanduser(os.path.join(root, 'jaxllm', name))


@contextlib.contextmanager
def counting_cache_hits():
  """Yields a list that gains an entry for every program read from the compilation cache
  while the block runs (instead of compiled)."""
  import jax
  hits = []

  def listen(event: str, **_):
    if event == '/jax/compilation_cache/cache_hits':
      hits.append(event)
  jax.monitoring.register_event_listener(listen)
  try:
    yield hits
  finally:
    jax.monitoring.unregister_event_listener(listen)


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA plugin is installed: it compiles for NVIDIA GPUs, present or not."""
  return any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)


def nvidia_gpu_present() -> bool:
  """Whether the machine shows an NVIDIA GPU: its driver's device files (WSL: /dev/dxg)."""
  return bool(glob.glob('/dev/nvidia[0-9]*')) or os.path.exists('/dev/dxg')


def installed_cudnn() -> tuple[int, int, int] | None:
  """The version of the cuDNN wheel installed beside JAX, if any."""
  for package in ('nvidia-cudnn-cu13', 'nvidia-cudnn-cu12'):
    try:
      version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      continue
    return tuple(int(x) for x in (version.split('.') + ['0', '0'])[:3])
  return None


def plugin_cuda() -> tuple[int, int, int]:
  """The CUDA release the installed plugin runs on (13.0 for cuda13): XLA's GPU compiler
  offers what needs a newer toolkit (cuBLASLt's FP8 matmuls) only when it knows it."""
  return (13, 0, 0) if importlib.util.find_spec(CUDA_PLUGINS[0]) else (12, 0, 0)


def gpu_devices(hardware, count: int) -> list:
  """`count` compile-only devices of the profile's GPU (`hardware`, a
  `jaxllm.cost.hardware.Hardware`: the runtime imports nothing of the cost model), in nodes of
  `devices_per_node`, one host each (as a real run lays them out): what a step is lowered and
  compiled for."""
  if not cuda_plugin_installed():
    raise ConfigError(f'--hardware={hardware.name}: compiling the GPU program needs JAX\'s CUDA '
                      f'plugin; install it with {GPU_COMPILE_INSTALL}, or pass --compiler=cpu '
                      'to read the CPU compiler\'s program instead.')
  per_node = hardware.devices_per_node
  if count < 1 or (count > per_node and count % per_node):
    raise ConfigError(f'--devices={count}: {hardware.name} nodes hold {per_node} GPUs; use '
                      f'1 to {per_node}, or a multiple of {per_node}.')
  nodes = max(1, count // per_node)
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(
      platform='cuda', topology=f'1x{nodes}x{count // nodes}', target_config=gpu_target(hardware))
  return topology.devices


def gpu_target(hardware) -> str:
  """The GPU `gpu_devices` compiles for, as XLA's GPU compiler is told of it (its target
  config): what, beside the program, decides what the compiler makes."""
  return hardware.gpu.target_config(hardware.memory, installed_cudnn(), plugin_cuda())


def is_compile_only(device) -> bool:
  """Whether `device` only compiles (a GPU of `gpu_devices`), never runs anything."""
  return device.client.runtime_type == 'compile_only_runtime'


@contextlib.contextmanager
def lowering_for(devices):
  """Traces for `devices`: JAX's cuDNN attention asks the live backend (the CPU, in a
  deviceless compile) for the GPU's compute capability before it offers Hopper-only
  layouts; here the answer comes from the devices the program is compiled for."""
  if not (devices and is_compile_only(devices[0])):
    yield
    return
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  target = tuple(int(x) for x in devices[0].compute_capability.split('.'))
  parse = lambda capability: tuple(int(x) for x in capability.split('.'))
  checks = {'check_compute_capability': lambda c: target >= parse(c),
            'is_cuda_compute_capability_equal': lambda c: target == parse(c)}
  saved = {name: getattr(cudnn_attention, name) for name in checks
           if hasattr(cudnn_attention, name)}
  for name in saved:
    setattr(cudnn_attention, name, checks[name])
  try:
    yield
  finally:
    for name, check in saved.items():
      setattr(cudnn_attention, name, check)
