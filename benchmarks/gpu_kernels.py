"""CPU seconds of compiling a config's train step for GPUs that are not there, with and without
the GPU kernels kept in the compilation cache (`jaxllm.backends.gpu_kernel_file`), and with
ptxas optimizing each kernel as XLA's default would (`compile.COMPILE_OPTIONS` skips that).

    python benchmarks/gpu_kernels.py --config configs/X.py [--devices 8] [--config.a.b=v ...]

Five compiles for 8 (`--devices`) H100s, each in a fresh process: without a cache
(compilation_cache=''), the same with ptxas optimizing, with an empty cache directory (every
kernel generated, then kept), with that directory again (every kernel found there), and with
it once more for the model under the other remat policy (none ↔ full: some kernels new, most
found). Printed per compile:
the CPU seconds it took (the compiler's threads and ptxas processes, as analyze counts them),
as a ratio to the one without a cache, and whether the program is the one compiled without a
cache (its optimized HLO and memory; the remat row is another program).
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_once(argv: list[str], devices: int, ptxas_optimizing: bool) -> dict:
  """In this process: the config of `argv` compiled for `devices` H100s."""
  from jaxllm.backends import gpu_devices, start_backends
  from jaxllm.cli import parse_command_line
  from jaxllm.cost.compile import COMPILE_OPTIONS, compile_step
  from jaxllm.cost.hardware import hardware_profile
  COMPILE_OPTIONS['xla_gpu_disable_gpuasm_optimizations'] = not ptxas_optimizing
  cfg, _ = parse_command_line(['compile', *argv])
  start_backends(cfg)
  c = compile_step(cfg, gpu_devices(hardware_profile('h100-nvlink'), devices))
  program = hashlib.sha256(f'{c.text}{c.memory}'.encode()).hexdigest()
  return {'cpu_s': c.compile_s, 'program': program}


def in_a_fresh_process(argv: list[str], devices: int, ptxas_optimizing: bool) -> dict:
  out = subprocess.run([sys.executable, __file__, '--one', str(devices), str(ptxas_optimizing),
                        *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
  devices = 8
  if '--devices' in argv:
    i = argv.index('--devices')
    devices, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
  from jaxllm.cli import parse_command_line
  remat = parse_command_line(['compile', *argv])[0].model.remat
  other = 'full' if remat == 'none' else 'none'
  with tempfile.TemporaryDirectory() as cache:
    cases = [('no cache', ["--config.compilation_cache="], False),
             ('no cache, ptxas optimizing', ["--config.compilation_cache="], True),
             ('cache empty', [f'--config.compilation_cache={cache}'], False),
             ('cache filled', [f'--config.compilation_cache={cache}'], False),
             (f'cache filled, remat {other}', [f'--config.compilation_cache={cache}',
                                               f'--config.model.remat={other}'], False)]
    results = [(name, in_a_fresh_process(argv + extra, devices, optimizing))
               for name, extra, optimizing in cases]
  base = results[0][1]
  print(f'{"compile":28} {"CPU s":>7} {"ratio":>6}  same program')
  for name, r in results:
    same = 'yes' if r['program'] == base['program'] else 'no'
    print(f'{name:28} {r["cpu_s"]:7.1f} {r["cpu_s"] / base["cpu_s"]:6.2f}  {same}')


if __name__ == '__main__':
  if sys.argv[1:2] == ['--one']:
    print(json.dumps(compile_once(sys.argv[4:], int(sys.argv[2]), sys.argv[3] == 'True')))
  else:
    main(sys.argv[1:])
