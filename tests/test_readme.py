"""README.md is tested as written: every fenced code block in it is run here exactly as printed,
or accounted for in `TABLE` with the reason it cannot run on this machine.

The only changes made to a command are visible in the call that runs it: placeholders replaced
by files this module makes (`configs/X.py`, `DIR`, `runs/X`, `/models/Llama-3.2-1B...`, a tiny
bf16 Hugging Face Llama with a tokenizer), `python` run as this interpreter, the optional
`[...]` of a syntax summary left out (or, for tune, three of them given), what a user must add
(`needs`: the HF recipe's data path) and overrides appended that only cut a run short
(`SHORTEN`). Each command runs in a temporary directory where `configs` links to the
repository's, so `runs/...` lands there. A code block the table does not name fails
`test_every_readme_code_block_is_in_the_table`: a new block needs a test (or a reason).

Commands run in this process (`conftest.run_main`: a `jaxllm.train` run there also says it is
one process), but for those whose output depends on a fresh one: the runs on a config that
leaves `cpu_devices` to JAX (one CPU device, where this process has 8).
"""

import dataclasses
import glob
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
from ast import literal_eval

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from ml_collections import ConfigDict
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from conftest import REPO, USER_XLA_FLAGS, once_per_run, paired_leaves, run_dir, run_main
from test_chat import tokenizer_dir  # noqa: F401  (a fixture: a BPE tokenizer with a chat template)
from test_families import FAMILIES, family_model
from jaxllm import backends
from jaxllm.cost.hardware import PROFILES
from test_hf import RULES, hf_logits, mesh_of, our_logits, save_hf_model

README = os.path.join(REPO, 'README.md')
FAMILIES_DOC = os.path.join(REPO, 'docs', 'families.md')
TIMEOUT = 600
# Overrides that only shorten a run: the only flags appended to a README command. A run
# shorter than its warmup warms up over the run with a note; a shortened run's warmup is cut
# with it (to what the run would take), which leaves the note out.
SHORTEN = ('--config.train.steps=', '--config.optim.warmup_steps=', '--config.checkpoint.every=',
           '--config.eval.every=')
TINY_STEPS = 12  # the README's profile traces steps 10–12


def steps(n: int) -> list[str]:
  """A run cut to n steps, its warmup with it."""
  return [f'--config.train.steps={n}', f'--config.optim.warmup_steps={n}']


# ----------------------------------------------------------------------------- README blocks

@dataclasses.dataclass(frozen=True)
class Block:
  line: int            # of the opening fence, 1-based
  lang: str            # '' when unlabelled
  lines: tuple[str, ...]


def readme_blocks(path: str = README) -> list[Block]:
  blocks, opened = [], None
  with open(path) as f:
    for number, line in enumerate(f.read().splitlines(), 1):
      if line.lstrip().startswith('```'):
        if opened is None:
          opened = (number, line.strip()[3:].strip(), [])
        else:
          blocks.append(Block(opened[0], opened[1], tuple(opened[2])))
          opened = None
      elif opened is not None:
        opened[2].append(line)
  assert opened is None, f'{path}:{opened[0]}: a code block is never closed'
  return blocks


SHELL = ('bash', 'sh', 'shell', 'console')


def command_key(text: str) -> str:
  """A shell command as printed, its comment dropped and runs of blanks made one."""
  body = re.split(r'\s+#', text, maxsplit=1)[0]
  assert shlex.split(body) == shlex.split(text, comments=True), text  # no '#' inside quotes
  return ' '.join(body.split())


def block_commands(block: Block) -> list[tuple[int, str]]:
  """(line, key) of each command of a shell block, `\\` continuations joined; comment lines
  are not commands."""
  commands, pending, start = [], '', None
  for number, line in enumerate(block.lines, block.line + 1):
    if not pending and (not line.strip() or line.lstrip().startswith('#')):
      continue
    start = start or number
    if line.rstrip().endswith('\\'):
      pending += line.rstrip()[:-1].strip() + ' '
      continue
    commands.append((start, command_key(pending + line.strip())))
    pending, start = '', None
  assert not pending, f'README.md:{start}: a command ends in a continuation'
  return commands


def block_key(block: Block) -> str:
  """A block that is not shell commands is known by its language and its first line."""
  first = next((line for line in block.lines if line.strip()), '')
  return f'{block.lang or "text"}: {" ".join(first.split())}'


def readme_items(path: str = README) -> list[tuple[int, str]]:
  """(line, key) of everything in a markdown file's code blocks (README.md's by default) that
  its table (`TABLE`, `FAMILIES_DOC_TABLE`) must account for."""
  items = []
  for block in readme_blocks(path):
    if block.lang in SHELL:
      items += block_commands(block)
    else:
      items.append((block.line, block_key(block)))
  return items


def readme_block(key: str) -> Block:
  [block] = [b for b in readme_blocks() if b.lang not in SHELL and block_key(b) == key]
  return block


# ----------------------------------------------------------------------------- the table

@dataclasses.dataclass(frozen=True)
class How:
  """Run by these tests of this module (none: not run here, and `note` says why)."""
  tests: tuple[str, ...]
  note: str = ''


def run_by(*tests, note=''):
  return How(tests, note)


def not_run(why):
  return How((), why)


TINY_CHAIN = 'test_the_tiny_run_profiles_resumes_generates_and_exports'
TRAIN_ALONE = 'test_train_command_runs_as_printed'
HF_RECIPE = 'test_the_hugging_face_recipe_fine_tunes_and_exports'
CHAT = 'test_chat_fine_tunes_a_hugging_face_checkpoint'
GENERATE_HF = 'test_generate_from_a_hugging_face_checkpoint'
PRETOKENIZE = 'test_pretokenize_then_train_on_the_shards'
ERRORS = 'test_the_error_examples_are_what_their_configs_print'
ANALYZE = 'test_analyze_and_tune_as_printed'
MOE = 'test_the_tiny_moe_trains_and_reports_its_experts'

