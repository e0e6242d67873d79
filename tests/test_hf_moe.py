"""Hugging Face mixtures of experts (Mixtral, Qwen3-MoE) in and out, against transformers."""

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import paired_leaves, run_cli_in_process, small_config
from jaxllm import hf
from jaxllm.config import ConfigError, default_config
from jaxllm.decode import generate
from jaxllm.hf.__main__ import main as hf_command
from jaxllm.hf.experts import moe_fields, moe_layers_pattern
from jaxllm.hf.layout import hf_names, layouts
from jaxllm.train import train
from test_hf import RULES, hf_logits, hf_tensors, mesh_of, our_logits

VOCAB = 96


def _perturb(model):
  """Every parameter moved off its init: weights larger than usual, norm scales not ones, so a
  misplaced tensor (an expert's gate for its up) moves the logits far beyond the tolerance."""
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith('norm.weight')
              else 0.15 * torch.randn_like(p))
  return model.eval()


def save_mixtral(directory, fused=False, dtype=torch.float32):
  """A tiny random MixtralForCausalLM (4 experts, top-2) saved as safetensors: per-expert
  tensors as save_pretrained writes them, or (`fused`) transformers 5's fused [E, ...]
  tensors, written from the model's own state."""
  config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
  return _save(MixtralForCausalLM(config), directory, fused, dtype)


def save_qwen3_moe(directory, fused=False, dtype=torch.float32):
  """A tiny random Qwen3MoeForCausalLM (4 experts of width 12, top-2, renormalised; q and k
  normed per head) whose first layer is dense and the next three MoE, saved as
  `save_mixtral` saves its model."""
  config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                          moe_intermediate_size=12, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6,
                          max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
  return _save(Qwen3MoeForCausalLM(config), directory, fused, dtype)


def _save(model, directory, fused, dtype):
  model = _perturb(model).to(dtype)
  model.save_pretrained(directory, safe_serialization=True)
  if fused:
    for file in directory.glob('*.safetensors'):
      file.unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              directory / 'model.safetensors', metadata={'format': 'pt'})
  return model


def hf_greedy(model, prompt, steps: int) -> list[int]:
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].tolist()


PROMPT = [5, 17, 33, 2, 80, 41]

# Each expert layout a checkpoint may hold: per-expert tensors read on one device, the fused 3D
# ones on a mesh that splits the experts over fsdp and their hidden units over tensor.
LAYOUTS = pytest.mark.parametrize('layout, axes', [
    ('per_expert', dict()),
    ('fused', dict(fsdp=2, tensor=2)),
], ids=['per_expert-one_device', 'fused-fsdp2_tensor2'])


@pytest.mark.slow  # about 15 s each: the decode loop compiles
@LAYOUTS
def test_mixtral_logits_and_greedy_tokens_equal_transformers(layout, axes, tmp_path):
  """Both expert layouts read; on a mesh the experts split over fsdp, their hidden units
  over tensor."""
  reference = save_mixtral(tmp_path, fused=layout == 'fused')
  names = hf_tensors(tmp_path).keys()
  assert ('model.layers.0.mlp.experts.gate_up_proj' in names) == (layout == 'fused')
  assert ('model.layers.0.block_sparse_moe.experts.3.w3.weight' in names) == (layout != 'fused')
  mesh = mesh_of(**axes)
  model_cfg, params = hf.load(str(tmp_path), mesh, RULES)
  assert (model_cfg.moe.experts, model_cfg.moe.top_k, model_cfg.moe.renormalize) == (4, 2, True)
  assert model_cfg.rope_theta == 1e6
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  np.testing.assert_allclose(our_logits(model_cfg, params, mesh, tokens),
                             hf_logits(reference, tokens), atol=1e-4, rtol=1e-4)
  assert generate(model_cfg, params, PROMPT, 10, greedy=True) == hf_greedy(reference, PROMPT, 10)


