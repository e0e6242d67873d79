"""The GPU's program beside the CPU compiler's, for one model on several meshes and splits.

    python benchmarks/programs.py --config configs/llama3_8b.py --devices 64 \
        --mesh fsdp=64 --mesh data=8,fsdp=8 [--compilers gpu,cpu] [--hardware h100-nvlink] \
        [--splits none,zero1,zero2,sp,sp_cm,cp,cp_sp] [--config.a.b=v ...]

Compiles the train step from shapes alone with each compiler: for the profile's GPU (the
program it would run, made without one) and with the CPU compiler on simulated devices. Prints
one row per mesh, split and compiler: state, temporary and peak memory per device and the
verdict against what a process may use, the bytes each mesh axis moves per step by element
type beside the analytic figure, attention, and the predicted step time and MFU, all as
`jaxllm.analyze` computes them. The splits (`SPLITS`) are config choices on the same model:
ZeRO over data, sequence parallelism over tensor, context parallelism over fsdp. (K/V heads
fewer than mesh.tensor are replicated over it in every split.)
"""

import collections
import math
import sys

import jax
from absl import flags
from ml_collections import ConfigDict

from jaxllm import analyze, metrics
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import MESH_AXES, ConfigError
from jaxllm.cost import report, tune
from jaxllm.cost.hardware import hardware_profile

# --devices, --hardware and --device-memory are analyze's.
_MESH = flags.DEFINE_multi_string('mesh', [], 'A mesh, e.g. data=8,fsdp=8 (axes not named: 1).')
_COMPILERS = flags.DEFINE_list('compilers', ['gpu', 'cpu'], 'Whose programs: gpu, cpu.')

SPLITS = {**tune.SPLITS,  # name: (what the row says, the config fields it sets)
          'zero1': ('ZeRO-1', {'sharding.zero': 1}), 'zero2': ('ZeRO-2', {'sharding.zero': 2})}
_SPLITS = flags.DEFINE_list('splits', ['none'], f'Which splits of each mesh: {", ".join(SPLITS)}.')


def with_split(cfg: ConfigDict, mesh: dict[str, int], split: str) -> ConfigDict:
  """`cfg` on `mesh`, with the fields of SPLITS[split] set."""
  cfg = tune.with_fields(cfg, SPLITS[split][1])
  cfg.mesh.update(mesh)
  return cfg


def parse_mesh(text: str) -> dict[str, int]:
  mesh = dict.fromkeys(MESH_AXES, 1)
  for part in text.split(','):
    axis, _, size = part.partition('=')
    if axis not in MESH_AXES or not size.isdigit():
      raise ConfigError(f'--mesh {text}: write axis=size pairs of {", ".join(MESH_AXES)}, '
                        'e.g. data=8,fsdp=8.')
    mesh[axis] = int(size)
  return mesh


def per_axis_text(r: dict) -> str:
  """Bytes per mesh axis, split by element type, and the ratio to the analytic figure."""
  by_type = collections.defaultdict(collections.Counter)
  for c in r['collectives']:
    by_type[tuple(c['axes'])][c['dtype']] += c['bytes']
  parts = []
  for a in r['per_axis']:
    types = ' + '.join(f'{report.size_text(b)} {t}' for t, b in
                       sorted(by_type[tuple(a['axes'])].items(), key=lambda x: -x[1]))
    ratio = f' ({a["ratio"]:.2f}×)' if a['ratio'] else ''
    parts.append(f'{",".join(a["axes"])}: {types}{ratio}')
  return '; '.join(parts)


def attention_text(r: dict) -> str:
  kernels = r['attention']['kernels']
  if not kernels:
    return 'XLA ops'
  bias = {k['bias'] for k in kernels if k['bias']}
  flash = all(k['flash'] for k in kernels)
  return ('cuDNN flash' if flash else 'cuDNN') + (f', bias {", ".join(bias)}' if bias else '')


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  meshes = [parse_mesh(m) for m in _MESH.value]
  if not meshes:
    raise ConfigError('--mesh is required: one or more meshes, e.g. --mesh fsdp=8.')
  unknown = [s for s in _SPLITS.value if s not in SPLITS]
  if unknown:
    raise ConfigError(f'--splits names unknown splits {unknown}; use {", ".join(SPLITS)}.')
  n = analyze.DEVICES.value
  for text, mesh in zip(_MESH.value, meshes):
    if math.prod(mesh.values()) != n:
      raise ConfigError(f'--mesh {text}: makes {math.prod(mesh.values())} devices, not '
                        f'--devices={n}; make them agree.')
  if 'cpu' in _COMPILERS.value:
    cfg.cpu_devices = n
  start_backends(cfg)
  hardware = hardware_profile(analyze.HARDWARE.value, analyze.DEVICE_MEMORY.value)
  devices = {'gpu': lambda: gpu_devices(hardware, n), 'cpu': lambda: jax.devices()[:n]}
  m = cfg.model
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print(f'model {metrics.param_counts(m)["total"] / 1e9:.2f}B, {m.dtype} compute, '
        f'remat {m.remat}, attention {m.attention}; global batch {cfg.train.global_batch} × '
        f'{cfg.data.seq_len} tokens, {cfg.train.micro_batches} micro-batch(es); {n} × '
        f'{hardware.name}, jax {jax.__version__}')
  print('| mesh | program | params + optimizer | temporaries | peak | fits | bytes per axis '
        '(ratio to analytic) | attention | predicted step | predicted MFU (full / causal) |')
  print('|---|---|---:|---:|---:|---|---|---|---:|---:|')
  for mesh in meshes:
    for split in _SPLITS.value:
      for compiler in _COMPILERS.value:
        r = report.analyze(with_split(cfg, mesh, split), hardware, devices[compiler]())
        mem, pr = r['memory'], r['prediction']
        name = ' × '.join(f'{a}={s}' for a, s in mesh.items() if s > 1) or 'one device'
        name += f', {SPLITS[split][0]}' if SPLITS[split][0] else ''
        print(f'| {name} | {compiler.upper()} | '
              f'{report.size_text(mem["params"] + mem["optimizer"])} | '
              f'{report.size_text(mem["temporaries"])} | {report.size_text(mem["peak"])} | '
              f'{"yes" if r["fits"] else "no"} | {per_axis_text(r)} | {attention_text(r)} | '
              f'{report.seconds_text(pr["step_s"])} | '
              f'{pr["mfu"]:.1%} / {pr["mfu_causal"]:.1%} |', flush=True)


if __name__ == '__main__':
  main_guard(main)