INSTALL_AND_TRAIN = 'pip install -e ".[dev]" && python -m jaxllm.train --config configs/tiny.py'
PROFILE = ('python -m jaxllm.train --config configs/tiny.py --config.profile.start_step=10 '
           '--config.profile.steps=3')
GENERATE = ("python -m jaxllm.generate --checkpoint runs/tiny/checkpoints --prompt 'def ' "
            '--max_new_tokens 64 --greedy')
GENERATE_FILE = ('python -m jaxllm.generate --checkpoint runs/tiny/checkpoints --prompt_file '
                 'prompts.txt --max_new_tokens 64 --greedy --mesh fsdp=2,tensor=2')
GENERATE_FROM_HF = ("python -m jaxllm.generate --hf /models/Llama-3.2-1B --prompt 'The mesh' "
                    '--max_new_tokens 32 --temperature 0.8 --top_k 50 --top_p 0.9 --seed 1')
EXPORT = ('python -m jaxllm.hf export --checkpoint runs/X/checkpoints[/STEP] --out DIR '
          '[--dtype bfloat16] [--max-shard-gb 5]')
PRETOKENIZE_CMD = 'python -m jaxllm.data.pretokenize --config configs/X.py --out DIR'
TRAIN_ON_SHARDS = ("python -m jaxllm.train --config configs/X.py "
                   "--config.data.path='DIR/train-*.arrayrecord'")
CHAT_CMD = ('python -m jaxllm.train --config configs/X.py '
            '--config.init_from=hf:/models/Llama-3.2-1B-Instruct --config.data.format=chat '
            '--config.data.path=chats.jsonl --config.data.tokenizer=/models/Llama-3.2-1B-Instruct')
RECIPE_BLOCK = 'python: from jaxllm import hf'
CHAT_BLOCK = ('json: {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": '
              '"user", "content": "What splits the batch?"}, {"role": "assistant", "content": '
              '"data and fsdp."}]}')
LOG_BLOCK = 'text: devices 8 × cpu mesh data=2 fsdp=2 pipe=1 tensor=2'
TINY_MOE = 'python -m jaxllm.train --config configs/tiny_moe.py'
TINY_MOE_ALL_TO_ALL = TINY_MOE + ' --config.model.moe.dispatch=all_to_all'
MOE_LOG_BLOCK = ('text: experts 8 in 4 of 4 layers, top-2 sigmoid router; 0.58M parameters active '
                 'per token; split over fsdp=8 (1 per device), ring dispatch, dropless')
ERROR_BLOCK = ('text: error: train.global_batch=6 is not divisible by data×fsdp×micro_batches = '
               '4×1; make it a multiple of 4 or change train.micro_batches.')

TABLE = {
    # Set up and run
    INSTALL_AND_TRAIN: run_by(TINY_CHAIN, note='the command after `&&` (the install is what CI '
                              'does before the tests), after the profiled run of configs/tiny.py: '
                              'it resumes, finds the steps done and stops, as the README says'),
    'pip install -e ".[dev]" && pytest -n 2': not_run('the CI job itself, which runs this file'),
    'pip install -e ".[dev]" && pytest -n 2 -m "not slow"':
        not_run("the CI job's tests less those marked slow, this file's quick ones among them"),
    LOG_BLOCK: run_by(TINY_CHAIN, note="the tiny run's log: its lines before the first compile "
                      'are printed as they stand by the tiny run'),
    # Choosing the mesh and other settings
    'python -m jaxllm.train --config configs/tiny.py --config.mesh.data=1 --config.mesh.fsdp=8 '
    '--config.mesh.tensor=1':
        run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py --config.mesh.tensor=4 --config.mesh.data=-1 '
    '--config.mesh.fsdp=1': run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py --config.train.steps=1000 '
    '--config.optim.lr=1e-3 --workdir runs/long': run_by(TRAIN_ALONE),
    'tensorboard --logdir runs': not_run('starts a server; tests/test_cli.py reads the event '
                                         "files back with TensorBoard's reader"),
    # Data
    PRETOKENIZE_CMD: run_by(PRETOKENIZE, note='configs/X.py: configs/tiny.py'),
    TRAIN_ON_SHARDS: run_by(PRETOKENIZE, note='configs/X.py: configs/tiny.py'),
    CHAT_CMD: run_by(CHAT, note='configs/X.py: a config with the tiny checkpoint\'s model section'),
    CHAT_BLOCK: run_by(CHAT, note='is chats.jsonl'),
    # Many hosts
    'python -m jaxllm.train --config configs/llama3_8b.py '
    '--config.distributed.coordinator_address=host0:1234 --config.distributed.num_processes=4 '
    '--config.distributed.process_id=$RANK':
        not_run('a launch over 4 hosts of GPUs; tests/test_distributed.py runs 2 processes on '
                'localhost'),
    # Profiling
    PROFILE: run_by(TINY_CHAIN),
    # Hugging Face checkpoints
    RECIPE_BLOCK: run_by(HF_RECIPE),
    EXPORT: run_by(TINY_CHAIN, HF_RECIPE, note='a syntax summary: its bracket-free form'),
    # Generating text
    GENERATE: run_by(TINY_CHAIN),
    GENERATE_FROM_HF: run_by(GENERATE_HF),
    GENERATE_FILE: run_by(TINY_CHAIN),
    # Pipeline parallelism, ZeRO, more ways to split
    'python -m jaxllm.train --config configs/tiny.py --config.mesh.pipe=2 --config.mesh.fsdp=1':
        run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py --config.mesh.pipe=2 --config.mesh.fsdp=1 '
    '--config.pipeline.schedule=interleaved_1f1b --config.pipeline.repeats=2':
        run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py --config.sharding.zero=1':
        run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py '
    '"--config.sharding.rules.act_seq=(\'tensor\',)"': run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py "--config.sharding.rules.seq=(\'fsdp\',)" '
    '"--config.sharding.rules.batch=(\'data\',)"': run_by(TRAIN_ALONE),
    'python -m jaxllm.train --config configs/tiny.py --config.model.num_kv_heads=1':
        run_by(TRAIN_ALONE),
    # Mixture of experts
    TINY_MOE: run_by(MOE),
    TINY_MOE_ALL_TO_ALL: run_by(MOE),
    MOE_LOG_BLOCK: run_by(MOE, note="the tiny MoE run's experts line is printed as it stands; the "
                          'step lines are a run of 2 cores'),
    # Batch vocabulary
    ERROR_BLOCK: run_by(ERRORS, note='error messages: the configs that print them are run'),
    # See before you launch
    'python -m jaxllm.analyze --config configs/llama3_8b.py --config.mesh.fsdp=8': run_by(ANALYZE),
    'python -m jaxllm.analyze --config configs/llama3_8b.py --devices 64 --config.mesh.data=2 '
    '--config.mesh.fsdp=8 --config.mesh.tensor=4 --config.train.global_batch=64 '
    '[--hardware h100-nvlink] [--compiler gpu|cpu] [--json] [--dump DIR]':
        run_by(ANALYZE, note='a syntax summary: its bracket-free form'),
    'python -m jaxllm.analyze --hlo FILE [--hardware h100-nvlink] [--devices-per-node 8] '
    '[--json]':
        run_by(ANALYZE, note='a syntax summary: FILE a program compiled for 8 H100s here'),
    'python -m jaxllm.tune --config configs/tiny.py [--devices N] [--remat none,full] '
    '[--micro-batches 1,2] [--zero 0,1,2] [--splits none,sp,sp_cm,cp,cp_sp] [--loss-chunk 0,1024] '
    '[--schedules gpipe,1f1b,circular,interleaved_1f1b] [--measure 2] [--exhaustive] [--json]':
        run_by(ANALYZE, note='a syntax summary: with --devices 1 --remat none --micro-batches 1 '
               '(bracket-free it is 128 compiles; 80 took 9 CPU-minutes)'),
    # Notebooks
    'pip install -e ".[dev]" jupyterlab && jupyter lab notebooks/':
        not_run('starts a server; tests/test_notebooks.py executes every notebook'),
    # How it is built
    'text: configs/ one file per model; get_config() returns a ConfigDict built on '
    'config.default_config()': not_run("the repository's layout, not a command"),
}


