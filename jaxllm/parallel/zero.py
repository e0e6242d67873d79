"""ZeRO over data (sharding.zero): the optimizer state, and under stage 2 the gradient sum,
split over the data axis on top of what the rules split, while the parameters stay whole
over data."""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.parallel.rules import mesh_axes, spec_entry


def over_data(spec: P, shape: tuple[int, ...], mesh_shape) -> P:
  """ZeRO's layout of an array laid out by `spec`: 'data' added after the axes of the
  dimension with the largest shard that still splits evenly, so each device keeps a 1/data
  slice of the shard it had (no data moves to make it). `spec` itself when data is one
  device, is already in it, or no dimension divides."""
  n = mesh_shape['data']
  entries = list(spec) + [None] * (len(shape) - len(spec))
  axes = [mesh_axes(e) for e in entries]
  if n == 1 or any('data' in a for a in axes):
    return spec
  parts = [math.prod(mesh_shape[a] for a in dim_axes) for dim_axes in axes]
  fits = [i for i, d in enumerate(shape) if d % (parts[i] * n) == 0]
  if not fits:
    return spec
  best = max(fits, key=lambda i: shape[i] // parts[i])  # the first of equals
  entries[best] = spec_entry(axes[best] + ('data',))
  return P(*entries)


def optimizer_shardings(abstract_opt_state, shardings, mesh):
  """The optimizer state's shardings (`shardings`, the params') split over data by `over_data`."""
  return jax.tree.map(lambda a, s: NamedSharding(mesh, over_data(s.spec, a.shape, mesh.shape)),
                      abstract_opt_state, shardings)


def zero_specs(params):
  """The params' PartitionSpecs split over data as ZeRO splits the optimizer state (inside jit,
  on the mesh in scope)."""
  mesh_shape = jax.sharding.get_abstract_mesh().shape
  return jax.tree.map(lambda spec, p: over_data(spec, p.shape, mesh_shape),
                      nnx.get_partition_spec(params), params)
