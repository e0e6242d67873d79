"""The timing model kernel by kernel against a real profile: runs a config's train step under
`jax.profiler`, reads each kernel's measured duration from the trace and joins it to the
timing model's prediction for the same HLO instruction of the same compiled program.

    python benchmarks/kernels.py --config configs/X.py [--config.a.b=v ...] [--steps 5]
        [--warmup 3] [--warmup-seconds 60] [--hardware h100-nvlink] [--trace-dir DIR] [--top 10]

The trace directory keeps the compiled program beside the trace (program.hlo.txt).

The steps traced come after `--warmup` steps and as many more as `--warmup-seconds` take
(default a minute on a GPU, none elsewhere): the model times kernels at the clocks a GPU
sustains under load, not at the boost clock of a cold start.

Prints the traced steps' wall time, tokens/s and MFU per device, then predicted against
measured per step for each category (GEMMs, attention, memory-bound kernels, collectives, the
gaps between kernels) and the `--top` kernels the model is furthest off. On a GPU the
prediction is the profile's (`--hardware`; default the device's own: h200-nvlink on an H200,
else h100-nvlink), with what the program's XLA flags say of command buffers; a command
buffer's kernels reach the trace as one event, so the join kernel by kernel wants them off
(`XLA_FLAGS=--xla_gpu_enable_command_buffer=`). On a CPU it reads and joins the trace all
the same (the H100 profile's times mean nothing there): that is how the suite checks it.
Bad input stops with one line and status 2.
"""

import os
import tempfile

import jax
from absl import flags

# benchmarks/ is on the path when this runs as a script
from timing import benchmark_config, rates_per_device, settle_seconds, time_steps
from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError
from jaxllm.cost import experts, report, timing as model, trace
from jaxllm.cost.hardware import PROFILES, hardware_profile
from jaxllm.train import setup

_STEPS = flags.DEFINE_integer('steps', 5, 'Steps traced.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untraced steps run first, after compiling.')
_WARMUP_S = flags.DEFINE_float('warmup-seconds', -1.0, 'Untraced steps go on until this many '
                               'seconds have passed (default: 60 on a GPU, 0 elsewhere).')
_HARDWARE = flags.DEFINE_string('hardware', '', 'Profile to predict with: '
                                f'{", ".join(PROFILES)} (default: the device\'s).')
_TRACE_DIR = flags.DEFINE_string('trace-dir', '', 'Where the trace goes (default: a new '
                                 'temporary directory).')
_TOP = flags.DEFINE_integer('top', 10, 'Kernels furthest off to list.')


def profile_for(device) -> str:
  """The profile of the device the steps ran on."""
  return _HARDWARE.value or ('h200-nvlink' if 'H200' in device.device_kind else 'h100-nvlink')


def traced_steps(run, steps: int, warmup: int, warmup_s: float, directory: str):
  """Compiles the run's step ahead of time (as `jaxllm.train` does), warms it up (`warmup`
  steps, and on for `warmup_s` seconds), then runs `steps` steps under `jax.profiler` into
  `directory`. Returns the compiled step and the traced steps' seconds a step."""
  step_s, _, compiled, _ = time_steps(run, steps, warmup, warmup_s=warmup_s,
                                      during=lambda: jax.profiler.trace(directory))
  return compiled, step_s


def throughput(cfg, step_s: float, mesh) -> str:
  """The traced steps' wall time (under the profiler), tokens/s and MFU per device."""
  tokens_per_s, _, mfu = rates_per_device(cfg, step_s, mesh)
  return (f'traced steps: {step_s * 1e3:,.1f} ms a step (wall, under the profiler), '
          f'{tokens_per_s:,.0f} tokens/s/device, MFU {mfu["full"]} (causal {mfu["causal"]})')


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  cfg = benchmark_config(cfg, keep_data=False)
  start_backends(cfg)
  if (_STEPS.value < 1 or _WARMUP.value < 0 or _TOP.value < 1
      or _WARMUP_S.value < 0 and _WARMUP_S.value != -1):
    raise ConfigError(f'--steps={_STEPS.value}, --warmup={_WARMUP.value}, --warmup-seconds='
                      f'{_WARMUP_S.value:g}, --top={_TOP.value}: trace at least one step, warm '
                      'up zero or more steps and seconds, list at least one kernel.')
  run = setup(cfg)
  device = run.mesh.devices.flat[0]
  hardware = hardware_profile(profile_for(device))
  directory = _TRACE_DIR.value or tempfile.mkdtemp(prefix='kernels-')
  compiled, step_s = traced_steps(run, _STEPS.value, _WARMUP.value,
                                  settle_seconds(_WARMUP_S.value, device), directory)
  text = compiled.as_text()
  with open(os.path.join(directory, 'program.hlo.txt'), 'w') as f:
    f.write(text)  # the program as this XLA compiled it, beside its trace
  rates = hardware.rates.for_flags(os.environ.get('XLA_FLAGS', ''))
  devices = run.mesh.devices.size
  predicted = model.step_time(text, rates, devices,
                              model.node_crossing(hardware.devices_per_node, devices),
                              experts.custom_call_costs(run.cfg, run.layout.batch_shards))
  measured = trace.read(directory, trace.module_name(text), trace.containers(text))
  print(f'{_STEPS.value} steps of {trace.module_name(text)} on {devices} × {device.device_kind} '
        f'traced into {directory}; predicted on {hardware.name} '
        f'({report.assumptions_text(rates.assumptions())})')
  print(throughput(run.cfg, step_s, run.mesh))
  if device.platform != 'gpu':
    print(f'(a {device.platform} trace: the join is checked, the times are not comparable)')
  comparison = trace.compare(predicted, measured, _STEPS.value)
  print(trace.format_comparison(comparison, _TOP.value))
  if buffers := sum(r.name.startswith('command_buffer') for r in comparison.rows):
    # A command buffer's kernels run as one CUDA graph, which the trace shows whole.
    print(f'{buffers} command buffers ran kernels the trace does not show one by one: '
          'XLA_FLAGS=--xla_gpu_enable_command_buffer= joins them kernel by kernel')
  for note in predicted.untimed:
    print(f'not timed as it runs: {note}')


if __name__ == '__main__':
  main_guard(main)
