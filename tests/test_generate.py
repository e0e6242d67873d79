"""Generation: the KV cache against the plain forward pass, sampling, EOS, the command line."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import once_per_run, run_cli, run_cli_in_process, small_config
from jaxllm.config import ConfigError, default_config
from jaxllm.decode import Sampling, generate, sample_next
from jaxllm.generate import main
from jaxllm.model import KVCache, Transformer, sequence_positions
from jaxllm.parallel.mesh import make_mesh, sharding_context
from test_readme import TINY_STEPS, tiny_run  # noqa: F401  (a fixture: the README's tiny run)

RULES = default_config().sharding.rules
ONE_DEVICE = dict(data=1, fsdp=1, pipe=1, tensor=1)
SHARDED = dict(data=2, fsdp=2, pipe=1, tensor=2)
NEW_TOKENS = 8


def model_cfg():
  cfg = small_config().model
  # Large weights spread the logits apart, so no argmax is a near-tie that rounding could flip.
  cfg.init_std = 0.5
  return cfg


def create_params(cfg):
  return nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))


def shardings_on(mesh, cfg):
  """Where training puts each parameter on `mesh` (by the rules)."""
  with sharding_context(mesh, RULES):
    return nnx.get_named_sharding(jax.eval_shape(lambda: create_params(cfg)), mesh)


def params_on(mesh, cfg):
  """The model's parameters, created sharded on `mesh`."""
  with sharding_context(mesh, RULES):
    return jax.jit(lambda: create_params(cfg), out_shardings=shardings_on(mesh, cfg))()


def prompts(batch, length=6):
  return np.random.default_rng(batch).integers(0, 256, (batch, length)).tolist()


@pytest.fixture(scope='module')
def one_device_params():
  return params_on(make_mesh(ONE_DEVICE, jax.devices()[:1]), model_cfg())


def reference_greedy(cfg, params, prompt_BP, steps):
  """Greedy decoding with no cache: the plain forward pass over the whole sequence at every
  step. The sequence sits in a fixed buffer, so one compiled program serves every step
  (causality keeps the unfilled tail out of the logits read). Returns the tokens and the
  smallest gap between the best and second-best logit."""
  B, P = np.shape(prompt_BP)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  seq_BT = np.zeros((B, P + steps), np.int32)
  seq_BT[:, :P] = prompt_BP
  margin = np.inf
  for t in range(P, P + steps):
    logits_BV = np.asarray(forward(params, seq_BT))[:, t - 1]
    top2_B2 = np.sort(logits_BV, axis=-1)[:, -2:]
    margin = min(margin, np.min(top2_B2[:, 1] - top2_B2[:, 0]))
    seq_BT[:, t] = np.argmax(logits_BV, axis=-1)
  return seq_BT[:, P:].tolist(), margin


def test_greedy_with_the_cache_equals_the_full_forward_argmax(one_device_params):
  cfg, prompt = model_cfg(), prompts(1)[0]  # one prompt in, one list of ids out
  got = generate(cfg, one_device_params, prompt, NEW_TOKENS, greedy=True)
  with sharding_context(make_mesh(ONE_DEVICE, jax.devices()[:1]), RULES):
    want, margin = reference_greedy(cfg, one_device_params, [prompt], NEW_TOKENS)
  assert margin > 1e-3  # no near-tie: a mismatch would be the cache's fault
  assert got == want[0]


# Prompts of different lengths; the last, alone, is shorter than every other.
RAGGED = [p[:n] for p, n in zip(prompts(4, length=7), (3, 7, 5, 1))]


@pytest.fixture(scope='module')
def each_alone(one_device_params):
  """Each RAGGED prompt generated greedily on its own on one device, checked against the plain
  forward pass without a cache. Made once per test run."""
  def generated():
    cfg, alone = model_cfg(), []
    for prompt in RAGGED:
      alone.append(generate(cfg, one_device_params, prompt, NEW_TOKENS, greedy=True))
      with sharding_context(make_mesh(ONE_DEVICE, jax.devices()[:1]), RULES):
        want, margin = reference_greedy(cfg, one_device_params, [prompt], NEW_TOKENS)
      assert margin > 1e-3 and alone[-1] == want[0]
    return alone
  return once_per_run('each_alone', generated)


