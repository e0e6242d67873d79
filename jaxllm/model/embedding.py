"""The token embedding's lookup, without gathering the table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.mesh import dividing_spec, logical_spec
from jaxllm.parallel.rules import mesh_axes


def sharded_lookup(table_VD, tokens_BT, dtype):
  """`table_VD[tokens_BT]` in `dtype`, without gathering the table.

  Each device looks up, in its own block of vocabulary rows and embedding columns, the tokens
  of every device that shares that block with it; the pieces are then summed over the vocabulary
  split and handed back to the devices whose rows (and positions) they are. Traffic is B·T·D,
  not V·D, and the gradient is a scatter-add into each device's block: no dense [V, D]
  reduction.
  Rows are cast to `dtype` after the lookup, so they move in it and the gradient is added into
  the table in the table's own dtype.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return table_VD[tokens_BT].astype(dtype)
  table_spec = logical_spec('vocab', 'embed')
  vocab_axes, embed_axes = mesh_axes(table_spec[0]), mesh_axes(table_spec[1])
  # Tokens split over rows (batch) and positions (seq: context parallelism): the dimension
  # each mesh axis splits them along.
  rows_spec = dividing_spec(tokens_BT, 'batch', 'seq')
  token_dim = {a: d for d in (0, 1) for a in mesh_axes(rows_spec[d])}
  # Columns are joined minor axis first, so they end in the spec's order; the tokens are
  # split back in the reverse of the order they were gathered in.
  column_axes = embed_axes[::-1]
  splits = [a for a in vocab_axes + column_axes if a in token_dim]

  def lookup(table_VD, tokens_BT):
    for a in reversed(splits):
      tokens_BT = jax.lax.all_gather(tokens_BT, a, axis=token_dim[a], tiled=True)
    rows = table_VD.shape[0]
    local_BT = tokens_BT - (jax.lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
    mine_BT = (local_BT >= 0) & (local_BT < rows)
    x_BTD = jnp.where(mine_BT[..., None], table_VD[jnp.where(mine_BT, local_BT, 0)], 0)
    x_BTD = x_BTD.astype(dtype)
    for a in vocab_axes:  # one device holds each token's row: the sums are exact
      x_BTD = (jax.lax.psum_scatter(x_BTD, a, scatter_dimension=token_dim[a], tiled=True)
               if a in token_dim else jax.lax.psum(x_BTD, a))
    for a in column_axes:
      x_BTD = (jax.lax.all_to_all(x_BTD, a, token_dim[a], 2, tiled=True) if a in token_dim
               else _join_columns(x_BTD, a))
    return x_BTD

  return jax.shard_map(lookup, in_specs=(table_spec, rows_spec),
                       out_specs=P(*rows_spec, None),
                       axis_names=set(mesh.axis_names) - set(mesh.manual_axes))(table_VD, tokens_BT)


def _join_columns(x, axis):
  """All-gathers the last dimension over `axis` as a sum of zero-padded blocks, so the result
  is known to be the same on every device of `axis` (as its out_specs says)."""
  block = x.shape[-1]
  whole = jnp.zeros((*x.shape[:-1], block * jax.lax.axis_size(axis)), x.dtype)
  return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
      whole, x, jax.lax.axis_index(axis) * block, axis=x.ndim - 1), axis)
