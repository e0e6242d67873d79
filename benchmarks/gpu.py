"""Training throughput on one accelerator (written for an NVIDIA H100), beside a plain-JAX step.

    python benchmarks/gpu.py --config configs/llama3_1b.py [--config.a.b=v ...] [--steps 20]
        [--warmup 3] [--warmup-seconds 60] [--plain] [--keep-data]
        [--largest [--device-memory-gb GB] [--max-layers 512] [--largest-remat none,full]]

The run is built with `jaxllm.train.setup` on a synthetic batch (`--keep-data` keeps the
config's data), its step compiled ahead of time, run `--warmup` times and on until
`--warmup-seconds` have passed (default 60 on a GPU, 0 elsewhere: under load a GPU's clock
falls from its boost to what its power limit sustains within about a minute, and a training
run lives at the latter), then timed over `--steps` steps with one host sync at the end, the
GPU's SM clock and board power sampled meanwhile (NVML, from nvidia-ml-py where installed). It
prints one block: devices, versions, the command and the config fields that matter, tokens/s
per device, step time, model TFLOP/s per device, MFU in both FLOP conventions, the clocks and
power while timed and peak device memory.

`--plain` also times `plain_llama.py` (the same model and optimizer in plain JAX, one device)
on the same batch and weights, prints jaxllm's throughput over the plain one, and checks both
give the same first-step loss. `--largest` finds, for every remat policy, the most layers of
the configured width whose train step fits one device's memory (fsdp=1: the whole state on
it), compiling from shapes alone (`jaxllm.cost.compile.compile_step`); `--steps 0` skips the timed
run. Bad input stops with one line (`error: ...`) and exit status 2.
"""

import copy
import gc
import importlib.metadata
import itertools
import math
import shlex
import threading
import time

import jax
from absl import flags
from ml_collections import ConfigDict

import plain_llama  # benchmarks/ is on the path when this runs as a script
from timing import benchmark_config, rates_per_device, settle_seconds, time_steps, timed
from jaxllm import metrics
from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError, TrainingError
from jaxllm.cost import report
from jaxllm.cost.cache import MemoryStats
from jaxllm.cost.compile import compile_step
from jaxllm.model import with_available_attention
from jaxllm.model.remat import REMAT
from jaxllm.optim import make_optimizer
from jaxllm.train import setup
from jaxllm.validate import resolve_mesh, validate

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps run after compiling.')
_WARMUP_S = flags.DEFINE_float('warmup-seconds', -1.0, 'Untimed steps go on until this many '
                               'seconds have passed (default: 60 on a GPU, 0 elsewhere).')
_PLAIN = flags.DEFINE_bool('plain', False, 'Also time the plain-JAX step (one device only).')
_LARGEST = flags.DEFINE_bool('largest', False, 'Find the most layers that fit, per remat policy.')
_MEMORY_GB = flags.DEFINE_float('device-memory-gb', 0.0, '--largest: memory of one device in GB '
                                '(default: what the device reports; a CPU reports nothing).')
_MAX_LAYERS = flags.DEFINE_integer('max-layers', 512, '--largest: search no deeper than this.')
_REMAT = flags.DEFINE_list('largest-remat', None, '--largest: the remat policies to search, '
                           'comma-separated (default: none, dots, full and any others jaxllm has).')
_KEEP_DATA = flags.DEFINE_bool('keep-data', False, "Use the config's data, not a synthetic batch.")

# First-step losses of jaxllm and the plain step must agree this closely; bf16 compute
# leaves the order of roundings to each compiled program.
LOSS_RTOL = {'float32': 1e-4, 'bfloat16': 1e-2}


