"""Several processes as one run: two processes × 4 simulated CPU devices on localhost (gloo
collectives), against one process with 8 devices; lost and failing processes."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import REPO, run_cli_in_process
from jaxllm.config import ConfigError
from jaxllm.parallel.mesh import host_split, hosts

# tiny's mesh data=2 × fsdp=2 × tensor=2; data is what spans the two processes.
# Runs of a few steps, without warmup.
TINY = ['--config', 'configs/tiny.py', '--config.train.log_every=1', '--config.eval.every=0',
        '--config.data.streams=2', '--config.optim.warmup_steps=0']


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def start(workdir, *args, only=None, launch=None):
  """`python -m jaxllm.train` as 2 processes of one run on this machine, 4 devices each;
  `only` adds arguments for some processes ({process: [args]}); `launch`: the processes to
  start (default: both)."""
  common = [sys.executable, '-m', 'jaxllm.train', *TINY, *args, f'--workdir={workdir}',
            '--config.cpu_devices=4',
            f'--config.distributed.coordinator_address=localhost:{free_port()}',
            '--config.distributed.num_processes=2']
  own = lambda i: [f'--config.distributed.process_id={i}', *(only or {}).get(i, [])]
  return [subprocess.Popen(common + own(i), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
          for i in (range(2) if launch is None else launch)]


def finish(procs, timeout=240):
  """Waits for every process; returns their (stdout, stderr) and asserts they all succeeded."""
  outputs = [p.communicate(timeout=timeout) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  return outputs


def alone(workdir, *args) -> str:
  """The run as one process of 8 devices, this one (`run_cli_in_process`); returns its stdout."""
  result = run_cli_in_process(*TINY, *args, f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def losses(workdir) -> dict[int, float]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  return {row['step']: row['loss'] for row in rows if 'loss' in row}


def assert_same_losses(got, want):
  assert got.keys() == want.keys()
  for step in want:
    assert got[step] == pytest.approx(want[step], rel=1e-5), step


def resume_from(tmp_path, name, source, step):
  """A new run directory holding only checkpoint `step` of run `source`."""
  workdir = tmp_path / name
  shutil.copytree(source / 'checkpoints' / str(step), workdir / 'checkpoints' / str(step))
  return workdir


@pytest.mark.slow
def test_two_processes_train_save_and_restore_like_one(tmp_path):
  """Losses of 2 processes × 4 devices equal 1 process × 8 devices; a checkpoint written by
  the two restores in one process, and one process's restores in two, continuing alike."""
  args = ['--config.train.steps=4', '--config.checkpoint.every=2', '--config.checkpoint.keep=5']
  two, one = tmp_path / 'two', tmp_path / 'one'
  (out0, _), (out1, _) = finish(start(two, *args))
  alone(one, *args)
  assert_same_losses(losses(two), losses(one))
  assert 'split between hosts: data=2' in out0  # the two-level mesh
  assert 'step 1 ' in out0 and 'step 1 ' not in out1  # process 0 alone reports
  # ... and alone writes TensorBoard's events: each step's loss once.
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(two / 'tensorboard'))
  events.Reload()
  assert [e.step for e in events.Scalars('loss')] == [1, 2, 3, 4]

  # Both processes wrote their part: array shards, and each its data stream's position.
  saved = two / 'checkpoints' / '2'
  assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(saved / 'state'))
  assert {'stream-0-of-2.json', 'stream-1-of-2.json'} <= set(os.listdir(saved / 'data'))

  # Two processes' checkpoint -> one process (data.streams=0 follows the checkpoint's 2).
  into_one = resume_from(tmp_path, 'into_one', two, 2)
  out = alone(into_one, *args, '--config.data.streams=0')
  assert 'resumed from the checkpoint of step 2' in out
  assert_same_losses(losses(into_one), {s: v for s, v in losses(two).items() if s > 2})

  # One process's checkpoint -> two processes.
  into_two = resume_from(tmp_path, 'into_two', one, 2)
  finish(start(into_two, *args))
  assert_same_losses(losses(into_two), {s: v for s, v in losses(one).items() if s > 2})


def wait_for(proc, text, timeout=180):
  """Reads `proc`'s stdout until a line holds `text`."""
  deadline = time.monotonic() + timeout
  for line in proc.stdout:
    if text in line:
      return
    assert time.monotonic() < deadline, f'no {text!r} within {timeout}s'
  raise AssertionError(f'stdout ended before {text!r}')


def error_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith('error: ')]


HEARTBEAT = 5  # seconds


def kill_during_training(tmp_path, victim: int):
  """Two processes training; once process 0 reports step 2, SIGKILL for `victim`. Returns
  the survivor's exit status, stderr and seconds from the kill to its exit."""
  procs = start(tmp_path / 'run', '--config.train.steps=100000', '--config.checkpoint.every=0',
                f'--config.distributed.heartbeat_timeout={HEARTBEAT}')
  wait_for(procs[0], 'step 2 ')
  procs[victim].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  survivor = procs[1 - victim]
  _, err = survivor.communicate(timeout=60)
  seconds = time.monotonic() - killed
  procs[victim].communicate()
  return survivor.returncode, err, seconds


