"""The model against independent references: numpy attention/RoPE, a per-layer loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_params_close, paired_leaves, small_config
from jaxllm.config import default_config
from jaxllm.metrics import param_counts
from jaxllm.model import Transformer
from jaxllm.model.attention import Attention, document_spans, sharded_attention
from jaxllm.model.embedding import sharded_lookup
from jaxllm.model.layers import project, rope_frequencies
from jaxllm.model import loss
from jaxllm.model.loss import chunked_loss_sum, splits_vocabulary
from jaxllm.parallel.mesh import make_mesh, sharding_context
from jaxllm.step import loss_terms
from jaxllm.validate import resolve_mesh


def numpy_rope(x, positions, inv_freq):
  """Rotates pairs (i, i + H/2) by position · inv_freq[i], one pair at a time."""
  out = x.copy()
  half = x.shape[-1] // 2
  for i in range(half):
    angle = positions * inv_freq[i]
    a, b = x[..., i], x[..., i + half]
    out[..., i] = a * np.cos(angle) - b * np.sin(angle)
    out[..., i + half] = b * np.cos(angle) + a * np.sin(angle)
  return out


def numpy_attention(x, wq, wk, wv, wo, inv_freq):
  """Causal grouped-query attention written out head by head."""
  B, T, _ = x.shape
  N, K, H = wq.shape[1], wk.shape[1], wq.shape[2]
  pos = np.broadcast_to(np.arange(T), (B, T)).astype(np.float64)
  q = numpy_rope(np.einsum('btd,dnh->btnh', x, wq), pos[..., None], inv_freq)
  k = numpy_rope(np.einsum('btd,dkh->btkh', x, wk), pos[..., None], inv_freq)
  v = np.einsum('btd,dkh->btkh', x, wv)
  o = np.zeros((B, T, N, H))
  causal = np.tril(np.ones((T, T), bool))
  for n in range(N):
    kv = n // (N // K)
    scores = np.einsum('bqh,bkh->bqk', q[:, :, n], k[:, :, kv]) / np.sqrt(H)
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o[:, :, n] = np.einsum('bqk,bkh->bqh', p, v[:, :, kv])
  return np.einsum('btnh,nhd->btd', o, wo)


@pytest.mark.parametrize('kv_heads', [1, 2, 4])
def test_attention_matches_numpy_reference(kv_heads, one_device):
  cfg = small_config().model
  cfg.update(num_kv_heads=kv_heads, init_std=0.3)
  attn = Attention(cfg, nnx.Rngs(1))
  x = np.random.default_rng(0).normal(size=(2, 12, cfg.embed_dim)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  graphdef, state = nnx.split(attn)  # jitted: eagerly, op by op, it takes seconds
  got = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, positions))(state, jnp.asarray(x))
  w = {k: np.asarray(getattr(attn, k)[...], np.float64)
       for k in ('wq_DNH', 'wk_DKH', 'wv_DKH', 'wo_NHD')}
  want = numpy_attention(x.astype(np.float64), w['wq_DNH'], w['wk_DKH'], w['wv_DKH'],
                         w['wo_NHD'], np.asarray(rope_frequencies(cfg), np.float64))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


WHOLE_KV = dict(kv_heads=(), act_kv_heads=())


@pytest.mark.parametrize('mesh, kv_heads, rules', [
    (dict(data=2, tensor=4), 4, {}),                # rows and heads split
    (dict(data=2, tensor=4), 2, WHOLE_KV),          # kv heads whole: each device takes its own
    (dict(tensor=8), 2, WHOLE_KV),                  # one query head a device, 4 share a kv head
    (dict(data=2, fsdp=4), 2, {}),                  # 2 rows over 8: rows whole
    (dict(fsdp=4, tensor=2), 4, dict(batch=('data',), seq=('fsdp',))),  # 3 positions a device
])
def test_sharded_attention_matches_numpy_reference(mesh, kv_heads, rules):
  """Attention on each device's rows, heads and positions, wherever the rules put them."""
  cfg = small_config(**mesh)
  cfg.model.update(num_kv_heads=kv_heads, init_std=0.3)
  cfg.sharding.rules.update(rules)
  device_mesh = make_mesh(resolve_mesh(cfg.mesh, 8))
  with sharding_context(device_mesh, cfg.sharding.rules):
    attn = Attention(cfg.model, nnx.Rngs(1))
    x = np.random.default_rng(0).normal(size=(2, 12, cfg.model.embed_dim)).astype(np.float32)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    graphdef, state = nnx.split(attn)
    got = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, positions))(state, jnp.asarray(x))
  w = {k: np.asarray(getattr(attn, k)[...], np.float64)
       for k in ('wq_DNH', 'wk_DKH', 'wv_DKH', 'wo_NHD')}
  want = numpy_attention(x.astype(np.float64), w['wq_DNH'], w['wk_DKH'], w['wv_DKH'],
                         w['wo_NHD'], np.asarray(rope_frequencies(cfg.model), np.float64))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_llama3_rope_scaling_matches_formula(one_device):
  cfg = small_config().model
  cfg.update(head_dim=128, rope_theta=500_000.0)
  cfg.rope_scaling.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192)
  got = np.asarray(rope_frequencies(cfg))
  # The published recipe, element by element.
  want = []
  for i in range(0, 128, 2):
    freq = 1.0 / 500_000.0 ** (i / 128)
    wavelen = 2 * np.pi / freq
    if wavelen < 8192 / 4.0:
      want.append(freq)
    elif wavelen > 8192 / 1.0:
      want.append(freq / 8.0)
    else:
      smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
      want.append((1 - smooth) * freq / 8.0 + smooth * freq)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert got[0] == pytest.approx(1.0) and got[-1] < 1.0 / 500_000.0 ** (126 / 128)


