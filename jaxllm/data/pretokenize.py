"""`python -m jaxllm.data.pretokenize --config configs/X.py --out DIR [--config.a.b=v ...]`

Tokenizes the config's documents (data.path, and data.eval_path if set) with data.tokenizer
into ArrayRecord shards DIR/train-00000.arrayrecord, ... (and DIR/eval-*.arrayrecord). Train
on them with --config.data.path='DIR/train-*.arrayrecord': no tokenizing at train time.
Documents keep their order, so data.eval_fraction holds out the same documents as before.
"""

from __future__ import annotations

import itertools
import os

import grain
from absl import flags

from jaxllm.backends import start_backends
from jaxllm.cli import main_guard, parse_command_line
from jaxllm.config import ConfigError
from jaxllm.data.loader import READ_OPTIONS
from jaxllm.data.sources import open_documents, write_token_records
from jaxllm.data.tokenizer import load_tokenizer

_OUT = flags.DEFINE_string('out', None, 'Directory to write the ArrayRecord shards to.')
_SHARD_DOCS = flags.DEFINE_integer('shard_docs', 100_000, 'Documents per shard.')


def pretokenize(data_cfg, out: str, shard_docs: int) -> None:
  """Writes the tokenized documents to `out`, `shard_docs` per shard, in their order."""
  tokenizer = load_tokenizer(data_cfg)
  os.makedirs(out, exist_ok=True)
  splits = [('train', data_cfg.path, 'data.path')]
  if data_cfg.eval_path:
    splits.append(('eval', data_cfg.eval_path, 'data.eval_path'))
  for name, path, field in splits:
    documents = open_documents(data_cfg, path, field)
    # Threads tokenize ahead; the iterator keeps the documents' order.
    ids = iter(grain.MapDataset.source(documents).map(tokenizer.encode)
               .to_iter_dataset(READ_OPTIONS))
    for shard in itertools.count():
      first = next(ids, None)
      if first is None:
        break
      shard_name = f'{name}-{shard:05d}.arrayrecord'
      written = write_token_records(os.path.join(out, shard_name),
                                    itertools.chain([first], itertools.islice(ids, shard_docs - 1)))
      print(f'{shard_name}  {written:,} documents', flush=True)


def main(argv: list[str]) -> None:
  cfg, _ = parse_command_line(argv, __doc__)
  if not _OUT.value:
    raise ConfigError('--out is required: the directory to write the ArrayRecord shards to.')
  if _SHARD_DOCS.value < 1:
    raise ConfigError(f'--shard_docs={_SHARD_DOCS.value} must be at least 1.')
  if cfg.data.format == 'chat':
    raise ConfigError("data.format='chat': conversations are rendered and tokenized as they "
                      'are read (the records hold no loss mask); train on the JSONL files.')
  start_backends(cfg)
  pretokenize(cfg.data, _OUT.value, _SHARD_DOCS.value)
  print(f"train on them with --config.data.path='{os.path.join(_OUT.value, 'train-*.arrayrecord')}'")


if __name__ == '__main__':
  main_guard(main)
