"""`python -m jaxllm.train` end to end, and the one-line errors bad input gets."""

import json
import os

import pytest

from conftest import run_cli


def test_tiny_config_trains_and_writes_metrics(tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli('--config', 'configs/tiny.py', '--config.train.steps=60',
                   '--config.train.log_every=20', f'--workdir={workdir}')
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows] == [20, 40, 60]
  assert {'loss', 'grad_norm', 'lr', 'step_time', 'tokens_per_sec'} <= rows[0].keys()
  assert rows[-1]['loss'] < rows[0]['loss'] - 0.5
  assert 'mesh  data=2 fsdp=2 pipe=1 tensor=2' in result.stdout
  assert json.loads((workdir / 'config.json').read_text())['mesh']['tensor'] == 2


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
    'kv_heads_vs_tensor': (['--config.mesh.data=1', '--config.mesh.fsdp=1',
                            '--config.mesh.tensor=8'], 'model.num_kv_heads'),
    'heads_vs_kv_heads': (['--config.model.num_heads=5'], 'model.num_heads'),
    'global_batch': (['--config.train.global_batch=6'], 'train.global_batch'),
    'micro_batches': (['--config.train.micro_batches=3'], 'train.global_batch'),
    'unknown_field': (['--config.model.num_layerz=2'], 'num_layerz'),
    'unknown_section': (['--config.modle.num_layers=2'], 'modle'),
    'bad_value': (['--config.mesh.data=two'], 'mesh.data'),
    'missing_data': (['--config.data.path=/nonexistent/corpus/*.txt'], 'data.path'),
    'remat_policy': (['--config.model.remat=sometimes'], 'model.remat'),
    'two_fill_axes': (['--config.mesh.data=-1', '--config.mesh.fsdp=-1'], 'mesh'),
    'layers_vs_stages': (['--config.mesh.pipe=8', '--config.mesh.data=1', '--config.mesh.fsdp=1',
                          '--config.mesh.tensor=1'], 'model.num_layers'),
    'microbatches_vs_stages': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                                '--config.pipeline.microbatches=1'], 'pipeline.microbatches'),
    'pipeline_batch': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                        '--config.pipeline.microbatches=3'], 'pipeline.microbatches'),
    'circular_repeats': (['--config.mesh.pipe=2', '--config.mesh.fsdp=1',
                          '--config.pipeline.schedule=circular'], 'pipeline.repeats'),
}


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


def test_missing_config_file_is_one_readable_line():
  result = run_cli('--config', 'configs/nope.py')
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      'error: --config configs/nope.py: no such file; pass a file from configs/, '
      'e.g. configs/tiny.py.']
