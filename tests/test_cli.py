"""`python -m jaxllm.train` end to end, and the one-line errors bad input gets."""

import json
import math
import os

import pytest

from conftest import run_cli, small_config
from jaxllm.config import ConfigError, validate


def test_tiny_config_trains_evaluates_and_writes_metrics(tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', '--config.train.steps=60',
                   '--config.train.log_every=20', '--config.data.eval_fraction=0.05',
                   '--config.eval.every=30', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  rows = [r for r in logged if 'loss' in r]
  evals = [r for r in logged if 'eval_loss' in r]
  assert [r['step'] for r in rows] == [20, 40, 60]
  assert [r['step'] for r in evals] == [30, 60]
  assert evals[1]['eval_loss'] < evals[0]['eval_loss']
  assert all(abs(r['eval_perplexity'] - math.exp(r['eval_loss'])) < 1e-6 * r['eval_perplexity']
             for r in evals)
  assert 'eval_loss' in result.stdout
  assert {'loss', 'grad_norm', 'lr', 'step_time', 'tokens_per_sec'} <= rows[0].keys()
  # Only the last interval saved (checkpoint.every=100 > steps), and the log says so.
  assert [r['save_time'] > 0 for r in rows] == [False, False, True]
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['60']
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5
  assert 'mesh  data=2 fsdp=2 pipe=1 tensor=2' in result.stdout
  assert json.loads((workdir / 'config.json').read_text())['mesh']['tensor'] == 2


def test_tiny_config_trains_with_every_extra_split(tmp_path):
  """One K/V head over tensor=2 (replicated), the sequence split over fsdp (context
  parallelism) and the residual stream over tensor too (sequence parallelism), ZeRO-1 over
  data: all from the command line, on tiny's data=2 × fsdp=2 × tensor=2."""
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', '--config.model.num_kv_heads=1',
                   "--config.sharding.rules.batch=('data',)",
                   "--config.sharding.rules.seq=('fsdp',)",
                   "--config.sharding.rules.act_seq=('tensor',)", '--config.sharding.zero=1',
                   '--config.train.steps=40', '--config.train.log_every=20', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5
  rules = json.loads((workdir / 'config.json').read_text())['sharding']['rules']
  assert (rules['seq'], rules['act_seq'], rules['kv_heads']) == (['fsdp'], ['tensor'], [])


def test_tiny_config_trains_with_a_pipeline(tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', '--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                   '--config.train.steps=40', '--config.train.log_every=20', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'pipeline gpipe: S=2 stages × R=1 repeats, M=4 micro-batches' in result.stdout
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5


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
}


@pytest.mark.parametrize('files,args,field', BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_data_or_checkpoint_input_is_one_readable_line(files, args, field, tmp_path):
  for name, text in files.items():
    if name.endswith('/'):
      (tmp_path / name).mkdir()
    else:
      (tmp_path / name).write_text(text)
  args = [a.format(tmp=tmp_path) for a in args]
  test_bad_input_is_one_readable_line(args, field, tmp_path)


@pytest.mark.parametrize('args,field', BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_readable_line(args, field, tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', *args, f'--workdir={workdir}')
  assert result.returncode != 0
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith('error: ') and field in lines[0]
  assert 'Traceback' not in result.stdout + result.stderr
  assert not os.path.exists(workdir)


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
]
ONE_DEVICE = dict(data=1, fsdp=1, pipe=1, tensor=1)


def with_fields(overrides: dict):
  """`small_config` with dotted fields set, as --config.a.b=v would set them."""
  cfg = small_config()
  for path, value in overrides.items():
    *sections, name = path.split('.')
    node = cfg
    for section in sections:
      node = node[section]
    node[name] = value
  return cfg


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


def test_missing_config_file_is_one_readable_line():
  result = run_cli('--config', 'configs/nope.py')
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