class Clocks:
  """The SM clock (MHz) and board power (W) of `device`, sampled by NVML every `interval`
  seconds while the context is entered. Without NVML (no nvidia-ml-py, no driver) it samples
  nothing and says why."""

  def __init__(self, device, interval: float = 0.05):
    self.device, self.interval = device, interval
    self.samples: list[tuple[float, float]] = []
    self.missing = ''

  def __enter__(self):
    try:
      import pynvml
      pynvml.nvmlInit()
      self._nvml = pynvml
      self._handle = pynvml.nvmlDeviceGetHandleByIndex(
          getattr(self.device, 'local_hardware_id', None) or 0)
    except Exception as e:  # noqa: BLE001 (an absent module or driver alike)
      self.missing = f'{type(e).__name__}: {e}'.splitlines()[0]
      return self
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    nvml = self._nvml
    while not self._stop.wait(self.interval):
      self.samples.append((nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM),
                           nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3))

  def __exit__(self, *_):
    if not self.missing:
      self._stop.set()
      self._thread.join()
      self._nvml.nvmlShutdown()

  def text(self) -> str:
    if self.missing or not self.samples:
      return ('not sampled (NVML: ' + (self.missing or 'no sample in time') +
              '; pip install nvidia-ml-py on a machine with an NVIDIA driver)')
    mhz, watts = zip(*self.samples)
    mean = lambda xs: sum(xs) / len(xs)
    return (f'SM {min(mhz):,.0f}–{max(mhz):,.0f} MHz (mean {mean(mhz):,.0f}), power '
            f'{min(watts):,.0f}–{max(watts):,.0f} W (mean {mean(watts):,.0f}), '
            f'{len(mhz)} samples while timed')


def device_peak_bytes(device) -> int | None:
  stats = device.memory_stats()  # None on a CPU
  return stats.get('peak_bytes_in_use') if stats else None


def time_jaxllm(run, first_batch, steps: int, warmup: int) -> dict:
  device = run.mesh.devices.flat[0]
  clocks = Clocks(device)
  step_s, compile_s, compiled, first = time_steps(run, steps, warmup, first_batch,
                                                  settle_seconds(_WARMUP_S.value, device),
                                                  lambda: clocks)
  return {'step_s': step_s, 'compile_s': compile_s, 'loss': float(first['loss']),
          'compiled_peak': MemoryStats.of(compiled).peak, 'clocks': clocks.text()}


def time_plain(run, params_host: dict, first_batch, steps: int, warmup: int) -> dict:
  """The plain step on the run's device, from `params_host` and a fresh optimizer state."""
  cfg = run.cfg
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  params = jax.device_put(params_host, run.mesh.devices.flat[0])
  opt_state = jax.jit(tx.init)(params)
  step = jax.jit(plain_llama.make_train_step(cfg.model, tx), donate_argnums=(0, 1))
  start = time.perf_counter()
  compiled = step.lower(params, opt_state, first_batch).compile()
  compile_s = time.perf_counter() - start
  memory = MemoryStats.of(compiled)
  check_plain_fits(memory, run.mesh.devices.flat[0])

  def state_step(state, batch):
    params, opt_state, step_metrics = compiled(*state, batch)
    return (params, opt_state), step_metrics

  batches = itertools.chain([first_batch], run.batches)
  clocks = Clocks(run.mesh.devices.flat[0])
  step_s, first = timed(state_step, (params, opt_state), batches, steps, warmup,
                        settle_seconds(_WARMUP_S.value, run.mesh.devices.flat[0]),
                        lambda: clocks)
  return {'step_s': step_s, 'compile_s': compile_s, 'loss': float(first['loss']),
          'compiled_peak': memory.peak, 'clocks': clocks.text()}


def check_plain_fits(memory: MemoryStats, device) -> None:
  """Refuses, in one line, a plain step the device has no room for beside what it holds (its
  arguments are on it already): it would fail in its first step with an allocator's dump."""
  stats = device.memory_stats()  # None on a CPU
  if not stats or not stats.get('bytes_limit'):
    return
  needed = memory.outputs - memory.aliases + memory.temporaries
  free = stats['bytes_limit'] - stats.get('bytes_in_use', 0)
  if needed > free:
    raise ConfigError(
        f'--plain: the plain step needs {size_text(needed)} beside its state and '
        f'{size_text(free)} of the device is free (plain JAX holds whole fp32 logits): lower '
        '--config.train.global_batch, or raise XLA_PYTHON_CLIENT_MEM_FRACTION.')


