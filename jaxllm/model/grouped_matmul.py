"""The grouped matmul a mixture of experts runs: rows sorted by expert, each group of rows times
its own weight matrix. One interface, with implementations chosen by name:

- 'xla': `jax.lax.ragged_dot`, which runs everywhere and is the reference. (On NVIDIA GPUs XLA
  rewrites it into a dense matmul over a group-masked input: groups × the FLOPs.)
- 'triton': own Pallas-Triton kernels for the forward pass and both gradients
  (`grouped_matmul_triton`), each computing only its groups' rows: the H100 default. On other
  platforms they run in Pallas' interpreter (correct, slow: for tests).
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ('xla', 'triton')


def grouped_matmul(x_MK, w_GKN, group_sizes_G, implementation: str = 'xla'):
  """out[M, N]: row m of `x_MK` times `w_GKN[g]`, where the rows come sorted by group, the first
  `group_sizes_G[0]` taking group 0, the next `group_sizes_G[1]` group 1, and so on. Rows past
  the groups' total (padding) come out as zeros, and so do their gradients."""
  if implementation == 'xla':
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
  if implementation == 'triton':
    # Imported on first use: Pallas' Triton lowering takes about half a second to import,
    # which runs on 'xla' (or without experts) should not pay.
    from jaxllm.model import grouped_matmul_triton
    return grouped_matmul_triton.grouped_matmul(x_MK, w_GKN, group_sizes_G)
  raise ValueError(f'grouped_matmul: unknown implementation {implementation!r}; use one of '
                   f'{", ".join(IMPLEMENTATIONS)}.')