def _model_and_tokens(**model):
  cfg = small_config().model
  cfg.update(**model)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)
  return Transformer(cfg, rngs=nnx.Rngs(0)), tokens


def _jitted(model):
  """`model(tokens, ...)` compiled once per input shape: eagerly, op by op, a call costs
  seconds."""
  graphdef, params = nnx.split(model)
  call = jax.jit(lambda params, *args: nnx.merge(graphdef, params)(*args))
  return lambda *args: call(params, *args)


def test_scanned_stack_equals_layer_by_layer_loop(one_device):
  """(Each side jitted: run eagerly, op by op, the two took twice as long.)"""
  model, tokens = _model_and_tokens(num_layers=3)
  model_def, params = nnx.split(model)
  got = jax.jit(lambda params: nnx.merge(model_def, params)(tokens))(params)

  @jax.jit
  def layer_by_layer(params):
    model = nnx.merge(model_def, params)
    graphdef, stacked = nnx.split(model.blocks)
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    x = model.embed(tokens)
    for i in range(3):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
      x, _ = layer(x, positions)
    return model.logits(x)
  np.testing.assert_allclose(got, layer_by_layer(params), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('policy', ['full', 'dots', 'dots_except_mlp', 'attention'])
def test_remat_policies_keep_loss_and_gradients(policy, one_device):
  model, tokens = _model_and_tokens()
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'mask': jnp.ones(tokens.shape)}
  graphdef, params = nnx.split(model)
  remat_model, _ = _model_and_tokens(remat=policy)
  remat_graphdef = nnx.graphdef(remat_model)

  def grads(gd):
    return jax.jit(jax.grad(lambda p: loss_terms(gd, p, batch)[0]))(params)

  for a, b in paired_leaves(grads(graphdef), grads(remat_graphdef)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_future_tokens_do_not_change_past_logits(one_device):
  model, tokens = _model_and_tokens()
  model = _jitted(model)
  changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
  before, after = model(tokens), model(changed)
  np.testing.assert_array_equal(before[:, :10], after[:, :10])
  assert not np.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize('tied', [False, True])
def test_param_counts_match_the_model(tied, one_device):
  model, _ = _model_and_tokens(tie_embeddings=tied)
  actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert param_counts(model.cfg)['total'] == actual
  assert hasattr(model, 'head_DV') != tied


def test_bf16_compute_keeps_fp32_params_and_logits(one_device):
  model, tokens = _model_and_tokens(dtype='bfloat16')
  logits = _jitted(model)(tokens)
  assert logits.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype('float32')}
  reference, _ = _model_and_tokens()
  np.testing.assert_allclose(logits, _jitted(reference)(tokens), atol=0.05)


