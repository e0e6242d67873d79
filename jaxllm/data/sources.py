"""Documents on disk: `data.path` resolved to files, a random-access reader per format,
the train/eval split and each data stream's share of it.

A reader is a sequence of documents over all its files, in file order: `str` texts, or
int32 token ids for pre-tokenised ArrayRecord files.
"""

from __future__ import annotations

import glob
import json
import os
import threading

import numpy as np
from ml_collections import ConfigDict

from jaxllm.config import DATA_FORMATS, ConfigError
from jaxllm.data.chat import ROLES

FORMAT_BY_EXTENSION = {'.jsonl': 'jsonl', '.json': 'jsonl', '.parquet': 'parquet',
                       '.arrayrecord': 'arrayrecord', '.array_record': 'arrayrecord'}
# The held-out documents of data.eval_fraction do not move with train.seed, so runs with
# different seeds are evaluated on the same documents.
EVAL_SPLIT_SEED = 0
_CHUNK = 1 << 26  # bytes scanned at a time when indexing lines


def resolve_files(path: str, field: str = 'data.path') -> list[str]:
  """A file, every file under a directory (hidden ones left out), or a glob's files; sorted."""
  if not path:
    raise ConfigError(f'{field} is empty; set it to a file, a directory or a glob of shards '
                      "(or set data.source='synthetic').")
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not f.startswith('.')]
  else:
    files = glob.glob(path, recursive=True)
  files = sorted(f for f in files if os.path.isfile(f) and os.path.getsize(f) > 0)
  if not files:
    raise ConfigError(f'{field}={path!r} matches no non-empty files; point it at a file, '
                      'a directory or a glob that exists.')
  return files


def file_format(data_cfg: ConfigDict, files: list[str], field: str = 'data.path') -> str:
  """data.format, or with 'auto' the one format the files' extensions name (else text)."""
  if data_cfg.format != 'auto':
    if data_cfg.format not in DATA_FORMATS:
      raise ConfigError(f'data.format={data_cfg.format!r} is unknown; use one of '
                        f'{", ".join(DATA_FORMATS)}.')
    return data_cfg.format
  found = sorted({FORMAT_BY_EXTENSION.get(os.path.splitext(f)[1].lower(), 'text') for f in files})
  if len(found) > 1:
    raise ConfigError(f'{field} holds files of several formats ({", ".join(found)}); narrow '
                      f'{field} to one kind of file or set data.format.')
  return found[0]


def _reason(e: Exception) -> str:
  """An exception's first line, for one-line error messages."""
  return (str(e).splitlines() or [type(e).__name__])[0]


class _Files:
  """The documents of many files as one sequence; subclasses read document i of file f."""

  def __init__(self, files: list[str], counts):
    self.files = files
    self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, index: int):
    if not 0 <= index < len(self):
      raise IndexError(index)
    f = int(np.searchsorted(self._starts, index, side='right')) - 1
    return self.read(f, int(index - self._starts[f]))

  def read(self, f: int, i: int):
    raise NotImplementedError


class TextFiles(_Files):
  """One document per file."""

  def __init__(self, files):
    super().__init__(files, [1] * len(files))

  def read(self, f, i):
    with open(self.files[f], 'rb') as fh:
      return fh.read().decode('utf-8', errors='replace')


def line_spans(path: str) -> np.ndarray:
  """[lines, 2] byte (start, end) of the non-empty lines of a file, without '\\r\\n'."""
  data = np.memmap(path, np.uint8, mode='r')
  breaks = np.concatenate([np.flatnonzero(data[i:i + _CHUNK] == ord('\n')) + i
                           for i in range(0, len(data), _CHUNK)])
  starts = np.concatenate([[0], breaks + 1])
  ends = np.concatenate([breaks, [len(data)]])
  ends -= (ends > starts) & (data[np.maximum(ends - 1, 0)] == ord('\r'))
  keep = ends > starts
  return np.stack([starts[keep], ends[keep]], axis=1)


class LineFiles(_Files):
  """One document per non-empty line; line offsets are indexed once, here."""

  def __init__(self, files):
    self._spans = [line_spans(f) for f in files]
    super().__init__(files, [len(s) for s in self._spans])

  def read_line(self, f: int, i: int) -> bytes:
    start, end = self._spans[f][i]
    with open(self.files[f], 'rb') as fh:
      fh.seek(start)
      return fh.read(end - start)

  def read(self, f, i):
    return self.read_line(f, i).decode('utf-8', errors='replace')


