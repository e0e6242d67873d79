"""Hugging Face Llama import and export, against transformers' LlamaForCausalLM (the other
families: test_families)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import paired_leaves, small_config
from jaxllm import hf
from jaxllm.config import ConfigError, default_config
from jaxllm.data.loader import synthetic_batch
from jaxllm.hf.__main__ import main as hf_command
from jaxllm.model import Transformer
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.train import setup, train

RULES = default_config().sharding.rules
LLAMA3_ROPE = dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)


def save_hf_model(directory, kv_heads=2, tied=False, rope_scaling=None, rope_theta=10_000.0,
                  dtype=torch.float32, max_shard_size=None):
  """A tiny random LlamaForCausalLM saved as safetensors. Its weights are larger than the
  usual init and its norm scales are not ones, so a misplaced tensor or a wrong rotary
  convention moves the logits well beyond the tolerance."""
  torch.manual_seed(0)
  config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                       rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tied)
  model = LlamaForCausalLM(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith('norm.weight')
              else 0.15 * torch.randn_like(p))
  model = model.to(dtype).eval()
  extra = {'max_shard_size': max_shard_size} if max_shard_size else {}
  model.save_pretrained(directory, safe_serialization=True, **extra)
  return model


def hf_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def our_logits(model_cfg, params, mesh, tokens) -> np.ndarray:
  with sharding_context(mesh, RULES):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))


def mesh_of(**axes):
  shape = {**dict(data=1, fsdp=1, pipe=1, tensor=1), **axes}
  return make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])


def hf_tensors(directory) -> dict[str, torch.Tensor]:
  tensors = {}
  for file in os.listdir(directory):
    if file.endswith('.safetensors'):
      tensors.update(load_file(os.path.join(directory, file)))
  return tensors


CASES = {
    'gqa': dict(hf=dict(kv_heads=2), mesh=dict()),
    'mha_tied': dict(hf=dict(kv_heads=4, tied=True), mesh=dict()),
    'llama3_rope': dict(hf=dict(kv_heads=2, rope_theta=500_000.0, rope_scaling=LLAMA3_ROPE),
                        mesh=dict()),
    'sharded_files_on_mesh': dict(hf=dict(kv_heads=2, max_shard_size='40KB'),
                                  mesh=dict(data=2, fsdp=2, tensor=2)),
}


@pytest.mark.parametrize('case', CASES)
def test_imported_logits_match_transformers(case, tmp_path):
  reference = save_hf_model(tmp_path, **CASES[case]['hf'])
  mesh = mesh_of(**CASES[case]['mesh'])
  model_cfg, params = hf.load(str(tmp_path), mesh, RULES)
  assert set(model_cfg.keys()) == set(default_config().model.keys())
  if case == 'llama3_rope':
    assert (model_cfg.rope_theta, model_cfg.rope_scaling.factor) == (500_000.0, 8.0)
  if case == 'sharded_files_on_mesh':
    assert os.path.exists(tmp_path / 'model.safetensors.index.json')
    # Each device holds only its block: vocab over tensor, embed over fsdp.
    assert params['embed_VD'].sharding.spec == P('tensor', 'fsdp')
    assert params['embed_VD'].addressable_shards[0].data.shape == (50, 32)
  tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
  np.testing.assert_allclose(our_logits(model_cfg, params, mesh, tokens),
                             hf_logits(reference, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_export_reproduces_the_hf_checkpoint_and_round_trips(dtype, tmp_path):
  original, exported = tmp_path / 'original', tmp_path / 'exported'
  save_hf_model(original, tied=True, rope_theta=500_000.0, rope_scaling=LLAMA3_ROPE, dtype=dtype)
  mesh = mesh_of(fsdp=4, tensor=2)
  model_cfg, params = hf.load(str(original), mesh, RULES)
  dtype_name = str(dtype).removeprefix('torch.')
  hf.export(params, model_cfg, str(exported), dtype_name, hf.vocabulary(str(original)),
            max_shard_bytes=40_000)

  assert os.path.exists(exported / 'model.safetensors.index.json')
  config = json.loads((exported / 'config.json').read_text())
  original_config = json.loads((original / 'config.json').read_text())
  assert config['torch_dtype'] == dtype_name
  for key in ('max_position_embeddings', 'bos_token_id', 'eos_token_id'):
    assert config[key] == original_config[key], key
  assert config['rope_scaling']['rope_type'] == 'llama3' and config['tie_word_embeddings']
  got, want = hf_tensors(exported), hf_tensors(original)
  assert got.keys() == want.keys()
  for name in want:
    assert torch.equal(got[name], want[name]), name

  again_cfg, again = hf.load(str(exported), mesh, RULES)
  assert again_cfg.to_dict() == model_cfg.to_dict()
  for a, b in paired_leaves(again, params):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # transformers reads our config.json (old-style rope_scaling, torch_dtype) as meaning what
  # its own config.json means.
  tokens = np.random.default_rng(1).integers(0, 100, (2, 16))
  reread = lambda d: hf_logits(LlamaForCausalLM.from_pretrained(d, dtype=dtype).eval(), tokens)
  np.testing.assert_array_equal(reread(exported), reread(original))

  with pytest.raises(ConfigError, match='already holds .*safetensors'):
    hf.export(params, model_cfg, str(exported), dtype_name, hf.Vocabulary())


@pytest.mark.slow
def test_init_from_hf_trains_from_its_weights_and_exports_the_result(tmp_path):
  hf_dir, run_dir, out_dir = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'out'
  reference = save_hf_model(hf_dir)
  cfg = small_config(fsdp=2, tensor=2)
  cfg.model = hf.model_config(str(hf_dir))
  cfg.init_from = f'hf:{hf_dir}'
  cfg.train.steps = 2
  cfg.data.seq_len = 16
  state, history = train(cfg, str(run_dir), devices=jax.devices()[:4])

  # Step 1's loss is computed before any update: it must be HF's loss on that batch.
  batch = synthetic_batch(cfg, cfg.train.global_batch)
  logits = torch.tensor(hf_logits(reference, batch['inputs']))
  hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              torch.tensor(batch['targets']).reshape(-1).long())
  assert history[0]['loss'] == pytest.approx(float(hf_loss), rel=1e-5)
  assert history[1]['loss'] < history[0]['loss']

  # The checkpoint of step 2, exported by the command line, holds the trained parameters.
  hf_command(['jaxllm.hf', 'export', '--checkpoint', str(run_dir / 'checkpoints'),
              '--out', str(out_dir)])
  _, exported = hf.load(str(out_dir), mesh_of(), RULES)
  for a, b in paired_leaves(exported, state.params):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _changed_fraction(params, initial) -> float:
  """The fraction of parameter elements that differ from their initial values."""
  changed = sum(int(np.sum(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
                for a, b in paired_leaves(params, initial))
  return changed / sum(np.size(a) for a in jax.tree.leaves(initial))


def _update(params, initial) -> np.ndarray:
  """All parameters' change in training, as one fp32 vector."""
  return np.concatenate([(np.asarray(a, np.float32) - np.asarray(b, np.float32)).ravel()
                         for a, b in paired_leaves(params, initial)])