@pytest.mark.slow
def test_prompts_of_different_lengths_in_one_batch_equal_each_alone(one_device_params,
                                                                     each_alone):
  cfg = model_cfg()
  assert generate(cfg, one_device_params, RAGGED, NEW_TOKENS, greedy=True) == each_alone
  # EOS ends each row where that row alone would produce it.
  eos = each_alone[1][2]
  cut = lambda row: row[:row.index(eos) + 1] if eos in row else row
  got = generate(cfg, one_device_params, RAGGED, NEW_TOKENS, greedy=True, eos_id=eos)
  assert got == [cut(row) for row in each_alone] and len(got[1]) == 3


@pytest.mark.slow
@pytest.mark.parametrize('axes', [dict(tensor=2), dict(fsdp=2), dict(data=2, fsdp=2, tensor=2)],
                         ids=lambda axes: '_'.join(f'{a}{n}' for a, n in axes.items()))
def test_a_batch_on_a_mesh_equals_each_prompt_alone_on_one_device(axes, one_device_params,
                                                                  each_alone):
  """Three prompts of different lengths (the batch split over data×fsdp is padded to a
  multiple of it) and the parameters split as in training."""
  mesh_shape = {**ONE_DEVICE, **axes}
  mesh = make_mesh(mesh_shape, jax.devices()[:math.prod(mesh_shape.values())])
  params = jax.device_put(one_device_params, shardings_on(mesh, model_cfg()))
  if 'tensor' in axes:
    assert params['blocks']['attn']['wq_DNH'].sharding.spec[-2] == 'tensor'
  got = generate(model_cfg(), params, RAGGED[:3], NEW_TOKENS, greedy=True)  # the params' mesh
  assert got == each_alone[:3]


@pytest.mark.slow
def test_cache_filled_in_pieces_gives_the_logits_of_the_whole_sequence():
  """Prefill, one token, then a chunk of several: each attends to the cache and causally
  within itself. The cache comes out sharded like the keys (batch over data×fsdp, kv heads
  over tensor)."""
  cfg = model_cfg()
  mesh = make_mesh(SHARDED)
  params = params_on(mesh, cfg)
  tokens_BT = jnp.asarray(prompts(4, length=12))
  with sharding_context(mesh, RULES):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

  def in_pieces(params, tokens_BT):
    model = nnx.merge(graphdef, params)
    cache = KVCache.empty(model.cfg, 4, 12)
    logits = []
    for start, stop in ((0, 5), (5, 6), (6, 12)):
      piece_BT = tokens_BT[:, start:stop]
      x_BTD, cache = model.layers(model.embed(piece_BT),
                                  cache.length + sequence_positions(piece_BT), cache=cache)
      logits.append(model.logits(x_BTD))
    return jnp.concatenate(logits, axis=1), cache

  with sharding_context(mesh, RULES):
    got, cache = jax.jit(in_pieces)(params, tokens_BT)
    want = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens_BT)
  # fp32 sums in another order (over the cache's slots, split over devices): ~1e-5 of logits ~5.
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert int(cache.length) == 12
  assert cache.k_LBSKH.sharding.spec == P(None, ('data', 'fsdp'), None, 'tensor')


def test_top_k_1_sampling_equals_greedy(one_device_params):
  cfg, prompt = model_cfg(), prompts(1)[0]
  sampled = generate(cfg, one_device_params, prompt, NEW_TOKENS, top_k=1, temperature=0.7,
                     top_p=0.9, rng=5)
  assert sampled == generate(cfg, one_device_params, prompt, NEW_TOKENS, greedy=True)


def test_eos_stops_each_row_after_it(one_device_params):
  cfg, params, prompt = model_cfg(), one_device_params, prompts(2)
  free = generate(cfg, params, prompt, NEW_TOKENS, greedy=True)
  eos = free[0][2]
  cut = lambda row: row[:row.index(eos) + 1] if eos in row else row
  got = generate(cfg, params, prompt, NEW_TOKENS, greedy=True, eos_id=eos)
  assert got == [cut(row) for row in free]
  assert len(got[0]) == 3 and got[0][-1] == eos


PROBS = np.array([0.05, 0.5, 0.04, 0.3, 0.11])


