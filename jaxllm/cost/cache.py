"""Compiled programs kept on disk, keyed by the program: what `jaxllm.cost.compile` reads of one
(its buffer assignment's sizes and its optimized HLO) and the CPU seconds compiling it took, so
that no program is compiled twice (tune's candidates; a second search with one flag changed
compiles only the programs that changed). Reports are made from an entry afresh each time, so
a change of the timing model or of a profile's rates needs no compile.

The key is the lowered program (StableHLO, without source locations), the compiler's options
and XLA_FLAGS, what the devices are (a GPU's target config, their count and hosts) and the
versions of JAX and its compilers: anything else that changes the program changes the lowered
text.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import tempfile

import jax

@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """A compiled program's bytes per device, by the compiler's buffer assignment."""
  arguments: int
  outputs: int
  aliases: int       # outputs that reuse a donated argument's buffer
  temporaries: int

  @property
  def peak(self) -> int:
    """Arguments and outputs (donated ones once) plus temporaries."""
    return self.arguments + self.outputs - self.aliases + self.temporaries

  @classmethod
  def of(cls, executable) -> MemoryStats:
    """A compiled executable's (`jax.stages.Compiled`), by its `memory_analysis`."""
    stats = executable.memory_analysis()
    return cls(stats.argument_size_in_bytes, stats.output_size_in_bytes,
               stats.alias_size_in_bytes, stats.temp_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Entry:
  """What is kept of one compiled program."""
  memory: MemoryStats
  text: str          # the optimized HLO
  compile_s: float   # CPU seconds the compile took (the compiler's threads and processes)


class ProgramCache:
  """Compiled programs in `directory`, for devices described by `target`."""

  def __init__(self, directory: str, target: str):
    self.directory, self.target = directory, target

  def key(self, lowered_text: str, options: dict) -> str:
    versions = {'jax': jax.__version__, 'jaxlib': jax.lib.__version__}
    xla_flags = os.environ.get('XLA_FLAGS', '')  # they change the compiled program
    head = json.dumps([self.target, sorted(options.items()), versions, xla_flags], default=str)
    return hashlib.sha256(f'{head}\n{lowered_text}'.encode()).hexdigest()

  def _path(self, key: str) -> str:
    return os.path.join(self.directory, key[:2], f'{key}.json.gz')

  def get(self, key: str) -> Entry | None:
    """The entry kept under `key`; None when there is none (or it cannot be read: an entry
    cut short is compiled again)."""
    try:
      with gzip.open(self._path(key), 'rt') as f:
        d = json.load(f)
      return Entry(MemoryStats(**d['memory']), d['text'], d['compile_s'])
    except (OSError, EOFError, ValueError, KeyError, TypeError):
      return None

  def put(self, key: str, entry: Entry) -> None:
    """Keeps `entry`, written whole or not at all (a reader never sees part of one)."""
    path = self._path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.partial')
    with os.fdopen(fd, 'wb') as raw, gzip.open(raw, 'wt') as f:
      json.dump({'memory': dataclasses.asdict(entry.memory), 'compile_s': entry.compile_s,
                 'text': entry.text}, f)
    os.replace(partial, path)
