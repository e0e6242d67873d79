"""`python -m jaxllm.train` end to end, and the one-line errors bad input gets."""

import gc
import importlib
import importlib.machinery
import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import types

import numpy as np
import pytest

from conftest import (REPO, USER_XLA_FLAGS, once_per_run, run_cli, run_cli_in_process, run_dir,
                      small_config)
from jaxllm import train
from jaxllm.cli import load_config, parse_command_line
from jaxllm.config import ConfigError, default_config
from jaxllm.cost import tune
from jaxllm.metrics import MetricsLog
from jaxllm.validate import validate


TINY_RUN = ['--config', 'configs/tiny.py', '--config.train.steps=20', '--config.train.log_every=4',
            '--config.data.eval_fraction=0.05', '--config.eval.every=10']


def read_rows(workdir) -> list[dict]:
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def tiny_runs():
  """The tiny config trained twice by the `jaxllm-train` command, each time in a new workdir
  with one compilation cache of their own: the first run fills it, the second (without
  evaluations, which leave training as it is) reads it. Returns both results and workdirs.
  Made once per test run."""
  def two_runs():
    root = pathlib.Path(run_dir('tiny_runs'))
    command = os.path.join(sysconfig.get_path('scripts'), 'jaxllm-train')
    runs = []
    for name, evaluate in (('first', []), ('second', ['--config.eval.every=0'])):
      workdir = root / name
      result = subprocess.run([command, *TINY_RUN, *evaluate, f'--workdir={workdir}',
                               f'--config.compilation_cache={root}/cache'],
                              cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, 'XLA_FLAGS': USER_XLA_FLAGS})  # 20 steps
      assert result.returncode == 0, result.stderr[-2000:]
      runs.append((result, workdir))
    return runs
  return once_per_run('tiny_runs', two_runs)


@pytest.mark.slow
def test_tiny_config_trains_evaluates_and_writes_metrics(tiny_runs):
  result, workdir = tiny_runs[0]
  logged = read_rows(workdir)
  rows = [r for r in logged if 'loss' in r]
  evals = [r for r in logged if 'eval_loss' in r]
  assert [r['step'] for r in rows] == [4, 8, 12, 16, 20]
  assert [r['step'] for r in evals] == [10, 20]  # (10: between two logged steps)
  assert evals[1]['eval_loss'] < evals[0]['eval_loss']
  assert all(abs(r['eval_perplexity'] - math.exp(r['eval_loss'])) < 1e-6 * r['eval_perplexity']
             for r in evals)
  assert 'eval_loss' in result.stdout
  assert {'loss', 'grad_norm', 'lr', 'step_time', 'tokens_per_sec'} <= rows[0].keys()
  # Only the last interval saved (checkpoint.every=100 > steps), and the log says so.
  assert [r['save_time'] > 0 for r in rows] == [False, False, False, False, True]
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['20']
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5
  assert 'mesh  data=2 fsdp=2 pipe=1 tensor=2' in result.stdout
  assert json.loads((workdir / 'config.json').read_text())['mesh']['tensor'] == 2


@pytest.mark.parametrize('module, flag', [('jaxllm.train', '--workdir'),
                                          ('jaxllm.analyze', '--hardware'),
                                          ('jaxllm.tune', '--measure'),
                                          ('jaxllm.data.pretokenize', '--shard_docs')])
def test_each_command_s_help_is_its_own(module, flag):
  """`--help` prints the command's own usage line and flags (with their defaults), then the
  config's fields; it exits 0 without a --config."""
  result = run_cli_in_process('--help', module=module)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f'usage: python -m {module} --config configs/X.py'), (
      result.stdout[:200])
  assert f'\n  {flag} (default: ' in result.stdout
  assert ('\n  --workdir ' in result.stdout) == (module == 'jaxllm.train')  # runs' alone
  assert result.stdout.rstrip().endswith(str(default_config()).rstrip())