@pytest.mark.parametrize('sampling,support', [
    (Sampling(top_p=0.75), {1, 3}),            # 0.5 < 0.75 ≤ 0.5 + 0.3
    (Sampling(top_p=0.85), {1, 3, 4}),         # 0.8 < 0.85 ≤ 0.91
    (Sampling(top_p=0.3), {1}),                # the likeliest token alone reaches 0.3
    (Sampling(top_k=2), {1, 3}),
    (Sampling(top_k=3, top_p=0.75), {1, 3}),
])
def test_sampling_stays_in_the_nucleus_and_top_k(sampling, support):
  logits_BV = jnp.log(jnp.broadcast_to(jnp.asarray(PROBS, jnp.float32), (4000, len(PROBS))))
  drawn = np.asarray(sample_next(logits_BV, jax.random.key(0), sampling))
  assert set(drawn.tolist()) == support
  # Within the support, tokens keep their relative probabilities.
  share = np.mean(drawn == 1)
  assert share == pytest.approx(PROBS[1] / PROBS[sorted(support)].sum(), abs=0.03)


def test_top_k_1_draws_the_argmax_at_any_temperature():
  logits_BV = jax.random.normal(jax.random.key(1), (64, 50))
  drawn = sample_next(logits_BV, jax.random.key(2), Sampling(top_k=1, temperature=3.0))
  np.testing.assert_array_equal(drawn, jnp.argmax(logits_BV, -1))


@pytest.mark.parametrize('kwargs,field', [
    (dict(top_p=0.0), 'top_p'), (dict(top_p=1.5), 'top_p'), (dict(top_k=0), 'top_k'),
    (dict(temperature=0.0), 'temperature'), (dict(prompt=[[1, 999]]), 'prompt_ids'),
    (dict(prompt=[[1, 2], []]), 'prompt 1 is empty'),
    (dict(prompt=[[1, [2]]]), 'a list of prompts'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(mesh=dict(data=2, fsdp=1, pipe=2, tensor=2)), 'pipe=1'),
])
def test_bad_generate_arguments_raise_config_errors(kwargs, field, one_device_params):
  cfg, params = model_cfg(), one_device_params
  prompt, max_new = kwargs.pop('prompt', [[1, 2]] * 4), kwargs.pop('max_new_tokens', 4)
  if 'mesh' in kwargs:
    kwargs['mesh'] = make_mesh(kwargs['mesh'])
  with pytest.raises(ConfigError, match=field.replace('(', r'\(').replace(')', r'\)')):
    generate(cfg, params, prompt, max_new, **kwargs)


# ----------------------------------------------------------------------------- command line

@pytest.fixture
def tiny_checkpoints(tiny_run, tmp_path):
  """A copy of the checkpoints of configs/tiny.py trained TINY_STEPS steps: the README's
  profiled run (test_readme's, made once per test run)."""
  cwd, _ = tiny_run
  return shutil.copytree(os.path.join(cwd, 'runs', 'tiny', 'checkpoints'),
                         tmp_path / 'checkpoints')


def generate_cli(*args):
  return run_cli_in_process(*args, module='jaxllm.generate')


