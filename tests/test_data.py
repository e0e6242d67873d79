"""The input pipeline: formats, tokenizers, packing, order, streams, splits, resume."""

import io
import json
import re

import jax
import numpy as np
import pytest

from conftest import small_config, text_config
from jaxllm.config import ConfigError
from jaxllm.data import (BOS_ID, EOS_ID, load_tokenizer, make_batches, make_eval_batches,
                         write_token_records)
from jaxllm.data import pretokenize as pretokenize_cli
from jaxllm.data.pretokenize import pretokenize
from jaxllm.data.sources import split, stream_share
from jaxllm.data.tokenizer import ByteTokenizer
from jaxllm.parallel.mesh import make_mesh

DOCS = ['the mesh splits every layer', 'across devices while', 'the compiler inserts collectives',
        'so that each shard', 'computes its part', 'of the batch', 'ünïcode too', 'and the end']


@pytest.fixture(scope='module')
def mesh():
  return make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1])


def files_config(path, **data):
  """`small_config` reading documents at `path`, prefetch off unless asked for."""
  cfg = small_config()
  cfg.data.update(source='files', path=str(path), prefetch=0)
  cfg.data.update(**data)
  return cfg


def write_docs(tmp_path, fmt, docs=DOCS) -> str:
  """`docs` in format `fmt` under tmp_path; returns the data.path to read them from."""
  if fmt == 'text':
    for i, d in enumerate(docs):
      (tmp_path / f'doc{i:02d}.txt').write_text(d)
    return str(tmp_path)
  if fmt == 'lines':  # blank lines are not documents; split over two files
    half = len(docs) // 2
    (tmp_path / 'a.txt').write_text('\n'.join(docs[:half]) + '\n\n')
    (tmp_path / 'b.txt').write_text('\r\n'.join(docs[half:]))
    return str(tmp_path / '*.txt')
  if fmt == 'jsonl':
    (tmp_path / 'docs.jsonl').write_text(
        ''.join(json.dumps({'id': i, 'body': d}) + '\n' for i, d in enumerate(docs)))
    return str(tmp_path / 'docs.jsonl')
  if fmt == 'parquet':
    import pyarrow as pa
    import pyarrow.parquet as pq
    half = len(docs) // 2
    for name, part in (('a', docs[:half]), ('b', docs[half:])):
      pq.write_table(pa.table({'body': part, 'n': list(range(len(part)))}),
                     str(tmp_path / f'{name}.parquet'), row_group_size=2)
    return str(tmp_path)
  assert fmt == 'arrayrecord'
  write_token_records(str(tmp_path / 'docs.arrayrecord'), [ByteTokenizer().encode(d) for d in docs])
  return str(tmp_path / 'docs.arrayrecord')


def docs_config(tmp_path, fmt, docs=DOCS, **data):
  """`files_config` over `docs` written in `fmt`; every format but 'lines' is found by 'auto'."""
  path = write_docs(tmp_path, fmt, docs)
  data = {'text_field': 'body', 'format': 'lines' if fmt == 'lines' else 'auto', **data}
  return files_config(path, **data)


def row_documents(batch) -> list[str]:
  """With packing=False: the document of each row (its first token and masked targets)."""
  inputs, targets, mask = (np.asarray(batch[k]) for k in ('inputs', 'targets', 'mask'))
  return [ByteTokenizer().decode([i[0], *t[m > 0]]) for i, t, m in zip(inputs, targets, mask)]


def take(batches, n):
  return [jax.device_get(next(batches)) for _ in range(n)]


def assert_same_batches(got, want):
  for g, w in zip(got, want, strict=True):
    assert g.keys() == w.keys()
    for k in w:
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)


# ----------------------------------------------------------------------------- formats

@pytest.mark.parametrize('fmt', ['text', 'lines', 'jsonl', 'parquet', 'arrayrecord'])
def test_each_format_reads_its_documents(tmp_path, mesh, fmt):
  cfg = docs_config(tmp_path, fmt, packing=False, seq_len=48)
  cfg.train.global_batch = len(DOCS)  # one epoch: every document once, one per row
  assert sorted(row_documents(next(make_batches(cfg, mesh)))) == sorted(DOCS)