@pytest.mark.slow
def test_a_killed_process_stops_the_other_naming_it(tmp_path):
  status, err, seconds = kill_during_training(tmp_path, victim=1)
  assert status == 1
  assert error_lines(err) == [
      f'error: distributed: process 1 of 2 stopped responding (no heartbeat for over '
      f"{HEARTBEAT}s: killed, crashed or cut off); stopping process 0 too. See process 1's log."
  ], err[-3000:]
  assert seconds < HEARTBEAT + 10


@pytest.mark.slow
def test_a_killed_coordinator_ends_the_other_within_the_timeout(tmp_path):
  """Process 0 hosts JAX's coordination service; when it dies, JAX itself ends the others
  at once, with its own message ('... another task died ...')."""
  status, err, seconds = kill_during_training(tmp_path, victim=0)
  assert status != 0
  assert seconds < HEARTBEAT + 10
  assert 'another task died' in err or 'lost process 0' in err, err[-3000:]


@pytest.mark.slow
def test_a_failing_process_stops_the_others_with_its_error(tmp_path):
  started = time.monotonic()
  procs = start(tmp_path / 'run', '--config.train.steps=100000', '--config.checkpoint.every=0',
                '--config.distributed.heartbeat_timeout=60',
                only={1: ['--config.data.path=/nonexistent/*.txt']})
  (_, err0), (_, err1) = [p.communicate(timeout=120) for p in procs]
  assert (procs[0].returncode, procs[1].returncode) == (1, 2)
  assert error_lines(err1) == ["error: data.path='/nonexistent/*.txt' matches no non-empty "
                               'files; point it at a file, a directory or a glob that exists.']
  assert error_lines(err0) == [
      "error: distributed: process 1 stopped: data.path='/nonexistent/*.txt' matches no "
      'non-empty files; point it at a file, a directory or a glob that exists; stopping '
      'process 0 too.'], err0[-3000:]
  assert time.monotonic() - started < 60  # well before the 60 s heartbeat timeout


@pytest.mark.slow
def test_a_signal_to_one_process_stops_all_after_the_same_step(tmp_path):
  """A scheduler's SIGTERM may reach one process first: all finish the same step, save one
  checkpoint together and exit cleanly."""
  workdir = tmp_path / 'run'
  procs = start(workdir, '--config.train.steps=100000', '--config.checkpoint.every=0')
  wait_for(procs[0], 'step 2 ')
  procs[1].send_signal(signal.SIGTERM)
  (out0, _), _ = finish(procs, timeout=120)
  last = max(losses(workdir))
  assert f'stopped by a signal after step {last}; saved a checkpoint' in out0
  assert os.listdir(workdir / 'checkpoints') == [str(last)]
  saved = workdir / 'checkpoints' / str(last)
  assert {'stream-0-of-2.json', 'stream-1-of-2.json'} <= set(os.listdir(saved / 'data'))


@pytest.mark.slow  # ~8 s: a process that waits for its peer
def test_a_missing_process_is_an_error_at_start(tmp_path):
  (proc,) = start(tmp_path / 'run', '--config.distributed.initialization_timeout=3', launch=[0])
  _, err = proc.communicate(timeout=120)  # process 1 never starts
  assert proc.returncode == 1
  (line,) = error_lines(err)
  assert 'did not all join within distributed.initialization_timeout=3s' in line


def test_hosts_take_the_across_hosts_axes_in_order():
  shape = dict(data=2, fsdp=8, pipe=1, tensor=4)
  assert host_split(shape, 4, 'data,pipe,fsdp,tensor') == dict(data=2, fsdp=2, pipe=1, tensor=1)
  assert host_split(shape, 8, 'fsdp,data') == dict(data=1, fsdp=8, pipe=1, tensor=1)
  assert host_split(shape, 16, 'fsdp,data') == dict(data=2, fsdp=8, pipe=1, tensor=1)
  with pytest.raises(ConfigError, match=r"mesh.across_hosts='data': .* 4 hosts but data=2 "
                                        'spans only 2 of them'):
    host_split(shape, 4, 'data')


def test_hosts_are_slices_when_devices_report_several_else_processes():
  device = lambda slice_index, process_index: SimpleNamespace(
      slice_index=slice_index, process_index=process_index)
  # One process per GPU, two hosts (slices) of two GPUs each.
  gpus = [device(s, p) for s, p in ((0, 0), (0, 1), (1, 2), (1, 3))]
  groups, by_slice = hosts(gpus)
  assert by_slice and groups == [gpus[:2], gpus[2:]]
  # CPU processes on one machine: one slice, grouped by process.
  cpus = [device(0, p) for p in (0, 0, 1, 1)]
  groups, by_slice = hosts(cpus)
  assert not by_slice and groups == [cpus[:2], cpus[2:]]
