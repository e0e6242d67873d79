"""Per remat policy, the GPU program of one model on one mesh: what it moves, holds, recomputes
and predicts, and the largest global batch that fits.

    python benchmarks/fit.py --config configs/llama3_8b.py --devices 8 \
        --remat none,full,dots,dots_except_mlp,attention [--hardware h100-nvlink] [--config.a.b=v ...]

Compiles the train step from shapes for the profile's GPUs (as `jaxllm.analyze` does) at the
config's global batch, then at doubling batches from there until the peak no longer fits what
a process may use of the card: the largest batch is found to within a factor of 2. One row per
policy: bytes each mesh axis moves per step by element type, peak memory per device, the FLOPs
recomputed (the program's beyond the model's, causal attention counted once: the policy's, and
XLA's own rematerialization where a program exceeds the card), the largest fitting batch, and
the predicted MFU at the config's batch.
"""

import copy
import sys

import jax
from absl import flags
from ml_collections import ConfigDict

from jaxllm import analyze
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.cost import report
from jaxllm.cost.hardware import hardware_profile

from programs import per_axis_text

# --devices, --hardware and --device-memory are analyze's.
_REMAT = flags.DEFINE_list('remat', ['none', 'full', 'dots', 'dots_except_mlp', 'attention'],
                           'Remat policies, one row each.')
_MAX_DOUBLINGS = flags.DEFINE_integer('max-doublings', 6, 'Stop doubling the batch after this.')


def with_changes(cfg: ConfigDict, **changes) -> ConfigDict:
  """A copy of `cfg` with changes given as section__field=value."""
  c = copy.deepcopy(cfg)
  for key, value in changes.items():
    section, field = key.split('__')
    c[section][field] = value
  return c


def largest_fitting_batch(cfg: ConfigDict, hardware, devices, fits: bool) -> str:
  """The largest of batch, 2·batch, 4·batch, ... whose program fits ('< batch' if none)."""
  batch = cfg.train.global_batch
  if not fits:
    return f'< {batch}'
  for _ in range(_MAX_DOUBLINGS.value):
    if not report.analyze(with_changes(cfg, train__global_batch=2 * batch), hardware,
                           devices)['fits']:
      return str(batch)
    batch *= 2
  return f'≥ {batch}'


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  start_backends(cfg)
  hardware = hardware_profile(analyze.HARDWARE.value, analyze.DEVICE_MEMORY.value)
  devices = gpu_devices(hardware, analyze.DEVICES.value)
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print(f'global batch {cfg.train.global_batch} × {cfg.data.seq_len} tokens on '
        f'{len(devices)} × {hardware.name}, jax {jax.__version__}')
  print('| remat | bytes per axis (ratio to analytic) | peak | recomputed FLOPs | largest '
        'batch that fits | predicted MFU (full / causal) |')
  print('|---|---|---:|---:|---:|---:|')
  tokens = cfg.train.global_batch * cfg.data.seq_len
  for policy in _REMAT.value:
    c = with_changes(cfg, model__remat=policy)
    r = report.analyze(c, hardware, devices)
    model = r['flops']['model_per_token_causal'] * tokens
    recomputed = r['flops']['compiled_per_step'] - model
    print(f'| {policy} | {per_axis_text(r)} | {report.size_text(r["memory"]["peak"])} | '
          f'{recomputed / 1e15:.2f} PFLOP ({recomputed / model:.0%}) | '
          f'{largest_fitting_batch(c, hardware, devices, r["fits"])} | '
          f'{r["prediction"]["mfu"]:.1%} / {r["prediction"]["mfu_causal"]:.1%} |', flush=True)


if __name__ == '__main__':
  main_guard(main)
