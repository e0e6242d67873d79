"""The timing model against published measurements: each run's own program predicted beside
the step its authors measured, and jaxllm's program for the same run beside it.

    python benchmarks/predictions.py --maxtext-hlo DIR [--hardware h100-nvlink]

DIR holds MaxText's programs for the runs, as `benchmarks/maxtext.py` writes them
(`<run>.hlo.txt`, one per entry of RUNS); a run whose file is missing is predicted from
jaxllm's program alone. Prints a markdown table: the measured step, each program's predicted
step and its error (predicted ÷ measured − 1), printed whatever it is, and where the predicted
time of MaxText's program goes.
"""

import dataclasses
import os
import sys

from absl import flags

from jaxllm import analyze, metrics
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import load_config, main_guard
from jaxllm.config import ConfigError
from jaxllm.cost import report
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import hardware_profile

_MAXTEXT_HLO = flags.DEFINE_string('maxtext-hlo', '', 'Directory of MaxText\'s programs, '
                                   '<run>.hlo.txt as benchmarks/maxtext.py writes them.')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Run:
  name: str            # benchmarks/maxtext.py's --run
  what: str
  source: str          # where the measurement is published
  devices: int
  global_batch: int    # sequences of seq_len per step
  seq_len: int
  config: str          # jaxllm's config of the same model
  step_s: float = 0.0  # measured seconds per step, if published as such
  tflops: float = 0.0  # else: model TFLOP/s per GPU, as the authors counted them

  def measured_step(self) -> float:
    """The measured step; from TFLOP/s by MaxText's FLOP count of that time, 6·N per token
    plus causal-halved attention, N without the input embedding (jaxllm's 'causal' count)."""
    if self.step_s:
      return self.step_s
    m = load_config(os.path.join(REPO, self.config)).model
    flops = metrics.flops_per_token(m, self.seq_len)['causal'] * self.global_batch * self.seq_len
    return flops / (self.tflops * 1e12 * self.devices)


RUNS = (
    Run('jax_toolbox', 'MaxText Llama-2-7B, 8 H100s, fsdp=8, 16 × 4096 tokens, bf16',
        'NVIDIA JAX-Toolbox, docs/frameworks/maxtext/README.md', 8, 16, 4096,
        'configs/llama2_7b.py', step_s=0.721),
    Run('a3_1vm', 'MaxText Llama-2-7B, 8 H100s (A3), fsdp=8, 32 × 4096 tokens, bf16',
        'MaxText, src/maxtext/configs/gpu/a3/llama_2_7b/README.md (492 TFLOP/s per GPU)', 8, 32,
        4096, 'configs/llama2_7b.py', tflops=492),
)


def jaxllm_program(run: Run, hardware) -> dict:
  """jaxllm's own program for the run: its config on fsdp over the run's GPUs, the run's batch."""
  cfg = load_config(os.path.join(REPO, run.config))
  cfg.mesh.update(data=1, fsdp=run.devices, pipe=1, tensor=1)
  cfg.train.global_batch = run.global_batch
  cfg.data.seq_len = run.seq_len
  return report.report(compile_step(cfg, gpu_devices(hardware, run.devices)), hardware)


def error_text(predicted: float, measured: float) -> str:
  return f'{predicted * 1e3:,.0f} ms ({predicted / measured - 1:+.1%})'


def breakdown_text(p: dict) -> str:
  return ', '.join(f'{label} {p[f"{c}_s"] * 1e3:,.0f}' for c, label in (
      ('gemm', 'GEMMs'), ('attention', 'attention'), ('memory', 'memory-bound'),
      ('launch', 'launches'), ('exposed_comm', 'exposed comm')))


def main(argv: list[str]) -> None:
  if '--help' in argv or '-h' in argv:
    print(__doc__)
    return
  try:
    flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None
  directory = _MAXTEXT_HLO.value
  if directory and not os.path.isdir(directory):
    raise ConfigError(f'--maxtext-hlo {directory}: no such directory; pass the one '
                      'benchmarks/maxtext.py wrote the programs into.')
  start_backends()
  hardware = hardware_profile(analyze.HARDWARE.value)
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print('| run | measured step | MaxText\'s program, predicted (error) | jaxllm\'s program, '
        'predicted (error) | where MaxText\'s predicted step goes, ms |')
  print('|---|---:|---:|---:|---|')
  for run in RUNS:
    measured = run.measured_step()
    path = os.path.join(directory, f'{run.name}.hlo.txt') if directory else ''
    theirs, breakdown = '–', '–'
    if path and os.path.isfile(path):
      with open(path) as f:
        p = report.program_report(f.read(), hardware, run.devices,
                                  hardware.devices_per_node)['prediction']
      theirs, breakdown = error_text(p['step_s'], measured), breakdown_text(p)
    ours = jaxllm_program(run, hardware)['prediction']['step_s']
    print(f'| {run.what} ({run.source}) | {measured * 1e3:,.0f} ms | {theirs} | '
          f'{error_text(ours, measured)} | {breakdown} |', flush=True)


if __name__ == '__main__':
  main_guard(main)
