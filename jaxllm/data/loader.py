"""Batches for the train step and for evaluation, as a grain pipeline.

    documents (this process's share) → shuffle (train.seed; a new order every epoch) → repeat
      → tokenize → pack (or pad one document per row) → batch → prefetch → global arrays

Every array of a batch is [rows, seq_len]: 'inputs' and 'targets' (the next token), int32;
'positions' of each input token in its document, int32; 'mask', float32, 1 where the target
is a real token of the same document as the input. Packed rows also carry 'segment_ids'
(which document of the row each input token belongs to; 0 = padding), int32, for the
attention mask; rows of one document each need only the causal mask, so they leave it out.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref
from typing import Callable, Iterator

import grain
import jax
import numpy as np
from ml_collections import ConfigDict

from jaxllm.config import ConfigError
from jaxllm.data.sources import TokenRecords, process_share, split
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.mesh import batch_sharding

# Threads that read and tokenize documents, and documents read ahead of the packer.
READ_OPTIONS = grain.ReadOptions(num_threads=min(8, os.cpu_count() or 1), prefetch_buffer_size=128)

Batch = dict[str, np.ndarray]


def to_example(rows: Batch, packed: bool) -> Batch:
  """Rows of seq_len + 1 tokens (with their segment ids and positions) -> the batch dict."""
  tokens, segments = rows['tokens'], rows['tokens_segment_ids']
  same_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  example = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
             'positions': rows['tokens_positions'][:, :-1],
             'mask': same_document.astype(np.float32)}
  if packed:
    example['segment_ids'] = segments[:, :-1]
  return example


def pad_document(tokens: np.ndarray, length: int) -> Batch:
  """One document alone in a row: cut to `length` tokens, or padded with segment id 0."""
  n = min(len(tokens), length)
  padded = lambda values: np.pad(values, (0, length - n)).astype(np.int32)
  return {'tokens': padded(tokens[:n]), 'tokens_segment_ids': padded(np.ones(n)),
          'tokens_positions': padded(np.arange(n))}


def token_ids_fn(cfg: ConfigDict, documents) -> Callable[[object], np.ndarray]:
  """The document -> token ids function of `documents`; model.vocab_size must cover the ids."""
  vocab_size = cfg.model.vocab_size
  if isinstance(documents.source, TokenRecords):  # pre-tokenised: the ids are used as they are
    largest = int(documents[0].max(initial=0))
    if largest >= vocab_size:
      raise ConfigError(f'model.vocab_size={vocab_size} is too small for token id {largest} in '
                        f'{documents.source.files[0]}; set it to at least {largest + 1}.')
    return lambda ids: ids
  tokenizer = load_tokenizer(cfg.data)
  if vocab_size < tokenizer.vocab_size:
    raise ConfigError(f'model.vocab_size={vocab_size} is smaller than the vocabulary of '
                      f'data.tokenizer={cfg.data.tokenizer!r} ({tokenizer.vocab_size} ids); '
                      f'set it to at least {tokenizer.vocab_size}.')
  return tokenizer.encode


def local_batches(cfg: ConfigDict, split_name: str, rows: int, process_index: int,
                  process_count: int) -> grain.IterDataset | None:
  """This process's batches of `rows` rows of the 'train' or 'eval' split, endlessly
  (None when there is no such split). Train documents are shuffled, eval ones are not."""
  documents = split(cfg.data, split_name)
  if documents is None:
    return None
  field = 'data.path' if split_name == 'train' else (
      'data.eval_path' if cfg.data.eval_path else 'data.eval_fraction')
  documents = process_share(documents, process_index, process_count, field)
  tokenize = token_ids_fn(cfg, documents)
  length = cfg.data.seq_len + 1  # inputs and targets are this shifted by one

  docs = grain.MapDataset.source(documents)
  if split_name == 'train':
    if not 0 <= cfg.train.seed < 2**32:
      raise ConfigError(f'train.seed={cfg.train.seed} must be in [0, 2**32) to shuffle the data.')
    docs = docs.shuffle(seed=cfg.train.seed)  # shuffled indices past the end: a new epoch order
  docs = docs.repeat().map(tokenize)
  if cfg.data.packing:
    packed = grain.experimental.ConcatThenSplitIterDataset(
        docs.map(lambda ids: {'tokens': ids}).to_iter_dataset(READ_OPTIONS),
        length_struct={'tokens': length})
  else:
    packed = docs.map(lambda ids: pad_document(ids, length)).to_iter_dataset(READ_OPTIONS)
  batches = packed.batch(rows, drop_remainder=True).map(
      functools.partial(to_example, packed=cfg.data.packing))
  if split_name == 'train' and cfg.data.prefetch:
    batches = grain.experimental.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=cfg.data.prefetch)
  return batches


def synthetic_batch(cfg: ConfigDict, rows: int) -> Batch:
  """One fixed batch of random tokens, one document per row (benchmarks: no input cost)."""
  T = cfg.data.seq_len
  tokens = np.random.default_rng(cfg.train.seed).integers(
      0, cfg.model.vocab_size, (rows, T + 1), dtype=np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy()
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'positions': positions,
          'mask': np.ones((rows, T), np.float32)}


def to_global(sharding, local: Batch) -> dict[str, jax.Array]:
  """This process's rows -> global arrays laid out by `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def _json_to_state(state):
  """JSON turns grain's tuples into lists; grain compares them with tuples, so turn back."""
  if isinstance(state, dict):
    return {k: _json_to_state(v) for k, v in state.items()}
  if isinstance(state, list):
    return tuple(_json_to_state(v) for v in state)
  return state