@pytest.mark.slow  # about 15 s each: the decode loop compiles
@LAYOUTS
def test_qwen3_moe_logits_and_greedy_tokens_equal_transformers(layout, axes, tmp_path):
  """Qwen3-MoE's q/k norms, its dense first layer and its experts of their own width, in
  both expert layouts; on a mesh the experts split over fsdp, their hidden units over
  tensor."""
  reference = save_qwen3_moe(tmp_path, fused=layout == 'fused')
  names = hf_tensors(tmp_path).keys()
  assert ('model.layers.1.mlp.experts.gate_up_proj' in names) == (layout == 'fused')
  assert ('model.layers.1.mlp.experts.3.up_proj.weight' in names) == (layout != 'fused')
  assert 'model.layers.0.self_attn.q_norm.weight' in names
  mesh = mesh_of(**axes)
  model_cfg, params = hf.load(str(tmp_path), mesh, RULES)
  assert model_cfg.qk_norm
  assert (model_cfg.moe.experts, model_cfg.moe.top_k, model_cfg.moe.mlp_dim,
          model_cfg.moe.first_dense, model_cfg.moe.every) == (4, 2, 12, 1, 1)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  np.testing.assert_allclose(our_logits(model_cfg, params, mesh, tokens),
                             hf_logits(reference, tokens), atol=1e-4, rtol=1e-4)
  assert generate(model_cfg, params, PROMPT, 10, greedy=True) == hf_greedy(reference, PROMPT, 10)


def test_qwen3_moe_exports_what_transformers_reads(tmp_path):
  """A Qwen3-MoE checkpoint read and written back: the same config keys that decide the model
  and the same tensors by name, which transformers reads into a model of the same logits."""
  hf_dir, out_dir = tmp_path / 'hf', tmp_path / 'out'
  reference = save_qwen3_moe(hf_dir)
  model_cfg, params = hf.load(str(hf_dir), mesh_of(), RULES)
  hf.export(params, model_cfg, str(out_dir), 'float32', hf.Vocabulary(bos_id=1, eos_id=2))
  config = json.loads((out_dir / 'config.json').read_text())
  assert (config['architectures'], config['model_type']) == (['Qwen3MoeForCausalLM'],
                                                             'qwen3_moe')
  assert hf.model_config(str(out_dir)) == model_cfg
  written, want = hf_tensors(out_dir), hf_tensors(hf_dir)
  assert sorted(written) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(written[name], want[name], err_msg=name)
  exported = Qwen3MoeForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(reference, tokens),
                             atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_mixtral_fine_tuned_on_a_mesh_exports_what_transformers_reads(tmp_path):
  """From a Mixtral checkpoint on data×fsdp×tensor (experts split over fsdp), two steps, the
  checkpoint exported by the command line: transformers reads the trained weights (per-expert
  tensors, as save_pretrained writes them) and its greedy tokens equal jaxllm's from the
  trained parameters on the mesh, and `python -m jaxllm.generate --hf` of the export."""
  hf_dir, run_dir, out_dir = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'out'
  save_mixtral(hf_dir)
  cfg = small_config(data=2, fsdp=2, tensor=2)
  cfg.model = hf.model_config(str(hf_dir))
  cfg.init_from = f'hf:{hf_dir}'
  cfg.train.update(steps=2, global_batch=8)
  cfg.optim.update(lr=1e-2, warmup_steps=0)
  cfg.data.seq_len = 16
  state, history = train(cfg, str(run_dir), devices=jax.devices()[:8])
  assert history[-1]['loss'] < history[0]['loss']

  hf_command(['jaxllm.hf', 'export', '--checkpoint', str(run_dir / 'checkpoints'),
              '--out', str(out_dir)])
  config = json.loads((out_dir / 'config.json').read_text())
  assert (config['model_type'], config['num_local_experts']) == ('mixtral', 4)
  assert sorted(hf_tensors(out_dir)) == sorted(hf_tensors(hf_dir))  # save_pretrained's names
  exported = MixtralForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
  w2 = exported.model.layers[1].mlp.experts.down_proj[3].detach().numpy()  # [D, F]
  trained = np.asarray(state.params['blocks']['mlp']['w_down_EFD'][...][1, 3]).T
  np.testing.assert_array_equal(w2, trained)

  want = hf_greedy(exported, PROMPT, 8)
  assert generate(cfg.model, state.params, PROMPT, 8, greedy=True) == want
  by_hf = run_cli_in_process('--hf', str(out_dir), '--prompt_ids', ','.join(map(str, PROMPT)),
                             '--max_new_tokens', '8', '--greedy', '--print_ids',
                             module='jaxllm.generate')
  assert by_hf.returncode == 0, by_hf.stderr[-2000:]
  assert [int(t) for t in by_hf.stdout.strip().splitlines()[-1].split(',')] == want