def _pack(documents, rows: int, length: int):
  """Documents laid end to end into `rows` rows of `length` + 1 tokens, by hand: the batch
  dict the data pipeline makes, with segment ids, positions, and padding masked."""
  tokens = np.zeros((rows, length + 1), np.int32)
  segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
  row, col, seg = 0, 0, 0
  for doc in documents:
    if col + len(doc) > length + 1:
      row, col, seg = row + 1, 0, 0
    seg += 1
    tokens[row, col:col + len(doc)] = doc
    segments[row, col:col + len(doc)] = seg
    positions[row, col:col + len(doc)] = np.arange(len(doc))
    col += len(doc)
  same_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'mask': same_document.astype(np.float32),
          'segment_ids': segments[:, :-1], 'positions': positions[:, :-1]}


def test_packed_rows_give_the_loss_of_one_document_per_row(one_device):
  """Segment masking: packing documents into shared rows changes nothing in the loss."""
  model, _ = _model_and_tokens()
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, 256, n) for n in (5, 9, 3, 7, 4, 11, 6, 2)]
  packed = _pack(documents, rows=4, length=16)
  assert packed['segment_ids'].max() > 1  # rows really hold several documents
  one_per_row = [_pack([doc], rows=1, length=16) for doc in documents]
  one_per_row = {k: np.concatenate([b[k] for b in one_per_row]) for k in packed}

  loss_fn = jax.jit(lambda b: loss_terms(graphdef, params, b)[1][:2])
  (packed_sum, packed_tokens), (ref_sum, ref_tokens) = loss_fn(packed), loss_fn(one_per_row)
  assert packed_tokens == ref_tokens == sum(len(d) - 1 for d in documents)
  np.testing.assert_allclose(packed_sum, ref_sum, rtol=1e-5)