def commands_of(test: str) -> list[str]:
  return [key for key, how in TABLE.items() if test in how.tests and not key.startswith(
      tuple(f'{lang}: ' for lang in ('python', 'json', 'text')))]


def assert_doc_table(doc: str, table: dict, name: str) -> None:
  """Every code block of `doc` is a key of `table` (called `name` here), printed once, and every
  key is one of its blocks, run by a test of this module or said why not."""
  where = os.path.relpath(doc, REPO)
  items = readme_items(doc)
  missing = [f'{where}:{line}: {key}' for line, key in items if key not in table]
  assert not missing, (f'code blocks of {where} that no test runs; run them in '
                       f'tests/test_readme.py and add them to {name}:\n' + '\n'.join(missing))
  keys = [key for _, key in items]
  stale = [key for key in table if key not in keys]
  assert not stale, f'{name} names what {where} no longer prints: {stale}'
  repeated = sorted({key for key in keys if keys.count(key) > 1})
  assert not repeated, f'{where} prints these more than once: {repeated}'
  for key, how in table.items():
    assert how.tests or how.note, f'{key}: neither run nor said why not'
    for test in how.tests:
      assert callable(globals().get(test)), f'{key}: {test} is not a test of this module'


def test_every_readme_code_block_is_in_the_table():
  assert_doc_table(README, TABLE, 'TABLE')


# docs/families.md, tested the same way.
FAMILY_CONFIGS = ('qwen3_8b', 'qwen2_5_7b', 'mistral_7b', 'gemma3_4b')
FAMILIES_ANALYZED = 'test_the_families_are_analysed_as_their_doc_says'
FAMILIES_DOC_TABLE = {
    f'python -m jaxllm.analyze --config configs/{name}.py --config.mesh.fsdp=8':
        run_by(FAMILIES_ANALYZED) for name in FAMILY_CONFIGS}


def test_every_families_doc_code_block_is_in_its_table():
  assert_doc_table(FAMILIES_DOC, FAMILIES_DOC_TABLE, 'FAMILIES_DOC_TABLE')


# docs/moe.md, tested the same way.
MOE_DOC = os.path.join(REPO, 'docs', 'moe.md')
MOE_TUNE = ('python -m jaxllm.tune --config configs/tiny_moe.py --devices 2 --compiler cpu '
            '--remat none --micro-batches 1 --schedules gpipe --dispatch ring,all_to_all')
MOE_DOC_TABLE = {
    MOE_TUNE: run_by('test_the_moe_doc_s_search_ranks_both_dispatches'),
    'text: experts 8 in 4 of 4 layers, top-2 sigmoid router; 0.58M parameters active per token; '
    'split over fsdp=8 (1 per device), ring dispatch, dropless':
        run_by('test_the_tiny_moe_trains_and_reports_its_experts'),
}


def test_every_moe_doc_code_block_is_in_its_table():
  assert_doc_table(MOE_DOC, MOE_DOC_TABLE, 'MOE_DOC_TABLE')


# ----------------------------------------------------------------------------- running