def test_every_command_is_installed_as_its_modules_entry_point():
  """`jaxllm-<name>` runs `jaxllm.<name>.cli`, which `python -m jaxllm.<name>` runs too (the
  tiny runs above go through `jaxllm-train`)."""
  commands = ('train', 'analyze', 'tune', 'generate', 'hf')
  scripts = {e.name: e for e in importlib.metadata.entry_points(group='console_scripts')
             if e.name.startswith('jaxllm-')}
  assert sorted(scripts) == sorted(f'jaxllm-{name}' for name in commands)
  for name in commands:
    # A command that is a package (hf) runs its __main__.
    package = os.path.isdir(os.path.join(REPO, 'jaxllm', name))
    module = f'jaxllm.{name}.__main__' if package else f'jaxllm.{name}'
    assert scripts[f'jaxllm-{name}'].load() is importlib.import_module(module).cli
    assert os.path.isfile(os.path.join(sysconfig.get_path('scripts'), f'jaxllm-{name}'))
    with open(os.path.join(REPO, *module.split('.')) + '.py') as f:
      source = f.read()
    assert source.endswith("if __name__ == '__main__':\n  cli()\n"), name


@pytest.mark.slow
def test_tensorboard_holds_every_metrics_row_and_the_config(tiny_runs):
  """Read back with TensorBoard's own reader: each number of each metrics.jsonl row is a
  scalar at the row's step (stored as float32), and the config is the text of config.json."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  from tensorboard.util import tensor_util
  _, workdir = tiny_runs[0]
  events = EventAccumulator(str(workdir / 'tensorboard'), size_guidance={'scalars': 0})
  events.Reload()
  rows = read_rows(workdir)
  names = {k for row in rows for k in row if k != 'step'}
  assert set(events.Tags()['scalars']) == names and 'eval_loss' in names
  for name in names:
    want = [(row['step'], row[name]) for row in rows if name in row]
    got = [(e.step, e.value) for e in events.Scalars(name)]
    assert [s for s, _ in got] == [s for s, _ in want], name
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6, err_msg=name)
  [text] = events.Tensors('config/text_summary')
  shown = tensor_util.make_ndarray(text.tensor_proto).item().decode()
  assert json.loads(shown) == json.loads((workdir / 'config.json').read_text())


@pytest.mark.slow
def test_the_second_run_reads_the_compiled_step_from_the_cache(tiny_runs):
  (first, first_dir), (second, second_dir) = tiny_runs
  assert re.search(r'compiled the train step in [\d.]+s\n', first.stdout)
  assert re.search(r'compiled the train step in [\d.]+s \(cache hit\)\n', second.stdout)
  # The program read back is the one compiled: the same losses to the last bit.
  losses = lambda rows: [(r['step'], r['loss']) for r in rows if 'loss' in r]
  assert losses(read_rows(second_dir)) == losses(read_rows(first_dir))
  assert len(losses(read_rows(first_dir))) == 5
  # JAX keeps programs compressed with zstandard (a dependency for it), not zlib: faster to
  # write and to read back.
  kept = list((first_dir.parent / 'cache').glob('jit_train_step-*-cache'))
  assert kept and all(p.read_bytes()[:4] == b'\x28\xb5\x2f\xfd' for p in kept), kept


def test_a_tensorboard_dir_that_cannot_be_written_is_a_config_error(tmp_path):
  """Raised before metrics.jsonl is opened; `main_guard` makes any ConfigError one line."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'tensorboard').write_text('a file where the event files would go')
  with pytest.raises(ConfigError, match=(
      f'^metrics.tensorboard: cannot write event files to {workdir}/tensorboard \\(File '
      r'exists\); make it a writable directory, or set metrics.tensorboard=False\.$')):
    MetricsLog(str(workdir), small_config())
  assert sorted(os.listdir(workdir)) == ['tensorboard']


