"""Pipeline schedules side by side, from the GPU's compiled program (made without a GPU).

    python benchmarks/schedules.py --config configs/llama3_70b.py --devices 32 \
        --mesh pipe=4,tensor=8 [--schedules gpipe,1f1b,circular,interleaved_1f1b] \
        [--repeats 2] [--hardware h100-nvlink] [--config.pipeline.microbatches=16 ...]

For each schedule (circular and interleaved with --repeats): how many stage visits a stage
keeps residuals for at once (`pipeline.residual_items`) and the bubble (from the tick tables,
`jaxllm.pipeline.ticks`); from the compiled step the
temporaries and peak memory per device (a device is a stage), the largest array (under the
pipelines, the residuals kept for the backward), the bytes sent over pipe beside the analytic
figure (`jaxllm.cost.traffic.expected_bytes`), and the predicted step time and MFU, all as
`jaxllm.analyze` computes them.
"""

import sys

import jax
from absl import flags

from jaxllm import analyze, metrics
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import PIPELINE_SCHEDULES, ROUND_TRIP_SCHEDULES, ConfigError
from jaxllm.cost import report
from jaxllm.cost.hardware import hardware_profile
from jaxllm.pipeline.spec import pipeline_spec, residual_items
from jaxllm.pipeline.ticks import schedule_ticks

sys.path.insert(0, __file__.rsplit('/', 1)[0])
from programs import _MESH, parse_mesh  # noqa: E402

# --devices, --hardware and --device-memory are analyze's; --mesh (one) is programs.py's.
_SCHEDULES = flags.DEFINE_list('schedules', list(PIPELINE_SCHEDULES), 'Schedules to compare.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'pipeline.repeats of circular and interleaved.')



def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  if len(_MESH.value) != 1:
    raise ConfigError('--mesh: give one mesh, e.g. --mesh pipe=4,tensor=8.')
  mesh = parse_mesh(_MESH.value[0])
  unknown = [s for s in _SCHEDULES.value if s not in PIPELINE_SCHEDULES]
  if unknown:
    raise ConfigError(f'--schedules names unknown schedules {unknown}; use '
                      f'{", ".join(PIPELINE_SCHEDULES)}.')
  start_backends(cfg)
  hardware = hardware_profile(analyze.HARDWARE.value, analyze.DEVICE_MEMORY.value)
  devices = gpu_devices(hardware, analyze.DEVICES.value)
  cfg.mesh.update(mesh)
  m = cfg.model
  S = mesh['pipe']
  M = cfg.pipeline.microbatches or 2 * S
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print(f'model {metrics.param_counts(m)["total"] / 1e9:.2f}B, {m.num_layers} layers, '
        f'{m.dtype} compute, remat {m.remat}; global batch {cfg.train.global_batch} × '
        f'{cfg.data.seq_len} tokens in M={M} pipeline micro-batches; mesh '
        f'{_MESH.value[0]} of {len(devices)} × {hardware.name}, jax {jax.__version__}')
  print('| schedule | stage visits kept × their share of the stage | bubble | temporaries | '
        'peak | fits | largest array | pipe bytes (analytic) | predicted step | MFU |')
  print('|---|---:|---:|---:|---:|---|---|---:|---:|---:|')
  for schedule in _SCHEDULES.value:
    c = cfg.copy_and_resolve_references()
    R = _REPEATS.value if schedule in ROUND_TRIP_SCHEDULES else 1
    c.pipeline.update(schedule=schedule, repeats=R)
    ticks = schedule_ticks(schedule, S, R, M)
    kept = residual_items(pipeline_spec(c, S))
    r = report.analyze(c, hardware, devices)
    mem, pr = r['memory'], r['prediction']
    pipe = next(a for a in r['per_axis'] if a['axes'] == ['pipe'])
    largest = r['largest_arrays'][0]
    name = schedule + (f' ×{R}' if R > 1 else '')
    print(f'| {name} | {kept} × 1/{R} | {ticks.bubble_fraction():.1%} | '
          f'{report.size_text(mem["temporaries"])} | {report.size_text(mem["peak"])} | '
          f'{"yes" if r["fits"] else "no"} | {report.size_text(largest["bytes"])} '
          f'{largest["shape"]} | {report.size_text(pipe["bytes"])} '
          f'({pipe["ratio"]:.2f}×) | {report.seconds_text(pr["step_s"])} | {pr["mfu"]:.1%} |',
          flush=True)


if __name__ == '__main__':
  main_guard(main)