@pytest.mark.slow
def test_packed_rows_split_over_the_sequence_give_one_device_loss():
  """Context parallelism (rules.seq over fsdp=4, with tensor=2): each device holds 4 of a
  packed row's 16 positions, yet the loss and its gradients are one device's on the same
  rows, and the loss of one document per row (the reference of the test above)."""
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, 256, n) for n in (5, 9, 3, 7, 4, 11, 6, 2)]
  packed = _pack(documents, rows=4, length=16)
  one_per_row = {k: np.concatenate([_pack([d], rows=1, length=16)[k] for d in documents])
                 for k in packed}
  with sharding_context(make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), jax.devices()[:1]),
                        default_config().sharding.rules):
    graphdef, params = nnx.split(_model_and_tokens()[0])
    loss_and_grads = jax.jit(jax.value_and_grad(
        lambda p, b: loss_terms(graphdef, p, b)[1][0]))
    want_loss, want_grads = loss_and_grads(params, packed)
    alone_loss, _ = loss_and_grads(params, one_per_row)
  cfg = small_config(fsdp=4, tensor=2)
  cfg.sharding.rules.update(batch=('data',), seq=('fsdp',))
  with sharding_context(make_mesh(resolve_mesh(cfg.mesh, 8)), cfg.sharding.rules):
    got_loss, got_grads = loss_and_grads(jax.device_get(params), packed)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(got_loss, alone_loss, rtol=1e-5)
  for got, want in paired_leaves(got_grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_no_token_attends_across_documents(one_device):
  model, tokens = _model_and_tokens()
  model = _jitted(model)
  segments = jnp.where(jnp.arange(16) < 6, 1, 2) * jnp.ones_like(tokens)
  positions = jnp.where(jnp.arange(16) < 6, jnp.arange(16), jnp.arange(16) - 6) * jnp.ones_like(tokens)
  changed = tokens.at[:, :6].set((tokens[:, :6] + 1) % 256)  # edit only the first document
  before = model(tokens, positions, segments)
  after = model(changed, positions, segments)
  np.testing.assert_array_equal(before[:, 6:], after[:, 6:])
  assert not np.allclose(before[:, :6], after[:, :6])
  # The second document alone, at positions 0.., gives the same logits as inside the row.
  alone = model(tokens[:, 6:])
  np.testing.assert_allclose(before[:, 6:], alone, rtol=1e-5, atol=1e-5)


# Rows of 12 tokens: several documents, one, padding (segment id 0) after documents, a row
# of padding alone, and 12 documents of one token each (the most a row can hold).
PACKED_ROWS = np.array([
    [1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4],
    [1] * 12,
    [1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0] * 12,
    list(range(1, 13)),
], np.int32)


def spans_mask(starts_BM1, lengths_BM, T: int) -> np.ndarray:
  """[B, T, T]: where cuDNN's packed layout with a causal mask lets query t see key s, read
  from the spans alone (s ≤ t, both inside one span); also checks their padding."""
  starts_BM1, lengths_BM = np.asarray(starts_BM1), np.asarray(lengths_BM)
  assert (starts_BM1[:, -1] == -1).all()  # the layout's spare column
  assert ((starts_BM1[:, :-1] == -1) == (lengths_BM == -1)).all()
  mask = np.zeros((len(lengths_BM), T, T), bool)
  for b, m in zip(*np.nonzero(lengths_BM >= 0)):
    start, end = starts_BM1[b, m], starts_BM1[b, m] + lengths_BM[b, m]
    mask[b, start:end, start:end] |= np.tri(end - start, dtype=bool)
  return mask


@pytest.mark.parametrize('max_documents', [12, 16])
def test_document_spans_are_the_documents(max_documents):
  """The spans given to cuDNN allow exactly what the dense segment mask allows: same
  segment id, causal; every token sees itself, so each lies in a span (padding too) and gets
  an output. With M = T = 12 the row of one-token documents fills every span."""
  starts, lengths = jax.jit(document_spans, static_argnums=1)(PACKED_ROWS, max_documents)
  assert starts.shape == (6, max_documents + 1) and lengths.shape == (6, max_documents)
  got = spans_mask(starts, lengths, 12)
  same = PACKED_ROWS[:, :, None] == PACKED_ROWS[:, None, :]
  np.testing.assert_array_equal(got, same & np.tri(12, dtype=bool))
  np.testing.assert_array_equal(np.sum(np.asarray(lengths) > 0, axis=1), [4, 1, 3, 2, 1, 12])


def documents_row(lengths, T: int) -> np.ndarray:
  """Segment ids of a row holding documents of these lengths, then padding (id 0)."""
  ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  return np.pad(ids, (0, T - len(ids))).astype(np.int32)


def hopper_or_newer() -> bool:
  """Whether JAX runs on an NVIDIA GPU of compute capability 9.0 or more: cuDNN's packed
  layout needs one."""
  return jax.default_backend() == 'gpu' and tuple(
      int(x) for x in jax.devices()[0].compute_capability.split('.')) >= (9, 0)


@pytest.mark.skipif(not hopper_or_newer(), reason='cuDNN\'s packed layout needs a Hopper GPU')
@pytest.mark.parametrize('max_documents', [4, 256])
def test_packed_cudnn_attention_matches_the_segment_mask(max_documents):
  """On a GPU: cuDNN's packed layout gives the outputs and gradients of XLA's attention under
  the dense segment mask (computed in fp32 from the same bf16 inputs), with grouped-query
  heads. Rows of up to `max_documents` documents; at 256, one of 256 one-token documents."""
  T, N, K, H = 256, 4, 2, 64
  rows = [[100, 30, 1, 125], [256], [60, 40], [7]] + ([[1] * 256] if max_documents == T else [])
  segment_ids = jnp.asarray(np.stack([documents_row(r, T) for r in rows]))
  keys = jax.random.split(jax.random.key(4), 4)
  q, k, v, ct = (jax.random.normal(key, (len(rows), T, heads, H), jnp.bfloat16)
                 for key, heads in zip(keys, (N, K, K, N)))

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def outputs_and_gradients(implementation, dtype, q, k, v, ct, segment_ids):
    def attend(q, k, v):
      return sharded_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), segment_ids,
                               implementation, max_documents)
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct.astype(out.dtype))

  got = outputs_and_gradients('cudnn', jnp.bfloat16, q, k, v, ct, segment_ids)
  want = outputs_and_gradients('xla', jnp.float32, q, k, v, ct, segment_ids)
  for g, w in paired_leaves(got, want):
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_dots_except_mlp_keeps_less_than_dots(one_device):
  """The policy drops the MLP's activations: the compiled step needs less scratch memory."""
  _, tokens = _model_and_tokens()
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'mask': jnp.ones(tokens.shape)}

  def scratch_bytes(policy):
    model, _ = _model_and_tokens(remat=policy, mlp_dim=1024)
    graphdef, params = nnx.split(model)
    grad = jax.jit(jax.grad(lambda p: loss_terms(graphdef, p, batch)[0]))
    return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

  assert scratch_bytes('dots_except_mlp') < 0.75 * scratch_bytes('dots')