def test_event_files_are_written_without_importing_torch(tmp_path):
  """tensorboardX imports torch (installed here) unless kept from it: seconds at every start.
  A fresh process, as this one has torch already."""
  script = ('import sys\n'
            'from jaxllm.config import default_config\n'
            'from jaxllm.metrics import TensorBoard\n'
            'events = TensorBoard(sys.argv[1], default_config())\n'
            "events.write({'step': 1, 'loss': 2.5, 'moe_expert_load': [0.5, 1.5]})\n"
            'events.close()\n'
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
  result = subprocess.run([sys.executable, '-c', script, str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == '[]'
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(tmp_path))


@pytest.mark.slow
def test_a_short_run_of_the_tiny_config_trains(tmp_path, monkeypatch, capsys):
  """`python -m jaxllm.train --config configs/tiny.py --config.train.steps=10`, the first run
  people try: tiny's 20 warmup steps are longer than the run, so it warms up over the 10 it
  has, says so, and its last step takes the peak lr (halfway up tiny's own warmup: 1.5e-3)."""
  workdir = tmp_path / 'run'
  monkeypatch.chdir(REPO)
  monkeypatch.setattr(sys, 'argv', ['jaxllm-train', '--config', 'configs/tiny.py',
                                    '--config.train.steps=10', f'--workdir={workdir}',
                                    '--config.distributed.num_processes=1',
                                    '--config.compilation_cache='])
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
  train.cli()
  out = capsys.readouterr().out
  assert ('note: optim.warmup_steps=20 is longer than the run (train.steps=10): the lr warms up '
          'over its 10 steps and reaches optim.lr=0.003 on the last.\n') in out
  [row] = [r for r in read_rows(workdir) if 'loss' in r]
  assert row['step'] == 10 and row['lr'] == pytest.approx(3e-3, rel=1e-6)
  assert math.isfinite(row['loss'])


def test_a_workdir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capfd):
  """--workdir under a file, with checkpoint.dir elsewhere (so the checkpoints' own check
  passes): one line naming --workdir, where opening metrics.jsonl raised; nothing written."""
  (tmp_path / 'a_file').write_text('kept')
  workdir = tmp_path / 'a_file' / 'run'
  monkeypatch.chdir(REPO)
  monkeypatch.setattr(sys, 'argv', ['jaxllm-train', '--config', 'configs/tiny.py',
                                    f'--workdir={workdir}',
                                    f'--config.checkpoint.dir={tmp_path}/checkpoints',
                                    '--config.data.source=synthetic', '--config.eval.every=0',
                                    '--config.model.num_layers=1',
                                    '--config.distributed.num_processes=1',
                                    '--config.compilation_cache='])
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
  with pytest.raises(SystemExit) as stopped:
    train.cli()
  err = capfd.readouterr().err
  assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith(f'error: --workdir={workdir}: cannot write there (')
  assert 'point --workdir at a directory you can write to' in err
  assert (tmp_path / 'a_file').read_text() == 'kept' and os.listdir(tmp_path / 'checkpoints') == []


@pytest.mark.slow
def test_tiny_config_fine_tunes_on_conversations_with_every_extra_split(tmp_path):
  """data.format='chat' (the byte tokenizer with a ChatML template file; the loss on the
  assistant's replies only, test_chat.py checks which tokens) with one K/V head over
  tensor=2 (replicated), the sequence split over fsdp (context parallelism: packed
  conversations keep to their own segments) and the residual stream over tensor too
  (sequence parallelism), ZeRO-1 over data: all from the command line, on tiny's
  data=2 × fsdp=2 × tensor=2."""
  from test_chat import TEMPLATE, conversations
  (tmp_path / 'chats.jsonl').write_text(
      ''.join(json.dumps({'messages': m}) + '\n' for m in conversations(40)))
  (tmp_path / 'chatml.jinja').write_text(TEMPLATE)
  workdir = tmp_path / 'run'
  result = run_cli_in_process(
      '--config', 'configs/tiny.py', '--config.data.format=chat',
      f'--config.data.path={tmp_path}/chats.jsonl',
      f'--config.data.chat_template={tmp_path}/chatml.jinja', '--config.eval.every=0',
      '--config.model.num_kv_heads=1', "--config.sharding.rules.batch=('data',)",
      "--config.sharding.rules.seq=('fsdp',)", "--config.sharding.rules.act_seq=('tensor',)",
      '--config.sharding.zero=1', '--config.train.steps=10', '--config.train.log_every=5',
      f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  rows = read_rows(workdir)
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5  # 5.20 at step 5, 4.08 at 10
  saved = json.loads((workdir / 'config.json').read_text())
  rules = saved['sharding']['rules']
  # The rules as configured: one K/V head over tensor=2 is kept whole by the run's own rules
  # (`parallel.rules.derive`, on any mesh the checkpoint is restored onto), not by the config.
  assert (rules['seq'], rules['act_seq'], rules['kv_heads']) == (['fsdp'], ['tensor'], ['tensor'])
  assert saved['data']['format'] == 'chat'


BAD_INPUTS = {
    'mesh_product': (['--config.mesh.data=3'], 'mesh'),
    # 3 K/V heads over tensor=2: neither splits nor replicates evenly
    'kv_heads_vs_tensor': (['--config.model.num_heads=6', '--config.model.num_kv_heads=3'],
                           'model.num_kv_heads'),
    'sequence_over_data': (["--config.sharding.rules.seq=('data',)"], 'sharding.rules.seq'),
    'sequence_and_batch_over_fsdp': (["--config.sharding.rules.seq=('fsdp',)"],
                                     'sharding.rules.seq'),
    'sequence_split_vs_seq_len': (["--config.sharding.rules.act_seq=('tensor',)",
                                   '--config.data.seq_len=127'], 'data.seq_len'),
    'collective_matmul_without_sequence_parallelism': (['--config.model.collective_matmul=True'],
                                                       'model.collective_matmul'),
    'heads_vs_kv_heads': (['--config.model.num_heads=5'], 'model.num_heads'),
    'global_batch': (['--config.train.global_batch=6'], 'train.global_batch'),
    'micro_batches': (['--config.train.micro_batches=3'], 'train.global_batch'),
    'unknown_field': (['--config.model.num_layerz=2'], 'num_layerz'),
    'unknown_section': (['--config.modle.num_layers=2'], 'modle'),
    'bad_value': (['--config.mesh.data=two'], 'mesh.data'),
    'missing_data': (['--config.data.path=/nonexistent/corpus/*.txt'], 'data.path'),
    'eval_without_split': (['--config.data.eval_fraction=0'], 'eval.every'),
    'remat_policy': (['--config.model.remat=sometimes'], 'model.remat'),
    'cudnn_in_fp32': (['--config.model.attention=cudnn'], 'model.dtype'),
    'two_fill_axes': (['--config.mesh.data=-1', '--config.mesh.fsdp=-1'], 'mesh'),
    'layers_vs_stages': (['--config.mesh.pipe=8', '--config.mesh.data=1', '--config.mesh.fsdp=1',
                          '--config.mesh.tensor=1'], 'model.num_layers'),
    'microbatches_vs_stages': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                                '--config.pipeline.microbatches=1'], 'pipeline.microbatches'),
    'pipeline_batch': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                        '--config.pipeline.microbatches=6'], 'pipeline.microbatches'),
    'microbatches_multiple': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                              '--config.pipeline.microbatches=3'], 'pipeline.microbatches'),
    'circular_repeats': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                          '--config.pipeline.schedule=circular'], 'pipeline.repeats'),
    'profile_steps': (['--config.profile.start_step=5', '--config.profile.steps=0'],
                      'profile.steps'),
    'process_id': (['--config.distributed.num_processes=2', '--config.distributed.process_id=2'],
                   'distributed.process_id'),
    'coordinator_port': (['--config.distributed.coordinator_address=localhost'],
                         'distributed.coordinator_address'),
    'across_hosts': (['--config.mesh.across_hosts=data,hosts'], 'mesh.across_hosts'),
    'streams_vs_batch': (['--config.data.streams=3'], 'data.streams'),
    'zero_stage': (['--config.sharding.zero=3'], 'sharding.zero'),
    'negative_lr': (['--config.optim.lr=-1.0'], 'optim.lr'),  # trained by gradient ascent
    'lr_schedule': (['--config.optim.schedule=step'], 'optim.schedule'),
    # one mesh axis on two dimensions of a weight ([embed, mlp]) or of an activation
    # ([batch, seq, act_mlp])
    'one_axis_on_two_weight_dimensions': (["--config.sharding.rules.mlp=('fsdp',)"],
                                          "sharding.rules.mlp=('fsdp',)"),
    'one_axis_on_two_activation_dimensions': (["--config.sharding.rules.act_mlp=('fsdp',)"],
                                              "sharding.rules.act_mlp=('fsdp',)"),
}


