"""Batches for the train step and for evaluation, as a grain pipeline.

    documents (one stream's share) → shuffle (train.seed; a new order every epoch) → repeat
      → tokenize → pack (or pad one document per row) → batch → prefetch
    the streams this process reads → its rows → global arrays

The data is read as `data.streams` independent streams, each filling its own block of rows
of every batch (see `Streams`); a process reads the streams its devices' rows come from.

Every array of a batch is [rows, seq_len]: 'inputs' and 'targets' (the next token), int32;
'positions' of each input token in its document, int32; 'mask', float32, 1 where the target
is a real token of the same document as the input (and, for chat data, said by the
assistant: the loss is taken there only). Packed rows also carry 'segment_ids'
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
from jaxllm.data.chat import ChatEncoder
from jaxllm.data.sources import ChatFiles, TokenRecords, split, stream_share
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.parallel.mesh import batch_sharding

# Threads that read and tokenize documents, and documents read ahead of the packer.
READ_OPTIONS = grain.ReadOptions(num_threads=min(8, os.cpu_count() or 1), prefetch_buffer_size=128)

Batch = dict[str, np.ndarray]


def to_example(rows: Batch, packed: bool, max_documents: int | None = None) -> Batch:
  """Rows of seq_len + 1 tokens (with their segment ids and positions) -> the batch dict.
  Packed rows may hold at most `max_documents` documents (None: any number)."""
  tokens, segments = rows['tokens'], rows['tokens_segment_ids']
  trained = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  if 'loss_mask' in rows:  # chat: the targets the assistant says
    trained &= rows['loss_mask'][:, 1:] > 0
  example = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
             'positions': rows['tokens_positions'][:, :-1],
             'mask': trained.astype(np.float32)}
  if packed:
    example['segment_ids'] = segments[:, :-1]
    if max_documents:
      check_documents(example['segment_ids'], max_documents)
  return example


def check_documents(segment_ids: np.ndarray, max_documents: int) -> None:
  """Refuses rows holding more documents (runs of equal segment ids, as the model counts
  them) than cuDNN's packed attention makes room for: it would attend across the extra ones."""
  documents = 1 + np.count_nonzero(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1)
  if documents.max() > max_documents:
    raise ConfigError(
        f'a packed row holds {documents.max()} documents, more than model.max_documents='
        f"{max_documents} that model.attention='cudnn' makes room for; raise "
        "model.max_documents, or use model.attention='xla' or data.packing=False.")


def pad_document(document: Batch, length: int) -> Batch:
  """One document ({'tokens', and chat's 'loss_mask'}) alone in a row: cut to `length`
  tokens, or padded with segment id 0."""
  n = min(len(document['tokens']), length)
  padded = lambda values: np.pad(values[:n], (0, length - n)).astype(np.int32)
  return {**{k: padded(v) for k, v in document.items()},
          'tokens_segment_ids': padded(np.ones(n)), 'tokens_positions': padded(np.arange(n))}


def tokenize_fn(cfg: ConfigDict, documents) -> Callable[[object], Batch]:
  """The document -> {'tokens': ids} function of `documents` (chat adds 'loss_mask');
  model.vocab_size must cover the ids."""
  vocab_size = cfg.model.vocab_size
  if isinstance(documents.source, TokenRecords):  # pre-tokenised: the ids are used as they are
    if len(documents):
      documents[0]  # the reader checks every record's ids (`split`); the first one now
    return lambda ids: {'tokens': ids}
  tokenizer = load_tokenizer(cfg.data)
  if vocab_size < tokenizer.vocab_size:
    raise ConfigError(f'model.vocab_size={vocab_size} is smaller than the vocabulary of '
                      f'data.tokenizer={cfg.data.tokenizer!r} ({tokenizer.vocab_size} ids); '
                      f'set it to at least {tokenizer.vocab_size}.')
  if isinstance(documents.source, ChatFiles):
    encode = ChatEncoder(cfg.data, tokenizer)
    if len(documents):
      encode(documents[0])  # the template fails here, at start-up, not mid-run
    return encode
  return lambda text: {'tokens': tokenizer.encode(text)}


