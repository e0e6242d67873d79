"""The timing model against published measurements: each run's own program predicted beside
the step its authors measured, and jaxllm's program for the same run beside it.

    python benchmarks/predictions.py --maxtext-hlo DIR [--runs a3_1vm,jax_toolbox,...]

DIR holds MaxText's programs for the runs, as `benchmarks/maxtext.py` writes them
(`<run>.hlo.txt`, one per entry of RUNS, with the XLA flags they were compiled with); a run
whose file is missing is predicted from jaxllm's program alone. Each run is predicted on a
profile of the machine it ran on (`Run.hardware`), with the cuDNN of its day and command
buffers as its flags set them. Prints a markdown table: the measured step, each program's
predicted step and its error (predicted ÷ measured − 1), printed whatever it is, and where the
predicted time of MaxText's program goes.
"""

import dataclasses
import os
import sys

from absl import flags

from jaxllm import metrics
from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import load_config, main_guard
from jaxllm.config import ConfigError
from jaxllm.cost import report
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import hardware_profile

_MAXTEXT_HLO = flags.DEFINE_string('maxtext-hlo', '', 'Directory of MaxText\'s programs, '
                                   '<run>.hlo.txt as benchmarks/maxtext.py writes them.')
_RUNS = flags.DEFINE_list('runs', None, 'The runs to predict (default: all).')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Run:
  name: str            # benchmarks/maxtext.py's --run
  what: str
  source: str          # where the measurement is published
  hardware: str        # the profile of the machine it ran on
  cudnn: str           # the cuDNN series of its day (`hardware.ATTENTION`)
  devices: int
  global_batch: int    # sequences of seq_len per step
  seq_len: int
  config: str          # jaxllm's config of the same model
  step_s: float = 0.0  # measured seconds per step, if published as such
  tflops: float = 0.0  # else: model TFLOP/s per GPU, by MaxText's count of 2024

  def measured_step(self) -> float:
    """The measured step; from TFLOP/s by the FLOP count MaxText published them with in 2024
    (`maxtext_utils.calculate_tflops_training_per_device` at efb6d9e4a): 6 × all parameters,
    the embedding's included, per token, plus causal-halved attention, 6·L·H·Q·T."""
    if self.step_s:
      return self.step_s
    m = load_config(os.path.join(REPO, self.config)).model
    per_token = (6 * metrics.param_counts(m)['total']
                 + 6 * m.num_layers * m.num_heads * m.head_dim * self.seq_len)
    return per_token * self.global_batch * self.seq_len / (self.tflops * 1e12 * self.devices)


def a3(vms: int, tflops: float) -> Run:
  gpus = 8 * vms
  return Run(f'a3_{vms}vm', f'MaxText Llama-2-7B, {gpus} H100s on {vms} A3 VM'
             f'{"s" if vms > 1 else ""}, fsdp=8{f" × data={vms} across VMs" if vms > 1 else ""}, '
             f'{4 * gpus} × 4096 tokens, bf16',
             f'MaxText, configs/a3/llama_2_7b/README.md at efb6d9e4a ({tflops:g} TFLOP/s per GPU)',
             'h100-a3', '2024', gpus, 4 * gpus, 4096, 'configs/llama2_7b.py', tflops=tflops)


RUNS = (
    Run('jax_toolbox', 'MaxText Llama-2-7B, 8 H100s (DGX), fsdp=8, 16 × 4096 tokens, bf16',
        'NVIDIA JAX-Toolbox, MaxText README of 2024-05-01', 'h100-nvlink', '2024', 8, 16, 4096,
        'configs/llama2_7b.py', step_s=0.721),
    a3(1, 492), a3(2, 422), a3(4, 407), a3(8, 409),
)


def profile(run: Run):
  hardware = hardware_profile(run.hardware)
  return dataclasses.replace(hardware,
                             rates=dataclasses.replace(hardware.rates, cudnn=run.cudnn))


def jaxllm_program(run: Run, hardware) -> dict:
  """jaxllm's own program for the run: its config on the run's mesh (fsdp over each node's 8
  GPUs, data across nodes), the run's batch."""
  cfg = load_config(os.path.join(REPO, run.config))
  nodes = max(1, run.devices // 8)
  cfg.mesh.update(data=nodes, fsdp=run.devices // nodes, pipe=1, tensor=1)
  cfg.train.global_batch = run.global_batch
  cfg.data.seq_len = run.seq_len
  return report.report(compile_step(cfg, gpu_devices(hardware, run.devices)), hardware)


def error_text(predicted: float, measured: float) -> str:
  return f'{predicted * 1e3:,.0f} ms ({predicted / measured - 1:+.1%})'


def breakdown_text(p: dict) -> str:
  return ', '.join(f'{label} {p[f"{c}_s"] * 1e3:,.0f}' for c, label in (
      ('gemm', 'GEMMs'), ('attention', 'attention'), ('memory', 'memory-bound'),
      ('launch', 'launches'), ('contention', 'beside NCCL'), ('exposed_comm', 'exposed comm')))


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
  names = [r.name for r in RUNS]
  if unknown := set(_RUNS.value or ()) - set(names):
    raise ConfigError(f'--runs: unknown {", ".join(sorted(unknown))}; use {", ".join(names)}.')
  start_backends()
  print(f'{sys.argv[0]} {" ".join(argv[1:])}')
  print('| run | measured step | profile | MaxText\'s program, predicted (error) | jaxllm\'s '
        'program, predicted (error) | where MaxText\'s predicted step goes, ms |')
  print('|---|---:|---|---:|---:|---|')
  for run in RUNS:
    if _RUNS.value and run.name not in _RUNS.value:
      continue
    measured, hardware = run.measured_step(), profile(run)
    path = os.path.join(directory, f'{run.name}.hlo.txt') if directory else ''
    theirs, breakdown, assumed = '–', '–', hardware.rates.assumptions()
    if path and os.path.isfile(path):
      with open(path) as f:
        p = report.program_report(f.read(), hardware, run.devices,
                                  hardware.devices_per_node)['prediction']
      theirs, breakdown, assumed = error_text(p['step_s'], measured), breakdown_text(p), p['assumes']
    ours = jaxllm_program(run, hardware)['prediction']['step_s']
    print(f'| {run.what} ({run.source}) | {measured * 1e3:,.0f} ms | {run.hardware}, '
          f'{report.assumptions_text(assumed)} | {theirs} | {error_text(ours, measured)} | '
          f'{breakdown} |', flush=True)


if __name__ == '__main__':
  main_guard(main)