@pytest.mark.slow
def test_cli_generates_from_a_checkpoint_and_its_hf_export(tiny_checkpoints, tmp_path):
  """Text and ids from a checkpoint, then the same ids from one step directory and from the
  checkpoint exported as a Hugging Face Llama; bad prompts fail before any parameter is read."""
  args = ['--max_new_tokens', '8', '--greedy', '--print_ids']
  result = generate_cli('--checkpoint', str(tiny_checkpoints), '--prompt', 'def ', *args)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.strip().splitlines()
  ids = [int(i) for i in lines[-1].split(',')]
  assert 1 <= len(ids) <= 8 and all(0 <= i < 320 for i in ids)
  # It stops at the first EOS (the byte tokenizer's 257), else after the 8 tokens asked for.
  assert len(ids) == (ids.index(257) + 1 if 257 in ids else 8), ids
  assert lines[0].startswith('def ')
  # The same prompt as ids (BOS, then the bytes of 'def '), from the step directory.
  same = ['--prompt_ids', '256,100,101,102,32', *args]
  by_step = generate_cli('--checkpoint', str(tiny_checkpoints / str(TINY_STEPS)), *same)
  assert by_step.stdout.strip().splitlines()[-1] == lines[-1], by_step.stderr[-2000:]
  # A file of prompts, one per line, as one batch on a mesh with the parameters split as in
  # training: each prompt's ids are those it gets alone on one device (library, in-process).
  lines_of_file = ['def ', 'class Mesh:', '    return']
  (tmp_path / 'prompts.txt').write_text('\n'.join(lines_of_file[:2]) + '\n\n' + lines_of_file[2])
  by_file = generate_cli('--checkpoint', str(tiny_checkpoints), '--prompt_file',
                         str(tmp_path / 'prompts.txt'), '--mesh=fsdp=2,tensor=2', *args)
  assert by_file.returncode == 0, by_file.stderr[-2000:]
  sections = by_file.stdout.split('--- prompt ')[1:]
  assert [s.split('\n')[0] for s in sections] == ['1 of 3', '2 of 3', '3 of 3']
  assert [s.split('\n')[1][:len(p)] for s, p in zip(sections, lines_of_file)] == lines_of_file
  batch_ids = [s.strip().split('\n')[-1] for s in sections]
  assert batch_ids[0] == lines[-1]
  assert batch_ids == [','.join(map(str, ids)) for ids in alone_on_one_device(
      tiny_checkpoints, lines_of_file, 8)]
  # tiny has 2 K/V heads: over tensor=4 each is kept whole on the pair of devices that share
  # it, as training does, and the tokens are one device's.
  by_four = generate_cli('--checkpoint', str(tiny_checkpoints), '--prompt_file',
                         str(tmp_path / 'prompts.txt'), '--mesh=tensor=4', *args)
  assert by_four.returncode == 0, by_four.stderr[-2000:]
  assert [s.strip().split('\n')[-1] for s in by_four.stdout.split('--- prompt ')[1:]] == batch_ids
  # Exported as a Hugging Face Llama it generates the same, printing ids only (there is no
  # tokenizer.json): its config.json carries the context (data.seq_len) and the byte
  # tokenizer's special ids, so neither --context nor an EOS needs giving.
  from jaxllm import hf
  hf.export_checkpoint(str(tiny_checkpoints), str(tmp_path / 'hf'))
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert (config['max_position_embeddings'], config['bos_token_id'], config['eos_token_id'],
          config['torch_dtype']) == (128, 256, 257, 'float32')
  by_hf = generate_cli('--hf', str(tmp_path / 'hf'), *same, '--mesh=tensor=4')
  hf_lines = by_hf.stdout.strip().splitlines()
  assert len(hf_lines) == 1, by_hf.stderr[-2000:]
  assert hf_lines[0] == lines[-1]
  # Bad prompts, against the checkpoint copied above.
  check_bad_prompts_are_config_errors(tiny_checkpoints, tmp_path)
  too_long = generate_cli('--checkpoint', str(tiny_checkpoints), '--prompt', 'def ',
                          '--max_new_tokens', '200')
  assert too_long.returncode == 2
  assert too_long.stderr.strip().splitlines() == [
      "error: --prompt is 5 tokens and --max_new_tokens=200: 205 positions, more than the "
      "context of 128 (data.seq_len of the checkpoint's config); shorten the prompt, lower "
      "--max_new_tokens or pass --context N."]


def alone_on_one_device(checkpoints, texts, max_new_tokens):
  """Greedy ids for each text alone, from the checkpoint's parameters on one device."""
  from jaxllm.checkpoint import params_target, restore_params, saved_config
  from jaxllm.data import load_tokenizer
  cfg = saved_config(str(checkpoints), 'checkpoints')
  mesh = make_mesh(ONE_DEVICE, jax.devices()[:1])
  params = restore_params(str(checkpoints), params_target(cfg.model, mesh, cfg.sharding.rules),
                          cfg.model, 'checkpoints')
  tokenizer = load_tokenizer(cfg.data)
  return [generate(cfg.model, params, tokenizer.encode(text).tolist()[:-1], max_new_tokens,
                   greedy=True, eos_id=tokenizer.eos_id, rules=cfg.sharding.rules)
          for text in texts]


BAD_PROMPTS = [
    (['--prompt_ids', '256,400'], '--prompt_ids: token id 400 is outside the vocabulary'),
    (['--prompt_ids', '256,x'], '--prompt_ids'),
    (['--prompt', 'x' * 200], '--prompt is 201 tokens'),  # data.seq_len=128
    (['--prompt', 'def ', '--context', '8'], r'context of 8 \(--context\)'),
    (['--prompt_file', '/nonexistent/prompt.txt'],
     "--prompt_file='/nonexistent/prompt.txt' cannot be read"),
    (['--prompt_file', '{tmp}/blank.txt'], r"--prompt_file='.*/blank.txt' has no prompts"),
    (['--prompt_file', '{tmp}/long.txt'], r'--prompt_file line 2 is 201 tokens'),
]