def search_layers(peak_of, fits, cap: int) -> tuple[int, int | None]:
  """The most layers L ≤ cap with fits(peak_of(L)), by doubling from 1 and then bisecting
  (peak memory grows with L). Returns (L, its peak); (0, None) when one layer does not fit."""
  peaks = {}

  def ok(n):
    peaks[n] = peak_of(n)
    return fits(peaks[n])

  good, n = 0, 1  # good: the most layers known to fit; bad: the fewest known not to
  while True:
    if not ok(n):
      bad = n
      break
    good = n
    if n == cap:
      bad = cap + 1
      break
    n = min(2 * n, cap)
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if ok(mid) else (good, mid)
  return good, peaks.get(good)


POLICIES = ['none', 'dots', 'full'] + [p for p in REMAT if p not in ('dots', 'full')]


def largest(cfg: ConfigDict, memory_bytes: float, cap: int,
            policies: list[str]) -> list[tuple[str, int, int, int]]:
  """Per remat policy: (policy, layers, parameters, compiled peak bytes) of the deepest model
  of cfg's width whose train step fits `memory_bytes` on one device."""
  device = jax.devices()[:1]
  rows = []
  for policy in policies:
    def peak_of(layers, policy=policy):
      c = copy.deepcopy(cfg)
      c.model.update(remat=policy, num_layers=layers)
      c.mesh.update(data=1, fsdp=1, pipe=1, tensor=1)
      try:
        return report.memory(compile_step(c, device))['peak']
      except jax.errors.JaxRuntimeError as e:  # a GPU compiler may run out while autotuning
        if 'RESOURCE_EXHAUSTED' in str(e) or 'out of memory' in str(e).lower():
          return math.inf
        raise

    layers, peak = search_layers(peak_of, lambda p: p <= memory_bytes, cap)
    c = copy.deepcopy(cfg.model)
    c.num_layers = layers
    rows.append((policy, layers, metrics.param_counts(c)['total'] if layers else 0, peak))
  return rows


def versions() -> str:
  found = []
  for name in ('jax', 'jaxlib', 'flax', 'optax', 'jax-cuda13-plugin', 'jax-cuda13-pjrt',
               'jax-cuda12-plugin', 'jax-cuda12-pjrt'):
    try:
      found.append(f'{name} {importlib.metadata.version(name)}')
    except importlib.metadata.PackageNotFoundError:
      pass
  if not any('cuda' in f for f in found):
    found.append('no CUDA plugin')
  return '  '.join(found)


def size_text(n) -> str:
  return 'n/a' if n is None else report.size_text(n)


def config_lines(cfg: ConfigDict, mesh_shape: dict[str, int]) -> list[str]:
  m, t, d = cfg.model, cfg.train, cfg.data
  data = d.source if d.source == 'synthetic' else f'{d.source} {d.path} (packing={d.packing})'
  return [
      f'model     vocab_size={m.vocab_size} embed_dim={m.embed_dim} num_layers={m.num_layers} '
      f'num_heads={m.num_heads} num_kv_heads={m.num_kv_heads} head_dim={m.head_dim} '
      f'mlp_dim={m.mlp_dim} tie_embeddings={m.tie_embeddings} rope_scaling.factor='
      f'{m.rope_scaling.factor}',
      f'          dtype={m.dtype} param_dtype={m.param_dtype} attention={m.attention} '
      f'remat={m.remat}',
      '          ' + f'{metrics.param_counts(m)["total"] / 1e6:,.2f}M parameters',
      'mesh      ' + ' '.join(f'{a}={n}' for a, n in mesh_shape.items()),
      f'train     global_batch={t.global_batch} seq_len={d.seq_len} '
      f'({t.global_batch * d.seq_len:,} tokens/step) micro_batches={t.micro_batches} '
      f'peak_flops={t.peak_flops:g} seed={t.seed}',
      f'data      {data}',
      f'xla_flags {cfg.xla_flags or "(none)"}',
  ]