def stream_batches(cfg: ConfigDict, documents, tokenize: Callable[[object], Batch],
                   rows: int, train: bool) -> grain.IterDataset:
  """Batches of `rows` rows of one stream's `documents`, endlessly; shuffled for training."""
  length = cfg.data.seq_len + 1  # inputs and targets are this shifted by one

  docs = grain.MapDataset.source(documents)
  if train:
    if not 0 <= cfg.train.seed < 2**32:
      raise ConfigError(f'train.seed={cfg.train.seed} must be in [0, 2**32) to shuffle the data.')
    docs = docs.shuffle(seed=cfg.train.seed)  # shuffled indices past the end: a new epoch order
  docs = docs.repeat().map(tokenize)
  if cfg.data.packing:
    # Chat's loss flags are packed beside the tokens, into the same places.
    features = ('tokens', 'loss_mask') if cfg.data.format == 'chat' else ('tokens',)
    packed = grain.experimental.ConcatThenSplitIterDataset(
        docs.to_iter_dataset(READ_OPTIONS), length_struct={k: length for k in features})
  else:
    packed = docs.map(lambda document: pad_document(document, length)).to_iter_dataset(
        READ_OPTIONS)
  max_documents = cfg.model.max_documents if cfg.model.attention == 'cudnn' else None
  batches = packed.batch(rows, drop_remainder=True).map(
      functools.partial(to_example, packed=cfg.data.packing, max_documents=max_documents))
  if train and cfg.data.prefetch:
    batches = grain.experimental.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=cfg.data.prefetch)
  return batches


def synthetic_batch(cfg: ConfigDict, rows: int) -> Batch:
  """A batch of random tokens from train.seed, one document per row (benchmarks: no input
  cost)."""
  T = cfg.data.seq_len
  tokens = np.random.default_rng(cfg.train.seed).integers(
      0, cfg.model.vocab_size, (rows, T + 1), dtype=np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy()
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'positions': positions,
          'mask': np.ones((rows, T), np.float32)}


def to_global(sharding, local: Batch, rows: int) -> dict[str, jax.Array]:
  """This process's rows (its devices' rows, in global order) -> global arrays of `rows` rows
  laid out by `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (rows, *v.shape[1:]))
          for k, v in local.items()}


def process_rows(sharding, rows: int) -> dict[int, np.ndarray]:
  """The global rows, ascending, that each process's devices hold of a batch of `rows` rows
  laid out by `sharding`."""
  held: dict[int, set] = {}
  for device, index in sharding.devices_indices_map((rows, 1)).items():
    held.setdefault(device.process_index, set()).update(range(rows)[index[0]])
  return {p: np.array(sorted(r)) for p, r in held.items()}


def _json_to_state(state):
  """JSON turns grain's tuples into lists; grain compares them with tuples, so turn back."""
  if isinstance(state, dict):
    return {k: _json_to_state(v) for k, v in state.items()}
  if isinstance(state, list):
    return tuple(_json_to_state(v) for v in state)
  return state


def _release(slot: dict) -> None:
  """Closes the iterators in `slot` and lets them go: at exit this runs while the
  interpreter is whole (grain's own clean-up fails during module teardown)."""
  while slot:
    slot.popitem()[1].close()