def bracket_free(text: str) -> str:
  """A syntax summary without its optional `[...]` parts."""
  return ' '.join(re.sub(r'\[[^\]]*\]', ' ', text).split())


def readme_cwd(directory) -> str:
  """A directory to run commands in, where `configs/` is the repository's."""
  os.symlink(os.path.join(REPO, 'configs'), os.path.join(directory, 'configs'))
  return str(directory)


def run(argv: list[str], cwd, fresh=False, many_steps=False) -> subprocess.CompletedProcess:
  """Runs `python ...` in cwd, in this process (`run_main`) or, `fresh`, as a new process of
  this interpreter; it must exit 0. `many_steps`: a fresh process compiling as a user's does
  (USER_XLA_FLAGS), whose steps run ~4× faster than this process's cheap compiles make them."""
  assert argv[0] == 'python', argv
  if fresh or many_steps:
    env = {**os.environ, 'XLA_FLAGS': USER_XLA_FLAGS} if many_steps else None
    result = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)
  else:
    result = run_main(argv, cwd)
  assert result.returncode == 0, (f'`{shlex.join(argv)}` in {cwd} exited {result.returncode}:\n'
                                  f'{result.stdout[-1500:]}\n{result.stderr[-3000:]}')
  return result


def readme_argv(key: str, subs=(), shorten=(), needs=()) -> tuple[list[str], list[str]]:
  """The README command `key` as it is run: its words as printed (after `&&` if it installs
  first; without the `[...]` of a syntax summary), each placeholder of `subs` ((placeholder,
  replacement), applied in order) replaced, then `needs` (what a user must add, said by the
  caller) and `shorten` (only overrides of SHORTEN). Returns (the README's words, argv)."""
  assert key in {k for _, k in readme_items()}, f'README.md no longer prints `{key}`'
  assert key in TABLE
  text = bracket_free(key)
  if text.startswith('pip install ') and ' && ' in text:
    text = text.split(' && ', 1)[1]  # the install is CI's job
  words = shlex.split(text)
  for placeholder, value in subs:
    words = [w.replace(placeholder, str(value)) for w in words]
  assert all(flag.startswith(SHORTEN) for flag in shorten), shorten
  argv = [*words, *needs, *shorten]
  assert shlex.join(argv).startswith(shlex.join(words))  # the README's text leads
  return words, argv


def run_readme(key, cwd, subs=(), shorten=(), needs=()) -> subprocess.CompletedProcess:
  _, argv = readme_argv(key, subs, shorten, needs)
  return run(argv, cwd)


def metric_rows(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def assert_trained(workdir, steps):
  rows = [r for r in metric_rows(workdir) if 'loss' in r]
  assert rows and rows[-1]['step'] == steps and math.isfinite(rows[-1]['loss']), rows


def config_value(text: str):
  try:
    value = literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  return list(value) if isinstance(value, tuple) else value


def assert_overrides_in_config_json(words, workdir, shortened):
  """Each `--config.a.b=v` of the README's command is in the run's config.json (fields we
  shortened, and -1, "the rest", aside)."""
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  for word in words:
    if not word.startswith('--config.') or '=' not in word:
      continue
    path, value = word[len('--config.'):].split('=', 1)
    if any(s.startswith(f'--config.{path}=') for s in shortened) or value == '-1':
      continue
    node = saved
    for part in path.split('.'):
      node = node[part]
    assert node == config_value(value), (path, node, value)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope='module')
def hf_checkpoint(tokenizer_dir):  # noqa: F811
  """/models/Llama-3.2-1B(-Instruct) here: a tiny random LlamaForCausalLM saved in bfloat16 by
  transformers, as Llamas are released, with a tokenizer (`save_with_tokenizer`). Made once per
  test run (tests only read it)."""
  return once_per_run('hf_checkpoint', lambda: save_hf_llama(tokenizer_dir))


def save_hf_llama(tokenizer_dir):
  root = pathlib.Path(run_dir('hf_llama'))
  return save_with_tokenizer(save_hf_model(root), root, tokenizer_dir)


def save_with_tokenizer(model, root, tokenizer_dir):  # noqa: F811
  """`model` saved in bfloat16, as checkpoints are released, with tokenizer_dir's
  tokenizer.json and tokenizer_config.json (a chat template: test_chat's), its vocabulary and
  special ids the tokenizer's."""
  from tokenizers import Tokenizer
  tokenizer = Tokenizer.from_file(str(tokenizer_dir / 'tokenizer.json'))
  model.resize_token_embeddings(tokenizer.get_vocab_size(), mean_resizing=False)
  config = json.loads((tokenizer_dir / 'tokenizer_config.json').read_text())
  for holder in (model.config, model.generation_config):
    holder.bos_token_id = tokenizer.token_to_id(config['bos_token'])
    holder.eos_token_id = tokenizer.token_to_id(config['eos_token'])
  model.to(torch.bfloat16).save_pretrained(root)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (root / name).write_text((tokenizer_dir / name).read_text())
  assert json.loads((root / 'config.json').read_text())['vocab_size'] == tokenizer.get_vocab_size()
  return root


@pytest.fixture(scope='module')
def family_checkpoints(tokenizer_dir, hf_checkpoint):  # noqa: F811
  """The README's Hugging Face directory for each family: the Llama of `hf_checkpoint`, or a
  tiny random model of another family (test_families') saved the same way, once per run."""
  def save(family):
    root = pathlib.Path(run_dir(f'hf_{family}'))
    return save_with_tokenizer(family_model(family), root, tokenizer_dir)

  return lambda family: (hf_checkpoint if family == 'llama' else
                         once_per_run(f'hf_{family}', lambda: save(family)))


