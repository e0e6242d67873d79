"""Checkpoints: exact resume after SIGKILL, restore onto other meshes, preemption, damaged
checkpoints, non-finite steps, fine-tuning from params."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from conftest import (REPO, once_per_run, paired_leaves, run_cli_in_process, run_dir, small_config,
                      text_config)
from jaxllm.checkpoint import check_resumable
from jaxllm.config import ConfigError, TrainingError
from jaxllm.pipeline.spec import from_stage_order
from jaxllm.train import setup, train

TINY = ['--config', 'configs/tiny.py', '--config.train.log_every=1', '--config.optim.warmup_steps=0',
        '--config.model.num_layers=2', '--config.train.global_batch=8']


def start_cli(workdir, *args):
  return subprocess.Popen([sys.executable, '-m', 'jaxllm.train', *TINY, f'--workdir={workdir}',
                           *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def logged(workdir) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  return [json.loads(line) for line in open(path).read().splitlines() if line.strip()]


def losses_by_step(workdir) -> dict[int, float]:
  """The last loss logged for each step (a resumed run logs steps again)."""
  return {row['step']: row['loss'] for row in logged(workdir) if 'loss' in row}


def wait_for_step(process, workdir, step, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(row.get('step', 0) >= step for row in logged(workdir)):
      return
    assert process.poll() is None, process.communicate()[1][-2000:]
    time.sleep(0.05)
  raise TimeoutError(f'step {step} not reached')


def checkpoint_steps(workdir):
  root = os.path.join(workdir, 'checkpoints')
  return sorted(int(d) for d in os.listdir(root) if d.isdigit())


@pytest.mark.slow
def test_resume_after_sigkill_repeats_the_uninterrupted_losses_exactly(tmp_path):
  """12 steps, a checkpoint every 4; a run killed hard after step 9 and restarted ends with the
  same losses for steps 9-12, bit for bit (same data order, same state)."""
  args = ['--config.train.steps=12', '--config.checkpoint.every=4']
  whole, interrupted = tmp_path / 'whole', tmp_path / 'interrupted'
  result = run_cli_in_process(*TINY, f'--workdir={whole}', *args)  # the reference: in this process
  assert result.returncode == 0, result.stderr[-2000:]

  process = start_cli(interrupted, *args)
  wait_for_step(process, interrupted, 9)
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=60)
  assert max(losses_by_step(interrupted)) < 12  # it really died before the end
  resumed = start_cli(interrupted, *args)
  out, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-2000:]
  assert 'resumed from the checkpoint of step' in out

  want, got = losses_by_step(whole), losses_by_step(interrupted)
  assert [got[s] for s in range(9, 13)] == [want[s] for s in range(9, 13)]
  assert checkpoint_steps(interrupted) == [4, 8, 12]


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_resume_continues(tmp_path):
  workdir = tmp_path / 'run'
  process = start_cli(workdir, '--config.train.steps=500', '--config.checkpoint.every=1000')
  wait_for_step(process, workdir, 3)
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err[-2000:]
  reached = max(losses_by_step(workdir))
  assert reached < 500
  assert f'stopped by a signal after step {reached}' in out
  assert checkpoint_steps(workdir) == [reached]

  resumed = start_cli(workdir, f'--config.train.steps={reached + 2}')
  out, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-2000:]
  assert [row['step'] for row in logged(workdir)][-2:] == [reached + 1, reached + 2]


def continue_one_step(cfg, saved_dir, workdir, devices=None):
  """Resumes a copy of `saved_dir` for step 4. Returns the params as restored, the mesh
  shapes they were restored onto, the run's mesh shape, step 4's loss and the final state."""
  shutil.copytree(saved_dir, workdir)
  cfg.train.steps = 4
  run = setup(cfg, devices, str(workdir))
  restored = jax.device_get(run.state.params)
  meshes = {tuple(leaf.sharding.mesh.shape.values()) for leaf in jax.tree.leaves(run.state.params)}
  run_mesh = tuple(run.mesh.shape.values())
  del run
  state, history = train(cfg, str(workdir), devices)
  assert [row['step'] for row in history] == [4]
  return restored, meshes, run_mesh, history[0]['loss'], state


@pytest.fixture(scope='module')
def saved_under_fsdp8(corpus):
  """A run of 3 steps on fsdp=8 that checkpointed at step 3: its directory (which tests copy
  or only read), its params, and the loss of step 4 when it goes on, on the same mesh. Made
  once per test run."""
  def saved():
    root = run_dir('fsdp8')
    workdir = os.path.join(root, 'run')
    cfg = text_config(corpus, fsdp=8)
    cfg.checkpoint.every = 3
    state, _ = train(cfg, workdir)
    *_, next_loss, _ = continue_one_step(text_config(corpus, fsdp=8), workdir,
                                         os.path.join(root, 'continued'))
    return workdir, jax.device_get(state.params), next_loss
  return once_per_run('saved_under_fsdp8', saved)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [dict(data=2, tensor=4), dict(), dict(pipe=2, data=2, tensor=2)],
                         ids=['data2_tensor4', 'one_device', 'pipe2_circular'])
def test_restore_onto_another_mesh(mesh, saved_under_fsdp8, corpus, tmp_path):
  """Saved under fsdp=8, restored with the new mesh's shardings: params equal, and the next
  step's loss equals that of continuing on fsdp=8."""
  saved_dir, saved_params, want_loss = saved_under_fsdp8
  cfg = text_config(corpus, **mesh)
  devices = jax.devices()[:1] if not mesh else None
  if 'pipe' in mesh:
    cfg.pipeline.update(schedule='circular', repeats=2)
  restored, meshes, run_mesh, loss, state = continue_one_step(cfg, saved_dir, tmp_path / 'new',
                                                              devices)
  if 'pipe' in mesh:  # the run holds circular blocks stage-major: compare in layer order
    restored = from_stage_order(restored, 2, 2)
  for got, want in paired_leaves(restored, saved_params):
    np.testing.assert_array_equal(got, want)
  assert meshes == {run_mesh}  # read straight onto the new mesh
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)

  if 'pipe' in mesh:
    # And back: the circular run's step-4 checkpoint, in layer order, read on one device.
    run = setup(text_config(corpus), jax.devices()[:1], str(tmp_path / 'new'))
    assert int(run.state.step) == 4
    want = jax.device_get(from_stage_order(state.params, 2, 2))
    for got, want in paired_leaves(jax.device_get(run.state.params), want):
      np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_zero_restores_from_a_plain_checkpoint_and_back(saved_under_fsdp8, corpus, tmp_path):
  """Saved under fsdp=8, resumed with ZeRO-1 on data=4 × fsdp=2 (moments read straight into
  their slices), whose step-4 checkpoint reads back on one device without ZeRO: params and
  moments equal, and step 4's loss is that of going on under fsdp=8."""
  saved_dir, saved_params, want_loss = saved_under_fsdp8
  cfg = text_config(corpus, data=4, fsdp=2)
  cfg.sharding.zero = 1
  restored, _, _, loss, state = continue_one_step(cfg, saved_dir, tmp_path / 'zero')
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved_params)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  wq = state.opt_state[1][0].mu['blocks']['attn']['wq_DNH'][...]
  assert wq.sharding.spec == jax.P('pipe', ('fsdp', 'data'), 'tensor', None)

  run = setup(text_config(corpus), jax.devices()[:1], str(tmp_path / 'zero'))
  assert int(run.state.step) == 4
  for got, want in zip(jax.tree.leaves(jax.device_get(run.state)), jax.tree.leaves(
      jax.device_get(state))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_the_previous(corpus, tmp_path, capsys):
  cfg = text_config(corpus)
  cfg.train.steps, cfg.checkpoint.every = 8, 4
  train(cfg, str(tmp_path), jax.devices()[:1])
  state_dir = tmp_path / 'checkpoints' / '8' / 'state'
  for name in os.listdir(state_dir):  # damage the array data, keep the directory
    path = state_dir / name
    if path.is_dir():
      shutil.rmtree(path)
  os.makedirs(tmp_path / 'checkpoints' / '12.orbax-checkpoint-tmp-1')  # a save cut short

  cfg.train.steps = 10
  _, history = train(cfg, str(tmp_path), jax.devices()[:1])
  err = capsys.readouterr().err
  assert 'could not be read' in err and 'resumed from step 4' in err
  assert history[0]['step'] == 5
  assert os.path.isdir(tmp_path / 'checkpoints' / '8.unreadable')  # set aside, not deleted
  assert checkpoint_steps(tmp_path) == [4, 8, 10]


@pytest.fixture(scope='module')
def saved_at_2_and_4():
  """`small_config` trained 4 steps on one device, checkpointed at steps 2 and 4: its run
  directory, for each test to copy. Made once per run."""
  def saved():
    workdir = os.path.join(run_dir('saved_at_2_and_4'), 'run')
    cfg = small_config()
    cfg.train.steps, cfg.checkpoint.every = 4, 2
    train(cfg, workdir, jax.devices()[:1])
    return workdir
  return once_per_run('saved_at_2_and_4', saved)


@pytest.mark.slow
@pytest.mark.parametrize('error', [OSError(errno.EIO, 'Input/output error'),
                                   ValueError('UNAVAILABLE: Error reading local file')],
                         ids=['io_error', 'storage_unavailable'])
def test_a_checkpoint_the_storage_fails_to_read_is_not_set_aside(error, saved_at_2_and_4,
                                                                 tmp_path, monkeypatch):
  """A read that fails for the storage's sake (an I/O error; tensorstore's UNAVAILABLE), not
  for what the files hold, stops the run in one line and sets nothing aside (it set step 4
  aside and resumed from 2); run again once the storage answers, it resumes from step 4."""
  shutil.copytree(saved_at_2_and_4, tmp_path / 'run')
  restore = ocp.CheckpointManager.restore

  def failing(self, step, *args, **kwargs):
    if step == 4:
      raise error
    return restore(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'restore', failing)
  cfg = small_config()
  cfg.train.steps = 6
  with pytest.raises(TrainingError) as stopped:
    setup(cfg, jax.devices()[:1], str(tmp_path / 'run'))
  assert str(stopped.value).startswith(
      f'checkpoint {tmp_path}/run/checkpoints/4 could not be read ({type(error).__name__}: ')
  assert 'nothing was set aside' in str(stopped.value) and '\n' not in str(stopped.value)
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2', '4']
  monkeypatch.setattr(ocp.CheckpointManager, 'restore', restore)
  assert int(setup(cfg, jax.devices()[:1], str(tmp_path / 'run')).state.step) == 4


def test_switching_fp8_on_a_resumed_run_names_the_field_and_init_from(saved_at_2_and_4,
                                                                      tmp_path):
  """model.fp8='delayed' keeps scales and amax histories in the train state, which a run
  saved without it lacks: resuming says which field changed and how to switch (a new run
  from the checkpoint's parameters), where it said no checkpoint could be read; the
  checkpoints stay, and the way it names works."""
  shutil.copytree(saved_at_2_and_4, tmp_path / 'run')
  cfg = small_config()
  cfg.model.fp8 = 'delayed'
  cfg.train.steps = 6
  step_dir = tmp_path / 'run' / 'checkpoints' / '4'
  with pytest.raises(ConfigError) as refused:
    setup(cfg, jax.devices()[:1], str(tmp_path / 'run'))
  assert str(refused.value) == (
      f"checkpoint {step_dir} was saved with model.fp8='none' but this run has model.fp8="
      "'delayed': delayed FP8 scaling keeps scales and amax histories in the train state. "
      f'Resume with the same, or start a new run from its parameters: init_from={step_dir} '
      'and another --workdir (or checkpoint.dir).')
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['2', '4']
  cfg.init_from = str(step_dir)
  run = setup(cfg, jax.devices()[:1], str(tmp_path / 'fp8'))
  assert run.origin == f'parameters from {step_dir}, fresh optimizer state'
  assert run.state.fp8 is not None


@pytest.mark.parametrize('saved, now, field', [
    (('delayed', 16), ('delayed', 8), 'model.fp8_history'),
    (('delayed', 16), ('current', 16), 'model.fp8'),
    (('none', 1024), ('current', 16), None),  # neither keeps FP8 state
    (('current', 1024), ('none', 16), None),
])
def test_fp8_state_must_match_to_resume(saved, now, field):
  saved_cfg = small_config()
  saved_cfg.model.update(fp8=saved[0], fp8_history=saved[1])
  model_cfg = small_config().model
  model_cfg.update(fp8=now[0], fp8_history=now[1])
  if field is None:
    check_resumable(saved_cfg.to_dict(), model_cfg, 'ckpt/2')
    return
  with pytest.raises(ConfigError, match=rf'^checkpoint ckpt/2 was saved with {field}='):
    check_resumable(saved_cfg.to_dict(), model_cfg, 'ckpt/2')


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  cfg = small_config()
  cfg.optim.update(lr=1e12, clip_norm=0.0)  # the first update blows the weights up
  cfg.train.steps, cfg.checkpoint.every = 6, 1
  with pytest.raises(TrainingError, match=r'step 2: .* not finite.*checkpoint of step 1'):
    train(cfg, str(tmp_path), jax.devices()[:1])
  assert checkpoint_steps(tmp_path) == [1]


@pytest.mark.slow
def test_nonfinite_updates_can_be_skipped(tmp_path):
  cfg = small_config()
  cfg.optim.update(lr=1e12, clip_norm=0.0, schedule='constant')  # step 1 alike in both runs
  cfg.train.update(steps=1)
  after_one, _ = train(cfg, None, jax.devices()[:1])
  cfg.train.update(steps=4, skip_nonfinite=True)
  state, history = train(cfg, None, jax.devices()[:1])
  assert [row['skipped'] for row in history] == [0, 1, 1, 1]
  for got, want in paired_leaves(state.params, after_one.params):
    np.testing.assert_array_equal(got, want)
  # The skipped steps still count for the schedule: the next update takes the lr of step 5,
  # the one the log would show, not step 2's. Not for Adam: its bias correction counts the
  # one update taken.
  counted = lambda s: isinstance(s, (optax.ScaleByScheduleState, optax.ScaleByAdamState))
  counts = {type(s).__name__: int(s.count)
            for s in jax.tree.leaves(state.opt_state, is_leaf=counted) if counted(s)}
  assert counts == {'ScaleByScheduleState': int(state.step), 'ScaleByAdamState': 1}
  assert int(state.step) == 4


@pytest.mark.slow
def test_init_from_takes_params_only(saved_under_fsdp8, corpus, tmp_path):
  saved_dir, saved_params, _ = saved_under_fsdp8
  cfg = text_config(corpus, data=2, tensor=4)
  cfg.init_from = os.path.join(saved_dir, 'checkpoints')
  run = setup(cfg, None, str(tmp_path))
  assert int(run.state.step) == 0
  for got, want in paired_leaves(run.state.params, saved_params):
    np.testing.assert_array_equal(got, want)
  assert all(not np.any(m) for m in jax.tree.leaves(run.state.opt_state[1][0].mu))


@pytest.mark.slow
def test_incompatible_checkpoint_is_an_error_and_stays(saved_under_fsdp8, corpus, tmp_path):
  saved_dir, *_ = saved_under_fsdp8
  shutil.copytree(saved_dir, tmp_path / 'run')
  before = sorted(os.listdir(tmp_path / 'run' / 'checkpoints'))
  cfg = text_config(corpus, fsdp=8)
  cfg.model.mlp_dim = 256
  with pytest.raises(ConfigError, match='model.mlp_dim=128 but this run has model.mlp_dim=256'):
    setup(cfg, None, str(tmp_path / 'run'))
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == before


def test_unwritable_checkpoint_dir_is_an_error(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  cfg = small_config()
  cfg.checkpoint.dir = str(blocker / 'checkpoints')
  with pytest.raises(ConfigError, match='checkpoint.dir=.*not writable'):
    setup(cfg, jax.devices()[:1])
