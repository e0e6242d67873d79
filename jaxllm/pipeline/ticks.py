"""Pipeline schedules as tables: in each tick, which micro-batch's forward and which one's
backward every stage runs (numpy, made once at trace time).

A stage holds R chunks of the layer stack (R = 1 but for the circular schedules), and an
*item* is one micro-batch through one chunk. Every tick has a forward slot and a backward slot
per stage; at its end `ppermute` moves activations one stage on and gradients one stage back.

- `gpipe_ticks`: every item's forward, then (as autodiff runs it) every backward in reverse;
  R ≥ 2 is the circular schedule, each micro-batch going round the ring R times.
- `one_f_one_b_ticks`: the last stage takes each micro-batch's backward straight after its
  forward, so each stage starts backwards as soon as they reach it and holds only the items
  between its forward and backward wave, not all M. With R ≥ 2 (interleaved 1F1B) micro-batches
  go round in groups of S: an item leaving the last stage enters stage 0's next chunk in the
  next tick. Both waves move one stage a tick, so stage s holds up to 2(S−1−s)+1 items'
  residuals (chunk 0's; later chunks' fewer), against R·M under GPipe.

The bubble is (S−1)/(R·M+S−1) of the ticks' work either way.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Ticks:
  """forward / backward [ticks, S]: the item each stage runs in each tick's slot, -1 for none.
  Item i is micro-batch `microbatch[i]` through chunk `chunk[i]` (stage s's chunk r holds
  layer block s + r·S)."""
  stages: int
  repeats: int
  microbatches: int
  forward: np.ndarray
  backward: np.ndarray
  microbatch: np.ndarray
  chunk: np.ndarray

  @property
  def busy(self) -> np.ndarray:
    """[ticks, S, 2]: whether each stage's forward and backward slot computes for an item."""
    return np.stack([self.forward >= 0, self.backward >= 0], -1)

  def bubble_fraction(self, backward_cost: float = 2.0) -> float:
    """The share of the stages' time idle, each tick lasting its busiest stage's forward and
    backward work (a backward costing `backward_cost` forwards): what lockstep SPMD spends."""
    has_f, has_b = self.busy.any(1).T
    wall = np.sum(has_f + backward_cost * has_b)
    work = self.repeats * self.microbatches * (1 + backward_cost)
    return 1 - work / wall

  def slots(self) -> tuple[np.ndarray, np.ndarray, int]:
    """(forward slot [ticks, S], backward slot [ticks, S], K): where each stage keeps each
    item's residuals from its forward to its backward, K slots in all. Slots are reused as
    soon as a backward frees them; the forward is written before the same tick's backward
    reads. An idle forward slot writes (what it computed on nothing) to a free slot, an idle
    backward reads slot 0: neither touches a held item."""
    T, S = self.forward.shape
    write, read = np.zeros((T, S), int), np.zeros((T, S), int)
    count = 0
    for s in range(S):
      held = {}
      for t in range(T):
        free = min(set(range(count + 1)) - set(held.values()))
        count = max(count, free + 1)
        write[t, s] = free
        if (i := self.forward[t, s]) >= 0:
          held[i] = free
        if (i := self.backward[t, s]) >= 0:
          read[t, s] = held.pop(i)
    return write, read, count


def _items(S: int, R: int, M: int, group: int):
  """Item order of the forward wave: micro-batches in groups of `group`, each group through
  chunk 0, then 1, ...; returns (microbatch, chunk) per item."""
  i = np.arange(R * M)
  per_group = R * group
  g, within = i // per_group, i % per_group
  return g * group + within % group, within // group


def gpipe_ticks(S: int, R: int, M: int) -> Ticks:
  """GPipe (R = 1) and circular: forward of item i on stage s in tick i + s, all forwards
  first; backward in reverse order once the last forward is done."""
  microbatch, chunk = _items(S, R, M, M)
  items = R * M
  ticks = 2 * (items + S - 1)
  forward, backward = np.full((ticks, S), -1), np.full((ticks, S), -1)
  for i in range(items):
    for s in range(S):
      forward[i + s, s] = i
      backward[items + S - 1 + (items - 1 - i) + (S - 1 - s), s] = i
  return Ticks(S, R, M, forward, backward, microbatch, chunk)


def one_f_one_b_ticks(S: int, R: int, M: int) -> Ticks:
  """1F1B (R = 1; any M) and interleaved 1F1B (R ≥ 2; M a multiple of S): item i's forward on
  stage s in tick i + s; the last chunk's backward on the last stage in the same tick as its
  forward, and each backward one stage back per tick, through the chunks in reverse."""
  if R > 1 and M % S:
    raise ValueError(f'interleaved 1F1B takes micro-batches in groups of the {S} stages; '
                     f'{M} is not a multiple.')
  group = S if R > 1 else M
  microbatch, chunk = _items(S, R, M, group)
  # Backward order: the same groups, chunks reversed; j is an item's place in it.
  j = (np.arange(R * M) // (R * group)) * R * group + (R - 1 - chunk) * group + (
      np.arange(R * M) % group)
  start = R * S - 1 if R > 1 else S - 1   # the first backward, on the last stage
  ticks = R * M + start + S - 1
  forward, backward = np.full((ticks, S), -1), np.full((ticks, S), -1)
  for i in range(R * M):
    for s in range(S):
      forward[i + s, s] = i
      backward[start + j[i] + S - 1 - s, s] = i
  return Ticks(S, R, M, forward, backward, microbatch, chunk)


def schedule_ticks(schedule: str, S: int, R: int, M: int) -> Ticks:
  """The table of a `pipeline.schedule`."""
  if schedule in ('gpipe', 'circular'):
    return gpipe_ticks(S, R, M)
  return one_f_one_b_ticks(S, R, M)