@pytest.mark.parametrize('spec', ['btd,dnh->btnh', 'btnh,nhd->btd', 'btf,fd->btd'])
def test_projection_gradients_match_autodiff(spec, one_device):
  """`project` takes its gradients by hand (to choose their element type): in fp32 they are
  autodiff's of the plain einsum."""
  x_axes, rest = spec.split(',')
  w_axes, out_axes = rest.split('->')
  sizes = dict(b=2, t=3, d=4, n=2, h=5, f=6)
  keys = jax.random.split(jax.random.key(0), 3)
  x, w, ct = (jax.random.normal(k, [sizes[a] for a in axes])
              for k, axes in zip(keys, (x_axes, w_axes, out_axes)))
  got = jax.grad(lambda x, w: jnp.sum(project(spec, x, w, 'float32') * ct), (0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * ct), (0, 1))(x, w)
  for g, r in paired_leaves(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('mesh, rules, rows', [
    (dict(data=2, fsdp=2, tensor=2), {}, 8),
    (dict(fsdp=8), {}, 8),
    (dict(data=8), {}, 8),
    (dict(data=2, fsdp=2, tensor=2), {}, 1),  # decoding: rows fewer than batch shards
    (dict(fsdp=4, tensor=2), {'vocab': ('tensor', 'fsdp'), 'embed': ()}, 8),
    (dict(data=2, fsdp=2, tensor=2), {'vocab': (), 'embed': ('tensor', 'fsdp')}, 8),
    (dict(data=2, fsdp=2, tensor=2), {'vocab': ('data',), 'embed': ('fsdp', 'tensor')}, 8),
    # positions split too (context parallelism): over the columns' axis, over the rows'
    (dict(data=2, fsdp=2, tensor=2), {'batch': ('data',), 'seq': ('fsdp',)}, 8),
    (dict(data=2, fsdp=2, tensor=2), {'batch': ('data',), 'seq': ('fsdp',), 'vocab': ('fsdp',),
                                      'embed': ('tensor',)}, 8),
])
def test_embedding_lookup_matches_the_whole_table(mesh, rules, rows):
  """Rows looked up where the table is split give the whole table's rows and its gradient."""
  V, D, T = 64, 32, 6
  keys = jax.random.split(jax.random.key(1), 3)
  table = jax.random.normal(keys[0], (V, D))
  tokens = jax.random.randint(keys[1], (rows, T), 0, V)
  ct = jax.random.normal(keys[2], (rows, T, D))
  np_table, np_tokens, np_ct = (np.asarray(a) for a in (table, tokens, ct))
  want_grad = np.zeros_like(np_table)
  np.add.at(want_grad, np_tokens, np_ct)  # each occurrence adds its row's cotangent
  want = np.sum(np_table[np_tokens] * np_ct), want_grad
  shape = {**dict(data=1, fsdp=1, pipe=1, tensor=1), **mesh}
  all_rules = {**default_config().sharding.rules, **rules}
  with sharding_context(make_mesh(shape), all_rules):
    got = jax.jit(jax.value_and_grad(
        lambda t: jnp.sum(sharded_lookup(t, tokens, jnp.float32) * ct)))(table)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def _whole_logits_loss(x, w, targets, mask, z_loss=0.0):
  logits = jnp.einsum('btd,dv->btv', x, w)
  logp = jax.nn.log_softmax(logits, axis=-1)
  log_z = jax.scipy.special.logsumexp(logits, axis=-1)
  return jnp.sum((z_loss * log_z ** 2 - jnp.take_along_axis(logp, targets[..., None],
                                                              axis=-1)[..., 0]) * mask)


@pytest.mark.parametrize('z_loss', [0.0, 0.1])
@pytest.mark.parametrize('chunks', [1, 4])
@pytest.mark.parametrize('mesh, rules, V, sliced', [
    (dict(), {}, 96, False),
    (dict(data=2, fsdp=2, tensor=2), {}, 96, False),  # 64 rows' tokens > 48 per tensor part
    (dict(fsdp=8), {}, 98, False),
    (dict(fsdp=8), {}, 402, True),  # vocabulary slices padded: 8 × 51 columns
    # context parallel; slices padded, 197 columns per tensor part in 4 × 50
    (dict(fsdp=4, tensor=2), dict(batch=('data',), seq=('fsdp',)), 394, True)])
def test_chunked_loss_equals_the_whole_logits(chunks, mesh, rules, V, sliced, z_loss,
                                              monkeypatch):
  """The loss made a chunk of positions at a time, with its hand-made gradients, equals
  log-softmax over all the logits at once (fp32, 1e-6), masked tokens left out; with z-loss,
  the objective adds z·log²Z per token (gradients by jax.grad of that formula) and the
  logged loss stays the cross-entropy. Over fsdp each device takes a slice of the vocabulary
  for the whole group's rows where that moves fewer bytes (`sliced`), else the whole head."""
  chose = []
  monkeypatch.setattr(loss, 'splits_vocabulary', lambda *args: chose.append(
      splits_vocabulary(*args)) or chose[-1])
  B, T, D = 8, 16, 32
  keys = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(keys[0], (B, T, D))
  w = jax.random.normal(keys[1], (D, V)) * 0.1
  targets = jax.random.randint(keys[2], (B, T), 0, V)
  mask = (jnp.arange(T) % 5 != 0).astype(jnp.float32) * jnp.ones((B, 1))
  want = jax.jit(jax.value_and_grad(_whole_logits_loss, (0, 1)))(x, w, targets, mask, z_loss)
  want_ce = jax.jit(_whole_logits_loss)(x, w, targets, mask)
  shape = {**dict(data=1, fsdp=1, pipe=1, tensor=1), **mesh}
  with sharding_context(make_mesh(shape), {**default_config().sharding.rules, **rules}):
    (objective, ce), grads = jax.jit(jax.value_and_grad(
        lambda x, w: chunked_loss_sum(chunks, jnp.float32, z_loss, x, w, targets, mask),
        (0, 1), has_aux=True))(x, w)
  assert chose == [sliced]
  np.testing.assert_allclose(objective, want[0], rtol=1e-6)
  np.testing.assert_allclose(ce, want_ce, rtol=1e-6)
  if z_loss:
    assert objective > ce * 1.2  # the z term is really there
  for g, r in paired_leaves(grads, want[1]):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def test_tree_comparisons_fail_on_a_missing_extra_or_moved_leaf():
  """The helpers every tree comparison here goes through (conftest): a zip of leaves alone
  would pass a tree that lost a parameter, or pair two parameters by position."""
  want = {'blocks': {'w': np.ones((2, 3)), 'scale': np.ones(3)}, 'embed': np.ones((4, 3))}
  assert_params_close({k: v for k, v in want.items()}, want)
  broken = {
      'missing': {'blocks': {'w': np.ones((2, 3))}, 'embed': np.ones((4, 3))},
      'extra': {**want, 'head': np.ones((3, 4))},
      'renamed': {'blocks': {'w': np.ones((2, 3)), 'norm': np.ones(3)}, 'embed': np.ones((4, 3))},
      'broadcast': {**want, 'blocks': {'w': np.ones((1, 3)), 'scale': np.ones(3)}},
  }
  for name, got in broken.items():
    with pytest.raises(AssertionError):
      assert_params_close(got, want)
    with pytest.raises(AssertionError):
      paired_leaves(want, got)
