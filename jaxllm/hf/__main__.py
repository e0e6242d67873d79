"""`python -m jaxllm.hf export --checkpoint RUN_DIR/checkpoints[/STEP] --out DIR [--dtype D]`"""

from __future__ import annotations

import argparse
import math

from jaxllm.backends import start_backends
from jaxllm.cli import main_guard
from jaxllm.config import DTYPES, ConfigError
from jaxllm.hf.export import export_checkpoint


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(
      prog='python -m jaxllm.hf',
      description='Hugging Face checkpoints (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3).')
  commands = parser.add_subparsers(dest='command', required=True)
  export_cmd = commands.add_parser('export', help='a jaxllm checkpoint → a HF checkpoint dir')
  export_cmd.add_argument('--checkpoint', required=True,
                          help='RUN_DIR/checkpoints (its newest step) or one step directory')
  export_cmd.add_argument('--out', required=True, help='the directory to write')
  export_cmd.add_argument('--dtype', choices=DTYPES, default=None,
                          help="the tensors' dtype (default: the run's model.dtype)")
  export_cmd.add_argument('--max-shard-gb', type=float, default=5.0,
                          help='split the weights into files of at most this size (GB)')
  args = parser.parse_args(argv[1:])
  if not 0 < args.max_shard_gb < math.inf:
    raise ConfigError(f'--max-shard-gb={args.max_shard_gb} must be a positive number of GB, '
                      'e.g. 5.')
  start_backends()
  export_checkpoint(args.checkpoint, args.out, args.dtype, int(args.max_shard_gb * 10**9))
  print(f'exported {args.checkpoint} to {args.out}')


def cli() -> None:
  """The `jaxllm-hf` command (pyproject's console script): `python -m jaxllm.hf`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