class JsonlFiles(LineFiles):
  """One document per line: the string in its `field`. The first record is checked here."""

  def __init__(self, files, field: str):
    super().__init__(files)
    self.field = field
    if len(self):
      self[0]  # a missing field fails here, at start-up, not mid-run

  def read(self, f, i):
    where = f'{self.files[f]} (record {i + 1})'
    try:
      text = json.loads(self.read_line(f, i)).get(self.field)
    except (ValueError, AttributeError):
      raise ConfigError(f'{where} is not a JSON object; data.format=jsonl needs one per line.') from None
    if not isinstance(text, str):
      raise ConfigError(f'data.text_field={self.field!r}: {where} has no such string field; set '
                        'data.text_field to the field that holds the text.')
    return text


class ChatFiles(LineFiles):
  """One conversation per line: the `messages` list of a JSON object, each message a
  {'role', 'content'} of strings. The first record is checked here."""

  def __init__(self, files):
    super().__init__(files)
    if len(self):
      self[0]

  def read(self, f, i):
    where = f'{self.files[f]} (record {i + 1})'
    try:
      messages = json.loads(self.read_line(f, i)).get('messages')
    except (ValueError, AttributeError):
      raise ConfigError(f"{where} is not a JSON object; data.format='chat' needs one per "
                        'line.') from None
    if not isinstance(messages, list) or not messages:
      raise ConfigError(f'{where} has no "messages" list; data.format=\'chat\' needs '
                        '{"messages": [{"role": ..., "content": ...}, ...]} per line.')
    for message in messages:
      if not (isinstance(message, dict) and isinstance(message.get('role'), str) and
              isinstance(message.get('content'), str)):
        raise ConfigError(f'{where} has a message that is not {{"role": str, "content": str}}: '
                          f'{json.dumps(message)[:80]}; fix the record.')
      if message['role'] not in ROLES:
        raise ConfigError(f'{where} has a message with role {message["role"]!r}; roles are '
                          f'{", ".join(ROLES)}.')
    return messages


class ParquetFiles(_Files):
  """One document per row of the `field` column.

  A file's column is read whole the first time one of its rows is wanted and then kept:
  shuffled reads hit every row group at random, so caching less would re-read row groups
  per document. Memory is about the size of the text; pre-tokenise a corpus larger than
  that to ArrayRecord (`python -m jaxllm.data.pretokenize`), which reads records from disk.
  """

  def __init__(self, files, field: str):
    import pyarrow.parquet as pq
    self._pq, self.field = pq, field
    counts = []
    for path in files:
      try:
        meta = pq.ParquetFile(path)
      except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise ConfigError(f'{path} is not a readable Parquet file ({_reason(e)}); fix data.path '
                          'or data.format.') from None
      if field not in meta.schema_arrow.names:
        raise ConfigError(f'data.text_field={field!r}: {path} has no such column (it has '
                          f'{", ".join(meta.schema_arrow.names)}); set data.text_field.')
      counts.append(meta.metadata.num_rows)
    super().__init__(files, counts)
    self._columns = [None] * len(files)
    self._lock = threading.Lock()  # grain reads documents from several threads

  def read(self, f, i):
    if self._columns[f] is None:
      with self._lock:
        if self._columns[f] is None:
          table = self._pq.read_table(self.files[f], columns=[self.field])
          self._columns[f] = table.column(0).combine_chunks()
    return self._columns[f][i].as_py() or ''


