"""`python -m jaxllm.analyze --config configs/X.py [--devices N] [--hardware h100-nvlink]`
`python -m jaxllm.analyze --hlo FILE [--hardware h100-nvlink] [--devices-per-node 8]`

Compiles the train step ahead of time from shapes alone, nothing allocated, and reports per
device: memory by kind and whether it fits what a process may use of the device; model FLOPs
beside the compiled program's, and the forward work it reruns in the backward (by remat or by
XLA); whether attention runs as a fused kernel; every collective grouped by the mesh axes it
runs over, with its element type and the analytic bytes beside the compiled; the largest
arrays; the pipeline bubble; and a predicted step time and MFU.

The program read is the one the profile's GPU would run: XLA's GPU compiler (in JAX's CUDA
plugin) compiles for N GPUs on a machine that has none (`jaxllm.backends.gpu_devices`).
`--compiler=cpu` reads the CPU compiler's program on N simulated CPU devices instead.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

import jax
from absl import flags

from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import MESH_AXES, ConfigError
from jaxllm.cost import hlo
from jaxllm.cost.compile import Compiled, compile_step
from jaxllm.cost.hardware import PROFILES, hardware_profile
from jaxllm.cost.report import (format_program_report, format_report, program_report,
                                 report)

DEVICES = flags.DEFINE_integer(
    'devices', 0, 'Analyse for this many devices (default: the mesh\'s size when no axis is -1, '
    'else one node of the profile; with --compiler=cpu, the devices present; with --hlo, those '
    'the program was compiled for, which a --devices given must equal).')
HARDWARE = flags.DEFINE_string('hardware', 'h100-nvlink',
                                f'Hardware profile: {", ".join(PROFILES)}.')
DEVICE_MEMORY = flags.DEFINE_float('device-memory', 0.0,
                                    'Memory of one device in GB (default: the profile\'s).')
COMPILER = flags.DEFINE_enum(
    'compiler', 'gpu', ['gpu', 'cpu'], "Whose program to read: 'gpu' compiles for the profile's "
    "GPU (no GPU needed), 'cpu' the CPU compiler's, on simulated CPU devices.")
JSON = flags.DEFINE_bool('json', False, 'Print the report as JSON (tune: every candidate, ranked or '
                           'left out and why).')
_DUMP = flags.DEFINE_string('dump', '', 'Write the compiled program (HLO text) and the report '
                            'into this new directory.')
_HLO = flags.DEFINE_string(
    'hlo', '', 'Predict this optimized GPU HLO text instead of compiling a config: any JAX '
    'program\'s, e.g. a *after_optimizations.txt file of XLA_FLAGS=--xla_dump_to=DIR, on the '
    'devices it was compiled for.')
_PER_NODE = flags.DEFINE_integer('devices-per-node', 0, 'With --hlo: devices are numbered this '
                                 'many to a node (default: the profile\'s, 8).')


def parse_and_place(argv: list[str], doc: str = __doc__):
  """The config, hardware profile and devices to analyse from the command line: N GPUs of the
  profile (compiled for, never present), or with --compiler=cpu N devices simulated on the
  CPU (default: those present, config.cpu_devices on a CPU): the first N of at least as many,
  so that a process whose backends have started with more (a notebook's) can analyse for
  fewer. Starts JAX's backends. `doc`: the command's docstring, for --help."""
  cfg, _ = parse_command_line(argv, doc)
  check_flags()
  hardware = hardware_profile(HARDWARE.value, DEVICE_MEMORY.value)
  if COMPILER.value == 'cpu' and DEVICES.value:  # before JAX starts its backends
    jax.config.update('jax_platforms', 'cpu')
    cfg.cpu_devices = max(cfg.cpu_devices, DEVICES.value)
  start_backends(cfg)
  if COMPILER.value == 'cpu':
    return cfg, hardware, jax.devices()[:DEVICES.value or None]
  sizes = [cfg.mesh[a] for a in MESH_AXES]
  count = DEVICES.value or (math.prod(sizes) if min(sizes) > 0 else hardware.devices_per_node)
  return cfg, hardware, gpu_devices(hardware, count)


def check_flags() -> None:
  """--devices and --device-memory, when given, must be positive: 0 is their default, which
  means the mesh's size and the profile's memory, so a 0 given would quietly mean those."""
  if DEVICES.present and DEVICES.value < 1:
    raise ConfigError(f'--devices={DEVICES.value} must be at least 1; leave it out for the '
                      "mesh's size.")
  memory = DEVICE_MEMORY.value
  if DEVICE_MEMORY.present and not (math.isfinite(memory) and memory > 0):
    raise ConfigError(f'--device-memory={memory} must be a positive number of GB; leave it out '
                      "for the profile's.")


def check_dump_directory(directory: str) -> None:
  """--dump writes only into a new (or empty) directory: nothing there is overwritten."""
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise ConfigError(f'--dump {directory}: exists and is not an empty directory; name a new '
                      'one.')


def write_dump(directory: str, c: Compiled, r: dict) -> None:
  """The compiled program and the report, for a person to read."""
  os.makedirs(directory, exist_ok=True)
  files = {'program.hlo.txt': c.text, 'report.json': json.dumps(r, indent=2) + '\n',
           'report.txt': format_report(r) + '\n'}
  for name, text in files.items():
    with open(os.path.join(directory, name), 'w') as f:
      f.write(text)


def read_hlo_flags(argv: list[str]) -> tuple[str, object, int, int]:
  """--hlo FILE and the flags that go with it: (text, hardware, devices, devices per node).
  The devices are those the program was compiled for (`program_devices`)."""
  if any(a.startswith('--config') for a in argv[1:]):
    raise ConfigError('--hlo predicts a program already compiled: leave out --config.')
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None
  check_flags()
  hardware = hardware_profile(HARDWARE.value, DEVICE_MEMORY.value)
  if hardware.rates is None:
    raise ConfigError(f'--hardware={hardware.name} has no measured kernel rates to time a '
                      'program with; use h100-nvlink or h200-nvlink.')
  per_node = _PER_NODE.value or hardware.devices_per_node
  if per_node < 1:
    raise ConfigError(f'--devices-per-node={per_node} must be at least 1.')
  try:
    with open(_HLO.value) as f:
      text = f.read()
  except OSError as e:
    raise ConfigError(f'--hlo {_HLO.value}: {e.strerror.lower()}; pass an HLO text file.') from None
  _, module = hlo.written_flags(text)  # a first line of flags (benchmarks/maxtext.py's)
  if not module.startswith('HloModule '):
    raise ConfigError(f'--hlo {_HLO.value}: not an HLO module in text form (no HloModule line); '
                      'pass a *after_optimizations.txt file of --xla_dump_to.')
  if cut_short(module):
    raise ConfigError(f'--hlo {_HLO.value}: the module ends before its ENTRY computation does; '
                      'pass the whole file (a dump still being written is cut short).')
  devices = program_devices(module)
  if DEVICES.present and DEVICES.value != devices:
    raise ConfigError(f'--devices={DEVICES.value}, but the program was compiled for {devices} '
                      'devices (num_partitions × replica_count in its HloModule line); leave '
                      '--devices out.')
  return text, hardware, devices, per_node


def _header_count(text: str, key: str) -> int:
  """num_partitions or replica_count of an HLO module's first line; XLA leaves out a 1."""
  found = re.search(rf'[ ,]{key}=(\d+)', text.split('\n', 1)[0])
  return int(found[1]) if found else 1


def program_devices(text: str) -> int:
  """The devices an HLO module was compiled for: its partitions times its replicas."""
  return _header_count(text, 'num_partitions') * _header_count(text, 'replica_count')


def cut_short(text: str) -> bool:
  """Whether an HLO module's text stops before its ENTRY computation ends: XLA prints the entry
  last, each computation closed by a line `}`."""
  lines = text.rstrip().splitlines()
  return not any(line.startswith('ENTRY ') for line in lines) or lines[-1] != '}'


def fp8_speedup(cfg, devices, hardware, prediction: dict) -> dict:
  """The same step in bf16 (model.fp8='none'), compiled and timed alike, beside the FP8 one."""
  bf16 = copy.deepcopy(cfg)
  bf16.model.fp8 = 'none'
  baseline = report(compile_step(bf16, devices), hardware)['prediction']
  return {'recipe': cfg.model.fp8, 'bf16_step_s': baseline['step_s'], 'bf16_mfu': baseline['mfu'],
          'speedup': baseline['step_s'] / prediction['step_s']}


def main(argv: list[str]) -> None:
  if any(a == '--hlo' or a.startswith('--hlo=') for a in argv[1:]):
    text, hardware, devices, per_node = read_hlo_flags(argv)
    r = program_report(text, hardware, devices, per_node)
    print(json.dumps(r, indent=2) if JSON.value else format_program_report(r))
    return
  cfg, hardware, devices = parse_and_place(argv)
  if _DUMP.value:
    check_dump_directory(_DUMP.value)  # before the long part
  compiled = compile_step(cfg, devices)
  r = report(compiled, hardware)
  if cfg.model.fp8 != 'none' and r['prediction']:
    r['fp8_speedup'] = fp8_speedup(cfg, devices, hardware, r['prediction'])
  print(json.dumps(r, indent=2) if JSON.value else format_report(r))
  if _DUMP.value:
    write_dump(_DUMP.value, compiled, r)


def cli() -> None:
  """The `jaxllm-analyze` command (pyproject's console script): `python -m jaxllm.analyze`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
