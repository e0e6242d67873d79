"""What each remat policy (model.remat) keeps of a layer for its backward; the rest is
recomputed."""

from __future__ import annotations

import jax


def cudnn_attention_outputs(prim, *_, **__) -> bool:
  """A remat policy: keep what cuDNN's fused attention forward returns, the attention output
  and its softmax statistics (logsumexp). Its backward kernel takes them beside q, k and v, so
  the backward never reruns the forward kernel."""
  return prim.name == 'dot_product_attention_fwd_wrapper'


def _keep(*names: str):
  """A policy keeping the values of these `checkpoint_name`s and cuDNN attention's outputs.
  The name 'attention' is on XLA's attention output only: cuDNN's kernel keeps its own."""
  return jax.checkpoint_policies.save_from_both_policies(
      jax.checkpoint_policies.save_only_these_names(*names), cudnn_attention_outputs)


REMAT = {
    'full': jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of weight matmuls; recompute attention and elementwise work.
    'dots': jax.checkpoint_policies.save_only_these_names('projection'),
    # Keep q, k, v and the attention output (and cuDNN's softmax statistics); recompute the
    # MLP, whose two [B,T,F] matmul outputs are the largest activations (about 4× less saved
    # than 'dots' at F = 4D).
    'dots_except_mlp': _keep('q_proj', 'k_proj', 'v_proj', 'attention'),
    # Keep the attention output (and cuDNN's softmax statistics) beside each layer's input;
    # recompute every matmul but not cuDNN's attention forward, whose work grows with T².
    'attention': _keep('attention'),
}


def stack_policy(remat: str):
  """The policy of a checkpoint around `scan_blocks` whose weights are made anew on every call
  (a pipeline stage's, sliced or gathered per iteration, or cast by its layers in each 1F1B
  tick): it keeps each layer's input and what the layers' own policy keeps, so nothing is
  recomputed twice, but never the weights, which every call would otherwise keep a copy of.
  Under 'none' it keeps the outputs of the weight matmuls and of attention: only elementwise
  work is recomputed."""
  kept = REMAT[remat] if remat != 'none' else _keep('projection', 'attention')
  return jax.checkpoint_policies.save_from_both_policies(
      kept, jax.checkpoint_policies.save_only_these_names('layer_input'))
