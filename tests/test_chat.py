"""Chat data: conversations rendered with the tokenizer's chat template, packed, with the loss
on the assistant's turns only. The reference is Hugging Face transformers' own rendering and
assistant mask (from the template's `{% generation %}` blocks)."""

import json

import jax
import numpy as np
import pytest

from conftest import small_config
from jaxllm.config import ConfigError
from jaxllm.data import load_tokenizer, make_batches, make_eval_batches
from jaxllm.data.chat import ChatEncoder
from jaxllm.parallel.mesh import make_mesh

# ChatML, with Hugging Face's marking of the assistant's text.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML whose generation blocks end at <|im_end|>: the newline after it is the template's,
# outside the block, so it is not trained.
TEMPLATE_ENDS_AT_IM_END = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML that marks nothing: the turn is what rendering it adds after its prompt.
TEMPLATE_UNMARKED = TEMPLATE.replace('{% generation %}', '').replace('{% endgeneration %}', '')
SPECIALS = ['<s>', '</s>', '<|im_start|>', '<|im_end|>']
SENTENCES = ['how do I split a model', 'over the tensor axis', 'the mesh has four axes',
             'pack the rows tightly', 'größer als gedacht', 'naïve café déjà vu', 'yes',
             'add more devices', 'the loss falls', 'check the gradients']


def conversations(count=20, seed=0) -> list[list[dict]]:
  """Multi-turn conversations, some with a system message, some non-ASCII."""
  rng = np.random.default_rng(seed)
  say = lambda: ' '.join(rng.choice(SENTENCES, rng.integers(1, 4)))
  chats = []
  for i in range(count):
    messages = [{'role': 'system', 'content': 'answer briefly'}] if i % 3 == 0 else []
    for _ in range(1 + i % 3):
      messages += [{'role': 'user', 'content': say()}, {'role': 'assistant', 'content': say()}]
    chats.append(messages)
  return chats


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE tokenizer.json trained here, with a tokenizer_config.json holding the
  chat template, as a Hugging Face model directory has them."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  root = tmp_path_factory.mktemp('chat_tokenizer')
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(SENTENCES * 10, trainer)
  tokenizer.save(str(root / 'tokenizer.json'))
  (root / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': '<s>', 'eos_token': '<|im_end|>', 'chat_template': TEMPLATE,
       'tokenizer_class': 'PreTrainedTokenizerFast'}))
  return root


@pytest.fixture(scope='module')
def chats(tmp_path_factory):
  """conversations() as a JSONL file; returns the path and the conversations."""
  path = tmp_path_factory.mktemp('chats') / 'chats.jsonl'
  chats = conversations()
  path.write_text(''.join(json.dumps({'messages': m}, ensure_ascii=False) + '\n' for m in chats))
  return str(path), chats


def transformers_reference(tokenizer_dir, chats, template=None):
  """transformers' ids and assistant mask of each conversation (with the tokenizer's own
  template, or `template`)."""
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
  out = [hf.apply_chat_template(m, chat_template=template, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True) for m in chats[1]]
  return [(np.asarray(o['input_ids']), np.asarray(o['assistant_masks'])) for o in out]


@pytest.fixture(scope='module')
def reference(tokenizer_dir, chats):
  return transformers_reference(tokenizer_dir, chats)


def chat_config(path, tokenizer, **data):
  cfg = small_config()
  cfg.model.vocab_size = 512
  cfg.data.update(source='files', path=path, format='chat', tokenizer=tokenizer, seq_len=32,
                  **data)
  return cfg


def one_device():
  return make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])


@pytest.mark.parametrize('template', [None, TEMPLATE_ENDS_AT_IM_END],
                         ids=['block_ends_after_newline', 'block_ends_at_im_end'])
def test_each_token_is_flagged_as_transformers_marks_the_assistants(template, tokenizer_dir,
                                                                   chats, tmp_path):
  """Exactly the tokens of the template's generation blocks, whatever follows them."""
  data = {}
  if template:
    (tmp_path / 'chat.jinja').write_text(template)
    data['chat_template'] = str(tmp_path / 'chat.jinja')
  reference = transformers_reference(tokenizer_dir, chats, template)
  cfg = chat_config(chats[0], str(tokenizer_dir), **data)
  encode = ChatEncoder(cfg.data, load_tokenizer(cfg.data))
  for messages, (want_ids, want_mask) in zip(chats[1], reference):
    got = encode(messages)
    np.testing.assert_array_equal(got['tokens'], want_ids)
    np.testing.assert_array_equal(got['loss_mask'], want_mask)
  flagged = np.concatenate([mask for _, mask in reference])
  assert 0.2 < flagged.mean() < 0.8  # both kinds of token, so a constant mask fails