# Bad data and checkpoint input, made in the test's directory: name -> (files, args, field).
BAD_FILES = {
    'empty_dataset_dir': ({'empty/': ''}, ['--config.data.path={tmp}/empty'], 'data.path'),
    'unknown_format': ({}, ['--config.data.format=csv'], 'data.format'),
    'jsonl_without_field': ({'docs.jsonl': '{"body": "hello"}\n'},
                            ['--config.data.path={tmp}/docs.jsonl'], 'data.text_field'),
    'tokenizer_missing': ({}, ['--config.data.tokenizer={tmp}/tokenizer.json'], '/tokenizer.json'),
    'checkpoint_dir_not_writable': ({'a_file': ''}, ['--config.checkpoint.dir={tmp}/a_file/ckpt'],
                                    'checkpoint.dir'),
    'chat_unknown_role': ({'chats.jsonl': '{"messages": [{"role": "bot", "content": "hi"}]}\n'},
                          ['--config.data.format=chat', '--config.data.path={tmp}/chats.jsonl'],
                          "has a message with role 'bot'"),
}


# Every case runs through `jaxllm-train`'s entry point in this process (a fresh one costs
# seconds) as a single process. These also run as the command in a fresh process, for its
# exit status and an stderr that holds nothing else: one for each place bad input is caught
# (the flags, the config's checks, the data), and the distributed set-up's, which only a
# fresh process may start.
FROM_THE_COMMAND = ('bad_value', 'mesh_product', 'chat_unknown_role')
DISTRIBUTED = ('process_id', 'coordinator_port')
IN_THIS_PROCESS = [name for name in [*BAD_INPUTS, *BAD_FILES] if name not in DISTRIBUTED]


