"""The device mesh, and the binding of logical axis names to its axes.

Model code names axes logically ('batch', 'embed', 'heads', ...). The rules table in
`cfg.sharding.rules` maps those names to the mesh axes data/fsdp/pipe/tensor; this module
is the only place that applies it.
"""

from __future__ import annotations

import contextlib
import math

import jax
from flax import nnx
from flax.core import spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxllm.config import AXIS_FIELDS, MESH_AXES, ConfigError
from jaxllm.parallel.rules import mesh_axes, spec_entry


def make_mesh(shape: dict[str, int], devices=None,
              across_hosts: str = 'data,pipe,fsdp,tensor') -> jax.sharding.Mesh:
  """A mesh with the four named axes, all compiler-managed (Auto).

  On devices of several hosts (see `hosts`) it is two-level: the axes named in
  `across_hosts` (mesh.across_hosts) take the split between hosts, so the traffic of the
  others stays on each host's fast links.
  """
  sizes = tuple(shape[a] for a in MESH_AXES)
  devices = list(jax.devices() if devices is None else devices)[:math.prod(sizes)]
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  groups, by_slice = hosts(devices)
  if len(groups) == 1:
    return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
  outer = host_split(shape, len(groups), across_hosts)
  inner = [shape[a] // outer[a] for a in MESH_AXES]
  grid = mesh_utils.create_hybrid_device_mesh(inner, [outer[a] for a in MESH_AXES], devices,
                                              process_is_granule=not by_slice)
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)


def hosts(devices) -> tuple[list[list], bool]:
  """The devices grouped by host: by slice (GPUs and TPUs report the fast-link domain each
  sits in) when they span several, else by process; and whether slices were used."""
  for attribute in ('slice_index', 'process_index'):
    groups: dict[int, list] = {}
    for d in devices:
      groups.setdefault(getattr(d, attribute, 0), []).append(d)
    if len(groups) > 1:
      return list(groups.values()), attribute == 'slice_index'
  return [list(devices)], False


def host_split(shape: dict[str, int], num_hosts: int, across_hosts: str) -> dict[str, int]:
  """How much of each mesh axis spans hosts: the hosts are handed out to the axes of
  `across_hosts` in order, each taking the largest part of what is left that divides it."""
  axes = [a.strip() for a in across_hosts.split(',') if a.strip()]  # names checked by validate
  outer, left = dict.fromkeys(MESH_AXES, 1), num_hosts
  for a in axes:
    outer[a] = math.gcd(shape[a], left)
    left //= outer[a]
  if left > 1:
    spanned = '×'.join(f'{a}={outer[a]}' for a in axes) or 'no axis'
    raise ConfigError(
        f'mesh.across_hosts={across_hosts!r}: the devices are on {num_hosts} hosts but '
        f'{spanned} spans only {num_hosts // left} of them; add an axis to mesh.across_hosts, '
        f'or resize its axes so their sizes multiply to a multiple of {num_hosts}.')
  return outer


@contextlib.contextmanager
def sharding_context(mesh: jax.sharding.Mesh, rules):
  """Mesh and logical rules in scope: for creating variables and tracing steps."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules(rules)):
    yield


def logical_spec(*names: str | tuple[str, ...] | None) -> P:
  """The mesh PartitionSpec of logical axis names, under the rules in scope. A dimension may
  name several (a tuple): it is split over all their mesh axes, in that order.

  Inside a shard_map only the compiler-managed axes can be named; manual ones are left out.
  """
  spec = P(*(spec_entry(bound_axes(name)) for name in names))
  manual = jax.sharding.get_abstract_mesh().manual_axes
  return keep_axes(spec, set(MESH_AXES) - set(manual)) if manual else spec


def bound_axes(name: str | tuple[str, ...]) -> tuple[str, ...]:
  """The mesh axes a logical axis name (or a tuple of them) binds to under the rules in
  scope, manual ones included."""
  names = name if isinstance(name, tuple) else (name,)
  return tuple(a for n in names for a in mesh_axes(spmd.apply_rules(P(n), None)[0]))


def manual_axes_of(*names: str) -> tuple[str, ...]:
  """The mesh axes of logical `names` that are manual here: inside a shard_map over them,
  what each device holds of those dimensions is its own share."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  return tuple(a for n in names for a in bound_axes(n) if a in manual)


def keep_axes(spec: P, keep) -> P:
  """`spec` naming only the mesh axes in `keep`."""
  return P(*(spec_entry(tuple(a for a in mesh_axes(e) if a in keep)) for e in spec))


def flax_rules(rules) -> tuple:
  """The config's rules table in the form flax's `logical_axis_rules` takes."""
  return tuple((name, spec_entry(mesh_axes(axes))) for name, axes in rules.items())


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
  """Pins an activation's layout by logical axis names (a hint to the compiler)."""
  return jax.lax.with_sharding_constraint(x, logical_spec(*names))


def split_micro_batches(x, micro_batches: int):
  """[B, ...] -> [M, B/M, ...] where micro-batch m takes rows m, m+M, m+2M, ...

  Each device's contiguous share of B then holds rows of every micro-batch, so the
  split moves no data between devices.
  """
  x = x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
  return constrain(x, None, 'batch', *([None] * (x.ndim - 2)))


def batch_sharding(mesh: jax.sharding.Mesh, rules, ndim: int) -> NamedSharding:
  """Where input batches live: dimension 0 split over the 'batch' rule, the rest replicated."""
  with nnx.logical_axis_rules(flax_rules(rules)):
    return NamedSharding(mesh, logical_spec('batch', *([None] * (ndim - 1))))


def check_divisible(abstract_state, mesh: jax.sharding.Mesh) -> None:
  """Every sharded parameter dimension must split evenly over its mesh axes."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  for path, var in jax.tree_util.tree_leaves_with_path(abstract_state, is_leaf=is_var):
    logical = var.get_metadata().get('out_sharding') or ()
    spec = nnx.get_partition_spec(var).get_value()
    for dim, axes, name in zip(var.get_value().shape, spec, logical):
      axes = mesh_axes(axes)
      parts = math.prod(mesh.shape[a] for a in axes)
      if dim % parts:
        field = AXIS_FIELDS.get(name, f'the {name!r} axis')
        split = '×'.join(f'{a}={mesh.shape[a]}' for a in axes)
        shared = ' (or a divisor of it: K/V heads are then replicated)' if name == 'kv_heads' else ''
        raise ConfigError(
            f'{field}={dim} does not split evenly over {split} (sharding.rules.{name}, '
            f'parameter {jax.tree_util.keystr(path)}); make it a multiple of {parts}{shared} '
            f'or change the mesh or sharding.rules.{name}.')


def dividing_spec(x, *names) -> P:
  """The PartitionSpec of `x`'s logical axis names, except that a dimension its mesh axes do
  not divide (a small batch) stays whole."""
  mesh = jax.sharding.get_abstract_mesh()
  return P(*(e if x.shape[i] % math.prod(mesh.shape[a] for a in mesh_axes(e)) == 0 else None
             for i, e in enumerate(logical_spec(*names))))