def _fine_tune(hf_dir, run_dir, devices, optim=None, **model):
  """20 steps at lr 1e-5 from the checkpoint: (config, first params, last state, losses)."""
  cfg = small_config(**{'data': 2, 'fsdp': 2, 'tensor': 2} if len(devices) == 8 else {})
  cfg.model = hf.model_config(str(hf_dir))
  cfg.model.update(**model)
  cfg.init_from = f'hf:{hf_dir}'
  cfg.train.update(steps=20, global_batch=8)
  cfg.optim.update(lr=1e-5, warmup_steps=0, **(optim or {}))
  cfg.data.seq_len = 16
  initial = jax.tree.map(np.asarray, setup(cfg, devices).state.params)
  state, history = train(cfg, str(run_dir), devices=devices)
  return cfg, initial, state, [row['loss'] for row in history]


def _fp32_loss(cfg, params) -> float:
  """The mean cross-entropy of `params` on the run's (synthetic, fixed) batch, in fp32."""
  model_cfg = ConfigDict(cfg.model)
  model_cfg.update(dtype='float32', param_dtype='float32', attention='xla')
  batch = synthetic_batch(cfg, cfg.train.global_batch)
  host = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  logits = torch.tensor(our_logits(model_cfg, host, mesh_of(), batch['inputs']))
  return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(batch['targets']).reshape(-1).long()))


