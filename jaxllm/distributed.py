"""Many processes as one run: joining them through jax.distributed, and turning a lost process
into an error on all the others instead of a hang.

Under SLURM (srun), Open MPI (mpirun) or Kubernetes, JAX reads the coordinator's address, the
number of processes and this process's id from the environment; `distributed.*` sets them by
hand. A single process (no cluster found, or num_processes=1) skips all of this.

Liveness: each process posts a heartbeat into the key-value store of JAX's coordination
service. Process 0 watches everyone's; the others watch process 0's. A process that stops on
an error posts it first, so the others stop at once and name it; one that goes silent for
`distributed.heartbeat_timeout` seconds is named by whoever notices. JAX's own heartbeat
check, which aborts with a C++ stack trace, is set to fire only after ours.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import jax
from ml_collections import ConfigDict

from jaxllm.config import ConfigError
from jaxllm.validate import validate_distributed

# Keys: _LIVE/<process>/beat, a counter that goes up while the process lives, and
# _LIVE/<process>/done once it has finished cleanly; _FAILED/<process>, why it failed.
_LIVE, _FAILED = 'jaxllm/live/', 'jaxllm/failed/'


def _client():
  # The coordination service's client has no public handle; orbax reaches it the same way.
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client


def _stop(message: str) -> None:
  """Ends this process at once with `message`: no clean-up that waits for the others (JAX's
  shutdown barrier would wait for processes that are gone)."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)


def _join(d: ConfigDict) -> bool:
  """Starts jax.distributed; False when this is a single process."""
  validate_distributed(d)
  explicit = d.coordinator_address or d.num_processes > 0 or d.process_id >= 0
  if d.num_processes == 1:
    return False
  if explicit:
    if d.num_processes and not 0 <= d.process_id < d.num_processes:
      raise ConfigError(f'distributed.process_id={d.process_id} must be in 0…'
                        f'{d.num_processes - 1} for distributed.num_processes={d.num_processes}.')
    if d.coordinator_address and ':' not in d.coordinator_address:
      raise ConfigError(f'distributed.coordinator_address={d.coordinator_address!r} needs a '
                        "port: give 'host:port' (process 0's host, a free port).")

  where = d.coordinator_address or 'the address the cluster gives'
  timer = threading.Timer(d.initialization_timeout, _stop, [
      f'distributed: the run\'s processes did not all join within '
      f'distributed.initialization_timeout={d.initialization_timeout}s (coordinator: {where}, '
      f'process 0). Start every process with the same coordinator address and process count, '
      f'check that process 0 is reachable from this host, or raise the timeout.'])
  timer.daemon = True
  timer.start()
  try:
    # JAX's own limits sit past ours, so our one-line errors come first.
    jax.distributed.initialize(
        d.coordinator_address or None, d.num_processes or None,
        d.process_id if d.process_id >= 0 else None,
        initialization_timeout=2 * d.initialization_timeout,
        heartbeat_timeout_seconds=2 * d.heartbeat_timeout + 10,
        shutdown_timeout_seconds=d.heartbeat_timeout)
  except ValueError as e:
    if explicit:
      raise ConfigError(f'distributed: {e} Set distributed.coordinator_address, '
                        'distributed.num_processes and distributed.process_id.') from None
    return False  # no cluster in the environment: a single process
  finally:
    timer.cancel()
  # Collectives between CPU processes (simulated devices, tests); GPUs use NCCL regardless.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  return True


class Watchdog:
  """Heartbeats in the coordination service's key-value store, checked on a thread: a lost
  or failed peer ends this process with one line naming it."""

  def __init__(self, timeout: float):
    self.timeout, self.me, self.count = timeout, jax.process_index(), jax.process_count()
    self.interval = min(5.0, max(0.2, timeout / 10))
    self._client, self._finished = _client(), threading.Event()
    self._beats = 0
    # Process 0 watches every other process; the others watch process 0 (the coordinator).
    start = time.monotonic()
    peers = range(1, self.count) if self.me == 0 else [0]
    self._seen = {str(p): (None, start) for p in peers}  # peer -> (last heartbeat, since when)
    self._thread = threading.Thread(target=self._run, name='jaxllm-watchdog', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    contact = time.monotonic()  # the last time the coordination service answered
    while not self._finished.wait(self.interval):
      try:
        self._beat()
        contact = time.monotonic()
      except Exception as e:  # the service lives in process 0: it is gone or cut off
        if time.monotonic() - contact > self.timeout:
          _stop(f'distributed: lost process 0 of {self.count} (the coordinator) for over '
                f'{self.timeout:g}s ({type(e).__name__}); stopping process {self.me} too. See '
                'process 0\'s log.')

  def _beat(self) -> None:
    client = self._client
    self._beats += 1
    client.key_value_set(f'{_LIVE}{self.me}/beat', str(self._beats), allow_overwrite=True)
    failures = [why for key, why in client.key_value_dir_get(_FAILED)
                if key != f'{_FAILED}{self.me}']
    if failures:
      _stop(f'{failures[0]}; stopping process {self.me} too.')
    live = dict(client.key_value_dir_get(_LIVE if self.me == 0 else f'{_LIVE}0/'))
    now = time.monotonic()
    for peer, (last, since) in self._seen.items():
      beat = live.get(f'{_LIVE}{peer}/beat')
      if f'{_LIVE}{peer}/done' in live:
        continue
      if beat != last:
        self._seen[peer] = (beat, now)
      elif now - since > self.timeout:
        message = (f'distributed: process {peer} of {self.count} stopped responding (no '
                   f'heartbeat for over {self.timeout:g}s: killed, crashed or cut off)')
        self.fail(message)
        _stop(f'{message}; stopping process {self.me} too. See process {peer}\'s log.')

  def fail(self, message: str) -> None:
    """Tells every process that the run failed, and why."""
    with contextlib.suppress(Exception):
      self._client.key_value_set(f'{_FAILED}{self.me}', message, allow_overwrite=True)

  def wait_for_verdict(self) -> None:
    """Gives the thread time to find a lost peer (which ends the process): a failed collective
    usually means a peer died, and naming it is the useful message."""
    time.sleep(self.timeout + 3 * self.interval)

  def close(self, done: bool) -> None:
    """Stops watching; `done`: this process finished cleanly, so the others stop watching it."""
    self._finished.set()
    self._thread.join()
    if done:
      with contextlib.suppress(Exception):
        self._client.key_value_set(f'{_LIVE}{self.me}/done', '1', allow_overwrite=True)


@contextlib.contextmanager
def session(d: ConfigDict):
  """Joins the run's processes (nothing for a single one) and watches the others while the
  body runs. An error in the body is posted for the others before it propagates."""
  if not _join(d):
    yield
    return
  watchdog = Watchdog(d.heartbeat_timeout)
  try:
    yield
  except Exception as e:
    if isinstance(e, jax.errors.JaxRuntimeError):  # a collective failed: is a peer gone?
      print(f'note: {type(e).__name__} ({str(e)[:200]}); waiting up to '
            f'{d.heartbeat_timeout}s (distributed.heartbeat_timeout) to learn whether a process '
            'was lost.', file=sys.stderr, flush=True)
      watchdog.wait_for_verdict()
    watchdog.close(done=False)
    first_line = str(e).splitlines()[0].rstrip('.') if str(e) else type(e).__name__
    watchdog.fail(f'distributed: process {watchdog.me} stopped: {first_line}')
    raise
  watchdog.close(done=True)
