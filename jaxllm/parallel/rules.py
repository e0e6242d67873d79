"""The rules a run shards by: one pure function from the config's rules table, the mesh and
the model to the layout every entry point uses (train, generate, hf, analyze, tune).

`sharding.rules` binds logical axis names to mesh axes as the user wrote it (the sequence's
splits included: `seq`, `act_seq`). A run applies it with what follows from the mesh and the
model: K/V heads kept whole where the mesh splits them finer than there are heads, the batch's
shards, ZeRO's stage. Validation checks the table; it never changes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec as P


def mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axes of a rule or a PartitionSpec entry (None, a name or a tuple of names), or of
  a whole PartitionSpec (every entry's, in order)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, P):
    return tuple(a for e in entry for a in mesh_axes(e))
  return tuple(entry)


def spec_entry(axes: tuple[str, ...]):
  """The PartitionSpec entry for a tuple of mesh axes: None, one name, or the tuple."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def parts(axes, mesh_shape: Mapping[str, int]) -> int:
  """How many pieces the mesh axes `axes` (a rule or spec entry) cut a dimension into."""
  return math.prod(mesh_shape[a] for a in mesh_axes(axes))


def kv_heads_fit(num_kv_heads: int, pieces: int) -> bool:
  """Whether K/V heads serve query heads split `pieces` ways: each piece holds whole K/V heads
  (K a multiple of pieces) or shares one with other pieces (pieces a multiple of K). The one
  rule for K/V heads: `derive` keeps them whole in the second case, and attention
  (`jaxllm.model.attention`) maps each device's query heads onto them."""
  return num_kv_heads % pieces == 0 or pieces % num_kv_heads == 0


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a run splits its arrays over its mesh (see `derive`)."""
  rules: dict[str, tuple[str, ...]]  # logical axis -> mesh axes, as the run applies them
  mesh_shape: dict[str, int]
  zero: int                          # sharding.zero, 0 where the data axis is one device

  @property
  def batch_shards(self) -> int:
    """How many ways the batch's rows are split."""
    return batch_shards(self.rules, self.mesh_shape)


def derive(rules: Mapping, mesh_shape: Mapping[str, int], model_cfg, zero: int = 0) -> Layout:
  """The layout a run on a mesh of `mesh_shape` uses for a model of `model_cfg`, from the
  config's `rules` (sharding.rules) and ZeRO stage (sharding.zero). Pure: nothing is changed.

  Fewer K/V heads than the devices their rule splits them over (8 over tensor=16): each
  device's query heads then share one K/V head, so the K/V weights and activations are kept
  whole on those devices (their rules emptied), as Megatron and MaxText replicate them. A
  count that fits neither way is left to the parameter check to name."""
  table = {name: mesh_axes(axes) for name, axes in rules.items()}
  K = model_cfg.num_kv_heads
  for name in ('kv_heads', 'act_kv_heads'):
    pieces = parts(table[name], mesh_shape)
    if K % pieces and kv_heads_fit(K, pieces):
      table[name] = ()
  return Layout(table, dict(mesh_shape), zero if mesh_shape['data'] > 1 else 0)


def collision(rules: Mapping, shape) -> tuple[str, str, str] | None:
  """(mesh axis, logical name, logical name) of the first mesh axis that splits two
  dimensions of an array with logical axes `shape` (per dimension: a name, a tuple of names
  splitting it in turn, or None), by the `rules` of those names; the same name twice when its
  own rule names the axis twice. None when each mesh axis splits at most one dimension, as
  a sharding must."""
  seen: dict[str, str] = {}
  for entry in shape:
    for name in entry if isinstance(entry, tuple) else (entry,):
      for axis in mesh_axes(rules[name]) if name else ():
        if axis in seen:
          return axis, seen[axis], name
        seen[axis] = name
  return None


def batch_shards(rules: Mapping, mesh_shape: Mapping[str, int]) -> int:
  """How many ways the batch's rows are split: the sizes of the batch rule's axes."""
  return parts(rules['batch'], mesh_shape)