@pytest.fixture(scope='session')
def tiny_run():
  """The README's profiled run of configs/tiny.py, shortened to TINY_STEPS, in a directory of
  its own, once per test run: (that directory, the run's result). Its runs/tiny/checkpoints is
  what the README's generate and export commands read (and test_generate's, from a copy)."""
  def profiled_run():
    cwd = readme_cwd(run_dir('readme_tiny'))
    return cwd, run_readme(PROFILE, cwd, shorten=steps(TINY_STEPS))
  return once_per_run('readme_tiny_run', profiled_run)


# ----------------------------------------------------------------------------- checks

def restored_params(checkpoints):
  """The model section and the parameters of a run's newest checkpoint, on one device."""
  from jaxllm.checkpoint import params_target, restore_params, saved_config
  cfg = saved_config(str(checkpoints), 'checkpoints')
  mesh = mesh_of()
  target = params_target(cfg.model, mesh, cfg.sharding.rules)
  return cfg.model, restore_params(str(checkpoints), target, cfg.model, 'checkpoints')


def assert_export_is_the_checkpoint(checkpoints, out, dtype: str, family: str = 'llama'):
  """The export holds the checkpoint's parameters in `dtype`, tensor by tensor under the same
  names, and transformers reads it as the family's causal LM (no tensor missing or left over)
  and computes jaxllm's logits from them."""
  from jaxllm import hf
  model_cfg, params = restored_params(checkpoints)
  config = json.loads((out / 'config.json').read_text())
  architecture = (FAMILIES[family][1] if family != 'llama' else LlamaForCausalLM).__name__
  assert config['torch_dtype'] == dtype and config['architectures'] == [architecture]
  stored = jax.tree.map(lambda p: np.asarray(jnp.asarray(p).astype(dtype)), params)
  _, exported = hf.load(str(out), mesh_of(), RULES)
  for got, want in paired_leaves(exported, stored):
    assert got.dtype == want.dtype == np.dtype(jnp.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

  reference, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                         output_loading_info=True)
  assert type(reference).__name__ == architecture
  assert not any(info.values()), info
  fp32 = ConfigDict(model_cfg)
  fp32.update(dtype='float32', attention='xla')
  tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, 16))
  np.testing.assert_allclose(
      our_logits(fp32, jax.tree.map(lambda p: p.astype(np.float32), stored), mesh_of(), tokens),
      hf_logits(reference.eval(), tokens), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- tests

@pytest.mark.slow
def test_the_tiny_run_profiles_resumes_generates_and_exports(tiny_run, tmp_path):
  """In order, in one directory: the profiled tiny run, the README's first command (which
  finds the run done), generating from its checkpoints, exporting them to Hugging Face."""
  cwd, result = tiny_run
  workdir = os.path.join(cwd, 'runs', 'tiny')
  # The profiled run: the README's sentence about it, its files, a checkpoint, metrics.
  assert 'profile  steps 10–12 traced into runs/tiny/profile' in result.stdout
  # jax writes plugins/profile/<time>/<host>.xplane.pb, and the trace as JSON beside it.
  [trace] = glob.glob(os.path.join(workdir, 'profile', 'plugins', 'profile', '*'))
  assert os.path.getsize(os.path.join(trace, 'perfetto_trace.json.gz')) > 0
  [xplane] = glob.glob(os.path.join(trace, '*.xplane.pb'))
  assert os.path.getsize(xplane) > 0
  assert_trained(workdir, TINY_STEPS)
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == [str(TINY_STEPS)]
  # The README's log of the tiny run: its lines before the first compile, word for word.
  log = readme_block(LOG_BLOCK).lines
  header = log[:next(i for i, line in enumerate(log) if line.startswith('compiled '))]
  printed = result.stdout.splitlines()
  assert [line for line in header if line not in printed] == []

  # "Run the command again and it resumes from runs/tiny/checkpoints, finds step 300 reached
  # and stops" (here TINY_STEPS).
  again = run_readme(INSTALL_AND_TRAIN, cwd, shorten=steps(TINY_STEPS))
  assert f'resumed from the checkpoint of step {TINY_STEPS}' in again.stdout
  assert (f'nothing to do: the state is at step {TINY_STEPS} of train.steps={TINY_STEPS}'
          in again.stdout)

  generated = run_readme(GENERATE, cwd).stdout
  assert generated.startswith('def ') and len(generated) > len('def \n'), generated
  prompts = ['def ', 'class Mesh:', '    return']
  with open(os.path.join(cwd, 'prompts.txt'), 'w') as f:
    f.write('\n'.join(prompts) + '\n')
  sections = run_readme(GENERATE_FILE, cwd).stdout.split('--- prompt ')[1:]
  assert [s.split('\n', 1)[0] for s in sections] == ['1 of 3', '2 of 3', '3 of 3']
  assert [s.split('\n', 1)[1][:len(p)] for s, p in zip(sections, prompts)] == prompts

  run_readme(EXPORT, cwd, subs=[('runs/X/', 'runs/tiny/'), ('DIR', tmp_path / 'tiny_hf')])
  assert_export_is_the_checkpoint(os.path.join(workdir, 'checkpoints'), tmp_path / 'tiny_hf',
                                  'float32')


# The pipeline's first command, the one pipelined training run of the suite, trains until it
# has learned something.
PIPELINE = 'python -m jaxllm.train --config configs/tiny.py --config.mesh.pipe=2 --config.mesh.fsdp=1'
PIPELINE_STEPS = 20  # one logged row, the mean loss of its steps: ~4.0 (a uniform guess: 5.77)


@pytest.mark.slow
@pytest.mark.parametrize('key', commands_of(TRAIN_ALONE))
def test_train_command_runs_as_printed(key, tmp_path):
  """Each in a directory of its own, one step (PIPELINE: PIPELINE_STEPS), no checkpoint."""
  assert PIPELINE in commands_of(TRAIN_ALONE)  # its check runs
  cwd = readme_cwd(tmp_path)
  n = PIPELINE_STEPS if key == PIPELINE else 1
  shorten = [f'--config.train.steps={n}', '--config.checkpoint.every=0']
  if n == 1:
    shorten += steps(1)[1:]  # the warmup cut with it
  words, argv = readme_argv(key, shorten=shorten)
  result = run(argv, cwd, many_steps=key == PIPELINE)
  workdir = os.path.join(cwd, words[words.index('--workdir') + 1] if '--workdir' in words
                         else os.path.join('runs', 'tiny'))
  assert 'compiled the train step' in result.stdout
  assert_trained(workdir, n)
  assert_overrides_in_config_json(words, workdir, shorten)
  if key == PIPELINE:
    assert 'pipeline gpipe: S=2 stages × R=1 repeats, M=4 micro-batches' in result.stdout
    [loss] = [r['loss'] for r in metric_rows(workdir) if 'loss' in r]
    assert loss < math.log(320) - 1.0  # a model that learned nothing guesses uniformly


@pytest.mark.slow
def test_the_moe_doc_s_search_ranks_both_dispatches(tmp_path):
  """docs/moe.md's tune command as printed: the meshes of 2 devices (and schedules, on pipe=2)
  with each dispatch; each ranked row names its experts' settings in the table's experts
  column."""
  assert MOE_TUNE in {k for _, k in readme_items(MOE_DOC)}
  out = run(shlex.split(MOE_TUNE), readme_cwd(tmp_path)).stdout  # the first 2 of the 8 devices
  lines = out.splitlines()
  header = next(i for i, line in enumerate(lines) if line.lstrip().startswith('#  data'))
  assert lines[header].split()[-1] == 'experts'
  rows = [line.split() for line in lines[header + 1:] if re.match(r' *\d+  ', line)]
  settings = {(tuple(map(int, r[1:5])), ' '.join(r[-3:])) for r in rows}
  assert {s for _, s in settings} == {'ring dropless fsdp', 'all_to_all dropless fsdp'}
  meshes = lambda dispatch: {m for m, s in settings if s.startswith(dispatch + ' ')}
  assert meshes('ring') == meshes('all_to_all') >= {(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1)}


MOE_STEPS = 20  # logged every 10: the loss falls ~1.8 between the two rows


@pytest.mark.slow
def test_the_tiny_moe_trains_and_reports_its_experts(tmp_path):
  """configs/tiny_moe.py, MOE_STEPS steps: the loss falls, the log prints the README's (and
  docs/moe.md's) experts line, and metrics.jsonl and TensorBoard hold the routers' figures.
  Then one step with the all-to-all dispatch."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  cwd = readme_cwd(tmp_path)
  shorten = [f'--config.train.steps={MOE_STEPS}', '--config.checkpoint.every=0',
             '--config.eval.every=0']  # the warmup of 10 stays
  result = run_readme(TINY_MOE, cwd, shorten=shorten)
  experts_line = readme_block(MOE_LOG_BLOCK).lines[0]
  assert experts_line in result.stdout.splitlines()
  with open(os.path.join(REPO, 'docs', 'moe.md')) as f:  # docs/moe.md prints it too
    assert experts_line in f.read().splitlines()
  workdir = os.path.join(cwd, 'runs', 'tiny_moe')
  assert_trained(workdir, MOE_STEPS)
  rows = [r for r in metric_rows(workdir) if 'loss' in r]
  assert rows[-1]['loss'] < rows[0]['loss'] - 1.0, rows
  for row in rows:
    assert row['moe_dropped'] == 0 and row['moe_load_min'] <= 1 <= row['moe_load_max']
    assert abs(row['moe_aux_loss'] - 2) < 0.5 and row['moe_z_loss'] > 0  # about top-k
    assert len(row['moe_expert_load']) == 8
    np.testing.assert_allclose(np.mean(row['moe_expert_load']), 1, rtol=1e-3)
  assert 'experts: load ' in result.stdout
  events = EventAccumulator(os.path.join(workdir, 'tensorboard'),
                            size_guidance={'scalars': 0, 'histograms': 0})
  events.Reload()
  assert {'moe_aux_loss', 'moe_z_loss', 'moe_dropped', 'moe_load_max', 'moe_load_min'} <= set(
      events.Tags()['scalars'])
  assert [e.step for e in events.Histograms('moe_expert_load')] == [r['step'] for r in rows]

  shorten = [*steps(1), '--config.checkpoint.every=0', '--config.eval.every=0']
  words, argv = readme_argv(TINY_MOE_ALL_TO_ALL, shorten=shorten)
  other = tmp_path / 'all_to_all'
  other.mkdir()
  run(argv, readme_cwd(other))
  assert_trained(other / 'runs' / 'tiny_moe', 1)
  assert_overrides_in_config_json(words, other / 'runs' / 'tiny_moe', shorten)


def recipe_config(directory, checkpoint) -> str:
  """The README's config for a Hugging Face checkpoint, as printed but for the checkpoint's
  path, written to a file in `directory`; its name."""
  text = '\n'.join(readme_block(RECIPE_BLOCK).lines) + '\n'
  assert "'/models/Llama-3.2-1B'" in text
  with open(os.path.join(directory, 'hf_recipe.py'), 'w') as f:
    f.write(text.replace('/models/Llama-3.2-1B', str(checkpoint)))
  return 'hf_recipe.py'


# The recipe from each family's checkpoint; the Llama's on 8 simulated devices as well.
RECIPE_RUNS = [pytest.param('llama', [], id='llama'),
               pytest.param('llama', ['--config.cpu_devices=8'], id='llama_cpu8'),
               *(pytest.param(f, [], id=f, marks=pytest.mark.slow) for f in FAMILIES)]


@pytest.mark.slow
@pytest.mark.parametrize('family, devices', RECIPE_RUNS)
def test_the_hugging_face_recipe_fine_tunes_and_exports(family, devices, family_checkpoints,
                                                        corpus, tmp_path):
  """`python -m jaxllm.train --config hf_recipe.py` with the data path a user must give, two
  steps, from a checkpoint of each family (and the Llama's once on 8 simulated devices); then
  the README's export of its checkpoints, which transformers loads as that family. The
  recipe's default devices are a fresh process's: one CPU."""
  cwd = tmp_path
  readme_cwd(cwd)
  hf_checkpoint = family_checkpoints(family)
  config = recipe_config(cwd, hf_checkpoint)
  result = run(['python', '-m', 'jaxllm.train', '--config', config, f'--config.data.path={corpus}',
                *steps(2), *devices], cwd, fresh=not devices)
  workdir = cwd / 'runs' / 'hf_recipe'
  assert f'devices  {8 if devices else 1} × cpu' in result.stdout
  assert f'parameters from hf:{hf_checkpoint}, fresh optimizer state' in result.stdout
  assert_trained(workdir, 2)
  saved = json.loads((workdir / 'config.json').read_text())
  assert (saved['model']['dtype'], saved['model']['param_dtype']) == ('bfloat16', 'float32')

  run_readme(EXPORT, cwd, subs=[('runs/X/', 'runs/hf_recipe/'), ('DIR', 'exported')])
  assert_export_is_the_checkpoint(workdir / 'checkpoints', cwd / 'exported', 'bfloat16', family)


@pytest.mark.slow
def test_chat_fine_tunes_a_hugging_face_checkpoint(hf_checkpoint, tmp_path):
  """The README's conversation is chats.jsonl; configs/X.py is a config holding the
  checkpoint's model section (what `hf.model_config` reads from it), whose devices are a fresh
  process's: one CPU."""
  from jaxllm import hf
  cwd = readme_cwd(tmp_path)
  lines = [line for line in readme_block(CHAT_BLOCK).lines if line.strip()]
  assert all('messages' in json.loads(line) for line in lines)
  (tmp_path / 'chats.jsonl').write_text('\n'.join(lines) + '\n')
  (tmp_path / 'chat_model.py').write_text(
      'from ml_collections import ConfigDict\n'
      'from jaxllm.config import default_config\n\n\n'
      'def get_config():\n'
      '  c = default_config()\n'
      f'  c.model = ConfigDict({hf.model_config(str(hf_checkpoint)).to_dict()!r})\n'
      '  return c\n')
  words, argv = readme_argv(CHAT_CMD, subs=[('configs/X.py', 'chat_model.py'),
                                            ('/models/Llama-3.2-1B-Instruct', hf_checkpoint)],
                            shorten=steps(2))
  result = run(argv, cwd, fresh=True)
  assert f'parameters from hf:{hf_checkpoint}, fresh optimizer state' in result.stdout
  workdir = tmp_path / 'runs' / 'chat_model'
  assert_trained(workdir, 2)
  assert_overrides_in_config_json(words, workdir, steps(2))
  assert os.listdir(workdir / 'checkpoints') == ['2']


@pytest.mark.parametrize('family', [
    'llama', *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES)])
def test_generate_from_a_hugging_face_checkpoint(family, family_checkpoints, tmp_path):
  cwd = readme_cwd(tmp_path)
  out = run_readme(GENERATE_FROM_HF, cwd,
                   subs=[('/models/Llama-3.2-1B', family_checkpoints(family))]).stdout
  assert out.startswith('The mesh'), out


@pytest.mark.slow
def test_pretokenize_then_train_on_the_shards(tmp_path):
  """configs/X.py is configs/tiny.py; its training run is the tiny run's program (same steps)."""
  cwd = readme_cwd(tmp_path)
  subs = [('configs/X.py', 'configs/tiny.py'), ('DIR', 'shards')]
  printed = run_readme(PRETOKENIZE_CMD, cwd, subs=subs).stdout
  assert "train on them with --config.data.path='shards/train-*.arrayrecord'" in printed
  assert os.path.isfile(tmp_path / 'shards' / 'train-00000.arrayrecord')
  shorten = [*steps(TINY_STEPS), '--config.checkpoint.every=0']
  words, argv = readme_argv(TRAIN_ON_SHARDS, subs=subs, shorten=shorten)
  run(argv, cwd)
  assert_trained(tmp_path / 'runs' / 'tiny', TINY_STEPS)
  assert_overrides_in_config_json(words, tmp_path / 'runs' / 'tiny', shorten)


# The README's error examples: each line, and the overrides of configs/tiny.py that print it.
ERROR_CONFIGS = {
    'error: train.global_batch=6 ': ['--config.train.global_batch=6'],
    'error: model.num_kv_heads=3 ': ['--config.model.num_kv_heads=3', '--config.model.num_heads=6'],
}


@pytest.mark.parametrize('start', ERROR_CONFIGS)
def test_the_error_examples_are_what_their_configs_print(start, tmp_path):
  [line] = [line for line in readme_block(ERROR_BLOCK).lines if line.startswith(start)]
  assert len([line for line in readme_block(ERROR_BLOCK).lines if line.strip()]) == len(
      ERROR_CONFIGS), 'an error example without a config that prints it'
  argv = ['python', '-m', 'jaxllm.train', '--config', 'configs/tiny.py', *ERROR_CONFIGS[start]]
  result = run_main(argv, readme_cwd(tmp_path))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [line], result.stderr[-2000:]


# tune's syntax summary with none of its options tries every mesh of 8 devices with both
# remat policies, both micro-batch counts and every schedule on the meshes with pipe > 1: 128
# compiles (the 80 without the schedules took about 9 minutes of CPU). Its options,
# as the summary shows them, cut it to one compile: 1 device, one policy, one count.
TUNE_OPTIONS = ['--devices', '1', '--remat', 'none', '--micro-batches', '1']


def sharded_matmul_for_8_h100s() -> str:
  """The optimized H100 program of a matmul whose contraction is split over 8 GPUs (its
  partial products all-reduced), compiled here without a GPU."""
  devices = backends.gpu_devices(PROFILES['h100-nvlink'], 8)
  mesh = jax.sharding.Mesh(np.array(devices), ('x',))
  spec = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
  arg = lambda shape, *axes: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=spec(*axes))
  matmul = jax.jit(jnp.matmul, out_shardings=spec())
  with backends.compiling_for(devices):
    return matmul.lower(arg((4096, 8192), None, 'x'), arg((8192, 4096), 'x')).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize('key', commands_of(ANALYZE))
