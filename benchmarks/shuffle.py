"""Microseconds per document of an epoch's shuffled order: grain's `MapDataset.shuffle` (its
index shuffle) beside `jaxllm.data.loader.shuffled`, which the loader uses (a numpy
permutation per epoch below `SMALL_DATASET` documents, grain's shuffle from there on).

    python benchmarks/shuffle.py [--lengths 2,12,60,1000,65535,65536] [--documents 20000]
"""

import argparse
import time

import grain

from jaxllm.data.loader import SMALL_DATASET, shuffled

_args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_args.add_argument('--lengths', default='2,12,60,1000,65535,65536',
                   help='Dataset lengths (documents) to time, comma-separated.')
_args.add_argument('--documents', type=int, default=20000,
                   help='Documents drawn per case (over as many epochs as that takes).')
ARGS = _args.parse_args()


def microseconds_per_document(dataset: grain.MapDataset, documents: int) -> float:
  start = time.perf_counter()
  for index in range(documents):
    dataset[index]
  return (time.perf_counter() - start) / documents * 1e6


def main():
  print(f'documents drawn per case: {ARGS.documents:,}; SMALL_DATASET = {SMALL_DATASET:,}')
  print(f'{"length":>8}  {"grain shuffle":>14}  {"loader":>10}  {"ratio":>7}')
  for length in map(int, ARGS.lengths.split(',')):
    docs = grain.MapDataset.range(length)
    # grain's cost falls with the length: fewer draws where it is slow, still ≥ 200.
    draws = max(200, min(ARGS.documents, ARGS.documents * length // 1000))
    ours = microseconds_per_document(shuffled(docs, 0), ARGS.documents)
    theirs = microseconds_per_document(docs.shuffle(seed=0), draws)
    print(f'{length:>8,}  {theirs:>11,.1f} µs  {ours:>7,.1f} µs  {theirs / ours:>6,.1f}×')


if __name__ == '__main__':
  main()