class TokenRecords:
  """Pre-tokenised documents: one ArrayRecord record of little-endian int32 ids each.

  With a `vocab_size`, every record's ids are checked as it is read: the embedding gather
  would clamp an id outside [0, vocab_size) silently, and the run would show only a NaN."""

  def __init__(self, files, vocab_size: int | None = None):
    from grain.sources import ArrayRecordDataSource
    self.files, self.vocab_size = files, vocab_size
    try:
      self._source = ArrayRecordDataSource(files)
    except Exception as e:
      raise ConfigError(f'data.path: could not read the ArrayRecord files {files[0]}, ... '
                        f'({_reason(e)}); check the files or set data.format.') from None

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> np.ndarray:
    ids = np.frombuffer(self._source[index], '<i4').astype(np.int32)
    if self.vocab_size is not None and ids.size and (
        ids.max() >= self.vocab_size or ids.min() < 0):
      self._bad_ids(index, ids)
    return ids

  def _bad_ids(self, index: int, ids: np.ndarray) -> None:
    """Raises ConfigError naming the file, the record in it and the id outside the vocabulary
    (the files are counted again here: only an error pays for it)."""
    from grain.sources import ArrayRecordDataSource
    for path in self.files:
      count = len(ArrayRecordDataSource([path]))
      if index < count:
        break
      index -= count
    where = f'{path}, record {index} (counting from 0)'
    if ids.min() < 0:
      raise ConfigError(f'{where}: token id {int(ids.min())} is negative; the file is not '
                        'token ids of this vocabulary, re-tokenise it.')
    raise ConfigError(f'{where}: token id {int(ids.max())} is outside model.vocab_size='
                      f'{self.vocab_size}; set model.vocab_size to at least '
                      f'{int(ids.max()) + 1}, or re-tokenise the file.')


def write_token_records(path: str, documents_ids) -> int:
  """Writes one ArrayRecord file of token-id documents (BOS/EOS included as given).
  Returns the number of records written."""
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(path, 'group_size:1')  # one record per chunk: fast random reads
  count = 0
  for ids in documents_ids:
    writer.write(np.asarray(ids, '<i4').tobytes())
    count += 1
  writer.close()
  return count


def open_documents(data_cfg: ConfigDict, path: str, field: str = 'data.path',
                   vocab_size: int | None = None):
  """The reader of every document at `path` (data.path or data.eval_path), in file order.
  `vocab_size`: pre-tokenised ids must lie below it (see `TokenRecords`)."""
  files = resolve_files(path, field)
  kind = file_format(data_cfg, files, field)
  if kind == 'text':
    return TextFiles(files)
  if kind == 'lines':
    return LineFiles(files)
  if kind == 'jsonl':
    return JsonlFiles(files, data_cfg.text_field)
  if kind == 'chat':
    return ChatFiles(files)
  if kind == 'parquet':
    return ParquetFiles(files, data_cfg.text_field)
  return TokenRecords(files, vocab_size)


class Subset:
  """The documents of `source` at `indices`, as a sequence."""

  def __init__(self, source, indices: np.ndarray):
    self.source, self.indices = source, indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i: int):
    return self.source[int(self.indices[i])]


def split(data_cfg: ConfigDict, name: str, vocab_size: int | None = None) -> Subset | None:
  """The 'train' or 'eval' documents; no 'eval' (None) without data.eval_path or
  data.eval_fraction. `vocab_size`: as for `open_documents`."""
  if name == 'eval' and data_cfg.eval_path:
    evaluation = open_documents(data_cfg, data_cfg.eval_path, 'data.eval_path', vocab_size)
    return Subset(evaluation, np.arange(len(evaluation)))
  if name == 'eval' and not data_cfg.eval_fraction:
    return None
  documents = open_documents(data_cfg, data_cfg.path, vocab_size=vocab_size)
  if data_cfg.eval_path or not data_cfg.eval_fraction:
    return Subset(documents, np.arange(len(documents)))
  held = max(1, round(len(documents) * data_cfg.eval_fraction))
  if held >= len(documents):
    raise ConfigError(f'data.eval_fraction={data_cfg.eval_fraction} holds out all '
                      f'{len(documents)} documents of data.path; lower it or add documents.')
  order = np.random.default_rng(EVAL_SPLIT_SEED).permutation(len(documents))
  return Subset(documents, np.sort(order[:held] if name == 'eval' else order[held:]))


def stream_share(documents: Subset, stream: int, streams: int, field: str = 'data.path') -> Subset:
  """Documents [stream::streams]: what one of the data streams reads."""
  if len(documents) < streams:
    raise ConfigError(f'{field}: {len(documents)} documents for {streams} data streams; every '
                      'stream needs at least one, so add documents or lower data.streams.')
  return Subset(documents.source, documents.indices[stream::streams])