QWEN3_MOE_LAYERS = {
    'every_layer': dict(),
    'every_second': dict(decoder_sparse_step=2),
    'first_dense_then_every_second': dict(decoder_sparse_step=2, mlp_only_layers=[0, 1]),
    'first_dense': dict(mlp_only_layers=[0]),
}


@pytest.mark.parametrize('case', QWEN3_MOE_LAYERS)
def test_qwen3_moe_layers_and_tensor_names_are_transformers(case, tmp_path):
  """Which Qwen3-MoE layers have experts (mlp_only_layers, decoder_sparse_step) becomes
  model.moe.first_dense and every, and our layout names every tensor save_pretrained writes
  (and its fused form), with their shapes: all but q_norm and k_norm, which the attention
  lacks."""
  config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                          moe_intermediate_size=12, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, **QWEN3_MOE_LAYERS[case])
  model = Qwen3MoeForCausalLM(config)
  model.save_pretrained(tmp_path, safe_serialization=True)
  hf_json = json.loads((tmp_path / 'config.json').read_text())
  fields = moe_fields(hf_json, 'qwen3_moe', 'config.json')
  want = [type(layer.mlp).__name__ == 'Qwen3MoeSparseMoeBlock' for layer in model.model.layers]
  assert moe_layers_pattern(6, fields['first_dense'], fields['every']) == want
  assert (fields['mlp_dim'], fields['renormalize']) == (12, True)

  model_cfg = default_config().model
  model_cfg.update(vocab_size=VOCAB, embed_dim=32, num_layers=6, num_heads=4, num_kv_heads=2,
                   head_dim=8, mlp_dim=40, qk_norm=True)
  model_cfg.moe.update(fields)
  written = {name: tuple(t.shape) for name, t in hf_tensors(tmp_path).items()}
  for fused, tensors in ((False, written), (True, {k: tuple(v.shape)
                                                   for k, v in model.state_dict().items()})):
    ours = {name: layout.hf_shape for layout in layouts(model_cfg, 'qwen3_moe', fused).values()
            for name in hf_names(layout)}
    assert ours == tensors


BAD_MIXTRAL = {
    'sliding window': (dict(sliding_window=4096), 'sliding_window=4096 is not supported'),
    'jitter': (dict(router_jitter_noise=0.1), 'router_jitter_noise=0.1 is not supported'),
}


@pytest.mark.parametrize('problem', BAD_MIXTRAL)
def test_unsupported_mixtral_is_a_one_line_config_error(problem, tmp_path):
  save_mixtral(tmp_path)
  changes, message = BAD_MIXTRAL[problem]
  path = tmp_path / 'config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
  with pytest.raises(ConfigError, match=message) as error:
    hf.load(str(tmp_path), mesh_of(), RULES)
  assert '\n' not in str(error.value)


def test_export_refuses_a_router_no_architecture_has(tmp_path):
  cfg = small_config()
  cfg.model.update(max_position=64)
  cfg.model.moe.update(experts=4, top_k=2, router='sigmoid')
  with pytest.raises(ConfigError, match=r"model\.moe\.router='sigmoid'") as error:
    hf.export({}, cfg.model, str(tmp_path / 'out'), 'float32', hf.Vocabulary())
  assert '\n' not in str(error.value) and not (tmp_path / 'out').exists()


def test_export_of_qwen3_moe_routing_without_its_attention_is_refused(tmp_path):
  """Experts after a dense first layer are Qwen3-MoE's alone, whose attention norms q and k:
  without model.qk_norm no architecture computes the model."""
  cfg = small_config()
  cfg.model.update(max_position=64)
  cfg.model.moe.update(experts=4, top_k=2, first_dense=1)
  with pytest.raises(ConfigError, match=r'set model\.qk_norm=True') as error:
    hf.export({}, cfg.model, str(tmp_path / 'out'), 'float32', hf.Vocabulary())
  assert '\n' not in str(error.value) and not (tmp_path / 'out').exists()