def bad_case(name, tmp_path) -> tuple[list[str], str]:
  """The command-line arguments of a bad-input case (its files made in tmp_path) and the
  field its error must name."""
  if name in BAD_INPUTS:
    return BAD_INPUTS[name]
  files, args, field = BAD_FILES[name]
  for file_name, text in files.items():
    if file_name.endswith('/'):
      (tmp_path / file_name).mkdir()
    else:
      (tmp_path / file_name).write_text(text)
  return [a.format(tmp=tmp_path) for a in args], field


def assert_one_readable_line(code, stdout, stderr, field, workdir):
  assert code != 0
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert len(lines) == 1, stderr
  assert lines[0].startswith('error: ') and field in lines[0]
  assert 'Traceback' not in stdout + stderr
  assert not os.path.exists(workdir)


@pytest.mark.parametrize('name', IN_THIS_PROCESS)
def test_bad_input_is_one_readable_line(name, tmp_path, monkeypatch, capfd):
  args, field = bad_case(name, tmp_path)
  workdir = tmp_path / 'run'
  monkeypatch.chdir(REPO)
  monkeypatch.setattr(sys, 'argv', ['jaxllm-train', '--config', 'configs/tiny.py', *args,
                                    f'--workdir={workdir}',
                                    # one process, as the test's backends have started
                                    '--config.distributed.num_processes=1',
                                    # left on, the cache would stay on in this process
                                    '--config.compilation_cache='])
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))  # the config adds to them
  with pytest.raises(SystemExit) as stopped:
    train.cli()
  out = capfd.readouterr()
  assert_one_readable_line(stopped.value.code, out.out, out.err, field, workdir)


@pytest.mark.parametrize('name', FROM_THE_COMMAND + DISTRIBUTED)
def test_bad_input_is_one_readable_line_from_the_command(name, tmp_path):
  args, field = bad_case(name, tmp_path)
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', *args, f'--workdir={workdir}')
  assert_one_readable_line(result.returncode, result.stdout, result.stderr, field, workdir)


