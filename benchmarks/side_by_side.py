"""jaxllm's program beside another trainer's, compiled for the same GPUs: what each moves per
collective kind and element type, its peak, and the predicted step.

    python benchmarks/side_by_side.py [--other-hlo FILE [--other-memory GIB]] \
        --config configs/llama3_8b.py --devices 8 --remat full,dots_except_mlp,dots \
        [--config.a.b=v ...]

FILE is the other program's optimized HLO text for the same model, batch and devices (MaxText's
Llama-3-8B: `benchmarks/maxtext.py --run llama3_8b`, fsdp=8, 8 × 8192 tokens, remat full);
`--other-memory` its peak in GiB where known (maxtext.py prints its memory analysis: the
HLO text does not hold it). One row per program: jaxllm's for each remat policy asked for,
then the other's, if given.
"""

import collections
import sys

from absl import flags

from jaxllm import analyze
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError
from jaxllm.cost import report, tune
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import hardware_profile

_OTHER_HLO = flags.DEFINE_string('other-hlo', '', 'The other program\'s optimized HLO text.')
_OTHER_MEMORY = flags.DEFINE_float('other-memory', 0.0, 'Its peak bytes per device, in GiB.')
_REMAT = flags.DEFINE_list('remat', ['full', 'dots_except_mlp', 'dots'],
                           'jaxllm\'s remat policies to compile.')


def traffic_text(collectives: list[dict]) -> str:
  """Calls per step and bytes one device sends, by element type, for each collective kind
  and group size (`kind/N`: over a mesh axis of N devices), from `report.program_report`'s
  rows."""
  found = collections.defaultdict(collections.Counter)
  for c in collectives:
    key = c['kind'], c['group_size']
    found[key]['calls'] += c['count']
    found[key][c['dtype']] += c['bytes']
  parts = []
  for (kind, n), moved in sorted(found.items()):
    types = ' + '.join(f'{report.size_text(b)} {t}' for t, b in sorted(moved.items())
                       if t != 'calls' and b >= 2**20)
    parts.append(f'{kind}/{n} ×{moved["calls"]:,} {types}')
  return '; '.join(parts)


def row(name: str, text: str, devices: int, hardware, peak: float | None) -> str:
  r = report.program_report(text, hardware, devices, hardware.devices_per_node)
  p = r['prediction']
  return (f'| {name} | {traffic_text(r["collectives"])} | '
          f'{report.size_text(peak) if peak else "–"} | {report.seconds_text(p["step_s"])} '
          f'(exposed comm {report.seconds_text(p["exposed_comm_s"])}) |')


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  other = None
  if _OTHER_HLO.value:
    try:
      with open(_OTHER_HLO.value) as f:
        other = f.read()
    except OSError as e:
      raise ConfigError(f'--other-hlo {_OTHER_HLO.value}: {e.strerror.lower()}.') from None
  start_backends(cfg)
  hardware = hardware_profile(analyze.HARDWARE.value)
  devices = analyze.DEVICES.value or hardware.devices_per_node
  gpus = gpu_devices(hardware, devices)
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print('| program | collectives per step (kind/group size): calls, bytes one device sends | '
        'peak | predicted step |')
  print('|---|---|---:|---:|')
  for remat in _REMAT.value:
    c = compile_step(tune.with_fields(cfg, {'model.remat': remat}), gpus)
    print(row(f'jaxllm, remat {remat}', c.text, devices, hardware, c.memory.peak), flush=True)
  if other:
    print(row('other', other, devices, hardware,
              _OTHER_MEMORY.value * 2**30 if _OTHER_MEMORY.value else None))


if __name__ == '__main__':
  main_guard(main)