def test_auto_format_treats_unknown_extensions_as_text(tmp_path):
  (tmp_path / 'a.py').write_text('print(1)\n')
  (tmp_path / 'b.md').write_text('# title\n')
  docs = split(files_config(tmp_path).data, 'train')
  assert sorted(docs[i] for i in range(len(docs))) == ['# title\n', 'print(1)\n']


def test_pretokenized_shards_hold_the_tokenized_documents(tmp_path):
  (tmp_path / 'src').mkdir()
  cfg = docs_config(tmp_path / 'src', 'lines')
  pretokenize(cfg.data, str(tmp_path / 'out'), shard_docs=3)
  shards = sorted(p.name for p in (tmp_path / 'out').iterdir())
  assert shards == ['train-00000.arrayrecord', 'train-00001.arrayrecord', 'train-00002.arrayrecord']
  records = split(files_config(tmp_path / 'out' / 'train-*.arrayrecord').data, 'train')
  got = [records[i] for i in range(len(records))]
  assert all(ids[0] == BOS_ID and ids[-1] == EOS_ID for ids in got)
  assert [ByteTokenizer().decode(ids) for ids in got] == DOCS


def test_pretokenize_needs_documents_in_each_shard(tmp_path):
  from absl import flags
  from conftest import REPO
  try:
    with pytest.raises(ConfigError, match='--shard_docs=0 must be at least 1'):
      pretokenize_cli.main(['pretokenize', '--config', f'{REPO}/configs/tiny.py',
                            f'--out={tmp_path}/out', '--shard_docs=0'])
  finally:
    flags.FLAGS.unparse_flags()
  assert not (tmp_path / 'out').exists()


# ----------------------------------------------------------------------------- rows

def test_packed_rows_mark_documents(tmp_path, mesh):
  """Documents [1 2 3], [4 5 6 7 8], [9 10] packed into rows of 7 tokens, in order (the eval
  split is not shuffled): positions restart per document, no target crosses a boundary."""
  write_token_records(str(tmp_path / 'eval.arrayrecord'), [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]])
  cfg = files_config(tmp_path / 'eval.arrayrecord', eval_path=str(tmp_path / 'eval.arrayrecord'),
                     seq_len=6)
  cfg.train.global_batch = 2
  cfg.eval.batches = 1
  (batch,) = [jax.device_get(b) for b in make_eval_batches(cfg, mesh)()]
  np.testing.assert_array_equal(batch['inputs'], [[1, 2, 3, 4, 5, 6], [8, 9, 10, 1, 2, 3]])
  np.testing.assert_array_equal(batch['targets'], [[2, 3, 4, 5, 6, 7], [9, 10, 1, 2, 3, 4]])
  np.testing.assert_array_equal(batch['positions'], [[0, 1, 2, 0, 1, 2], [0, 0, 1, 0, 1, 2]])
  np.testing.assert_array_equal(batch['segment_ids'], [[1, 1, 1, 2, 2, 2], [1, 2, 2, 3, 3, 3]])
  np.testing.assert_array_equal(batch['mask'], [[1, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0]])
  assert {k: v.dtype for k, v in batch.items()} == {
      'inputs': np.int32, 'targets': np.int32, 'positions': np.int32, 'segment_ids': np.int32,
      'mask': np.float32}


@pytest.mark.parametrize('attention, max_documents, refused', [
    ('cudnn', 3, False), ('cudnn', 2, True), ('xla', 2, False)])
def test_cudnn_rows_hold_at_most_max_documents(tmp_path, mesh, attention, max_documents,
                                               refused):
  """cuDNN's packed attention has room for model.max_documents documents per row: a row with
  more (here the second, of 3) is refused by name, not attended across. XLA takes any."""
  write_token_records(str(tmp_path / 'eval.arrayrecord'), [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]])
  cfg = files_config(tmp_path / 'eval.arrayrecord', eval_path=str(tmp_path / 'eval.arrayrecord'),
                     seq_len=6)
  cfg.train.global_batch = 2
  cfg.eval.batches = 1
  cfg.model.update(attention=attention, max_documents=max_documents)
  if not refused:
    assert len(list(make_eval_batches(cfg, mesh)())) == 1
    return
  with pytest.raises(ConfigError, match=r'a packed row holds 3 documents, more than '
                                        r'model.max_documents=2 .*raise model.max_documents'):
    list(make_eval_batches(cfg, mesh)())