def test_analyze_and_tune_as_printed(key, tmp_path):
  if 'jaxllm.tune' in key:
    for flag in TUNE_OPTIONS[::2]:
      assert f'[{flag} ' in key, f'{flag} is not an option tune\'s summary shows'
    out = run_readme(key, readme_cwd(tmp_path), needs=TUNE_OPTIONS).stdout
    # One candidate, the GPU's program ranked: the table's head, its row, its legend.
    head, _, row, legend = out.strip().splitlines()
    assert head == ('1 candidates fit h100-nvlink (none left out); GPU: XLA\'s program for 1 × '
                    'NVIDIA H100 80GB HBM3, compiled without a GPU; predicted, best first:')
    # mesh, remat, micro-batches, ZeRO stage, split, loss chunk and pipeline (none on 1
    # device): the config's where not asked
    assert row.split()[:11] == ['1', '1', '1', '1', '1', 'none', '1', '0', 'none', '1024', '-']
    assert legend.startswith('matmul: GEMMs and attention;')
    return
  if '--hlo' in key:  # any program's HLO text: here a sharded matmul's, for 8 H100s
    program = tmp_path / 'program.hlo.txt'
    program.write_text(sharded_matmul_for_8_h100s())
    out = run_readme(key, readme_cwd(tmp_path), subs=[('FILE', program)]).stdout
    assert re.search(r'^predicted on h100-nvlink: step [\d.]+ µs', out, re.M), out
    assert re.search(r'^  GEMMs +[\d.]+ ms', out, re.M) and 'all-reduce' in out, out
    return
  out = run_readme(key, readme_cwd(tmp_path)).stdout
  devices = 64 if '--devices 64' in key else 8
  assert f"XLA's program for {devices} × NVIDIA H100 80GB HBM3" in out
  mesh = 'data=2 fsdp=8 pipe=1 tensor=4' if devices == 64 else 'data=1 fsdp=8 pipe=1 tensor=1'
  assert f'{mesh}  ({devices} devices)' in out and '8,030.26M total' in out, out
  # one verdict: Llama-3-8B's step fits what a JAX process may use of an H100
  verdicts = re.findall(r'^  peak .*?(fits|does NOT fit) the ', out, re.M)
  assert verdicts == ['fits'], out
  assert 'fits the 59.74 GiB a process may use of h100-nvlink' in out
  # where the predicted step goes, and its most expensive kernels, as the README says
  assert re.search(r'^predicted on h100-nvlink: step [\d,.]+ ms, [\d,]+ tokens/s, MFU', out, re.M)
  for part in ('GEMMs', 'attention', 'memory-bound', 'launches', 'exposed comm'):
    assert re.search(rf'^  {part} +[\d,.]+ ms +[\d.]+%', out, re.M), (part, out)
  assert len(re.findall(r'^ +[\d,.]+ ms +[\d.]+%  ×\d+ +(gemm|attention|memory|collective) ',
                        out, re.M)) == 10, out