def throughput_lines(name: str, result: dict, cfg: ConfigDict, mesh) -> list[str]:
  tokens_per_s, flops, mfu = rates_per_device(cfg, result['step_s'], mesh)
  peak = metrics.peak_flops(mesh.devices.flat[0], cfg.train.peak_flops)
  return [
      f'{name:9} tokens/s/device {tokens_per_s:,.0f}   step {result["step_s"] * 1e3:,.1f} ms   '
      f'model TFLOP/s/device {flops["full"] / 1e12:,.3f} '
      f'(causal {flops["causal"] / 1e12:,.3f})',
      f'{"":9} MFU {mfu["full"]} (6N + 12LHQT)   MFU causal {mfu["causal"]} (6N + 6LHQT)   '
      f'peak FLOP/s/device {f"{peak / 1e12:,.0f}T" if peak else "unknown"}',
      f'{"":9} compile {result["compile_s"]:.1f}s   compiled peak memory '
      f'{size_text(result["compiled_peak"])}   first-step loss {result["loss"]:.6f}',
      f'{"":9} clocks {result["clocks"]}',
  ]


def check_flags(cfg: ConfigDict) -> None:
  if _STEPS.value < 0 or not (_STEPS.value or _LARGEST.value):
    raise ConfigError(f'--steps={_STEPS.value} must be at least 1 (0 only with --largest, to '
                      'skip the timed run).')
  if _PLAIN.value and not _STEPS.value:
    raise ConfigError('--plain times steps: give --steps 1 or more.')
  if _WARMUP.value < 0:
    raise ConfigError(f'--warmup={_WARMUP.value} must be at least 0.')
  if _WARMUP_S.value < 0 and _WARMUP_S.value != -1:
    raise ConfigError(f'--warmup-seconds={_WARMUP_S.value} must be at least 0.')
  if _MAX_LAYERS.value < 1:
    raise ConfigError(f'--max-layers={_MAX_LAYERS.value} must be at least 1.')
  if _MEMORY_GB.value < 0:
    raise ConfigError(f'--device-memory-gb={_MEMORY_GB.value} must be positive.')
  unknown = [p for p in _REMAT.value or [] if p not in POLICIES]
  if unknown:
    raise ConfigError(f'--largest-remat={",".join(_REMAT.value)}: unknown '
                      f'{", ".join(unknown)}; use {", ".join(POLICIES)}.')
  if _PLAIN.value:
    mesh_shape = resolve_mesh(cfg.mesh, jax.device_count())
    if math.prod(mesh_shape.values()) > 1:
      raise ConfigError(
          f'--plain times one device, but the mesh has {math.prod(mesh_shape.values())}: set '
          '--config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.pipe=1 --config.mesh.tensor=1'
          ' (and --config.cpu_devices=1 on a CPU).')
    if cfg.train.micro_batches != 1:
      raise ConfigError(f'--plain has no gradient accumulation: set '
                        f'--config.train.micro_batches=1 (not {cfg.train.micro_batches}).')


def largest_memory(device) -> tuple[float, str]:
  """Bytes of one device's memory for --largest, and where the figure came from."""
  if _MEMORY_GB.value:
    return _MEMORY_GB.value * 1e9, '--device-memory-gb'
  stats = device.memory_stats()
  if stats and stats.get('bytes_limit'):
    return stats['bytes_limit'], ("the device's bytes_limit; XLA_PYTHON_CLIENT_MEM_FRACTION "
                                  'sets it')
  raise ConfigError(f'--largest: the {device.platform} device reports no memory size; '
                    'give it with --device-memory-gb GB.')