def test_unpacked_rows_hold_one_document_each(tmp_path, mesh):
  """Short documents are padded with segment 0 (masked out), long ones cut to seq_len + 1."""
  write_token_records(str(tmp_path / 'eval.arrayrecord'), [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]])
  cfg = files_config(tmp_path / 'eval.arrayrecord', eval_path=str(tmp_path / 'eval.arrayrecord'),
                     seq_len=5, packing=False)
  cfg.train.global_batch = 2
  cfg.eval.batches = 1
  (batch,) = [jax.device_get(b) for b in make_eval_batches(cfg, mesh)()]
  np.testing.assert_array_equal(batch['inputs'], [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
  np.testing.assert_array_equal(batch['targets'], [[2, 3, 0, 0, 0], [5, 6, 7, 8, 9]])
  np.testing.assert_array_equal(batch['positions'], [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])
  assert 'segment_ids' not in batch  # one document per row: the causal mask is enough
  np.testing.assert_array_equal(batch['mask'], [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])


def test_synthetic_batch_is_fixed_and_stateless(mesh):
  cfg = small_config()
  batches = make_batches(cfg, mesh)
  first, second = take(batches, 2)
  assert_same_batches([second], [first])
  np.testing.assert_array_equal(first['inputs'][:, 1:], first['targets'][:, :-1])
  assert 'segment_ids' not in first and (first['mask'] == 1).all()
  np.testing.assert_array_equal(first['positions'][3], np.arange(cfg.data.seq_len))


# ----------------------------------------------------------------------------- order

def test_order_follows_the_seed(corpus, mesh):
  cfg = text_config(corpus)
  same = take(make_batches(cfg, mesh), 2)
  assert_same_batches(take(make_batches(cfg, mesh), 2), same)
  cfg.train.seed = 1
  other = take(make_batches(cfg, mesh), 2)
  assert not np.array_equal(other[0]['inputs'], same[0]['inputs'])


def test_every_epoch_is_a_new_permutation(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'lines', packing=False, seq_len=48)
  cfg.train.global_batch = len(DOCS)  # a batch is an epoch
  epochs = [row_documents(b) for b in take(make_batches(cfg, mesh), 4)]
  assert all(sorted(e) == sorted(DOCS) for e in epochs)
  assert len({tuple(e) for e in epochs}) > 1


def _tiling_records(tmp_path):
  """Documents of 4 tokens in rows of 8: every row ends where a document ends."""
  documents = [[d, d + 1, d + 2, d + 3] for d in range(0, 40, 4)]
  write_token_records(str(tmp_path / 'd.arrayrecord'), documents)
  return files_config(tmp_path / 'd.arrayrecord', seq_len=7)


RESUME_CASES = {
    'packed': lambda p: docs_config(p, 'lines', seq_len=24),
    'unpacked': lambda p: docs_config(p, 'lines', seq_len=24, packing=False),
    'rows end with documents': _tiling_records,
}


@pytest.mark.parametrize('case', RESUME_CASES)
def test_state_resumes_exactly(tmp_path, mesh, case):
  """Short documents, so the three batches after the checkpoint cross epochs; batches are
  prefetched ahead of what was consumed."""
  cfg = RESUME_CASES[case](tmp_path)
  cfg.data.prefetch = 3
  batches = make_batches(cfg, mesh)
  take(batches, 3)
  state = json.loads(json.dumps(batches.get_state()))  # as a checkpoint stores it
  want = take(batches, 3)
  resumed = make_batches(cfg, mesh)
  resumed.set_state(state)
  assert_same_batches(take(resumed, 3), want)


def _save_and_restore_position(tmp_path, batches, resumed):
  """`batches`' position through the checkpoint handler (one JSON file per stream) into
  `resumed`."""
  from etils import epath
  from jaxllm.checkpoint import StreamPositions, StreamPositionsRestore, StreamPositionsSave
  directory = epath.Path(tmp_path / 'position')
  directory.mkdir()
  StreamPositions().save(directory, StreamPositionsSave(batches))
  StreamPositions().restore(directory, StreamPositionsRestore(resumed))
  return sorted(p.name for p in directory.iterdir())


def test_position_saves_per_stream_and_restores(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'lines', seq_len=24, prefetch=2, streams=2)
  batches = make_batches(cfg, mesh)
  take(batches, 2)
  resumed = make_batches(cfg, mesh)
  files = _save_and_restore_position(tmp_path, batches, resumed)
  assert files == ['stream-0-of-2.json', 'stream-1-of-2.json']
  assert_same_batches(take(resumed, 2), take(batches, 2))


def test_automatic_streams_follow_the_checkpoint(tmp_path, mesh):
  """A run with data.streams=0 resuming a position read as 2 streams (say, by 2 processes)
  reads on as 2 streams, exactly where they were."""
  cfg = docs_config(tmp_path, 'lines', seq_len=24, streams=2)
  batches = make_batches(cfg, mesh)
  take(batches, 3)
  cfg.data.streams = 0
  resumed = make_batches(cfg, mesh)
  assert resumed.streams == 1  # one process
  _save_and_restore_position(tmp_path, batches, resumed)
  assert resumed.streams == 2
  assert_same_batches(take(resumed, 2), take(batches, 2))


def test_another_fixed_stream_count_cannot_resume(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'lines', seq_len=24, streams=2)
  batches = make_batches(cfg, mesh)
  cfg.data.streams = 4
  with pytest.raises(ConfigError, match=r'data.streams=2 .* this run has data.streams=4'):
    _save_and_restore_position(tmp_path, batches, make_batches(cfg, mesh))


# ----------------------------------------------------------------------------- streams, splits

def test_streams_read_disjoint_documents_into_their_own_rows(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'jsonl', packing=False, seq_len=48, streams=2)
  train = split(cfg.data, 'train')
  shares = [[s[i] for i in range(len(s))] for s in (stream_share(train, k, 2) for k in (0, 1))]
  assert not set(shares[0]) & set(shares[1])
  assert sorted(shares[0] + shares[1]) == sorted(DOCS)
  # Rows [0, B/2) of every batch come from stream 0's documents, the rest from stream 1's.
  half = cfg.train.global_batch // 2
  for batch in take(make_batches(cfg, mesh), 2):
    rows = row_documents(batch)
    assert set(rows[:half]) <= set(shares[0]) and set(rows[half:]) <= set(shares[1])


def test_eval_fraction_holds_out_documents_stably(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'lines', eval_fraction=0.25, packing=False, seq_len=48)
  train_docs, eval_docs = split(cfg.data, 'train'), split(cfg.data, 'eval')
  train = {train_docs[i] for i in range(len(train_docs))}
  held = {eval_docs[i] for i in range(len(eval_docs))}
  assert len(held) == 2 and not train & held and sorted(train | held) == sorted(DOCS)
  cfg.train.seed = 7  # the held-out documents do not move with the seed
  assert set(split(cfg.data, 'eval').indices) == set(eval_docs.indices)

  cfg.eval.batches = 2
  evaluate = make_eval_batches(cfg, mesh)
  first = [jax.device_get(b) for b in evaluate()]
  assert len(first) == 2 and set(sum((row_documents(b) for b in first), [])) == held
  assert_same_batches([jax.device_get(b) for b in evaluate()], first)
  assert_same_batches([jax.device_get(b) for b in make_eval_batches(cfg, mesh)()], first)
  assert set(sum((row_documents(b) for b in take(make_batches(cfg, mesh), 3)), [])) <= train


def test_no_eval_split_without_eval_settings(tmp_path, mesh):
  assert make_eval_batches(docs_config(tmp_path, 'lines'), mesh) is None
  assert make_eval_batches(small_config(), mesh) is None


# ----------------------------------------------------------------------------- tokenizers

def hf_tokenizer(tmp_path, template='<s> $A', eos_config=None) -> str:
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  vocab = {'[UNK]': 0, '<s>': 1, '</s>': 2, '<|end|>': 3, 'hello': 4, 'world': 5}
  tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = processors.TemplateProcessing(
      single=template, special_tokens=[('<s>', 1), ('</s>', 2)])
  tok.add_special_tokens(['<s>', '</s>', '<|end|>'])
  tok.save(str(tmp_path / 'tokenizer.json'))
  if eos_config:
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': eos_config}))
  return str(tmp_path / 'tokenizer.json')


def test_hf_tokenizer_adds_bos_by_its_template_and_eos(tmp_path):
  tok = load_tokenizer(files_config('x', tokenizer=hf_tokenizer(tmp_path)).data)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (6, 1, 2)  # EOS: the known '</s>'
  ids = tok.encode('hello world')
  assert ids.dtype == np.int32 and ids.tolist() == [1, 4, 5, 2]
  assert tok.decode(ids) == 'hello world'
  by_directory = load_tokenizer(files_config('x', tokenizer=str(tmp_path)).data)  # a HF checkpoint
  assert by_directory.encode('hello world').tolist() == [1, 4, 5, 2]


def test_hf_tokenizer_eos_from_config_not_doubled(tmp_path):
  path = hf_tokenizer(tmp_path, '<s> $A </s>', eos_config={'content': '<|end|>'})
  tok = load_tokenizer(files_config('x', tokenizer=path).data)
  assert (tok.bos_id, tok.eos_id) == (1, 3)
  assert tok.encode('hello').tolist() == [1, 4, 2, 3]  # the template's </s>, then EOS
  path = hf_tokenizer(tmp_path, '<s> $A </s>', eos_config='</s>')
  assert load_tokenizer(files_config('x', tokenizer=path).data).encode('hello').tolist() == [1, 4, 2]


def test_hf_tokenizer_feeds_the_pipeline(tmp_path, mesh):
  (tmp_path / 'd').mkdir()
  (tmp_path / 'd' / 'doc.txt').write_text('hello world')
  cfg = files_config(tmp_path / 'd', tokenizer=hf_tokenizer(tmp_path), seq_len=4)
  cfg.train.global_batch = 1
  batch = next(make_batches(cfg, mesh))
  np.testing.assert_array_equal(batch['inputs'], [[1, 4, 5, 2]])
  np.testing.assert_array_equal(batch['mask'], [[1, 1, 1, 0]])


@pytest.mark.parametrize('bos', [1, -1])
def test_sentencepiece_tokenizer_bos_and_eos(tmp_path, bos):
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(DOCS * 10), model_writer=model, vocab_size=40, hard_vocab_limit=False,
      bos_id=bos, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
  (tmp_path / 'sp.model').write_bytes(model.getvalue())
  tok = load_tokenizer(files_config('x', tokenizer=str(tmp_path / 'sp.model')).data)
  ids = tok.encode('the mesh splits')
  pieces = spm.SentencePieceProcessor(model_proto=model.getvalue()).encode('the mesh splits')
  assert ids.dtype == np.int32 and tok.eos_id == 2
  assert tok.bos_id == (1 if bos == 1 else None)
  assert ids.tolist() == [1] * (bos == 1) + pieces + [2]
  assert tok.decode(ids) == 'the mesh splits'


def test_byte_tokenizer_wraps_documents():
  tok = load_tokenizer(files_config('x').data)
  assert tok.encode('hé').tolist() == [BOS_ID, 104, 195, 169, EOS_ID]
  assert tok.decode(tok.encode('hé')) == 'hé' and tok.vocab_size == 258


# ----------------------------------------------------------------------------- bad input

def _bad_jsonl(tmp_path):
  (tmp_path / 'x.jsonl').write_text('{"body": "text"}\n')
  return files_config(tmp_path / 'x.jsonl')  # text_field is 'text'


def _bad_parquet(tmp_path):
  write_docs(tmp_path, 'parquet')
  return files_config(tmp_path)


def _small_vocab(tmp_path):
  cfg = docs_config(tmp_path, 'lines')
  cfg.model.vocab_size = 200
  return cfg


def _small_vocab_records(tmp_path):
  cfg = docs_config(tmp_path, 'arrayrecord')
  cfg.model.vocab_size = 200
  return cfg


def _empty_dir(tmp_path):
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'zero.txt').write_text('')
  return files_config(tmp_path / 'empty')


def _mixed_formats(tmp_path):
  write_docs(tmp_path, 'lines')
  write_docs(tmp_path, 'jsonl')
  return files_config(tmp_path)


def _unreadable_tokenizer(tmp_path):
  (tmp_path / 'tok.json').write_text('{oops')
  return docs_config(tmp_path, 'lines', tokenizer=str(tmp_path / 'tok.json'))


def _negative_seed(tmp_path):
  cfg = docs_config(tmp_path, 'lines')
  cfg.train.seed = -1
  return cfg


BAD_INPUTS = {  # case -> (config maker, what the message must name)
    'empty path': (lambda p: files_config(''), 'data.path'),
    'missing path': (lambda p: files_config(p / 'nowhere'), 'data.path=.*nowhere'),
    'empty directory': (_empty_dir, 'data.path'),
    'unknown format': (lambda p: docs_config(p, 'lines', format='csv'), 'data.format'),
    'mixed formats': (_mixed_formats, 'data.format'),
    'jsonl without the field': (_bad_jsonl, 'data.text_field'),
    'parquet without the column': (_bad_parquet, 'data.text_field'),
    'tokenizer missing': (lambda p: docs_config(p, 'lines', tokenizer=str(p / 'tok.json')),
                          'data.tokenizer'),
    'tokenizer unreadable': (_unreadable_tokenizer, 'data.tokenizer'),
    'vocab too small': (_small_vocab, 'model.vocab_size'),
    'vocab too small for records': (_small_vocab_records, 'model.vocab_size'),
    'negative seed': (_negative_seed, 'train.seed'),
    'eval_fraction takes everything': (
        lambda p: docs_config(p, 'text', DOCS[:2], eval_fraction=0.9), 'data.eval_fraction'),
}


@pytest.mark.parametrize('case', BAD_INPUTS)
def test_bad_input_names_the_field(tmp_path, mesh, case):
  make_config, field = BAD_INPUTS[case]
  with pytest.raises(ConfigError, match=field) as error:
    make_batches(make_config(tmp_path), mesh)
  assert '\n' not in str(error.value)


def test_too_few_documents_for_the_streams(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'text', DOCS[:2], streams=4)
  with pytest.raises(ConfigError, match='data.path: 2 documents for 4 data streams'):
    make_batches(cfg, mesh)


def test_streams_must_divide_the_batch(tmp_path, mesh):
  cfg = docs_config(tmp_path, 'lines', streams=3)
  with pytest.raises(ConfigError, match='train.global_batch=8 rows do not split evenly into '
                                        'data.streams=3'):
    make_batches(cfg, mesh)


@pytest.mark.parametrize('bad_id, problem', [
    (264, 'token id 264 is outside model.vocab_size=264; set model.vocab_size to at least 265'),
    (-3, 'token id -3 is negative')])
def test_every_record_of_token_ids_is_checked(tmp_path, bad_id, problem):
  """An id outside the vocabulary in a later record (not the first, checked at start-up)
  stops the run naming the file and the record, through the trainer's read-ahead threads:
  the embedding gather would clamp it, and the run would show only a NaN."""
  from jaxllm.train import train
  path = tmp_path / 'ids.arrayrecord'
  write_token_records(str(path), [[1, 5, 6, 2]] * 3 + [[1, 7, bad_id, 2]] + [[1, 9, 2]] * 2)
  cfg = files_config(path, prefetch=4)  # small_config: model.vocab_size=264
  with pytest.raises(ConfigError, match=re.escape(f'{path}, record 3 (counting from 0): '
                                                  f'{problem}')) as error:
    train(cfg, devices=jax.devices()[:1])
  assert '\n' not in str(error.value)


def test_token_ids_up_to_the_vocabulary_load(tmp_path, mesh):
  path = tmp_path / 'ids.arrayrecord'
  write_token_records(str(path), [[1, 5, 2], [0, 263, 263], [1, 9, 2]])
  batch = jax.device_get(next(make_batches(files_config(path), mesh)))
  assert batch['inputs'].min() == 0 and batch['inputs'].max() == 263
