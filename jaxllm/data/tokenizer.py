"""Tokenizers behind one small interface, chosen by `data.tokenizer`.

`encode(text)` returns a document's int32 ids with BOS/EOS as the tokenizer defines them;
`decode(ids)` drops special tokens. Text generation reuses this module, so it depends on
nothing but the config.
"""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence

import numpy as np
from ml_collections import ConfigDict

from jaxllm.config import ConfigError

# The built-in byte-level tokenizer: ids 0-255 are the bytes themselves.
BOS_ID, EOS_ID = 256, 257
BYTE_VOCAB_SIZE = 258

# End-of-text tokens of common vocabularies, for a tokenizer.json without a tokenizer_config.json.
KNOWN_EOS_TOKENS = ('<|end_of_text|>', '</s>', '<|endoftext|>', '<eos>')


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int | None
  eos_id: int | None

  def encode(self, text: str) -> np.ndarray: ...
  def decode(self, ids: Sequence[int]) -> str: ...
  # The ids of `text` as it stands, adding no BOS/EOS (a chat template writes its own special
  # tokens), and the character offset in `text` where each id's text starts.
  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...


class ByteTokenizer:
  """UTF-8 bytes; every document is BOS + bytes + EOS."""
  vocab_size, bos_id, eos_id = BYTE_VOCAB_SIZE, BOS_ID, EOS_ID

  def encode(self, text: str) -> np.ndarray:
    raw = text.encode('utf-8')
    ids = np.empty(len(raw) + 2, np.int32)
    ids[0], ids[1:-1], ids[-1] = BOS_ID, np.frombuffer(raw, np.uint8), EOS_ID
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    sizes = [len(c.encode('utf-8')) for c in text]  # a character is 1-4 bytes
    ids = np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)
    return ids, np.repeat(np.arange(len(text)), sizes)


class HuggingFaceTokenizer:
  """A tokenizer.json. Its post-processor adds BOS (if it defines one); EOS, which
  post-processors of causal LMs usually leave out, is appended here."""

  def __init__(self, path: str):
    import tokenizers  # only runs that use one need the package loaded
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._find_eos(path)
    # What the post-processor wraps around an empty text: BOS in front, maybe EOS behind.
    specials = self._tok.encode('').ids
    self.bos_id = specials[0] if specials and specials[0] != self.eos_id else None
    self._append_eos = self.eos_id is not None and (not specials or specials[-1] != self.eos_id)

  def _find_eos(self, path: str) -> int | None:
    config_path = os.path.join(os.path.dirname(path), 'tokenizer_config.json')
    candidates = list(KNOWN_EOS_TOKENS)
    if os.path.isfile(config_path):
      with open(config_path) as f:
        eos = json.load(f).get('eos_token')
      if isinstance(eos, dict):  # older configs store an AddedToken
        eos = eos.get('content')
      if eos:
        candidates = [eos]
    ids = (self._tok.token_to_id(token) for token in candidates)
    return next((i for i in ids if i is not None), None)

  def encode(self, text: str) -> np.ndarray:
    ids = self._tok.encode(text).ids
    if self._append_eos:
      ids.append(self.eos_id)
    return np.asarray(ids, np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = self._tok.encode(text, add_special_tokens=False)
    return (np.asarray(encoding.ids, np.int32),
            np.asarray([start for start, _ in encoding.offsets], np.int64))


class SentencePieceTokenizer:
  """A SentencePiece .model; BOS/EOS are the model's own (-1 there: none)."""

  def __init__(self, path: str):
    import sentencepiece
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode(self, text: str) -> np.ndarray:
    ids = self._sp.encode(text)
    return np.asarray(([self.bos_id] if self.bos_id is not None else []) + ids +
                      ([self.eos_id] if self.eos_id is not None else []), np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    raise ConfigError("data.format='chat' needs a Hugging Face tokenizer.json or the byte "
                      'tokenizer (a SentencePiece .model gives no character offsets); convert '
                      'the tokenizer to a tokenizer.json.')


def load_tokenizer(data_cfg: ConfigDict) -> Tokenizer:
  """'byte', a tokenizer.json (or a directory holding one), or a SentencePiece .model."""
  name = data_cfg.tokenizer
  if name == 'byte':
    return ByteTokenizer()
  path = os.path.expanduser(name)
  if os.path.isdir(path):
    path = os.path.join(path, 'tokenizer.json')
  if not os.path.isfile(path):
    raise ConfigError(f"data.tokenizer={name!r}: no such file; use 'byte', a Hugging Face "
                      'tokenizer.json or a SentencePiece .model.')
  try:
    return SentencePieceTokenizer(path) if path.endswith('.model') else HuggingFaceTokenizer(path)
  except Exception as e:  # the libraries raise assorted types for unreadable files
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    raise ConfigError(f'data.tokenizer={name!r} could not be read ({reason}); point it at a '
                      'Hugging Face tokenizer.json or a SentencePiece .model.') from None
