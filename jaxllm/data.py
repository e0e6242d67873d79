"""Input pipeline: grain over local text files with a byte-level tokenizer, or one fixed
synthetic batch; batches arrive as global arrays split over the 'batch' rule."""

from __future__ import annotations

import glob
import itertools
import os
from typing import Iterator

import grain
import jax
import numpy as np
from ml_collections import ConfigDict

from jaxllm.config import ConfigError
from jaxllm.mesh import batch_sharding

# Byte-level tokenizer: ids 0-255 are the bytes themselves.
BOS_ID, EOS_ID = 256, 257
BYTE_VOCAB_SIZE = 258


def byte_tokenize(raw: bytes) -> np.ndarray:
  """One document's token ids: its bytes, closed by EOS."""
  ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
  return np.append(ids, EOS_ID).astype(np.int32)


def resolve_files(path: str) -> list[str]:
  """A file, every file under a directory, or the files a glob matches, sorted."""
  if not path:
    raise ConfigError('data.path is empty; set it to a text file, a directory or a glob '
                      "(or set data.source='synthetic').")
  if os.path.isdir(path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
  else:
    files = glob.glob(os.path.expanduser(path), recursive=True)
  files = sorted(f for f in files if os.path.isfile(f) and os.path.getsize(f) > 0)
  if not files:
    raise ConfigError(f'data.path={path!r} matches no non-empty files; point it at a text file, '
                      'a directory or a glob that exists.')
  return files


def _read_document(path: str) -> dict[str, np.ndarray]:
  with open(path, 'rb') as f:
    return {'tokens': byte_tokenize(f.read())}


def _to_example(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A packed row of T+1 tokens -> inputs/targets of length T; padding is masked out."""
  tokens, segments = packed['tokens'], packed['tokens_segment_ids']
  return {'inputs': tokens[:-1], 'targets': tokens[1:],
          'mask': (segments[1:] > 0).astype(np.float32)}


def text_examples(data_cfg: ConfigDict, batch_size: int, seed: int) -> grain.IterDataset:
  """Batches of fixed-length rows cut from the documents concatenated in a seeded order.

  Each process reads its own slice of the files; documents run into each other across
  row boundaries (EOS separates them).
  """
  files = resolve_files(data_cfg.path)
  share = files[jax.process_index()::jax.process_count()]
  if not share:
    raise ConfigError(f'data.path={data_cfg.path!r} has {len(files)} files for '
                      f'{jax.process_count()} processes; give every process at least one file.')
  documents = grain.MapDataset.source(share).shuffle(seed=seed).repeat().map(_read_document)
  rows = grain.experimental.ConcatThenSplitIterDataset(
      documents.to_iter_dataset(), length_struct={'tokens': data_cfg.seq_len + 1})
  batches = rows.map(_to_example).batch(batch_size, drop_remainder=True)
  return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=4)


def synthetic_example(data_cfg: ConfigDict, vocab_size: int, batch_size: int,
                      seed: int) -> dict[str, np.ndarray]:
  """One fixed batch of random tokens (for benchmarks: no input cost at all)."""
  tokens = np.random.default_rng(seed).integers(
      0, vocab_size, (batch_size, data_cfg.seq_len + 1), dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'mask': np.ones((batch_size, data_cfg.seq_len), np.float32)}


def to_global(sharding, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """This process's rows -> global arrays laid out by `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def make_batches(cfg: ConfigDict, mesh) -> Iterator[dict[str, jax.Array]]:
  """The endless stream of global batches a run trains on. Errors surface here, early."""
  local_batch = cfg.train.global_batch // jax.process_count()
  rows = batch_sharding(mesh, cfg.sharding.rules, ndim=2)  # every array is [batch, seq]
  if cfg.data.source == 'synthetic':
    example = synthetic_example(cfg.data, cfg.model.vocab_size, local_batch, cfg.train.seed)
    return itertools.repeat(to_global(rows, example))
  if cfg.model.vocab_size < BYTE_VOCAB_SIZE:
    raise ConfigError(f'model.vocab_size={cfg.model.vocab_size} is smaller than the byte '
                      f'tokenizer\'s {BYTE_VOCAB_SIZE} ids; set it to at least {BYTE_VOCAB_SIZE}.')
  examples = text_examples(cfg.data, local_batch, cfg.train.seed)
  return (to_global(rows, b) for b in examples)
