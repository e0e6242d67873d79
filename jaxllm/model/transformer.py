"""The decoder: pre-norm blocks of attention and MLP (or, in a mixture of experts, routed
experts), run as one `lax.scan` over the layer stack, between the embedding and the output head
and loss. It reads top to bottom like the paper; the parts live beside it in `jaxllm.model`.

Where only some layers have experts (model.moe.first_dense, model.moe.every), the first dense
layers are a stack of their own, scanned before the rest, and the rest are scanned in groups
of `every` blocks whose last has the experts: one scan still runs them all.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from ml_collections import ConfigDict, FrozenConfigDict

from jaxllm.config import layer_types
from jaxllm.model.attention import Attention
from jaxllm.model.embedding import sharded_lookup
from jaxllm.model.kv_cache import KV_CACHE_AXES, KVCache, LayerCache
from jaxllm.model.layers import MLP, RMSNorm, param, project
from jaxllm.model.loss import chunked_loss_sum
from jaxllm.model.moe import MoE, has_experts
from jaxllm.model.remat import REMAT
from jaxllm.parallel.mesh import constrain


# The residual stream between the blocks' matmuls, and its norms: the sequence split as the
# blocks' activations are (seq: context parallelism) and further by act_seq (sequence
# parallelism: with act_seq=('tensor',) the tensor all-reduces after the attention and MLP
# outputs become reduce-scatters, and all-gathers before the next matmuls).
RESIDUAL_AXES = ('batch', ('seq', 'act_seq'), 'act_embed')

# The logical axes of every array the model lays out by `sharding.rules`: its parameters (the
# blocks' stacked on 'layers'), and with them their gradients and moments, and the activations
# it pins. Validation checks each against the rules (a mesh axis splits at most one dimension
# of an array); tests/test_rules.py checks the list against what a traced step lays out.
LOGICAL_SHAPES = (
    ('vocab', 'embed'), ('embed', 'vocab'), ('norm',),
    ('layers', 'embed', 'heads', 'head_dim'), ('layers', 'embed', 'kv_heads', 'head_dim'),
    ('layers', 'heads', 'head_dim', 'embed'), ('layers', 'embed', 'mlp'),
    ('layers', 'mlp', 'embed'), ('layers', 'norm'), ('layers', 'experts', None, 'expert_mlp'),
    RESIDUAL_AXES, ('batch', 'seq', 'act_heads', None), ('batch', 'seq', 'act_kv_heads', None),
    ('batch', 'seq', 'act_mlp'), ('batch', 'seq', 'act_vocab'), KV_CACHE_AXES,
)


class Block(nnx.Module):
  """Pre-norm residual block: attention, then MLP (with `experts`, the MoE layer); with
  model.post_norms, each output normed again before it joins the residual (Gemma's four norms a
  layer)."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs, experts: bool = False):
    pd = jnp.dtype(cfg.param_dtype)
    norm = lambda: RMSNorm(cfg.embed_dim, cfg.norm_eps, pd, rngs, cfg.norm_zero_centered)
    self.attn_norm = norm()
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = norm()
    self.mlp = MoE(cfg, rngs) if experts else MLP(cfg, rngs)
    self.attn_out_norm, self.mlp_out_norm = (norm(), norm()) if cfg.post_norms else (None, None)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None,
               sliding=None):
    """(the block's output, with a `cache` the new tokens' keys and values, else the router's
    `RouterStats`: None for a dense MLP). `sliding`: whether this layer's attention slides,
    where the layers differ (see `sliding_flags`)."""
    attn = self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT, cache, sliding)
    attn_BTD, new_kv = attn if cache is not None else (attn, None)
    if self.attn_out_norm is not None:
      attn_BTD = self.attn_out_norm(attn_BTD)
    x_BTD = constrain(x_BTD + attn_BTD, *RESIDUAL_AXES)
    mlp = self.mlp(self.mlp_norm(x_BTD))
    mlp_BTD, stats = mlp if isinstance(self.mlp, MoE) else (mlp, None)
    if self.mlp_out_norm is not None:
      mlp_BTD = self.mlp_out_norm(mlp_BTD)
    x_BTD = constrain(x_BTD + mlp_BTD, *RESIDUAL_AXES)
    return x_BTD, (stats if cache is None else new_kv)