# Numeric fields outside their meaningful range, checked in-process by `validate` (the CLI
# cases above prove the one-line exit): overrides -> what the message must say.
LLAMA3 = {'model.rope_scaling.factor': 8.0}
BAD_NUMBERS = [
    ({'cpu_devices': -1}, 'cpu_devices=-1 must be at least 0'),
    ({'model.rope_theta': 0.0}, 'model.rope_theta=0.0 must be a positive number'),
    ({'model.rope_theta': math.nan}, 'model.rope_theta=nan must be a positive number'),
    ({'model.norm_eps': -1e-5}, 'model.norm_eps=-1e-05 must be a positive number'),
    ({'model.init_std': 0.0}, 'model.init_std=0.0 must be a positive number'),
    ({'model.init_std': math.inf}, 'model.init_std=inf must be a positive number'),
    ({'model.rope_scaling.factor': -8.0}, 'model.rope_scaling.factor=-8.0 must be at least 1'),
    ({'model.rope_scaling.factor': 0.5}, 'model.rope_scaling.factor=0.5 must be at least 1'),
    ({**LLAMA3, 'model.rope_scaling.high_freq_factor': 1.0},
     'low_freq_factor=1.0 and high_freq_factor=1.0 must have 0 < low < high'),
    ({**LLAMA3, 'model.rope_scaling.low_freq_factor': 0.0},
     'low_freq_factor=0.0 and high_freq_factor=4.0 must have 0 < low < high'),
    ({**LLAMA3, 'model.rope_scaling.original_max_position': 0},
     'model.rope_scaling.original_max_position=0 must be'),
    ({'train.peak_flops': -1e15}, 'train.peak_flops=-1000000000000000.0 must be'),
    ({'train.peak_flops': math.nan}, 'train.peak_flops=nan must be'),
    ({'train.seed': -1}, 'train.seed=-1 must be in [0, 2**32)'),
    ({'train.seed': 2**32}, 'train.seed=4294967296 must be in [0, 2**32)'),
    ({'pipeline.repeats': 0}, 'pipeline.repeats=0 must be at least 1'),
    ({'pipeline.microbatches': -2}, 'pipeline.microbatches=-2 must be at least 0'),
    ({'distributed.num_processes': -1}, 'distributed.num_processes=-1 must be positive'),
    ({'distributed.process_id': -2}, 'distributed.process_id=-2 must be at least 0'),
    ({'distributed.initialization_timeout': 0},
     'distributed.initialization_timeout=0 must be at least 1'),
    ({'distributed.heartbeat_timeout': -5}, 'distributed.heartbeat_timeout=-5 must be at least 1'),
    ({'optim.lr': 0.0}, 'optim.lr=0.0 must be > 0'),
    ({'optim.lr': math.inf}, 'optim.lr=inf must be > 0'),
    ({'optim.warmup_steps': -1}, 'optim.warmup_steps=-1 must be at least 0'),
    ({'optim.decay_steps': -10}, 'optim.decay_steps=-10 must be at least 0'),
    ({'optim.min_lr_ratio': 1.5}, 'optim.min_lr_ratio=1.5 must be in [0, 1]'),
    ({'optim.min_lr_ratio': -0.1}, 'optim.min_lr_ratio=-0.1 must be in [0, 1]'),
    ({'optim.b1': 1.0}, 'optim.b1=1.0 must be in [0, 1)'),
    ({'optim.b2': -0.5}, 'optim.b2=-0.5 must be in [0, 1)'),
    ({'optim.eps': 0.0}, 'optim.eps=0.0 must be > 0'),
    ({'optim.weight_decay': -0.1}, 'optim.weight_decay=-0.1 must be >= 0'),
    ({'optim.weight_decay': math.nan}, 'optim.weight_decay=nan must be >= 0'),
    ({'optim.clip_norm': -1.0}, 'optim.clip_norm=-1.0 must be >= 0'),
    ({'optim.z_loss': -1e-4}, 'optim.z_loss=-0.0001 must be >= 0'),
    # wsd's decay is the run's last updates: warmup must be over before it (the first ended at
    # 0.55·lr, not lr·min_lr_ratio)
    ({'train.steps': 10, 'optim.schedule': 'wsd', 'optim.warmup_steps': 9},
     'optim.warmup_steps=9 + optim.decay_steps=0 (a fifth of train.steps: 2) > train.steps=10'),
    ({'train.steps': 10, 'optim.schedule': 'wsd', 'optim.warmup_steps': 6,
      'optim.decay_steps': 5}, 'optim.warmup_steps=6 + optim.decay_steps=5 > train.steps=10'),
    ({'train.steps': 10, 'optim.schedule': 'wsd', 'optim.decay_steps': 11},
     'optim.warmup_steps=0 + optim.decay_steps=11 > train.steps=10'),
    # a warmup longer than the run is shortened to it, but wsd's decay still has no room
    ({'train.steps': 10, 'optim.schedule': 'wsd', 'optim.warmup_steps': 20},
     'optim.warmup_steps=20 + optim.decay_steps=0 (a fifth of train.steps: 2) > train.steps=10'),
]
ONE_DEVICE = dict(data=1, fsdp=1, pipe=1, tensor=1)


