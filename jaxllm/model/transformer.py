"""The decoder: pre-norm blocks of attention and MLP, run as one `lax.scan` over the layer
stack, between the embedding and the output head and loss. It reads top to bottom like the
paper; the parts live beside it in `jaxllm.model`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from ml_collections import ConfigDict, FrozenConfigDict

from jaxllm.model.attention import Attention
from jaxllm.model.embedding import sharded_lookup
from jaxllm.model.kv_cache import KV_CACHE_AXES, KVCache, LayerCache
from jaxllm.model.layers import MLP, RMSNorm, param, project
from jaxllm.model.loss import chunked_loss_sum
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
    ('layers', 'mlp', 'embed'), ('layers', 'norm'),
    RESIDUAL_AXES, ('batch', 'seq', 'act_heads', None), ('batch', 'seq', 'act_kv_heads', None),
    ('batch', 'seq', 'act_mlp'), ('batch', 'seq', 'act_vocab'), KV_CACHE_AXES,
)


class Block(nnx.Module):
  """Pre-norm residual block: attention, then MLP."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd, rngs)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, cache: LayerCache | None = None):
    """The block's output; with a `cache`, also the new tokens' keys and values."""
    attn = self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT, cache)
    attn_BTD, new_kv = attn if cache is not None else (attn, None)
    x_BTD = constrain(x_BTD + attn_BTD, *RESIDUAL_AXES)
    x_BTD = constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), *RESIDUAL_AXES)
    return x_BTD if cache is None else (x_BTD, new_kv)


def sequence_positions(tokens_BT):
  """Positions 0..T-1 of every row: one unpacked sequence per row."""
  return jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)


def scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, remat: str,
                cache: KVCache | None = None):
  """Applies the blocks stacked on the leading axis of `stacked`, in order, with `lax.scan`.

  With a `cache` (decoding) returns the output and the cache holding the new tokens too."""
  if cache is not None:
    if segment_ids_BT is not None:
      raise ValueError('decoding with a KV cache takes one sequence per row: no segment ids.')
    return _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, cache)

  def body(x_BTD, layer):
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, segment_ids_BT), None

  if remat != 'none':
    body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
  # Named outside the layer's own checkpoint, for one around the whole stack (stack_policy).
  named_body = lambda x_BTD, layer: body(checkpoint_name(x_BTD, 'layer_input'), layer)
  x_BTD, _ = jax.lax.scan(named_body, x_BTD, stacked)
  return x_BTD


def _scan_blocks_cached(graphdef, stacked, x_BTD, positions_BT, cache: KVCache):
  """The scan of `scan_blocks` with each layer reading its slice of the cache and returning
  its new keys and values; they are written into the cache once, after the scan.
  No remat: decoding takes no gradients."""
  def body(x_BTD, layer_and_cache):
    layer, k_BSKH, v_BSKH = layer_and_cache
    return nnx.merge(graphdef, layer)(x_BTD, positions_BT, None,
                                      LayerCache(k_BSKH, v_BSKH, cache.length, cache.start_B))

  x_BTD, (k_LBTKH, v_LBTKH) = jax.lax.scan(body, x_BTD,
                                           (stacked, cache.k_LBSKH, cache.v_LBSKH))
  return x_BTD, cache.append(k_LBTKH, v_LBTKH)


def head_loss_sum(cfg, final_norm: RMSNorm, w_DV, x_BTD, targets_BT, mask_BT,
                  z_loss: float = 0.0):
  """`Transformer.loss_sum` from the final norm and output head [D, V] themselves (a
  pipeline runs them on its last stage)."""
  T = x_BTD.shape[1]
  chunks = T // cfg.loss_chunk if 0 < cfg.loss_chunk < T else 1
  return chunked_loss_sum(chunks, jnp.dtype(cfg.grad_reduce_dtype), z_loss, final_norm(x_BTD),
                          w_DV, targets_BT, mask_BT.astype(jnp.float32))


class Transformer(nnx.Module):
  """Embedding, a scanned stack of `num_layers` blocks, final norm and output head."""

  def __init__(self, cfg: ConfigDict, *, rngs: nnx.Rngs):
    cfg = FrozenConfigDict(cfg)  # hashable, so it can live in the static graph
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.embed_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.embed_VD = param(rngs, nnx.initializers.normal(cfg.init_std), (V, D),
                           ('vocab', 'embed'), pd)

    # One Block with a leading layer axis on every parameter, so the stack runs as a scan.
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(D, cfg.norm_eps, pd, rngs)
    if not cfg.tie_embeddings:
      self.head_DV = param(rngs, nnx.initializers.normal(cfg.init_std), (D, V),
                            ('embed', 'vocab'), pd)

  def embed(self, tokens_BT):
    x_BTD = sharded_lookup(self.embed_VD[...], tokens_BT, self.cfg.dtype)
    return constrain(x_BTD, *RESIDUAL_AXES)

  def layers(self, x_BTD, positions_BT, segment_ids_BT=None, cache: KVCache | None = None):
    """Runs the block stack as one `lax.scan`, rematerialised per the config.

    Decoding passes a `cache` (and one sequence per row, no segment ids): the tokens are
    written at slots `cache.length` on, and `positions_BT` are their positions in their rows;
    returns the output and the cache holding them."""
    graphdef, stacked = nnx.split(self.blocks)
    return scan_blocks(graphdef, stacked, x_BTD, positions_BT, segment_ids_BT, self.cfg.remat,
                       cache)

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
    return self.logits(self.layers(self.embed(tokens_BT), positions_BT, segment_ids_BT))
