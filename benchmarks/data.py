"""Input pipeline throughput: tokens/s that `make_batches` produces on its own, beside the
tokens/s the config's train step consumes.

    python benchmarks/data.py [--config configs/tiny.py] [--batches 2000] [--steps 20] [--bpe-vocab 4096]

Loader cases, each on the config's documents: the byte tokenizer; a byte-level BPE
(Hugging Face `tokenizers`) trained here on those documents; and the same BPE ids
pre-tokenised once into ArrayRecord shards (`jaxllm.data.pretokenize`). Each case makes the
global batches (jax.Arrays on the config's mesh), as training does, with nothing else running.
"""

import argparse
import os
import tempfile
import time

import jax

from jaxllm.backends import start_backends
from jaxllm.cli import load_config
from jaxllm.validate import resolve_mesh

_args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_args.add_argument('--config', default='configs/tiny.py')
_args.add_argument('--batches', type=int, default=2000, help='Timed batches per loader case.')
_args.add_argument('--steps', type=int, default=20, help='Timed train steps.')
_args.add_argument('--bpe-vocab', type=int, default=4096)
ARGS = _args.parse_args()
CFG = load_config(ARGS.config)
start_backends(CFG)

from timing import time_steps  # noqa: E402
from jaxllm.data import make_batches  # noqa: E402
from jaxllm.data.pretokenize import pretokenize  # noqa: E402
from jaxllm.data.sources import open_documents  # noqa: E402
from jaxllm.parallel.mesh import make_mesh  # noqa: E402
from jaxllm.train import setup  # noqa: E402


def loader_tokens_per_s(cfg, mesh, batches: int) -> float:
  """Global batches per second × tokens per batch, after a few untimed batches."""
  stream = make_batches(cfg, mesh)
  for _ in range(5):  # threads started, buffers filled
    next(stream)
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(stream)
  jax.block_until_ready(batch)
  return batches * cfg.train.global_batch * cfg.data.seq_len / (time.perf_counter() - start)


def train_bpe(data_cfg, vocab_size: int, out_dir: str) -> str:
  """A byte-level BPE trained on the config's documents; EOS is '<|endoftext|>'."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  documents = open_documents(data_cfg, data_cfg.path)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=['<|endoftext|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator((documents[i] for i in range(len(documents))), trainer)
  path = os.path.join(out_dir, 'tokenizer.json')
  tok.save(path)
  return path


def main():
  mesh = make_mesh(resolve_mesh(CFG.mesh, len(jax.devices())))
  tokens = CFG.train.global_batch * CFG.data.seq_len
  print(f'{ARGS.config}: {CFG.train.global_batch} × {CFG.data.seq_len} = {tokens:,} tokens per '
        f'batch, mesh {" ".join(f"{a}={n}" for a, n in mesh.shape.items())}, '
        f'{os.cpu_count()} CPU cores', flush=True)
  rate = loader_tokens_per_s(CFG, mesh, ARGS.batches)
  print(f'loader, byte tokenizer           {rate:12,.0f} tokens/s', flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    bpe = CFG.copy_and_resolve_references()
    bpe.data.tokenizer = train_bpe(CFG.data, ARGS.bpe_vocab, tmp)
    bpe.model.vocab_size = ARGS.bpe_vocab
    print(f'(trained a {ARGS.bpe_vocab}-token BPE in {time.perf_counter() - start:.1f}s)', flush=True)
    rate = loader_tokens_per_s(bpe, mesh, ARGS.batches)
    print(f'loader, BPE tokenizer            {rate:12,.0f} tokens/s', flush=True)

    start = time.perf_counter()
    pretokenize(bpe.data, os.path.join(tmp, 'records'), shard_docs=10_000)
    bpe.data.path = os.path.join(tmp, 'records', 'train-*.arrayrecord')
    print(f'(pre-tokenised in {time.perf_counter() - start:.1f}s)', flush=True)
    rate = loader_tokens_per_s(bpe, mesh, ARGS.batches)
    print(f'loader, BPE pre-tokenised        {rate:12,.0f} tokens/s', flush=True)

  run = setup(CFG)
  step_s, _, _, _ = time_steps(run, ARGS.steps, warmup=3)
  print(f'train step consumes (byte data)  {tokens / step_s:12,.0f} tokens/s '
        f'({step_s * 1e3:.0f} ms per step)', flush=True)


if __name__ == '__main__':
  main()
