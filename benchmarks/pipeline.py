"""Pipeline benchmark: step time of pipe=2/4 (each schedule) relative to pipe=1, measured
in one process, and the bytes each device sends over the pipe axis per step, compiled
(`jaxllm.cost.hlo`) against the analytic figure (`jaxllm.cost.traffic.expected_bytes`).

    python benchmarks/pipeline.py [--steps 10] [--layers 8] [--batch 8]

Runs the comparison model (configs/comparison.py) on 8 simulated CPU devices; every case
uses the devices left over by `pipe` as fsdp.
"""

import argparse
import os

import jax

jax.config.update('jax_platforms', 'cpu')  # a CPU benchmark, on any machine
jax.config.update('jax_num_cpu_devices', 8)

from timing import time_steps  # noqa: E402
from jaxllm.cli import load_config  # noqa: E402
from jaxllm.cost import hlo  # noqa: E402
from jaxllm.cost.compile import compile_step  # noqa: E402
from jaxllm.cost.traffic import expected_bytes  # noqa: E402
from jaxllm.train import setup  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--batch', type=int, default=8)
  args = parser.parse_args()

  cases = [('pipe=1', 1, 'gpipe', 1)] + [
      (f'pipe={S} {schedule}' + (f' R={R}' if R > 1 else ''), S, schedule, R) for S in (2, 4)
      for schedule, R in (('gpipe', 1), ('circular', 2), ('1f1b', 1), ('interleaved_1f1b', 2))]
  print(f'comparison model, {args.layers} layers, global batch {args.batch}, 8 simulated CPU '
        f'devices (jax {jax.__version__})')
  print(f'{"case":28} {"mesh":15} {"M":>3} {"step s":>7} {"vs pipe=1":>9} {"bubble":>7} '
        f'{"pipe MB":>9} {"analytic":>9} {"ratio":>6} {"pipe+ MB":>9}')
  baseline = None
  for name, stages, schedule, repeats in cases:
    cfg = load_config(os.path.join(REPO, 'configs', 'comparison.py'))
    cfg.model.num_layers = args.layers
    cfg.train.global_batch = args.batch
    cfg.mesh.update(data=1, fsdp=-1, pipe=stages, tensor=1)
    cfg.pipeline.update(schedule=schedule, repeats=repeats)
    fsdp = 8 // stages
    # As many micro-batches as the batch allows over fsdp, at least S.
    cfg.pipeline.microbatches = max(stages, min(2 * stages, args.batch // fsdp))
    run = setup(cfg)
    step_time, _, compiled, _ = time_steps(run, args.steps, warmup=2)
    baseline = baseline or step_time
    found = hlo.collectives(compiled.as_text(), dict(run.mesh.shape),
                            cpu=run.mesh.devices.flat[0].platform == 'cpu')
    pipe_bytes = sum(c.bytes for c in found if c.axes == ('pipe',))
    other_bytes = sum(c.bytes for c in found if 'pipe' in c.axes and c.axes != ('pipe',))
    line = f'{name:28} {"pipe=%d fsdp=%d" % (stages, fsdp):15} '
    if run.pipeline:
      analytic = expected_bytes(compile_step(cfg))[('pipe',)]
      line += (f'{run.pipeline.microbatches:>3} {step_time:7.3f} {step_time / baseline:9.2f} '
               f'{run.pipeline.bubble_fraction:7.1%} {pipe_bytes / 1e6:9.2f} '
               f'{analytic / 1e6:9.2f} {pipe_bytes / analytic:6.2f} {other_bytes / 1e6:9.2f}')
    else:
      line += f'{"-":>3} {step_time:7.3f} {1.0:9.2f} ' + f'{"-":>7} ' * 4 + f'{"-":>9}'
    print(line, flush=True)


if __name__ == '__main__':
  main()
