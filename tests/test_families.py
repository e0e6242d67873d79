"""Qwen3, Qwen2/2.5, Mistral and Gemma 3: tiny random transformers models of each family
against jaxllm (logits, greedy generation past the sliding window, on one device and with
the heads split over tensor), their export back, a fine-tune on a mesh that transformers
reads back, and each family's options on every kind of mesh against one device."""

import json
import re

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from ml_collections import ConfigDict
from transformers import (AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from conftest import once_per_run, paired_leaves, small_config, step_gradients, text_config
from jaxllm import hf
from jaxllm.config import ConfigError, default_config
from jaxllm.decode import generate
from jaxllm.generate import main as generate_command
from jaxllm.hf.__main__ import main as hf_command
from jaxllm.model import Transformer
from jaxllm.pipeline.spec import chunk_first_layer, to_stage_order
from jaxllm.train import train
from jaxllm.validate import validate
from test_hf import RULES, hf_logits, hf_tensors, mesh_of, our_logits

WINDOW = 4  # every sequence below is several windows long
VOCAB = 100
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Each family as its config class builds it: Qwen2 with Qwen's sliding layers (the last two),
# Gemma 3 with a pattern of period 3 over its 4 layers and linear RoPE scaling on the full one.
FAMILIES = {
    'qwen3': (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=True)),
    'qwen2': (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, max_window_layers=2,
                                                  sliding_window=WINDOW)),
    'mistral': (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    'gemma3': (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24,
        rope_scaling=dict(rope_type='linear', factor=4.0))),
}
# What hf.model_config makes of each: the fields it sets beside the shapes.
EXPECTED = {
    'qwen3': dict(qk_norm=True, tie_embeddings=True, layer_types=('full',)),
    'qwen2': dict(qkv_bias=True, layer_types=('full', 'full', 'sliding', 'sliding'),
                  sliding_window=WINDOW),
    'mistral': dict(layer_types=('sliding',), sliding_window=WINDOW),
    'gemma3': dict(qk_norm=True, mlp_activation='gelu_tanh', norm_zero_centered=True,
                   post_norms=True, scale_embeddings=True, attention_scale=24**-0.5,
                   layer_types=('sliding', 'sliding', 'full'), sliding_window=WINDOW,
                   rope_theta=1e6, sliding_rope_theta=1e4, tie_embeddings=True),
}
# One device, and the heads split over tensor (in the full suite: its compiles are slow).
MESHES_OF_HEADS = [dict(), pytest.param(dict(tensor=2), marks=pytest.mark.slow)]


def family_model(name, **config):
  """A tiny random transformers model of family `name` (`config` overriding SHAPES). Every
  parameter is perturbed (norm scales around their identity, biases and Gemma's
  zero-centred scales around 0), so a norm, bias or scale read wrongly moves the logits."""
  config_class, model_class, extra = FAMILIES[name]
  torch.manual_seed(0)
  model = model_class(config_class(**{**SHAPES, **config}, **extra))
  with torch.no_grad():
    for key, p in model.named_parameters():
      identity = 'norm' in key and name != 'gemma3'
      p.copy_(identity + 0.15 * torch.randn_like(p))
  return model.eval()


def save_family(name, directory, dtype=torch.float32):
  """`family_model(name)` saved with save_pretrained in `dtype`."""
  model = family_model(name).to(dtype)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope='session')
def family_checkpoint(tmp_path_factory):
  """(directory, transformers model) of each family's tiny fp32 checkpoint, made once."""
  made = {}

  def checkpoint(name):
    if name not in made:
      directory = tmp_path_factory.mktemp(f'hf_{name}')
      made[name] = directory, save_family(name, directory)
    return made[name]
  return checkpoint