def check_bad_prompts_are_config_errors(checkpoints, tmp):
  (tmp / 'blank.txt').write_text('\n  \n')
  (tmp / 'long.txt').write_text('def \n' + 'x' * 200 + '\n')
  for args, field in BAD_PROMPTS:
    args = [a.format(tmp=tmp) for a in args]
    with pytest.raises(ConfigError, match=field):
      main(['generate', '--checkpoint', str(checkpoints), '--max_new_tokens', '8', *args])


BAD_FLAGS = {
    'no_source': (['--prompt', 'x'], '--checkpoint DIR'),
    'two_sources': (['--checkpoint', 'a', '--hf', 'b', '--prompt', 'x'], '--checkpoint DIR'),
    'no_prompt': (['--checkpoint', 'a'], '--prompt TEXT'),
    'two_prompts': (['--checkpoint', 'a', '--prompt', 'x', '--prompt_ids', '1'], '--prompt TEXT'),
    'prompt_and_file': (['--checkpoint', 'a', '--prompt', 'x', '--prompt_file', 'p.txt'],
                        '--prompt_file PATH'),
    'top_p': (['--checkpoint', 'a', '--prompt', 'x', '--top_p', '1.5'], 'top_p=1.5'),
    'top_k': (['--checkpoint', 'a', '--prompt', 'x', '--top_k', '0'], 'top_k=0'),
    'temperature': (['--checkpoint', 'a', '--prompt', 'x', '--temperature', '0'], 'temperature'),
    'temperature_inf': (['--checkpoint', 'a', '--prompt', 'x', '--temperature', 'inf'],
                        'temperature=inf'),
    'seed_past_64_bits': (['--checkpoint', 'a', '--prompt', 'x', '--seed', str(2**64)], '--seed'),
    'greedy_and_sampling': (['--checkpoint', 'a', '--prompt', 'x', '--greedy', '--top_k', '5'],
                            '--greedy'),
    'missing_checkpoint': (['--checkpoint', '/nonexistent/run', '--prompt', 'x'],
                           "--checkpoint='/nonexistent/run' is not a directory"),
    'missing_hf_dir': (['--hf', '/nonexistent/llama', '--prompt', 'x'], "--hf='/nonexistent"),
    'mesh_with_pipe': (['--checkpoint', 'a', '--prompt', 'x', '--mesh=pipe=2'],
                       '--mesh=pipe=2: generation runs without a pipeline'),
    'mesh_unknown_axis': (['--checkpoint', 'a', '--prompt', 'x', '--mesh=tensr=2'],
                          r'--mesh=tensr=2: give axis=size pairs'),
    'mesh_size': (['--checkpoint', 'a', '--prompt', 'x', '--mesh=tensor=two'],
                  r'--mesh=tensor=two: give axis=size pairs'),
}


@pytest.mark.parametrize('args,field', BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_flags_are_config_errors(args, field):
  with pytest.raises(ConfigError, match=field):
    main(['generate', '--max_new_tokens', '4', *args])


def test_a_mesh_larger_than_the_devices_is_a_config_error():
  from jaxllm.generate import mesh_devices, parse_mesh
  with pytest.raises(ConfigError, match=r'^--mesh=data=4,tensor=4 needs 16 devices, but 8 cpu '
                     r'device\(s\) are present; use a smaller mesh\.$'):
    mesh_devices(parse_mesh('data=4,tensor=4'), 'data=4,tensor=4')


@pytest.mark.parametrize('name', ['missing_checkpoint', 'top_p'])
def test_bad_input_is_one_line_and_exit_status_2(name):
  """The command's exit: the first in a fresh process, whose stderr must hold nothing else."""
  args, field = BAD_FLAGS[name]
  run = run_cli if name == 'missing_checkpoint' else run_cli_in_process
  result = run('--max_new_tokens', '4', *args, module='jaxllm.generate')
  assert result.returncode == 2
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: ') and field in lines[0], result.stderr
