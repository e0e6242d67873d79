"""What a run says about itself: parameter counts, FLOPs per token, MFU, and the writers."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import jax
import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from jaxllm.config import ConfigError, layer_types, moe_layers

# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s of one device, by a substring of its
# `device_kind`, the first that matches: NVIDIA's datasheets for the H100 (SXM and PCIe), H200
# SXM, A100 (SXM, 40 and 80 GB alike) and HGX B200 (which print the sparse figure, twice these).
# The train prints' MFU divides by these (`peak_flops`), and `jaxllm.cost.hardware`'s profiles
# take theirs from here.
PEAK_FLOPS = {
    'H100 PCIe': 756e12,
    'H100': 989e12,
    'H200': 989e12,
    'A100': 312e12,
    'B200': 2.25e15,
}


def param_counts(m: ConfigDict) -> dict[str, int]:
  """Parameters of the model, from its config (a test checks this against the model):
  'total'; 'active', those a token runs through (an MoE layer's router, top_k of its experts
  and its shared ones); 'embedding'; 'flops', the active ones the FLOPs count."""
  D, N, K, H, F, V, L = (m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
                         m.vocab_size, m.num_layers)
  norms = 4 if m.post_norms else 2
  per_layer = (D * (N + 2 * K) * H + N * H * D + 3 * D * F + norms * D
               + (N + 2 * K) * H * m.qkv_bias + 2 * H * m.qk_norm)
  embedding = V * D
  head = 0 if m.tie_embeddings else D * V
  total = active = embedding + L * per_layer + D + head
  moe = m.moe
  if moe.experts:  # an MoE layer's router and experts in place of its MLP
    F_e = moe.mlp_dim or F
    shared = 3 * D * moe.shared_experts * (moe.shared_mlp_dim or F_e) - 3 * D * F
    total += moe_layers(m) * (D * moe.experts + 3 * D * F_e * moe.experts + shared)
    active += moe_layers(m) * (D * moe.experts + 3 * D * F_e * moe.top_k + shared)
  return {'total': total, 'active': active, 'embedding': embedding,
          # The PaLM convention counts the output head (tied or not) but not the input lookup.
          'flops': active if m.tie_embeddings else active - embedding}


def attended_keys(m: ConfigDict, seq_len: int) -> dict[str, float]:
  """Keys per query, summed over the layers: 'full' counts the T keys of a row (a sliding
  layer's window where it is shorter), 'causal' those before the query, its own included
  (averaged over a row's T positions; about T/2, or W − W²/2T under a window of W)."""
  T, W = seq_len, m.sliding_window
  keys = {'full': 0.0, 'causal': 0.0}
  for kind in layer_types(m):
    window = W if kind == 'sliding' and 0 < W < T else T
    keys['full'] += window
    keys['causal'] += (window * T - window**2 / 2) / T if window < T else T / 2
  return keys


def flops_per_token(m: ConfigDict, seq_len: int) -> dict[str, float]:
  """Training FLOPs per token, forward and backward: 6·N + 12·L·H·Q·T (PaLM appendix B),
  with T a sliding layer's window where it is shorter than the row.

  'causal' counts only the keys before each query (about half the row), as some projects
  report. Rematerialisation is not counted (that would be hardware FLOPs, not model FLOPs).
  """
  dense = 6 * param_counts(m)['flops']
  keys = attended_keys(m, seq_len)
  attention = lambda convention: 12 * m.num_heads * m.head_dim * keys[convention]
  return {'full': dense + attention('full'), 'causal': dense + attention('causal')}


def routing_row(steps: list[dict]) -> dict:
  """The routers' entries of a logged row from its steps' metrics (`moe.routing_metrics`):
  the means of the aux loss, z-loss and dropped fraction; the load of the most and least
  loaded expert against an even share (1.0), in the layers where they are furthest from it
  ('moe_load_max', 'moe_load_min'); and each expert's share of all assignments times the
  experts ('moe_expert_load': 1 each when even), over the steps and MoE layers."""
  load_UE = np.sum([s['moe_load'] for s in steps], axis=0)
  even_U1 = np.maximum(load_UE.mean(axis=-1, keepdims=True), 1e-9)
  load_E = load_UE.sum(axis=0)
  row = {k: float(np.mean([s[k] for s in steps]))
         for k in ('moe_aux_loss', 'moe_z_loss', 'moe_dropped')}
  return {**row, 'moe_load_max': float((load_UE / even_U1).max()),
          'moe_load_min': float((load_UE / even_U1).min()),
          'moe_expert_load': [round(float(x), 4) for x in load_E / max(load_E.mean(), 1e-9)]}


def peak_flops(device, override: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the override if set, else `PEAK_FLOPS`; None if unknown (CPU)."""
  if override > 0:
    return override
  kind = getattr(device, 'device_kind', '')
  return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def _summary_writer():
  """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch where it
  is installed only to accept its tensors (seconds of every start-up), and is given numpy
  here."""
  if 'torch' in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules['torch'] = None  # `import torch` raises ImportError while this stands
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules['torch']
  return SummaryWriter


class TensorBoard:
  """TensorBoard event files: every number of every row as a scalar at the row's step, and
  the config as text."""

  def __init__(self, directory: str, config: ConfigDict):
    SummaryWriter = _summary_writer()
    try:
      os.makedirs(directory, exist_ok=True)
      self._writer = SummaryWriter(directory)
    except OSError as e:
      raise ConfigError(f'metrics.tensorboard: cannot write event files to {directory} '
                        f'({e.strerror or e}); make it a writable directory, or set '
                        'metrics.tensorboard=False.') from None
    # Indented: TensorBoard shows text as Markdown, where that keeps the JSON as it is.
    self._writer.add_text('config', '    ' + config.to_json(indent=2).replace('\n', '\n    '), 0)
    self._writer.flush()

  def write(self, row: dict) -> None:
    for name, value in row.items():
      if isinstance(value, list):  # one number per expert
        self._writer.add_histogram(name, np.asarray(value), row['step'])
      elif name != 'step':
        self._writer.add_scalar(name, value, row['step'])
    self._writer.flush()  # a row per logging interval: TensorBoard sees it at once

  def close(self) -> None:
    self._writer.close()


class WeightsAndBiases:
  """A Weights & Biases run in `project`, named after the workdir, with the config."""

  def __init__(self, project: str, workdir: str, config: ConfigDict):
    import wandb  # jaxllm.validate has checked it is installed
    try:
      self._run = wandb.init(project=project, name=os.path.basename(os.path.abspath(workdir)),
                             config=config.to_dict(), dir=workdir)
    except Exception as e:  # wandb raises its own types: not logged in, no network, ...
      reason = (str(e).splitlines() or [type(e).__name__])[0]
      raise ConfigError(f'metrics.wandb_project={project!r}: W&B did not start ({reason}); run '
                        "`wandb login` (or set WANDB_MODE=offline), or set "
                        "metrics.wandb_project=''.") from None

  def write(self, row: dict) -> None:
    self._run.log({k: v for k, v in row.items() if k != 'step'}, step=row['step'])

  def close(self) -> None:
    self._run.finish()


class MetricsLog:
  """Progress bar on a terminal, a line per logging interval, and with a workdir the run's
  `config.json` and each row in `metrics.jsonl`, TensorBoard and W&B as `config.metrics`
  asks."""

  def __init__(self, workdir: str | None, config: ConfigDict, enabled: bool = True):
    self.enabled = enabled
    self.file = None
    self.writers = []
    if enabled and workdir:
      with _writing(workdir):
        os.makedirs(workdir, exist_ok=True)
      if config.metrics.tensorboard:
        self.writers.append(TensorBoard(os.path.join(workdir, 'tensorboard'), config))
      if config.metrics.wandb_project:
        self.writers.append(WeightsAndBiases(config.metrics.wandb_project, workdir, config))
      with _writing(workdir):
        with open(os.path.join(workdir, 'config.json'), 'w') as f:
          f.write(config.to_json(indent=2))
        self.file = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    # tqdm hides itself when stderr is not a terminal (logs, CI, subprocesses).
    self.bar = tqdm(total=config.train.steps, disable=None if enabled else True,
                    file=sys.stderr, dynamic_ncols=True, leave=False)

  def info(self, text: str) -> None:
    if self.enabled:
      tqdm.write(text, file=sys.stdout)

  def _record(self, row: dict) -> None:
    if self.file:
      self.file.write(json.dumps(row) + '\n')
      self.file.flush()
    for writer in self.writers:
      writer.write(row)

  def write(self, row: dict, steps_done: int) -> None:
    if not self.enabled:
      return
    self._record(row)
    self.bar.update(steps_done)
    self.bar.set_postfix(loss=f'{row["loss"]:.4f}')
    parts = [f'step {row["step"]}', f'loss {row["loss"]:.4f}', f'grad_norm {row["grad_norm"]:.3f}',
             f'lr {row["lr"]:.2e}', f'step_time {row["step_time"]:.3f}s',
             f'tokens/s {row["tokens_per_sec"]:,.0f}']
    if 'mfu' in row:
      parts.append(f'mfu {100 * row["mfu"]:.1f}%')
    if 'moe_aux_loss' in row:
      parts.append(f'experts: load {row["moe_load_min"]:.2f}–{row["moe_load_max"]:.2f}× even, '
                   f'dropped {100 * row["moe_dropped"]:.1f}%, aux {row["moe_aux_loss"]:.4f}, '
                   f'z {row["moe_z_loss"]:.3f}')
    if row.get('save_time'):
      parts.append(f'saved (blocked {row["save_time"]:.2f}s)')
    tqdm.write('  '.join(parts), file=sys.stdout)

  def write_eval(self, row: dict) -> None:
    if not self.enabled:
      return
    self._record(row)
    tqdm.write(f'step {row["step"]}  eval_loss {row["eval_loss"]:.4f}  '
               f'eval_perplexity {row["eval_perplexity"]:.2f}', file=sys.stdout)

  def close(self) -> None:
    self.bar.close()
    for writer in self.writers:
      writer.close()
    if self.file:
      self.file.close()


@contextlib.contextmanager
def _writing(workdir: str):
  """A failure to write into the workdir as one ConfigError line."""
  try:
    yield
  except OSError as e:
    raise ConfigError(f'--workdir={workdir}: cannot write there ({e.strerror or e}); point '
                      '--workdir at a directory you can write to.') from None


def is_logging_process() -> bool:
  return jax.process_index() == 0