def _release(slot: list) -> None:
  """Closes the iterator in `slot` and lets it go: at exit this runs while the interpreter
  is whole (grain's own clean-up fails during module teardown)."""
  if slot:
    slot.pop().close()


class Batches(grain.DatasetIterator):
  """The endless stream of global batches; `get_state()` (JSON-serialisable) after k batches
  and `set_state()` on a new stream from the same config resume at batch k + 1.

  A grain DatasetIterator, so grain's Orbax handler (`grain.checkpoint.CheckpointSave`)
  saves it, one JSON file per process.
  """

  def __init__(self, sharding, local=None, fixed: dict[str, jax.Array] | None = None):
    super().__init__()  # no grain parents: the pipeline sits in a slot that can be let go
    self._sharding, self._fixed = sharding, fixed
    self._slot = [] if local is None else [iter(local)]
    weakref.finalize(self, _release, self._slot)

  def __next__(self) -> dict[str, jax.Array]:
    if self._fixed is not None:
      return self._fixed
    return to_global(self._sharding, next(self._slot[0]))

  def get_state(self) -> dict:
    return self._slot[0].get_state() if self._slot else {}

  def set_state(self, state: dict) -> None:
    if self._slot:
      self._slot[0].set_state(_json_to_state(state))

  def start_prefetch(self) -> None:
    if self._slot:
      self._slot[0].start_prefetch()

  def close(self) -> None:
    _release(self._slot)


def _process(process_index, process_count) -> tuple[int, int]:
  return (jax.process_index() if process_index is None else process_index,
          jax.process_count() if process_count is None else process_count)


def make_batches(cfg: ConfigDict, mesh, process_index: int | None = None,
                 process_count: int | None = None) -> Batches:
  """The train batches of `train.global_batch` rows. Bad input raises ConfigError here."""
  process_index, process_count = _process(process_index, process_count)
  rows = cfg.train.global_batch // process_count
  sharding = batch_sharding(mesh, cfg.sharding.rules, ndim=2)  # every array is [batch, seq]
  if cfg.data.source == 'synthetic':
    return Batches(sharding, fixed=to_global(sharding, synthetic_batch(cfg, rows)))
  if cfg.data.source != 'files':
    raise ConfigError(f"data.source={cfg.data.source!r} is unknown; use 'files' or 'synthetic'.")
  return Batches(sharding, local_batches(cfg, 'train', rows, process_index, process_count))


def make_eval_batches(cfg: ConfigDict, mesh, process_index: int | None = None,
                      process_count: int | None = None
                      ) -> Callable[[], Iterator[dict[str, jax.Array]]] | None:
  """None without an eval split; else a function whose every call iterates over the same
  `eval.batches` batches of global_batch / micro_batches rows (the split repeats if short)."""
  if cfg.data.source != 'files':
    return None
  process_index, process_count = _process(process_index, process_count)
  rows = cfg.train.global_batch // cfg.train.micro_batches // process_count
  dataset = local_batches(cfg, 'eval', rows, process_index, process_count)
  if dataset is None:
    return None
  sharding = batch_sharding(mesh, cfg.sharding.rules, ndim=2)

  def eval_batches() -> Iterator[dict[str, jax.Array]]:
    local = iter(dataset)
    try:
      for batch in itertools.islice(local, cfg.eval.batches):
        yield to_global(sharding, batch)
    finally:
      local.close()  # stops the read-ahead threads
  return eval_batches
