"""The fingerprint of a config's train step as the GPU would run it, to show that a change
leaves a model's program alone (a new model option at its default, say).

    python benchmarks/fingerprint.py --config configs/llama3_8b.py [--devices N] \
        [--hardware h100-nvlink] [--config.a.b=v ...]

Compiles the step from shapes for the profile's GPUs (without one), as `jaxllm.analyze`
does, and prints the sha256 of its optimized HLO text with what names the source stripped:
each op's metadata (op names, source files and lines) and the stack-frame tables. Run it on
two commits: the same digest is the same program, byte for byte.
"""

import hashlib
import re

from jaxllm import analyze
from jaxllm.cli import main_guard
from jaxllm.cost.compile import compile_step

# The stack-frame tables XLA prints before the computations, and what names the source.
_TABLES = re.compile(r'(FileNames|FunctionNames|FileLocations|StackFrames)$|\d+ ')
_SOURCE = (re.compile(r',? metadata=\{[^}]*\}'), re.compile(r'stack_frame_id=\d+'))


def program_text(text: str) -> str:
  """An optimized HLO text without what names the source: the same for the same program
  whatever file or line its ops were traced from."""
  for pattern in _SOURCE:
    text = pattern.sub('', text)
  return '\n'.join(line for line in text.split('\n') if not _TABLES.match(line))


def main(argv: list[str]) -> None:
  cfg, _, devices = analyze.parse_and_place(argv, __doc__)  # analyze's flags: --devices, --hardware
  text = program_text(compile_step(cfg, devices).text)
  print(f'{hashlib.sha256(text.encode()).hexdigest()}  {len(text):,} characters')


if __name__ == '__main__':
  main_guard(main)
