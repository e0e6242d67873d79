"""The timing model kernel by kernel against a real profile: runs a config's train step under
`jax.profiler`, reads each kernel's measured duration from the trace and joins it to the
timing model's prediction for the same HLO instruction of the same compiled program.

    python benchmarks/kernels.py --config configs/X.py [--config.a.b=v ...] [--steps 5]
        [--warmup 3] [--hardware h100-nvlink] [--trace-dir DIR] [--top 10]

Prints predicted against measured per step for each category (GEMMs, attention, memory-bound
kernels, collectives, the gaps between kernels) and the `--top` kernels the model is furthest
off. On a GPU the prediction is the profile's (`--hardware`; default the device's own:
h200-nvlink on an H200, else h100-nvlink), with what the program's XLA flags say of command
buffers. On a CPU it reads and joins the trace all the same (the H100 profile's times mean
nothing there): that is how the suite checks it. Bad input stops with one line and status 2.
"""

import itertools
import os
import tempfile

import jax
from absl import flags

from timing import benchmark_config  # benchmarks/ is on the path when this runs as a script
from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError
from jaxllm.cost import timing as model, trace
from jaxllm.cost.hardware import PROFILES, hardware_profile
from jaxllm.parallel.mesh import sharding_context
from jaxllm.train import setup

_STEPS = flags.DEFINE_integer('steps', 5, 'Steps traced.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untraced steps run first, after compiling.')
_HARDWARE = flags.DEFINE_string('hardware', '', 'Profile to predict with: '
                                f'{", ".join(PROFILES)} (default: the device\'s).')
_TRACE_DIR = flags.DEFINE_string('trace-dir', '', 'Where the trace goes (default: a new '
                                 'temporary directory).')
_TOP = flags.DEFINE_integer('top', 10, 'Kernels furthest off to list.')


def profile_for(device) -> str:
  """The profile of the device the steps ran on."""
  return _HARDWARE.value or ('h200-nvlink' if 'H200' in device.device_kind else 'h100-nvlink')


def traced_steps(run, steps: int, warmup: int, directory: str):
  """Compiles the run's step ahead of time (as `jaxllm.train` does), runs `warmup` steps, then
  `steps` steps under `jax.profiler` into `directory`. Returns the compiled step."""
  first = next(run.batches)
  with sharding_context(run.mesh, run.layout.rules):
    compiled = run.train_step.lower(run.state, first).compile()
  batches, state = itertools.chain([first], run.batches), run.state
  for _ in range(warmup):
    state, _ = compiled(state, next(batches))
  jax.block_until_ready(state)
  jax.profiler.start_trace(directory)
  for _ in range(steps):
    state, step_metrics = compiled(state, next(batches))
  jax.block_until_ready((state, step_metrics))
  jax.profiler.stop_trace()
  return compiled


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv)
  cfg = benchmark_config(cfg, keep_data=False)
  start_backends(cfg)
  if _STEPS.value < 1 or _WARMUP.value < 0 or _TOP.value < 1:
    raise ConfigError(f'--steps={_STEPS.value}, --warmup={_WARMUP.value}, --top={_TOP.value}: '
                      'trace at least one step, warm up zero or more, list at least one kernel.')
  run = setup(cfg)
  device = run.mesh.devices.flat[0]
  hardware = hardware_profile(profile_for(device))
  directory = _TRACE_DIR.value or tempfile.mkdtemp(prefix='kernels-')
  compiled = traced_steps(run, _STEPS.value, _WARMUP.value, directory)
  text = compiled.as_text()
  rates = hardware.rates.for_flags(os.environ.get('XLA_FLAGS', ''))
  devices = run.mesh.devices.size
  predicted = model.step_time(text, rates, devices,
                              model.node_crossing(hardware.devices_per_node, devices))
  measured = trace.read(directory, trace.module_name(text), trace.containers(text))
  print(f'{_STEPS.value} steps of {trace.module_name(text)} on {devices} × {device.device_kind} '
        f'traced into {directory}; predicted on {hardware.name} ({rates.clocks} clocks, cuDNN '
        f'{rates.cudnn} attention, command buffers {"on" if rates.command_buffers else "off"})')
  if device.platform != 'gpu':
    print(f'(a {device.platform} trace: the join is checked, the times are not comparable)')
  print(trace.format_comparison(trace.compare(predicted, measured, _STEPS.value), _TOP.value))
  for note in predicted.untimed:
    print(f'not timed as it runs: {note}')


if __name__ == '__main__':
  main_guard(main)