@pytest.mark.parametrize('packing', [True, False], ids=['packed', 'one_per_row'])
def test_batches_take_the_loss_on_assistant_tokens_only(packing, tokenizer_dir, chats,
                                                        reference):
  """The held-out split is read in file order, so every row is known: packed, the
  conversations laid end to end and cut into rows of seq_len + 1; otherwise one per row, cut
  or padded. `mask` at t is the flag of target t+1 within the same conversation; segment ids
  and positions start anew with each conversation."""
  cfg = chat_config(chats[0], str(tokenizer_dir), eval_path=chats[0], packing=packing)
  cfg.eval.batches = 3
  L = cfg.data.seq_len + 1
  batches = list(make_eval_batches(cfg, one_device())())
  rows = [np.concatenate([np.asarray(b[k]) for b in batches])
          for k in ('inputs', 'targets', 'mask', 'positions')]
  if packing:
    ids = np.concatenate([i for i, _ in reference])
    flags = np.concatenate([m for _, m in reference])
    document = np.concatenate([np.full(len(i), d) for d, (i, _) in enumerate(reference)])
    starts = np.concatenate([np.arange(len(i)) for i, _ in reference])
    segments = np.concatenate([np.asarray(b['segment_ids']) for b in batches])
    assert len(ids) >= len(rows[0]) * L  # one pass over the conversations fills the rows
  for r, (inputs, targets, mask, positions) in enumerate(zip(*rows)):
    if packing:
      window = slice(r * L, (r + 1) * L)
      want_ids, want_doc, want_flags = ids[window], document[window], flags[window]
      same = want_doc[1:] == want_doc[:-1]
      want_positions = starts[window][:-1] - starts[r * L]
      want_positions = np.where(want_doc[:-1] == want_doc[0], want_positions, starts[window][:-1])
      new_document = np.concatenate([[True], want_doc[1:-1] != want_doc[:-2]])
      np.testing.assert_array_equal(segments[r][1:] != segments[r][:-1], new_document[1:])
      assert segments[r].min() > 0  # packed rows are full
    else:
      chat = reference[r % len(reference)]
      want_ids, want_flags = (np.pad(a[:L], (0, max(0, L - len(a)))) for a in chat)
      same = np.arange(1, L) < len(chat[0])
      want_positions = np.where(np.arange(L - 1) < len(chat[0]), np.arange(L - 1), 0)
    np.testing.assert_array_equal(np.append(inputs, targets[-1]), want_ids)
    np.testing.assert_array_equal(mask, (same & (want_flags[1:] > 0)).astype(np.float32))
    np.testing.assert_array_equal(positions, want_positions)
  assert 0 < np.mean(rows[2]) < 1


@pytest.mark.parametrize('template,turn_end', [
    (TEMPLATE, '<|im_end|>\n'), (TEMPLATE_ENDS_AT_IM_END, '<|im_end|>'),
    (TEMPLATE_UNMARKED, '<|im_end|>\n')], ids=['marked', 'marked_to_im_end', 'unmarked'])
def test_the_byte_tokenizer_takes_a_template_file(template, turn_end, tmp_path, chats):
  """Without transformers: decoding the flagged tokens of each conversation gives the
  assistant's replies with what the generation blocks mark after them, or without blocks what
  rendering the turn adds after its prompt (the end-of-turn marker), non-ASCII text included."""
  (tmp_path / 'chatml.jinja').write_text(template)
  cfg = chat_config(chats[0], 'byte', chat_template=str(tmp_path / 'chatml.jinja'))
  tokenizer = load_tokenizer(cfg.data)
  encode = ChatEncoder(cfg.data, tokenizer)
  for messages in chats[1]:
    got = encode(messages)
    text = tokenizer.decode(got['tokens'])
    assert text == chatml(messages)
    replies = ''.join(m['content'] + turn_end for m in messages if m['role'] == 'assistant')
    assert tokenizer.decode(got['tokens'][got['loss_mask'] > 0]) == replies


def chatml(messages):
  """ChatML written out by hand (the byte tokenizer has no BOS text)."""
  return ''.join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


BAD_CHATS = {
    'byte_without_template': ({}, dict(tokenizer='byte'),
                              "data.tokenizer='byte' has no chat template; set data.chat_template"),
    'tokenizer_without_template': ({'tok/tokenizer.json': None}, dict(tokenizer='{tmp}/tok'),
                                   r'has no chat template \(no chat_template.jinja'),
    'unknown_role': ({'chats.jsonl': [{'role': 'user', 'content': 'hi'},
                                      {'role': 'bot', 'content': 'hello'}]}, {},
                     r"chats.jsonl \(record 1\) has a message with role 'bot'; roles are "
                     'system, user, assistant, tool'),
    'no_messages': ({'chats.jsonl': 'text'}, {},
                    r'chats.jsonl \(record 1\) has no "messages" list'),
    'template_missing': ({}, dict(chat_template='{tmp}/none.jinja'),
                         r"data.chat_template='.*/none.jinja' cannot be read"),
}


@pytest.mark.parametrize('files,data,message', BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_input_is_a_config_error(files, data, message, tmp_path, tokenizer_dir, chats):
  path = chats[0]
  for name, content in files.items():
    (tmp_path / name).parent.mkdir(exist_ok=True)
    if name.endswith('tokenizer.json'):
      (tmp_path / name).write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
    else:
      record = {'messages': content} if isinstance(content, list) else {content: 'hi'}
      (tmp_path / name).write_text(json.dumps(record) + '\n')
      path = str(tmp_path / name)
  data = {'tokenizer': str(tokenizer_dir), **{k: v.format(tmp=tmp_path) for k, v in data.items()}}
  cfg = chat_config(path, **data)
  with pytest.raises(ConfigError, match=message):
    make_batches(cfg, one_device())