def with_fields(overrides: dict):
  """`small_config` with dotted fields set, as --config.a.b=v would set them."""
  return tune.with_fields(small_config(), overrides)


@pytest.mark.parametrize('overrides, message', BAD_NUMBERS, ids=[str(o) for o, _ in BAD_NUMBERS])
def test_numbers_out_of_range_are_config_errors(overrides, message):
  with pytest.raises(ConfigError) as error:
    validate(with_fields(overrides), ONE_DEVICE)
  assert message in str(error.value) and '\n' not in str(error.value)


def test_numbers_at_the_edge_of_their_range_are_valid():
  """The checks are not stricter than the fields: each bound itself is accepted."""
  validate(with_fields({'cpu_devices': 0, 'train.peak_flops': 0.0, 'train.seed': 2**32 - 1,
                        'pipeline.microbatches': 0, 'model.rope_scaling.factor': 1.0,
                        'model.rope_scaling.original_max_position': 1,
                        'distributed.process_id': -1, 'distributed.heartbeat_timeout': 1,
                        'optim.warmup_steps': 0, 'optim.decay_steps': 0,
                        'optim.min_lr_ratio': 0.0, 'optim.b1': 0.0, 'optim.b2': 0.0,
                        'optim.weight_decay': 0.0, 'optim.clip_norm': 0.0, 'optim.z_loss': 0.0}),
           ONE_DEVICE)
  validate(with_fields({'optim.min_lr_ratio': 1.0, 'optim.schedule': 'wsd'}),
           ONE_DEVICE)
  for warmup, decay in ((8, 0), (5, 5), (0, 10)):  # wsd's warmup ends where its decay begins
    validate(with_fields({'train.steps': 10, 'optim.schedule': 'wsd',
                          'optim.warmup_steps': warmup, 'optim.decay_steps': decay}), ONE_DEVICE)
  validate(with_fields({'train.steps': 10, 'optim.warmup_steps': 10}), ONE_DEVICE)  # ends at peak
  for schedule in ('cosine', 'linear', 'constant'):  # the warmup is shortened to the run
    validate(with_fields({'train.steps': 10, 'optim.schedule': schedule,
                          'optim.warmup_steps': 20}), ONE_DEVICE)


def test_a_second_command_line_in_one_process_starts_from_the_config(monkeypatch):
  """Nothing of the first parse (its overrides, its workdir) leaks into the next."""
  monkeypatch.chdir(REPO)
  tiny = load_config('configs/tiny.py')
  cfg, workdir = parse_command_line(['jaxllm-train', '--config', 'configs/tiny.py',
                                     '--config.train.steps=7', '--config.mesh.tensor=4',
                                     '--workdir=/tmp/first'])
  assert (cfg.train.steps, cfg.mesh.tensor, workdir) == (7, 4, '/tmp/first')
  cfg, workdir = parse_command_line(['jaxllm-train', '--config=configs/tiny.py',
                                     '--config.model.num_layers=3'])
  assert cfg.model.num_layers == 3 and tiny.model.num_layers != 3
  assert (cfg.train.steps, cfg.mesh.tensor) == (tiny.train.steps, tiny.mesh.tensor) != (7, 4)
  assert workdir == os.path.join('runs', 'tiny')


def test_missing_config_file_is_one_readable_line():
  result = run_cli_in_process('--config', 'configs/nope.py')
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      'error: --config configs/nope.py: no such file; pass a file from configs/, '
      'e.g. configs/tiny.py.']


def test_config_xla_flags_come_before_the_environments(monkeypatch):
  """XLA reads its flags in order and the last one given wins: the environment's override."""
  from jaxllm.backends import start_backends
  from jaxllm.config import default_config
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_enable_latency_hiding_scheduler=false')
  cfg = default_config()
  start_backends(cfg)
  assert os.environ['XLA_FLAGS'] == ('--xla_gpu_enable_latency_hiding_scheduler=true '
                                     '--xla_gpu_enable_latency_hiding_scheduler=false')