def throughput(run, steps: int, warmup: int, plain: bool) -> str | None:
  """Times jaxllm's step (and with `plain` the plain one) and prints the figures. Returns
  what is wrong when the two first-step losses differ, else None."""
  cfg, mesh = run.cfg, run.mesh
  device = mesh.devices.flat[0]
  first_batch = next(run.batches)
  params_host = plain_llama.params_from_jaxllm(run.state.params) if plain else None
  result = time_jaxllm(run, first_batch, steps, warmup)
  lines = throughput_lines('jaxllm', result, cfg, mesh)
  lines.append(f'{"":9} peak device memory {size_text(device_peak_bytes(device))} '
               '(peak_bytes_in_use after the jaxllm steps)')
  print('\n'.join(lines), flush=True)
  if not plain:
    return None
  other = time_plain(run, params_host, first_batch, steps, warmup)
  rtol = LOSS_RTOL[cfg.model.dtype]
  diff = abs(result['loss'] - other['loss']) / abs(other['loss'])
  same = diff <= rtol
  lines = throughput_lines('plain', other, cfg, mesh) + [
      f'ratio     jaxllm/plain throughput {other["step_s"] / result["step_s"]:.3f}',
      f'loss      first step: jaxllm {result["loss"]:.6f}  plain {other["loss"]:.6f}  '
      f'relative difference {diff:.1e} (rtol {rtol:g} in {cfg.model.dtype}): '
      f'{"same" if same else "DIFFERENT"}']
  print('\n'.join(lines), flush=True)
  return None if same else (
      f'--plain: the first-step losses differ (jaxllm {result["loss"]:.6f}, plain '
      f'{other["loss"]:.6f}): the two steps do not compute the same model.')


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  cfg = benchmark_config(cfg, _KEEP_DATA.value)
  start_backends(cfg)  # before anything touches a device
  check_flags(cfg)
  if _LARGEST.value:
    memory_bytes, memory_from = largest_memory(jax.devices()[0])  # fail before the long part
  if _STEPS.value:
    run = setup(cfg)
    cfg, mesh_shape, device = run.cfg, dict(run.mesh.shape), run.mesh.devices.flat[0]
  else:  # --largest alone: nothing to allocate, but the config is checked all the same
    run, mesh_shape, device = None, resolve_mesh(cfg.mesh, jax.device_count()), jax.devices()[0]
    validate(cfg, mesh_shape)
    cfg.model = with_available_attention(cfg.model, device.platform)
  platform = '; '.join(device.client.platform_version.splitlines())  # e.g. the CUDA version
  lines = [
      f'command   {shlex.join(["python", *argv])}',
      f'versions  {versions()}',
      f'devices   {math.prod(mesh_shape.values())} × {device.device_kind} in the mesh '
      f'({jax.device_count()} {jax.default_backend()} device(s) present; platform {platform})',
      *config_lines(cfg, mesh_shape),
  ]
  print('\n'.join(lines), flush=True)
  mismatch = throughput(run, _STEPS.value, _WARMUP.value, _PLAIN.value) if run else None

  if _LARGEST.value:
    del run  # the timed state must not crowd the compiler's scratch memory
    gc.collect()
    m = cfg.model
    print(f'largest   layers of width d={m.embed_dim} (heads {m.num_heads}/{m.num_kv_heads}×'
          f'{m.head_dim}, mlp {m.mlp_dim}) that fit one device (fsdp=1) with a global batch of '
          f'{cfg.train.global_batch} × {cfg.data.seq_len}, in {memory_bytes / 1e9:,.2f} GB '
          f'({memory_from}); compiled from shapes, up to {_MAX_LAYERS.value} layers', flush=True)
    print(f'  {"remat":16} {"layers":>7} {"parameters":>12} {"compiled peak":>14}')
    for policy, layers, params, peak in largest(cfg, memory_bytes, _MAX_LAYERS.value,
                                                _REMAT.value or POLICIES):
      print(f'  {policy:16} {layers:>7} {params / 1e6:>11,.2f}M {size_text(peak):>14}',
            flush=True)
  if mismatch:
    raise TrainingError(mismatch)


if __name__ == '__main__':
  main_guard(main)