def families_doc_row(config: str) -> list[str]:
  """The cells of docs/families.md's table row for `configs/<config>.py`."""
  with open(FAMILIES_DOC) as f:
    [row] = [line for line in f if line.startswith(f'| `{config}.py`')]
  return [cell.strip() for cell in row.strip().strip('|').split('|')]


@pytest.mark.slow
@pytest.mark.parametrize('key', list(FAMILIES_DOC_TABLE))
def test_the_families_are_analysed_as_their_doc_says(key, tmp_path):
  """Each family's config analysed for 8 H100s as docs/families.md prints it: its table row's
  parameters and attention kernels (each forward and backward, windowed or full, counted for
  the layers that run it) exactly, its peak memory and predicted step within 10% (a figure of
  the compiler of its day)."""
  assert key in {k for _, k in readme_items(FAMILIES_DOC)}
  out = run(shlex.split(key), readme_cwd(tmp_path)).stdout
  config = re.search(r'configs/(\w+)\.py', key).group(1)
  _, params, peak, kernels, step, *_ = families_doc_row(config)
  assert f'params   {params} total' in out, out
  figure = lambda pattern: float(re.search(pattern, out, re.M).group(1).replace(',', ''))
  assert figure(r'^  peak +([\d.]+) GiB') == pytest.approx(float(peak.split()[0]), rel=0.1)
  assert figure(r'^predicted on h100-nvlink: step ([\d,.]+) ms') == pytest.approx(
      float(step.split()[0].replace(',', '')), rel=0.1)
  for forward, backward, kind in re.findall(r'(\d+) \+ (\d+) (window \d+|full)', kernels):
    window = f', {kind}' if kind != 'full' else ''
    for target, count in (('fmhaSoftmax', forward), ('fmhaSoftmaxBackward', backward)):
      assert re.search(rf'^  __cudnn\${target} +×{count} +flash, mask CAUSAL{window}, ', out,
                       re.M), (target, count, kind, out)
