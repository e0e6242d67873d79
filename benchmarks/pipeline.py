"""Pipeline benchmark: step time of pipe=2/4 (GPipe, circular) relative to pipe=1, measured
in one process, and the compiled collective-permute bytes against the analytic figure.

    python benchmarks/pipeline.py [--steps 10] [--layers 8] [--batch 8]

Runs the comparison model (configs/comparison.py) on 8 simulated CPU devices; every case
uses the devices left over by `pipe` as fsdp.
"""

import argparse
import os
import re

import jax

jax.config.update('jax_num_cpu_devices', 8)

from bench import time_steps  # noqa: E402
from jaxllm.config import load_config  # noqa: E402
from jaxllm.train import setup  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4}


def permute_bytes_per_step(hlo: str) -> tuple[int, int]:
  """Bytes each device sends by collective-permute per step, as (inside loops, elsewhere).

  Inside loops: op size × the loop's trip count (the pipeline's stage-to-stage shifts).
  Elsewhere: resharding the compiler chose outside the pipeline (e.g. for the output head).
  """
  trips = {body: int(n) for body, n in re.findall(
      r'body=%?([\w.\-]+)[^\n]*?"known_trip_count":\{"n":"(\d+)"', hlo)}
  in_loops, elsewhere, current = 0, 0, None
  for line in hlo.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if header:
      current = header.group(1)
      continue
    op = re.search(r'= (\w+)\[([\d,]*)\][^\n]*? collective-permute(?:-start)?\(', line)
    if op:
      elements = 1
      for d in filter(None, op.group(2).split(',')):
        elements *= int(d)
      nbytes = DTYPE_BYTES[op.group(1)] * elements
      if current in trips:
        in_loops += nbytes * trips[current]
      else:
        elsewhere += nbytes
  return in_loops, elsewhere


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--batch', type=int, default=8)
  args = parser.parse_args()

  cases = [('pipe=1', 1, 'gpipe', 1), ('pipe=2 gpipe', 2, 'gpipe', 1),
           ('pipe=2 circular R=2', 2, 'circular', 2), ('pipe=4 gpipe', 4, 'gpipe', 1),
           ('pipe=4 circular R=2', 4, 'circular', 2)]
  print(f'comparison model, {args.layers} layers, global batch {args.batch}, 8 simulated CPU '
        f'devices (jax {jax.__version__})')
  print(f'{"case":22} {"mesh":15} {"M":>3} {"step s":>7} {"vs pipe=1":>9} {"bubble":>7} '
        f'{"stage MB":>9} {"analytic":>9} {"ratio":>6} {"other MB":>9}')
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
    hlo, pipeline = compiled.as_text(), run.pipeline
    baseline = baseline or step_time
    stage_bytes, other_bytes = permute_bytes_per_step(hlo)
    line = f'{name:22} {"pipe=%d fsdp=%d" % (stages, fsdp):15} '
    if pipeline:
      M = pipeline.microbatches
      rows = args.batch // M // fsdp  # b: micro-batch rows on one device
      # b·s·h per micro-batch per stage boundary, forward and backward, × R.
      analytic = 2 * repeats * M * rows * cfg.data.seq_len * cfg.model.embed_dim * 4
      line += (f'{M:>3} {step_time:7.3f} {step_time / baseline:9.2f} '
               f'{pipeline.bubble_fraction:7.1%} {stage_bytes / 1e6:9.2f} {analytic / 1e6:9.2f} '
               f'{stage_bytes / analytic:6.2f} {other_bytes / 1e6:9.2f}')
    else:
      line += f'{"-":>3} {step_time:7.3f} {1.0:9.2f} {"-":>7} {"-":>9} {"-":>9} {"-":>6} ' \
              f'{other_bytes / 1e6:9.2f}'
    print(line, flush=True)


if __name__ == '__main__':
  main()