def test_starting_the_backends_leaves_what_exists_out_of_later_collections():
  """A command starts its backends once its imports are done: what exists then lives as long
  as the process, and `start_backends` freezes it, so the garbage collections that tracing
  sets off do not walk it again and again."""
  from jaxllm.backends import start_backends
  made = [[] for _ in range(1000)]
  before = gc.get_freeze_count()
  start_backends()
  assert gc.get_freeze_count() >= before + len(made)


@pytest.mark.slow
def test_bf16_gradient_reduction_trains_on_the_cpu(tmp_path):
  """`model.grad_reduce_dtype=bfloat16` on the CPU: XLA's CPU compiler aborted the process
  (exit 134) in a pass that widens narrow reductions, which this run asked for and which
  `jaxllm.backends.compiler_options` leaves out."""
  result = run_cli('--config', 'configs/tiny.py', '--workdir', str(tmp_path),
                   '--config.train.steps=2', '--config.optim.warmup_steps=0',
                   '--config.model.dtype=bfloat16', '--config.model.grad_reduce_dtype=bfloat16')
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [r for r in read_rows(tmp_path) if 'loss' in r]
  assert rows[-1]['step'] == 2 and math.isfinite(rows[-1]['loss'])


def test_the_compilation_cache_lives_in_the_user_cache_dir_or_where_it_is_put(monkeypatch,
                                                                              tmp_path):
  from jaxllm.backends import compilation_cache_dir, use_compilation_cache
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert compilation_cache_dir('auto') == str(tmp_path / 'xdg' / 'jaxllm' / 'compilation')
  monkeypatch.delenv('XDG_CACHE_HOME')
  assert compilation_cache_dir('auto') == os.path.expanduser('~/.cache/jaxllm/compilation')
  assert compilation_cache_dir('~/elsewhere') == os.path.expanduser('~/elsewhere')
  (tmp_path / 'a_file').write_text('')
  with pytest.raises(ConfigError, match=r"compilation_cache='.*/a_file/cache': cannot create "
                     r".* set it to a writable directory, or to '' for no cache"):
    use_compilation_cache(str(tmp_path / 'a_file' / 'cache'))


def test_missing_wandb_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # as if not installed
  with pytest.raises(ConfigError, match=r"^metrics.wandb_project='mine' needs the wandb package: "
                     r"pip install wandb \(or set metrics.wandb_project=''\)\.$"):
    validate(with_fields({'metrics.wandb_project': 'mine'}), ONE_DEVICE)


def test_wandb_gets_the_config_and_every_row_at_its_step(monkeypatch, tmp_path):
  """W&B is optional and not installed here: a stand-in module records what the run asks."""
  calls = []

  class Run:
    def log(self, values, step):
      calls.append(('log', values, step))

    def finish(self):
      calls.append(('finish',))

  def init(**kwargs):
    calls.append(('init', kwargs))
    return Run()

  wandb = types.ModuleType('wandb')
  wandb.init, wandb.__spec__ = init, importlib.machinery.ModuleSpec('wandb', None)
  monkeypatch.setitem(sys.modules, 'wandb', wandb)
  cfg = with_fields({'metrics.wandb_project': 'mine', 'metrics.tensorboard': False})
  validate(cfg, ONE_DEVICE)
  log = MetricsLog(str(tmp_path / 'run'), cfg)
  row = {'step': 10, 'loss': 2.5, 'grad_norm': 1.0, 'lr': 1e-3, 'step_time': 0.1,
         'tokens_per_sec': 100.0}
  log.write(row, 10)
  log.write_eval({'step': 10, 'eval_loss': 2.7, 'eval_perplexity': 14.9})
  log.close()
  assert calls == [
      ('init', dict(project='mine', name='run', config=cfg.to_dict(), dir=str(tmp_path / 'run'))),
      ('log', {k: v for k, v in row.items() if k != 'step'}, 10),
      ('log', {'eval_loss': 2.7, 'eval_perplexity': 14.9}, 10),
      ('finish',)]
  assert not (tmp_path / 'run' / 'tensorboard').exists()  # metrics.tensorboard=False

  def refuse(**kwargs):
    raise RuntimeError('api_key not configured (no-tty)\nmore detail')

  wandb.init = refuse
  with pytest.raises(ConfigError, match=r"^metrics.wandb_project='mine': W&B did not start "
                     r"\(api_key not configured \(no-tty\)\); run `wandb login`"):
    MetricsLog(str(tmp_path / 'run'), cfg)