@pytest.mark.slow
@pytest.mark.parametrize('devices', [1, 8], ids=['one_device', 'data2_fsdp2_tensor2'])
def test_a_bf16_checkpoint_fine_tunes_with_fp32_master_weights(devices, tmp_path):
  """A bfloat16 checkpoint (as Llamas are released) computes in bf16 with fp32 master weights,
  moments and accumulation. At lr 1e-5 each update is below bf16's spacing (2⁻⁸ relative), so
  bf16 master weights would hardly move (the control), where fp32 ones move as an fp32 run's."""
  save_hf_model(tmp_path / 'hf', dtype=torch.bfloat16)
  model_cfg = hf.model_config(str(tmp_path / 'hf'))
  assert (model_cfg.dtype, model_cfg.param_dtype) == ('bfloat16', 'float32')
  devices = jax.devices()[:devices]
  cfg, initial, state, losses = _fine_tune(tmp_path / 'hf', tmp_path / 'run', devices)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype('float32')}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and {x.dtype for x in moments} == {np.dtype('float32')}
  assert _changed_fraction(state.params, initial) > 0.95

  # The reference: fp32 compute and master weights from the same weights, on one device.
  _, _, want, want_losses = _fine_tune(tmp_path / 'hf', tmp_path / 'fp32', devices[:1],
                                       dtype='float32', attention='xla')
  got_update, want_update = _update(state.params, initial), _update(want.params, initial)
  cosine = got_update @ want_update / np.linalg.norm(got_update) / np.linalg.norm(want_update)
  assert cosine > 0.95
  assert np.linalg.norm(got_update) == pytest.approx(np.linalg.norm(want_update), rel=0.05)
  # The first step's loss is bf16's forward of the checkpoint's weights; the trained master
  # weights have an fp32 loss as low as the reference's (which fell by 0.075 in 20 steps).
  assert losses[0] == pytest.approx(want_losses[0], rel=1e-2)
  assert _fp32_loss(cfg, state.params) == pytest.approx(want_losses[-1], abs=5e-3)

  if len(devices) > 1:
    return  # the control and the export are one device's
  # The control: the same run in bf16 master weights and moments hardly moves.
  _, _, bf16_state, _ = _fine_tune(tmp_path / 'hf', tmp_path / 'bf16', devices,
                                   dict(state_dtype='bfloat16'), param_dtype='bfloat16')
  assert {x.dtype for x in jax.tree.leaves(bf16_state.params)} == {np.dtype('bfloat16')}
  assert _changed_fraction(bf16_state.params, initial) < 0.1

  # Exported, by default in the run's compute dtype (bf16, as it came); or in fp32 on request.
  for dtype, flag in ((torch.bfloat16, []), (torch.float32, ['--dtype', 'float32'])):
    out = tmp_path / f'out-{dtype}'
    hf_command(['jaxllm.hf', 'export', '--checkpoint', str(tmp_path / 'run' / 'checkpoints'),
                '--out', str(out), *flag])
    assert json.loads((out / 'config.json').read_text())['torch_dtype'] == str(dtype)[6:]
    exported = LlamaForCausalLM.from_pretrained(out, dtype=dtype)
    weight = exported.model.layers[0].mlp.down_proj.weight.detach()
    master = np.asarray(state.params['blocks']['mlp']['w_down_FD'][...][0]).T
    assert weight.dtype == dtype
    np.testing.assert_array_equal(weight.float().numpy(),
                                  torch.tensor(master).to(dtype).float().numpy())


def test_init_from_hf_of_another_shape_names_the_field(tmp_path):
  save_hf_model(tmp_path)
  cfg = small_config()
  cfg.model = hf.model_config(str(tmp_path))
  cfg.model.num_layers = 4
  cfg.init_from = f'hf:{tmp_path}'
  with pytest.raises(ConfigError, match=r'model\.num_layers=4 but the Hugging Face checkpoint '
                                        r'.* has num_layers=2; set model\.num_layers=2'):
    setup(cfg, jax.devices()[:1])


def _edit_config(directory, **changes):
  path = directory / 'config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _drop_tensor(directory, name):
  tensors = load_file(directory / 'model.safetensors')
  del tensors[name]
  save_file(tensors, directory / 'model.safetensors', metadata={'format': 'pt'})


BAD_INPUTS = {
    'no directory': (lambda d: shutil.rmtree(d), 'is not a directory'),
    'no config.json': (lambda d: os.remove(d / 'config.json'), r'config\.json does not exist'),
    'not a family': (lambda d: _edit_config(d, model_type='gpt2',
                                            architectures=['GPT2LMHeadModel']),
                     "model_type='gpt2'.* is not supported; jaxllm reads and writes "
                     r'LlamaForCausalLM \(llama\), Qwen2ForCausalLM.*MixtralForCausalLM '
                     r'\(mixtral\), Qwen3MoeForCausalLM \(qwen3_moe\)'),
    'soft-capping': (lambda d: _edit_config(d, final_logit_softcapping=30.0),
                     r'final_logit_softcapping=30\.0 is not supported'),
    'no weights': (lambda d: os.remove(d / 'model.safetensors'), r'holds no \*\.safetensors'),
    'missing tensor': (lambda d: _drop_tensor(d, 'model.layers.1.mlp.up_proj.weight'),
                       "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    'shape mismatch': (lambda d: _edit_config(d, intermediate_size=256),
                       r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\] but "
                       r'config\.json implies \[256, 64\]'),
}


@pytest.mark.parametrize('problem', BAD_INPUTS)
def test_bad_checkpoint_is_a_one_line_config_error(problem, tmp_path):
  directory = tmp_path / 'hf'
  save_hf_model(directory)
  spoil, message = BAD_INPUTS[problem]
  spoil(directory)
  with pytest.raises(ConfigError, match=message) as error:
    hf.load(str(directory), mesh_of(), RULES)
  assert '\n' not in str(error.value)


@pytest.mark.parametrize('size', ['0', '-1', 'nan', 'inf'])
def test_export_needs_a_positive_shard_size(size, tmp_path):
  with pytest.raises(ConfigError, match=rf'--max-shard-gb={size}.* must be a positive number'):
    hf_command(['hf', 'export', '--checkpoint', str(tmp_path / 'run'), '--out',
                str(tmp_path / 'out'), '--max-shard-gb', size])
  assert not (tmp_path / 'out').exists()
