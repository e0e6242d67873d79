"""Qwen3-30B-A3B on one node of 8 H100s: jaxllm's train step, compiled here without a GPU and
timed by the timing model, beside NVIDIA NeMo's published measurement.

    python benchmarks/moe.py [--config configs/qwen3_30b_a3b.py] [--config.a.b=v ...]

Prints the predicted step, tokens/s per GPU and model TFLOP/s per GPU (6 × active parameters
per token plus causal attention, jaxllm.metrics: 23.1 GFLOP a token, NeMo's 277 ÷ 12,040
= 23.0) beside NeMo AutoModel's 12,040 tokens/s/GPU and
277 TFLOP/s/GPU (Transformer Engine and DeepEP, Qwen3-30B-A3B, 8×H100), with how the compiled
program runs the experts: the grouped GEMMs as the own Triton kernels (calls per step) and the
ring dispatch's bytes beside the analytic figure.
"""

from jaxllm.backends import gpu_devices, start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.cost import experts, hlo, timing
from jaxllm.cost.compile import compile_step
from jaxllm.cost.hardware import PROFILES
from jaxllm.cost.report import report

_CONFIG = 'configs/qwen3_30b_a3b.py'
NEMO = {'tokens_per_s_per_gpu': 12_040, 'tflops_per_gpu': 277}  # NeMo AutoModel, 8×H100


def main(argv):
  if not any(a.startswith('--config') and not a.startswith('--config.') for a in argv[1:]):
    argv = [argv[0], f'--config={_CONFIG}', *argv[1:]]
  cfg, _ = parse_command_line(argv, __doc__)
  start_backends()
  hardware = PROFILES['h100-nvlink']
  compiled = compile_step(cfg, gpu_devices(hardware, 8))
  r = report(compiled, hardware)
  pr, moe = r['prediction'], r['moe']
  tokens_per_gpu = pr['tokens_per_s'] / 8
  tflops = pr['mfu_causal'] * hardware.peak_flops / 1e12
  kernels = {}
  for k in hlo.triton_kernels(compiled.text):
    kernels[k.name] = kernels.get(k.name, 0) + k.count
  print(f'Qwen3-30B-A3B, 8×H100, global batch {cfg.train.global_batch} × {cfg.data.seq_len} '
        f'tokens, remat={cfg.model.remat!r}, dispatch={cfg.model.moe.dispatch!r}, grouped '
        f'matmul={cfg.model.moe.grouped_matmul!r}')
  print(f'{"":28} {"tokens/s/GPU":>13} {"TFLOP/s/GPU":>12} {"step":>9}')
  print(f'{"jaxllm (predicted)":28} {tokens_per_gpu:>13,.0f} {tflops:>12,.0f} '
        f'{pr["step_s"] * 1e3:>7,.0f}ms')
  print(f'{"NeMo AutoModel (published)":28} {NEMO["tokens_per_s_per_gpu"]:>13,} '
        f'{NEMO["tflops_per_gpu"]:>12,} {"":>9}')
  print('grouped GEMM kernels per step: ' + ', '.join(f'{n} {c}' for n, c in kernels.items()))
  print(f'dispatch bytes per GPU and step: {moe["dispatch_bytes"] / 2**30:,.2f} GiB compiled, '
        f'{moe["dispatch_bytes_analytic"] / 2**30:,.2f} GiB analytic')
  print('where the step goes: ' + ', '.join(f'{c} {pr[f"{c}_s"] * 1e3:,.0f}ms'
                                            for c in timing.CATEGORIES)
        + f'; collectives {pr["comm_s"] * 1e3:,.0f}ms, {pr["hidden_comm_s"] * 1e3:,.0f}ms hidden')
  print(f'optimistic: the grouped GEMMs are timed at cuBLAS\'s rates ({experts.KERNELS_MEASURED}'
        '), and the dispatch\'s scatter-add there took 7.7× its modelled time '
        '(benchmarks/README.md)')


if __name__ == '__main__':
  main_guard(main)
