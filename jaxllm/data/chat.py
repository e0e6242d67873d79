"""Conversations as training documents: rendered with the tokenizer's chat template, with the
loss on what the assistant says.

A conversation is a list of messages {'role', 'content'}. It is rendered with the Jinja chat
template a Hugging Face tokenizer ships (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) or `data.chat_template`, tokenized once as a whole, and each token
is flagged 1 when it belongs to what the assistant says. Where the template marks that with
`{% generation %}…{% endgeneration %}` blocks, it is exactly what the blocks render (the
character spans transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
uses); otherwise each assistant turn is the text that rendering it adds after the prompt for
it (`add_generation_prompt`), i.e. the reply and the template's end-of-turn marker. The loader
turns the flags into the batch's `mask`.
"""

from __future__ import annotations

import contextvars
import json
import os

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from ml_collections import ConfigDict

from jaxllm.config import ConfigError
from jaxllm.data.tokenizer import Tokenizer

ROLES = ('system', 'user', 'assistant', 'tool')

# While a render records its generation blocks: (the chunks output so far, their spans).
_RECORDING = contextvars.ContextVar('generation_blocks', default=None)


class _GenerationBlocks(jinja2.ext.Extension):
  """`{% generation %}…{% endgeneration %}` (Hugging Face's marking of assistant text) renders
  its body as it is and, while a render records (`_RECORDING`), the character span it fills:
  its start is the length of the output so far, as transformers' AssistantTracker counts it.
  `environment.marks_generation` says whether the template has such a block."""
  tags = {'generation'}

  def __init__(self, environment):
    super().__init__(environment)
    environment.extend(marks_generation=False)

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    self.environment.marks_generation = True
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_record'), [], [], body).set_lineno(lineno)

  def _record(self, caller) -> str:
    text = caller()
    if (recording := _RECORDING.get()) is not None:
      chunks, spans = recording
      start = sum(map(len, chunks))
      spans.append((start, start + len(text)))
    return text


def _raise(message: str):
  raise jinja2.TemplateError(message)


def _special(value) -> str:
  """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
  return (value.get('content') if isinstance(value, dict) else value) or ''


def find_template(data_cfg: ConfigDict) -> tuple[str, str, dict]:
  """The chat template's source, where it came from (for errors) and the special tokens the
  template may use (bos_token, eos_token)."""
  tokenizer_dir = None
  if data_cfg.tokenizer != 'byte':
    path = os.path.expanduser(data_cfg.tokenizer)
    tokenizer_dir = path if os.path.isdir(path) else os.path.dirname(path)
  config = {}
  config_path = tokenizer_dir and os.path.join(tokenizer_dir, 'tokenizer_config.json')
  if config_path and os.path.isfile(config_path):
    try:
      with open(config_path) as f:
        config = json.load(f)
    except (OSError, ValueError) as e:
      raise ConfigError(f'{config_path} cannot be read ({e}); fix the file or set '
                        'data.chat_template to a Jinja file.') from None
  specials = {name: _special(config.get(name)) for name in ('bos_token', 'eos_token')}
  candidates = [(data_cfg.chat_template, 'data.chat_template')] if data_cfg.chat_template else []
  if tokenizer_dir:
    candidates.append((os.path.join(tokenizer_dir, 'chat_template.jinja'), None))
  for path, field in candidates:
    path = os.path.expanduser(path)
    if os.path.isfile(path) or field:
      try:
        with open(path, encoding='utf-8') as f:
          return f.read(), path, specials
      except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f'{field}={path!r} cannot be read ({getattr(e, "strerror", None) or e}); '
                          'point it at a Jinja chat template file.') from None
  template = config.get('chat_template')
  if isinstance(template, list):  # several named templates: the default one
    template = next((t.get('template') for t in template if t.get('name') == 'default'), None)
  if isinstance(template, str) and template:
    return template, config_path, specials
  where = (f'data.tokenizer={data_cfg.tokenizer!r} has no chat template (no chat_template.jinja, '
           'and no chat_template in its tokenizer_config.json)' if tokenizer_dir else
           "data.tokenizer='byte' has no chat template")
  raise ConfigError(f"data.format='chat': {where}; set data.chat_template to a Jinja file.")


class ChatEncoder:
  """messages -> {'tokens': ids, 'loss_mask': 1 on assistant tokens}, both int32."""

  def __init__(self, data_cfg: ConfigDict, tokenizer: Tokenizer):
    source, self.where, self.specials = find_template(data_cfg)
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks])
    environment.globals['raise_exception'] = _raise
    try:
      self.template = environment.from_string(source)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat template of {self.where} is not valid Jinja ({e}); fix it or '
                        'set data.chat_template.') from None
    self.tokenizer = tokenizer

  def render(self, messages: list[dict], add_generation_prompt: bool,
             generation_spans: list[tuple[int, int]] | None = None) -> str:
    """The rendered text; the spans of its generation blocks are appended to
    `generation_spans` when one is given."""
    chunks = []
    recording = _RECORDING.set((chunks, generation_spans)) if generation_spans is not None else None
    try:
      for chunk in self.template.generate(messages=messages, **self.specials,
                                          add_generation_prompt=add_generation_prompt):
        chunks.append(chunk)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat template of {self.where} fails on a conversation ({e}); '
                        'fix the data or set data.chat_template.') from None
    finally:
      if recording is not None:
        _RECORDING.reset(recording)
    return ''.join(chunks)

  def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of what the assistant says: its
    generation blocks where the template has them, else its turns rendered one by one."""
    spans = []
    if self.template.environment.marks_generation:
      return self.render(messages, add_generation_prompt=False, generation_spans=spans), spans
    text = self.render(messages, add_generation_prompt=False)
    for i, message in enumerate(messages):
      if message['role'] != 'assistant':
        continue
      prompt = self.render(messages[:i], add_generation_prompt=True)
      through = self.render(messages[:i + 1], add_generation_prompt=False)
      if not (through.startswith(prompt) and text.startswith(through)):
        raise ConfigError(f'the chat template of {self.where} does not render a conversation '
                          'turn by turn (a shorter conversation is not a prefix of a longer '
                          'one), so the assistant turns cannot be found; set '
                          'data.chat_template to a template that does.')
      spans.append((len(prompt), len(through)))
    return text, spans

  def __call__(self, messages: list[dict]) -> dict[str, np.ndarray]:
    text, spans = self.assistant_spans(messages)
    ids, starts = self.tokenizer.encode_with_offsets(text)
    flags = np.zeros(len(ids), np.int32)
    for begin, end in spans:
      flags[(starts >= begin) & (starts < end)] = 1
    return {'tokens': ids, 'loss_mask': flags}