class Streams:
  """Global batches of `rows` rows of one split, read as `streams` independent streams:
  stream s packs documents s, s+streams, … into rows [s·rows/streams, (s+1)·rows/streams) of
  every batch. This process reads only the streams its devices' rows come from.

  So the batches depend on data.streams, not on how many processes read them, and
  `get_state()` (JSON-serialisable) after k batches, given to `set_state()` of a new
  Streams — on any number of processes — resumes at batch k + 1.
  """

  def __init__(self, cfg: ConfigDict, split_name: str, sharding, rows: int):
    self._cfg, self._split, self._sharding, self.rows = cfg, split_name, sharding, rows
    # Opened once, shared by the streams; pre-tokenised ids are checked against the model.
    self._documents = split(cfg.data, split_name, cfg.model.vocab_size)
    self._tokenize = tokenize_fn(cfg, self._documents)
    self._rows = process_rows(sharding, rows)
    self._slot: dict[int, Iterator] = {}
    weakref.finalize(self, _release, self._slot)
    # data.streams=0: a stream per distinct set of rows that processes hold (one per process,
    # unless some hold the same rows, as under pipe across hosts).
    self._open(cfg.data.streams or len({tuple(r) for r in self._rows.values()}))

  def stream_ids(self, streams: int, process: int | None = None) -> list[int]:
    """The streams `process` (default: this one) reads when there are `streams`."""
    process = jax.process_index() if process is None else process
    return sorted({int(r) // (self.rows // streams) for r in self._rows[process]})

  def _open(self, streams: int) -> None:
    if self.rows % streams:
      what = 'train.global_batch' if self._split == 'train' else (
          'train.global_batch / train.micro_batches (an eval batch)')
      raise ConfigError(f'{what}={self.rows} rows do not split evenly into data.streams='
                        f'{streams}; make data.streams a divisor of {self.rows}.')
    self.streams = streams
    per = self.rows // streams
    field = 'data.path' if self._split == 'train' else (
        'data.eval_path' if self._cfg.data.eval_path else 'data.eval_fraction')
    self._datasets = {
        s: stream_batches(self._cfg, stream_share(self._documents, s, streams, field),
                          self._tokenize, per, train=self._split == 'train')
        for s in self.stream_ids(streams)}
    # Where this process's rows sit in the rows of the streams it reads, laid end to end.
    read = np.concatenate([np.arange(s * per, (s + 1) * per) for s in self._datasets])
    self._pick = np.searchsorted(read, self._rows[jax.process_index()])
    # Each stream's position is saved by the lowest-numbered process that reads it.
    owner: dict[int, int] = {}
    for p in sorted(self._rows):
      for s in self.stream_ids(streams, p):
        owner.setdefault(s, p)
    self.owned = [s for s in self._datasets if owner[s] == jax.process_index()]
    self.restart()

  def restart(self) -> None:
    """Back to the first batch."""
    _release(self._slot)
    self._slot.update({s: iter(d) for s, d in self._datasets.items()})

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    parts = [next(it) for it in self._slot.values()]
    local = {k: np.concatenate([p[k] for p in parts])[self._pick] for k in parts[0]}
    return to_global(self._sharding, local, self.rows)

  def get_state(self) -> dict:
    return {'streams': self.streams,
            'positions': {str(s): it.get_state() for s, it in self._slot.items()}}

  def set_state(self, state: dict) -> None:
    """Moves to a saved position. `positions` needs only the streams this process reads."""
    if state['streams'] != self.streams:
      if self._cfg.data.streams:
        raise ConfigError(
            f'the checkpoint read the data as data.streams={state["streams"]} but this run has '
            f'data.streams={self._cfg.data.streams}; set data.streams={state["streams"]} (or 0, '
            'which follows the checkpoint) to resume the data where it was.')
      self._open(state['streams'])
    for s, it in self._slot.items():
      it.set_state(_json_to_state(state['positions'][str(s)]))

  def start_prefetch(self) -> None:
    for it in self._slot.values():
      if hasattr(it, 'start_prefetch'):
        it.start_prefetch()

  def close(self) -> None:
    _release(self._slot)


class FixedBatch:
  """data.source='synthetic': the same global batch every step, and no position to save."""

  def __init__(self, cfg: ConfigDict, sharding):
    rows = cfg.train.global_batch
    mine = process_rows(sharding, rows)[jax.process_index()]
    local = {k: v[mine] for k, v in synthetic_batch(cfg, rows).items()}
    self._batch = to_global(sharding, local, rows)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    return self._batch


def make_batches(cfg: ConfigDict, mesh) -> Streams | FixedBatch:
  """The train batches of `train.global_batch` rows. Bad input raises ConfigError here."""
  sharding = batch_sharding(mesh, cfg.sharding.rules, ndim=2)  # every array is [batch, seq]
  if cfg.data.source == 'synthetic':
    return FixedBatch(cfg, sharding)
  if cfg.data.source != 'files':
    raise ConfigError(f"data.source={cfg.data.source!r} is unknown; use 'files' or 'synthetic'.")
  return Streams(cfg, 'train', sharding, cfg.train.global_batch)


def make_eval_batches(cfg: ConfigDict, mesh) -> Callable[[], Iterator[dict[str, jax.Array]]] | None:
  """None without an eval split; else a function whose every call iterates over the same
  `eval.batches` batches of global_batch / micro_batches rows (the split repeats if short)."""
  if cfg.data.source != 'files' or not (cfg.data.eval_path or cfg.data.eval_fraction):
    return None
  sharding = batch_sharding(mesh, cfg.sharding.rules, ndim=2)
  stream = Streams(cfg, 'eval', sharding, cfg.train.global_batch // cfg.train.micro_batches)
  stream.close()  # opened to check the split now; read afresh by each evaluation

  def eval_batches() -> Iterator[dict[str, jax.Array]]:
    stream.restart()
    try:
      yield from itertools.islice(stream, cfg.eval.batches)
    finally:
      stream.close()  # stops the read-ahead threads
  return eval_batches
