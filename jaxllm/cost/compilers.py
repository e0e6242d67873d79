"""Compiling many candidates' train steps, in this process or in worker processes where cores
allow, each compile's log kept from the terminal.

XLA's GPU compiler writes its warnings from C++ straight to file descriptor 2: a candidate
that does not fit makes its rematerialization pass say it could not reduce the memory enough,
which a search expects (it counts the candidate as one that does not fit), and a compile that
takes over a minute or two sets off an alarm that asks for a bug report. Those lines are
left out; anything else the compiler writes is passed on (`unexpected`), so real errors show.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time

from ml_collections import ConfigDict

from jaxllm.config import ConfigError
from jaxllm.cost.cache import ProgramCache
from jaxllm.cost.hardware import Hardware

# What XLA says of a program that does not fit the device (`report` says it too), and of a
# compile that takes minutes (on a loaded machine, any may): its alarm's line, the banner's
# rule of stars and its text.
EXPECTED = re.compile(r"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below "
                      r"|slow_operation_alarm\.cc:\d+\]|^\*+$|\] Very slow compile\?")


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices candidates compile for, as a worker process can make them again: `count` of
  the profile's GPU (compile-only), or `count` simulated CPU devices."""
  hardware: Hardware
  count: int
  platform: str  # 'gpu' or 'cpu'

  def devices(self) -> list:
    import jax
    from jaxllm import backends
    if self.platform == 'cpu':
      return jax.devices()[:self.count]
    return backends.gpu_devices(self.hardware, self.count)

  def description(self) -> str:
    """What the devices are, for `ProgramCache`'s key."""
    from jaxllm import backends
    if self.platform == 'cpu':
      return f'cpu × {self.count}'
    return (f'{backends.gpu_target(self.hardware)}× {self.count} in nodes of '
            f'{self.hardware.devices_per_node}')


@dataclasses.dataclass
class Attempt:
  """What compiling one candidate gave."""
  report: dict | None   # analyze's report (None when it could not compile)
  error: str            # why it could not compile ('' when it did)
  log: list[str]        # what the compiler wrote that a search does not expect
  compile_s: float      # CPU seconds the compile took (when it was made, if cached)
  cached: bool          # read from the program cache


@contextlib.contextmanager
def captured_stderr():
  """File descriptor 2 into a temporary file while the block runs (XLA's C++ logging writes
  there); yields a list that then holds the lines written."""
  sys.stderr.flush()
  saved = os.dup(2)
  lines: list[str] = []
  with tempfile.TemporaryFile() as f:
    os.dup2(f.fileno(), 2)
    try:
      yield lines
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      lines.extend(f.read().decode(errors='replace').splitlines())


def unexpected(lines: list[str]) -> list[str]:
  """The lines a search does not expect from the compiler."""
  return [line for line in lines if line.strip() and not EXPECTED.search(line)]


def attempt(cfg: ConfigDict, hardware: Hardware, devices, cache: ProgramCache | None) -> Attempt:
  """Compiles `cfg`'s step for `devices` and reports it; a candidate that cannot compile is an
  Attempt with its reason, never an exception (a search goes on)."""
  from jaxllm.cost.compile import compile_step
  from jaxllm.cost.report import report
  with captured_stderr() as log:
    try:
      compiled = compile_step(cfg, devices, cache)
      error = ''
    except Exception as e:  # any failure is this candidate's, not the search's
      compiled, error = None, (str(e).strip().splitlines() or [''])[0]
      if not isinstance(e, ConfigError):  # the config's errors say what they are
        error = f'{type(e).__name__}: {error}'.rstrip(': ')
  if compiled is None:
    return Attempt(None, error, unexpected(log), 0.0, False)
  return Attempt(report(compiled, hardware), '', unexpected(log), compiled.compile_s,
                 compiled.cached)


class Compilers:
  """Compiles candidates for `target`, `workers` at a time: in this process (on `devices`, the
  target's) when 1, else in as many worker processes (each started afresh: a forked JAX is not
  safe). `submit` returns a future of an `Attempt`."""

  def __init__(self, target: Target, workers: int, cache_dir: str | None, devices=None):
    self.target, self.workers = target, workers
    self.cache = ProgramCache(cache_dir, target.description()) if cache_dir else None
    self.pool = None
    if workers > 1:
      self.pool = concurrent.futures.ProcessPoolExecutor(
          workers, multiprocessing.get_context('spawn'), initializer=_start_worker,
          initargs=(target, cache_dir))
    else:
      self.devices = devices or target.devices()

  def submit(self, cfg: ConfigDict) -> concurrent.futures.Future:
    if self.pool:
      return self.pool.submit(_compile_in_worker, cfg)
    future = concurrent.futures.Future()
    future.set_result(attempt(cfg, self.target.hardware, self.devices, self.cache))
    return future

  def close(self) -> None:
    if self.pool:
      self.pool.shutdown(cancel_futures=True)


_worker: dict = {}


def _start_worker(target: Target, cache_dir: str | None) -> None:
  """A worker's JAX: started for the target's platform, before anything else runs. The worker
  ends with the search: a `tune` stopped by a signal runs no clean-up that would end it."""
  import jax
  parent = os.getppid()
  threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
  from jaxllm.backends import start_backends
  if target.platform == 'cpu':
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', target.count)
  start_backends()
  _worker.update(target=target, devices=target.devices(),
                 cache=ProgramCache(cache_dir, target.description()) if cache_dir else None)


def _exit_with(parent: int) -> None:
  """Ends this process once `parent` is gone (an orphan is handed to another parent)."""
  while os.getppid() == parent:
    time.sleep(1)
  os._exit(1)


def _compile_in_worker(cfg: ConfigDict) -> Attempt:
  return attempt(cfg, _worker['target'].hardware, _worker['devices'], _worker['cache'])
