"""Weights split over the batch axes (fsdp) gathered whole inside a shard_map that is manual
over them, as the pipelines need: moving in the compute dtype, each device keeping its own block
of the axes left to the compiler (tensor), their gradients reduce-scattered back once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.mesh import keep_axes, logical_spec
from jaxllm.parallel.rules import mesh_axes


def compiler_axes() -> set[str]:
  """The mesh axes a pipeline's shard_map (manual over pipe and the batch axes) leaves to the
  compiler: tensor. Asked outside the shard_map."""
  mesh = jax.sharding.get_abstract_mesh()
  return set(mesh.axis_names) - {'pipe', *mesh_axes(logical_spec('batch')[0]),
                                 *mesh.manual_axes}


def batch_split_gatherer(compute_dtype, grad_dtype):
  """`gather(w, spec)`: inside a shard_map manual over pipe and the batch axes, `w` split
  over the batch axes (fsdp) as its mesh `spec` says, gathered whole in the compute dtype
  (`gather_for_compute`), and kept split as `spec` says over the axes left to the compiler
  (tensor; left to itself, XLA gathers those too). Made outside the shard_map, where the
  batch axes can be named."""
  batch_axes = mesh_axes(logical_spec('batch')[0])
  auto = compiler_axes()

  def gather(w, spec: P):
    pieces = tuple((dim, axis) for dim, entry in enumerate(spec)
                   for axis in reversed(mesh_axes(entry)) if axis in batch_axes)
    return gather_for_compute(w, pieces, keep_axes(spec, auto), jnp.dtype(compute_dtype),
                              jnp.dtype(grad_dtype))
  return gather


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather_for_compute(w, pieces, layout, compute_dtype, grad_dtype):
  """`w` all-gathered over its batch-axis `pieces` [(dimension, axis), ...], moving in
  `compute_dtype`, each device gathering its own block of the compiler's axes (`layout`). The
  result keeps w's dtype (holding compute_dtype's values), so the gradients of every pipeline
  iteration add up in it; their sum is reduce-scattered back once, in `grad_dtype`."""
  def gather(x):
    for dim, axis in pieces:
      x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return x
  return _blockwise(gather, layout)(w.astype(compute_dtype)).astype(w.dtype)


def _blockwise(f, layout: P):
  """`f` on each device's block over the axes still left to the compiler (tensor), split as
  `layout` says: XLA's partitioner runs a collective over manual axes on the whole of those
  axes' split (a tensor-split weight would be gathered over fsdp whole, tensor ways larger)."""
  mesh = jax.sharding.get_abstract_mesh()
  auto = set(mesh.axis_names) - set(mesh.manual_axes)
  return jax.shard_map(f, in_specs=layout, out_specs=layout, axis_names=auto, check_vma=False)


def _gather_fwd(w, pieces, layout, compute_dtype, grad_dtype):
  return gather_for_compute(w, pieces, layout, compute_dtype, grad_dtype), None


def _gather_bwd(pieces, layout, compute_dtype, grad_dtype, _, g):
  def scatter(g):
    for dim, axis in reversed(pieces):
      g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    return g
  return (_blockwise(scatter, layout)(g.astype(grad_dtype)).astype(g.dtype),)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)