class BlockGroup(nnx.Module):
  """`moe.every` blocks in a row, the last with experts: what the layer scan runs as one step
  when only every n-th layer is MoE."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    n = cfg.moe.every
    self.layers = nnx.List([Block(cfg, rngs, experts=i == n - 1) for i in range(n)])

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None,
               sliding=None):
    """As `Block`'s; a `cache` holds the group's layers on a leading axis, and so do the new
    keys and values. `sliding` is always None: validate refuses experts with layers whose
    attention differs, so each Block knows its type from the config."""
    assert sliding is None, 'per-layer attention types are not carried through block groups'
    sides = []
    for i, block in enumerate(self.layers):
      layer_cache = (None if cache is None else
                     cache._replace(k_BSKH=cache.k_BSKH[i], v_BSKH=cache.v_BSKH[i]))
      x_BTD, side = block(x_BTD, positions_BT, segment_ids_BT, layer_cache)
      sides.append(side)
    if cache is None:
      return x_BTD, sides[-1]
    return x_BTD, tuple(jnp.stack(kv) for kv in zip(*sides))


def sliding_flags(cfg: ConfigDict, first=0, count: int | None = None):
  """Whether each of `count` consecutive layers from layer `first` (default: all of them)
  slides, [count] bool: the data the layer scan carries where the layers' attention differs
  (model.layer_types), so that the one Block picks its window and RoPE layer by layer.
  `first` may be traced (a pipeline stage's first layer). None where every layer is alike:
  the Block then knows its layer type from the config."""
  kinds = layer_types(cfg)
  if len(set(kinds)) == 1:
    return None
  table = jnp.asarray([kind == 'sliding' for kind in kinds])
  return jax.lax.dynamic_slice_in_dim(table, first, count or cfg.num_layers)


def sequence_positions(tokens_BT):
  """Positions 0..T-1 of every row: one unpacked sequence per row."""
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)


def scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, remat: str,
                sliding_L=None):
  """Applies the blocks (or block groups) stacked on the leading axis of `stacked`, in order,
  with `lax.scan`. `sliding_L`: each of those layers' `sliding_flags`, or None where the
  layers are alike. Returns the output and the MoE layers' `RouterStats` stacked over the scan
  (None without experts)."""
  def body(x_BTD, layer):
    layer, sliding = layer if sliding_L is not None else (layer, None)
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, segment_ids_BT, sliding=sliding)

  if remat != 'none':
    body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
  # Named outside the layer's own checkpoint, for one around the whole stack (stack_policy).
  named_body = lambda x_BTD, layer: body(checkpoint_name(x_BTD, 'layer_input'), layer)
  return jax.lax.scan(named_body, x_BTD, stacked if sliding_L is None else (stacked, sliding_L))


def _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, cache: KVCache, sliding_L):
  """The scan of `scan_blocks` with each layer reading its slice of `cache` (this stack's
  layers) and returning its new keys and values [L, B, T, K, H], which the caller writes into
  the cache once. No remat: decoding takes no gradients."""
  units = jax.tree.leaves(stacked)[0].shape[0]
  by_unit = lambda a: a.reshape(units, -1, *a.shape[1:]) if a.shape[0] > units else a

  def body(x_BTD, layer_and_cache):
    layer, k_BSKH, v_BSKH, sliding = layer_and_cache
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, None,
                                      LayerCache(k_BSKH, v_BSKH, cache.length, cache.start_B),
                                      sliding=sliding)

  x_BTD, new_kv = jax.lax.scan(
      body, x_BTD, (stacked, by_unit(cache.k_LBSKH), by_unit(cache.v_LBSKH), sliding_L))
  return x_BTD, tuple(a.reshape(-1, *a.shape[-4:]) for a in new_kv)


def head_loss_sum(cfg, final_norm: RMSNorm, w_DV, x_BTD, targets_BT, mask_BT,
                  z_loss: float = 0.0):
  """`Transformer.loss_sum` from the final norm and output head [D, V] themselves (a
  pipeline runs them on its last stage)."""
  T = x_BTD.shape[1]
  chunks = T // cfg.loss_chunk if 0 < cfg.loss_chunk < T else 1
  return chunked_loss_sum(chunks, jnp.dtype(cfg.grad_reduce_dtype), z_loss, final_norm(x_BTD),
                          w_DV, targets_BT, mask_BT.astype(jnp.float32))


def _stack(make, count: int, rngs: nnx.Rngs):
  """`count` modules from `make(rngs)` with a leading layer axis on every parameter, so the
  stack runs as a scan."""
  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make_stack(rngs):
    return make(rngs)
  return make_stack(rngs)


def stack_layers(cfg) -> tuple[int, int]:
  """(layers of the first, dense stack (0: none), layers of the scanned `blocks`)."""
  first = cfg.moe.first_dense if has_experts(cfg) else 0
  return first, cfg.num_layers - first


class Transformer(nnx.Module):
  """Embedding, a scanned stack of `num_layers` blocks, final norm and output head. With
  experts, the first `moe.first_dense` layers are a dense stack of their own before it
  (`dense_blocks`), and where only every n-th layer is MoE it stacks `BlockGroup`s."""

  def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
    cfg = FrozenConfigDict(cfg)  # hashable, so it can live in the static graph
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.embed_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.embed_VD = param(rngs, nnx.initializers.normal(cfg.init_std), (V, D),
                           ('vocab', 'embed'), pd)

    first, rest = stack_layers(cfg)
    self.dense_blocks = _stack(lambda rngs: Block(cfg, rngs), first, rngs) if first else None
    if not has_experts(cfg):
      self.blocks = _stack(lambda rngs: Block(cfg, rngs), rest, rngs)
    elif cfg.moe.every == 1:
      self.blocks = _stack(lambda rngs: Block(cfg, rngs, experts=True), rest, rngs)
    else:
      self.blocks = _stack(lambda rngs: BlockGroup(cfg, rngs), rest // cfg.moe.every, rngs)
    self.final_norm = RMSNorm(D, cfg.norm_eps, pd, rngs, cfg.norm_zero_centered)
    if not cfg.tie_embeddings:
      self.head_DV = param(rngs, nnx.initializers.normal(cfg.init_std), (D, V),
                            ('embed', 'vocab'), pd)

  def embed(self, tokens_BT):
    x_BTD = sharded_lookup(self.embed_VD[...], tokens_BT, self.cfg.dtype)
    if self.cfg.scale_embeddings:  # √D rounded to the compute dtype first, as Gemma's
      x_BTD = x_BTD * jnp.asarray(math.sqrt(self.cfg.embed_dim), x_BTD.dtype)
    return constrain(x_BTD, *RESIDUAL_AXES)

  def layers(self, x_BTD, positions_BT, segment_ids_BT=None, cache: KVCache | None = None):
    """Runs the block stack as one `lax.scan` (after the first dense layers' own, if any),
    rematerialised per the config. Returns the output and the MoE layers' `RouterStats`,
    stacked over them (None without experts).

    Decoding passes a `cache` (and one sequence per row, no segment ids): the tokens are
    written at slots `cache.length` on, and `positions_BT` are their positions in their rows;
    returns the output and the cache holding them."""
    first, _ = stack_layers(self.cfg)
    stacks = [nnx.split(s) for s in (self.dense_blocks, self.blocks) if s is not None]
    # Each stack's layers: per-layer attention types only without experts (validate), where
    # `blocks` is the one stack of all the layers.
    bounds = ((0, first), (first, self.cfg.num_layers)) if first else ((0, self.cfg.num_layers),)
    sliding = [sliding_flags(self.cfg, start, stop - start) for start, stop in bounds]
    if cache is None:
      stats = None
      for (graphdef, stacked), sliding_L in zip(stacks, sliding):
        x_BTD, stats = scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT,
                                   self.cfg.remat, sliding_L)
      return x_BTD, stats
    if segment_ids_BT is not None:
      raise ValueError('decoding with a KV cache takes one sequence per row: no segment ids.')
    new_kv = []
    for (graphdef, stacked), (start, stop), sliding_L in zip(stacks, bounds, sliding):
      layers = cache._replace(k_LBSKH=cache.k_LBSKH[start:stop], v_LBSKH=cache.v_LBSKH[start:stop])
      x_BTD, kv = _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, layers, sliding_L)
      new_kv.append(kv)
    return x_BTD, cache.append(*(jnp.concatenate(a) for a in zip(*new_kv)))

  def logits(self, x_BTD):
    """Output logits in fp32 (from matmuls in the compute dtype)."""
    logits_BTV = project('btd,dv->btv', self.final_norm(x_BTD), self.head(),
                         self.cfg.grad_reduce_dtype, jnp.float32)
    return constrain(logits_BTV, 'batch', 'seq', 'act_vocab')

  def loss_sum(self, x_BTD, targets_BT, mask_BT, z_loss: float = 0.0):
    """(objective, cross-entropy) summed over the tokens `mask_BT` keeps, from the final
    activations: next-token cross-entropy, plus `z_loss`·log²Z in the objective. The logits
    are made `loss_chunk` positions at a time (`chunked_loss_sum`)."""
    return head_loss_sum(self.cfg, self.final_norm, self.head(), x_BTD, targets_BT, mask_BT,
                         z_loss)

  def head(self):
    """The output head [D, V]: the embedding table's transpose when they are tied."""
    return self.embed_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]

  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
    """Logits [B, T, V]. Packed rows give each token's position in its document and the
    document's segment id; attention then stays inside each document."""
    if positions_BT is None:
      positions_BT = sequence_positions(tokens_BT)
    return self.logits(self.layers(self.embed(tokens_BT), positions_BT, segment_ids_BT)[0])
