"""cuDNN's attention as the model calls it (`jaxllm.model.attention.sharded_attention`), on a
GPU, against XLA's: packed documents, grouped K/V heads and sliding windows, bf16.

    python benchmarks/attention.py [--reps 10]

For each case (the head shapes and windows of the families' configs: Llama-3-8B, Mistral-7B's
4,096 window, Gemma-3's 1,024 window at head_dim 256, global and sliding), rows packed with
documents of uneven lengths and a padded tail: the output and the gradients of q, k and v
from cuDNN in bf16 and from XLA in bf16, each as a relative Frobenius error against XLA in
fp32 (the reference). cuDNN more than 2× XLA's bf16 error, or a window cuDNN does not keep
(a key outside it changing a query's output), fails the run (exit status 1). Then each one's
forward-and-backward time (`--reps` calls back to back, the median of 3 rounds).
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from timing import seconds_per_call  # benchmarks/ is on the path when this runs as a script
from jaxllm.backends import start_backends
from jaxllm.model.attention import sharded_attention

# (name, batch, tokens, query heads, kv heads, head_dim, window)
CASES = [
    ('llama3_8b', 1, 8192, 32, 8, 128, 0),
    ('mistral_7b', 1, 8192, 32, 8, 128, 4096),
    ('gemma3 global', 1, 8192, 8, 4, 256, 0),
    ('gemma3 sliding', 1, 8192, 8, 4, 256, 1024),
]
MAX_DOCUMENTS = 16


def packed_segments(batch: int, tokens: int, seed: int = 0) -> np.ndarray:
  """Segment ids of rows packed with documents of uneven lengths (ids from 1), the last
  tenth of each row padding (id 0)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((batch, tokens), np.int32)
  for b in range(batch):
    at, doc = 0, 1
    while at < tokens * 9 // 10 and doc < MAX_DOCUMENTS:
      length = int(rng.integers(tokens // 16, tokens // 3))
      ids[b, at:at + length] = doc
      at, doc = at + length, doc + 1
    ids[b, at:tokens * 9 // 10] = doc
  return ids


def relative_error(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def run_case(name, batch, tokens, heads, kv_heads, head_dim, window, reps) -> bool:
  keys = jax.random.split(jax.random.key(tokens + head_dim + window), 4)
  q = jax.random.normal(keys[0], (batch, tokens, heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, tokens, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, tokens, kv_heads, head_dim), jnp.float32)
  dout = jax.random.normal(keys[3], q.shape, jnp.float32)
  segments = jnp.asarray(packed_segments(batch, tokens))

  def value_and_grads(implementation):
    # dout and the segments are arguments: as closed-over constants XLA would fold them.
    def loss(q, k, v, dout, segments):
      out = sharded_attention(q, k, v, segments, implementation, MAX_DOCUMENTS, window)
      return jnp.sum(out.astype(jnp.float32) * dout), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

  bf16 = [a.astype(jnp.bfloat16) for a in (q, k, v)] + [dout, segments]
  (dq, dk, dv), out = value_and_grads('xla')(q, k, v, dout, segments)
  reference = (out, dq, dk, dv)
  results = {}
  for implementation in ('xla', 'cudnn'):
    fn = value_and_grads(implementation)
    (dq, dk, dv), out = fn(*bf16)
    results[implementation] = ([relative_error(a, r) for a, r in
                                zip((out, dq, dk, dv), reference)],
                               seconds_per_call(fn, bf16, reps))
  ok = all(c <= 2 * x + 1e-6 for c, x in zip(results['cudnn'][0], results['xla'][0]))
  window_kept = True
  if window:  # a key just outside the window of the last query must not reach it
    forward = jax.jit(lambda q, k, v: sharded_attention(q, k, v, None, 'cudnn', MAX_DOCUMENTS,
                                                        window))
    last = forward(*bf16[:3])[:, -1]
    far = bf16[2].at[:, tokens - 1 - window].multiply(100.0)
    near = bf16[2].at[:, tokens - window].multiply(100.0)
    window_kept = (bool(jnp.all(forward(bf16[0], bf16[1], far)[:, -1] == last))
                   and not bool(jnp.all(forward(bf16[0], bf16[1], near)[:, -1] == last)))
  for implementation, (errors, seconds) in results.items():
    verdict = '' if ok and window_kept else '  FAIL'
    print(f'{name:15} {implementation:6} ' + ' '.join(f'{e:9.2e}' for e in errors)
          + f'  {seconds * 1e3:8.2f}ms{verdict if implementation == "cudnn" else ""}')
  if window and not window_kept:
    print(f'{name:15} cuDNN does not keep the window of {window}: a key outside it changed '
          'the last query\'s output, or one inside did not')
  return ok and window_kept


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--reps', type=int, default=10)
  args = parser.parse_args()
  start_backends()
  device = jax.devices()[0]
  if device.platform != 'gpu' or args.reps < 1:
    print(f'error: cuDNN attention needs an NVIDIA GPU (this is {device.platform}) and --reps '
          f'at least 1 (got {args.reps})', file=sys.stderr)
    return 2
  print(f'{device.device_kind}, jax {jax.__version__}; relative error against XLA in fp32, '
        'packed rows; forward + backward time')
  print(f'{"case":15} {"impl":6} {"output":>9} {"dq":>9} {"dk":>9} {"dv":>9}  {"time":>10}')
  ok = all([run_case(*case, args.reps) for case in CASES])
  print('\ncuDNN within 2× XLA\'s bf16 error, windows kept' if ok else '\nFAILED')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