def tokens(batch=2, length=4 * WINDOW, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


@pytest.mark.parametrize('mesh', MESHES_OF_HEADS, ids=['one_device', 'tensor2'])
@pytest.mark.parametrize('name', FAMILIES)
def test_logits_equal_transformers(name, mesh, family_checkpoint):
  """fp32 logits as transformers computes them; and the family's window, where it has one,
  is what makes them so (without it they are far off)."""
  directory, reference = family_checkpoint(name)
  mesh = mesh_of(**mesh)
  model_cfg, params = hf.load(str(directory), mesh, RULES)
  for field, value in EXPECTED[name].items():
    assert model_cfg[field] == value, field
  want = hf_logits(reference, tokens())
  np.testing.assert_allclose(our_logits(model_cfg, params, mesh, tokens()), want,
                             atol=1e-4, rtol=1e-4)
  if model_cfg.sliding_window:
    unwindowed = ConfigDict(model_cfg)
    unwindowed.update(layer_types=('full',), sliding_window=0)
    assert np.abs(our_logits(unwindowed, params, mesh, tokens()) - want).max() > 1e-2


@pytest.mark.parametrize('mesh', MESHES_OF_HEADS, ids=['one_device', 'tensor2'])
@pytest.mark.parametrize('name', FAMILIES)
def test_greedy_generation_equals_transformers_past_the_window(name, mesh, family_checkpoint):
  """Prompts of two lengths in one batch (left-padded), each decoded greedily for 5 windows
  with the KV cache: token for token transformers' `generate`."""
  directory, reference = family_checkpoint(name)
  mesh = mesh_of(**mesh)
  model_cfg, params = hf.load(str(directory), mesh, RULES)
  prompts = [tokens(1, 3, seed=1)[0].tolist(), tokens(1, WINDOW + 3, seed=2)[0].tolist()]
  new = 5 * WINDOW
  ours = generate(model_cfg, params, prompts, new, greedy=True)
  for prompt, got in zip(prompts, ours):
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    assert got == want[0, len(prompt):].tolist()


def test_packed_documents_see_their_own_window(family_checkpoint, one_device):
  """Documents packed in a row (positions restarting, segment ids apart) attend within
  themselves and the window, as each alone: Gemma 3's sliding and full layers both."""
  directory, _ = family_checkpoint('gemma3')
  model_cfg, params = hf.load(str(directory), one_device, RULES)
  lengths = (3 * WINDOW - 1, WINDOW + 2, 2 * WINDOW)
  docs = [tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
  row_BT = np.concatenate(docs)[None]
  positions_BT = np.concatenate([np.arange(n) for n in lengths])[None]
  segment_ids_BT = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  forward = jax.jit(lambda p, *rows: nnx.merge(graphdef, p)(*rows))
  packed = np.asarray(forward(params, row_BT, positions_BT, segment_ids_BT))
  alone = [np.asarray(forward(params, d[None]))[0] for d in docs]
  np.testing.assert_allclose(packed[0], np.concatenate(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('name', FAMILIES)
def test_export_writes_the_family_back(name, dtype, tmp_path):
  """Read onto a mesh and exported: the family's config.json and the very tensors
  save_pretrained wrote, in its dtype; transformers computes from them what it computed
  from its own."""
  original, exported = tmp_path / 'original', tmp_path / 'exported'
  save_family(name, original, dtype)
  model_cfg, params = hf.load(str(original), mesh_of(fsdp=2, tensor=2), RULES)
  dtype_name = str(dtype).removeprefix('torch.')
  hf.export(params, model_cfg, str(exported), dtype_name, hf.vocabulary(str(original)))
  got, want = hf_tensors(exported), hf_tensors(original)
  assert got.keys() == want.keys()
  for key in want:
    assert torch.equal(got[key], want[key]), key
  config, own = (json.loads((d / 'config.json').read_text()) for d in (exported, original))
  for key in ('model_type', 'architectures', 'sliding_window', 'layer_types', 'head_dim',
              'query_pre_attn_scalar', 'tie_word_embeddings'):
    assert key not in own or config[key] == own[key], key
  assert hf.model_config(str(exported)).to_dict() == hf.model_config(str(original)).to_dict()
  read = lambda d: hf_logits(AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval(), tokens())
  np.testing.assert_array_equal(read(exported), read(original))


@pytest.mark.slow
@pytest.mark.parametrize('name', FAMILIES)
def test_a_fine_tune_on_a_mesh_exports_what_jaxllm_generates(name, family_checkpoint, capsys,
                                                            tmp_path):
  """init_from='hf:' on data=2 × fsdp=2 × tensor=2, two steps; the checkpoint exported by the
  command line and read by transformers decodes greedily the tokens `jaxllm.generate` decodes
  from the checkpoint itself, past the window."""
  directory, _ = family_checkpoint(name)
  cfg = small_config(data=2, fsdp=2, tensor=2)
  cfg.model = hf.model_config(str(directory))
  cfg.init_from = f'hf:{directory}'
  cfg.train.steps = 2
  cfg.data.seq_len = 4 * WINDOW
  state, history = train(cfg, str(tmp_path / 'run'), devices=jax.devices())
  assert history[1]['loss'] < history[0]['loss']
  checkpoints, out = tmp_path / 'run' / 'checkpoints', tmp_path / 'exported'
  hf_command(['jaxllm.hf', 'export', '--checkpoint', str(checkpoints), '--out', str(out)])
  exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(exported) is FAMILIES[name][1]

  prompt, new = tokens(1, WINDOW + 1, seed=3)[0].tolist(), 4 * WINDOW
  capsys.readouterr()
  generate_command(['generate', '--checkpoint', str(checkpoints), '--prompt_ids',
                    ','.join(map(str, prompt)), '--max_new_tokens', str(new), '--greedy',
                    '--print_ids'])
  ours = [int(i) for i in capsys.readouterr().out.split()[-1].split(',')]
  theirs = exported.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
  assert ours == theirs[0, len(prompt):].tolist()


# Each family's options on a small model (`text_config`), and a mesh that exercises them: the
# window under context parallelism, Gemma 3's per-layer pattern through both pipelines'
# stage order, remat around the per-layer choice of attention.
GEMMA = dict(qk_norm=True, mlp_activation='gelu_tanh', norm_zero_centered=True, post_norms=True,
             scale_embeddings=True, attention_scale=0.3, layer_types=('sliding', 'sliding', 'full'),
             sliding_window=WINDOW, sliding_rope_theta=100.0, tie_embeddings=True)
MODELS = {
    'qwen3': dict(qk_norm=True, tie_embeddings=True),
    'qwen2': dict(qkv_bias=True, layer_types=('full', 'sliding'), sliding_window=WINDOW),
    'mistral': dict(layer_types=('sliding',), sliding_window=WINDOW),
    'gemma3': GEMMA,
}
CONTEXT_PARALLEL = dict(batch=('data',), seq=('fsdp',))
MESHES = {  # family, mesh, rules, pipeline, remat, (ZeRO stage, micro-batches)
    'qwen3_data2_fsdp2_tensor2_zero2': ('qwen3', dict(data=2, fsdp=2, tensor=2), {}, {}, 'none',
                                        (2, 2)),
    'qwen2_fsdp4_tensor2_remat': ('qwen2', dict(fsdp=4, tensor=2), {}, {}, 'dots_except_mlp',
                                  (0, 1)),
    'mistral_context_parallel': ('mistral', dict(fsdp=4, tensor=2), CONTEXT_PARALLEL, {}, 'none',
                                 (0, 1)),
    'gemma3_circular': ('gemma3', dict(data=2, pipe=2, tensor=2), {},
                        dict(schedule='circular', repeats=2), 'full', (0, 1)),
    'gemma3_interleaved_1f1b': ('gemma3', dict(data=2, pipe=2, tensor=2), {},
                                dict(schedule='interleaved_1f1b', repeats=2), 'none', (1, 1)),
}


def family_config(corpus, name, **mesh):
  cfg = text_config(corpus, **mesh)
  cfg.model.update(MODELS[name])
  if name == 'gemma3':
    cfg.model.rope_scaling.update(kind='linear', factor=4.0)
  return cfg


@pytest.fixture(scope='module')
def family_gradients(short_documents):
  """The first step's loss and gradients of each family's model on one device (fp32), on
  rows packed with several documents; made once per family per run."""
  made = {}

  def gradients(name):
    if name not in made:
      made[name] = once_per_run(
          f'test_families.family_gradients.{name}',
          lambda: step_gradients(family_config(short_documents, name), jax.devices()[:1]))
    return made[name]
  return gradients


@pytest.mark.slow
@pytest.mark.parametrize('case', MESHES)
def test_each_family_on_a_mesh_equals_one_device(case, short_documents, family_gradients):
  """Loss and every gradient tensor of the first step within 1e-5 (fp32) of one device's
  (ZeRO's reduce-scattered gradients gathered back)."""
  name, mesh, rules, pipeline, remat, (zero, micro_batches) = MESHES[case]
  ref_loss, ref_grads = family_gradients(name)
  cfg = family_config(short_documents, name, **mesh)
  cfg.sharding.rules.update(rules)
  cfg.sharding.zero = zero
  cfg.pipeline.update(pipeline)
  cfg.model.remat = remat
  cfg.train.micro_batches = micro_batches
  loss, grads = step_gradients(cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for got, want in paired_leaves(grads, ref_grads):
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize('stages,repeats', [(2, 1), (2, 2), (4, 2), (3, 3)])
def test_each_stage_chunk_knows_its_layers(stages, repeats):
  """What a pipeline stage takes as the first layer of each of its chunks is the layer the
  stage-major storage (`to_stage_order`) puts there."""
  layers = stages * repeats * 2
  stored = to_stage_order({'blocks': np.arange(layers)}, stages, repeats)['blocks']
  per_chunk = layers // (stages * repeats)
  for s in range(stages):
    for r in range(repeats):
      first = chunk_first_layer(s, r, stages, per_chunk)
      position = (s * repeats + r) * per_chunk  # where stage s's chunk r is stored
      assert list(stored[position:position + per_chunk]) == list(range(first, first + per_chunk))


BAD_FIELDS = [
    (dict(layer_types=('sliding',)), r"model\.sliding_window=0: the sliding layers"),
    (dict(sliding_window=512), r"model\.sliding_window=512 but no layer .* is 'sliding'"),
    (dict(layer_types=('local',), sliding_window=8), r"model\.layer_types=\('local',\) must be"),
    (dict(layer_types=('full',) * 5), r'must be 1 to model\.num_layers=4'),
    (dict(mlp_activation='gelu'), r"model\.mlp_activation='gelu' is unknown"),
    (dict(attention_scale=-1.0), r'model\.attention_scale=-1\.0 must be a positive number'),
    (dict(sliding_rope_theta=1e4), r"model\.sliding_rope_theta=10000\.0 but no layer"),
    (dict(rope_scaling=dict(kind='yarn')), r"model\.rope_scaling\.kind='yarn' is unknown"),
]


@pytest.mark.parametrize('fields, message', BAD_FIELDS)
def test_a_bad_family_field_is_one_line_naming_it(fields, message):
  cfg = small_config()
  scaling = fields.pop('rope_scaling', {})
  cfg.model.update(fields)
  cfg.model.rope_scaling.update(scaling)
  with pytest.raises(ConfigError, match=message) as error:
    validate(cfg, dict(data=1, fsdp=1, pipe=1, tensor=1))
  assert '\n' not in str(error.value)


@pytest.mark.parametrize('fields, message', [
    (dict(post_norms=True), r"model\.post_norms=True is Gemma 3's, which has qk_norm=True too"),
    (dict(qk_norm=True, qkv_bias=True), r'model\.qkv_bias=True with model\.qk_norm=True'),
    (dict(layer_types=('full', 'sliding'), sliding_window=8), r'mixes full and sliding layers'),
])
def test_a_model_no_family_computes_is_not_exported(fields, message, tmp_path):
  cfg = default_config().model
  cfg.update(fields)
  with pytest.raises(ConfigError, match=message) as error:
    hf.export({}, cfg, str(tmp_path), 'float32', hf.Vocabulary())
  assert '\n' not in str(error.value) and not list(tmp_path.iterdir())


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps(dict(model_type='phi3',
                                                        architectures=['Phi3ForCausalLM'])))
  with pytest.raises(ConfigError) as error:
    hf.model_config(str(tmp_path))
  message = str(error.value)
  assert "model_type='phi3'" in message and '\n' not in message
  assert re.findall(r'(\w+ForCausalLM) \((\w+)\)', message) == [
      ('LlamaForCausalLM', 'llama'), ('Qwen2ForCausalLM', 'qwen2'), ('Qwen3ForCausalLM', 'qwen3'),
      ('MistralForCausalLM', 'mistral'), ('Gemma3ForCausalLM', 'gemma3_text'),
      ('MixtralForCausalLM', 'mixtral'), ('Qwen3MoeForCausalLM', 'qwen3_moe')]


def test_param_counts_match_each_familys_model(one_device):
  from jaxllm.metrics import param_counts
  for name, fields in MODELS.items():
    cfg = small_config().model
    cfg.update(fields)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert param_counts(cfg)['total'] == sum(x.size for x in jax.tree.leaves(abstract)), name


def test_model_flops_count_each_layers_window():
  """Attention FLOPs per token by layer: a sliding layer whose window W is a quarter of the
  row counts W keys per query where a full layer counts T, and under the causal convention
  the band's W − W²/2T where a full layer counts T/2 (the mask's query-key pairs, counted
  here from a T×T mask); a window as long as the row is a full layer. The dense part is
  6 × the parameters either way."""
  from jaxllm.metrics import flops_per_token, param_counts
  T, W = 64, 16
  cfg = small_config().model
  cfg.update(layer_types=('sliding', 'sliding', 'full'), sliding_window=W)  # 3 sliding, 1 full
  full = small_config().model
  per_layer = 12 * cfg.num_heads * cfg.head_dim
  dense = 6 * param_counts(cfg)['flops']
  assert dense == 6 * param_counts(full)['flops']
  behind_TT = np.arange(T)[:, None] - np.arange(T)[None, :]
  # The masks' query-key pairs less what they hold beyond the convention's continuous count
  # of them (W·T − W²/2 and T²/2): W/2 and T/2.
  band_pairs = ((behind_TT >= 0) & (behind_TT < W)).sum() - W / 2
  causal_pairs = (behind_TT >= 0).sum() - T / 2
  got, plain = flops_per_token(cfg, T), flops_per_token(full, T)
  assert got['full'] - dense == per_layer * (3 * W + T)
  assert got['causal'] - dense == pytest.approx(per_layer * (3 * band_pairs + causal_pairs) / T)
  assert plain['causal'] - dense == per_layer * 4 * T / 2
  cfg.sliding_window = T
  assert flops_per_token(cfg, T) == plain


def test_a_checkpoint_saved_before_the_family_fields_restores_where_they_are_defaults():
  """A run's saved config without the fields (saved before they existed) is a Llama's: a
  Llama run restores it; a model with QK-norm, whose parameters it lacks, is refused naming
  the field."""
  from jaxllm.checkpoint import _check_model_shape
  saved = {'model': {k: v for k, v in default_config().model.items()
                     if k not in ('qk_norm', 'qkv_bias', 'post_norms')}}
  _check_model_shape(saved, default_config().model, 'step 1')
  qwen3 = default_config().model
  qwen3.qk_norm = True
  with pytest.raises(ConfigError, match=r'saved with model\.qk_norm=False but this run has '
                                        r'model\.qk_norm=True'):
    _check_model_shape(saved, qwen3, 'step 1')


def test_fine_tuning_a_checkpoint_needs_its_architecture(family_checkpoint):
  """A run whose model computes other than the checkpoint's (Gemma's weights read as plain
  norm scales, say) is stopped naming the field; a different window is only noted."""
  from jaxllm.hf.config import check_model_matches
  directory, _ = family_checkpoint('gemma3')
  model_cfg = hf.model_config(str(directory))
  model_cfg.norm_zero_centered = False
  with pytest.raises(ConfigError, match=r'model\.norm_zero_centered=False but the Hugging Face '
                                        r'checkpoint .* has norm_zero_centered=True'):
    check_model_matches(str(directory), model_cfg)
  model_cfg = hf.model_config(str(directory))
  model_cfg.sliding_window = 2 * WINDOW
  check_model_matches(str(directory), model_cfg)


@pytest.mark.slow
def test_fp8_matmuls_train_the_family_options(short_documents):
  """Delayed-scaling FP8 on data × fsdp × tensor with every option at once (Gemma 3's, and
  q/k/v biases added after the FP8 projections): the loss falls as the bf16 run's does, and
  every layer's scales are taken (amax histories filled for both steps)."""
  def run(fp8):
    cfg = family_config(short_documents, 'gemma3', data=2, fsdp=2, tensor=2)
    cfg.model.update(qkv_bias=True, dtype='bfloat16', fp8=fp8)
    cfg.train.steps = 2
    return train(cfg, devices=jax.devices())
  state, history = run('delayed')
  _, plain = run('none')
  losses, plain_losses = ([row['loss'] for row in h] for h in (history, plain))
  assert losses[1] < losses[0]
  np.testing.assert_allclose(losses, plain_losses, rtol=0.02)
  for amaxes in jax.tree.leaves(jax.device_get(state.fp8.history)):
    assert (amaxes[..., :2] > 0).all()
