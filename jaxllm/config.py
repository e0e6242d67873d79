"""Run configuration: defaults, validation and command-line parsing.

A config file (``configs/*.py``) defines ``get_config()`` returning a ConfigDict built
on :func:`default_config`. Any field can be overridden on the command line in the
ml_collections style: ``--config.mesh.tensor=2``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import traceback

from absl import flags
from ml_collections import ConfigDict, config_flags

MESH_AXES = ('data', 'fsdp', 'pipe', 'tensor')
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_except_mlp', 'attention')
ATTENTION_IMPLS = ('xla', 'cudnn')
DTYPES = ('float32', 'bfloat16')
DATA_SOURCES = ('files', 'synthetic')
DATA_FORMATS = ('auto', 'text', 'lines', 'jsonl', 'parquet', 'arrayrecord', 'chat')
PIPELINE_SCHEDULES = ('gpipe', 'circular')
GATHER_MODES = ('step', 'iteration')
ZERO_STAGES = (0, 1, 2)
SCHEDULES = ('cosine', 'linear', 'constant', 'wsd')  # optim.schedule

# Which config field sets the size of each logical parameter axis (for error messages).
AXIS_FIELDS = {
    'vocab': 'model.vocab_size',
    'embed': 'model.embed_dim',
    'heads': 'model.num_heads',
    'kv_heads': 'model.num_kv_heads',
    'head_dim': 'model.head_dim',
    'mlp': 'model.mlp_dim',
    'layers': 'model.num_layers',
    'norm': 'model.embed_dim',
}


class ConfigError(ValueError):
  """A user-facing configuration problem; the message names the field and the fix."""


class TrainingError(RuntimeError):
  """A run that cannot go on (e.g. a non-finite loss); the message names the step and the fix."""


def default_config() -> ConfigDict:
  """Every field a run can set, with its default. Configs start from this."""
  c = ConfigDict()
  # Simulated devices to create when JAX runs on the CPU (0: JAX's default of one).
  c.cpu_devices = 0
  # XLA flags for the run (before any in the XLA_FLAGS environment variable, which win). The
  # latency-hiding scheduler lets GPU collectives overlap compute; CPUs ignore GPU flags.
  c.xla_flags = '--xla_gpu_enable_latency_hiding_scheduler=true'
  # A training run keeps its compiled programs here, and the next run of the same programs
  # reads them back instead of compiling. 'auto': jaxllm/compilation under the user's cache
  # directory ($XDG_CACHE_HOME, else ~/.cache); '': no cache.
  c.compilation_cache = 'auto'

  c.model = ConfigDict(dict(
      vocab_size=320,
      embed_dim=128,
      num_layers=4,
      num_heads=4,
      num_kv_heads=4,
      head_dim=32,
      mlp_dim=512,
      rope_theta=10_000.0,
      # Llama-3 frequency scaling; factor 0 turns it off.
      rope_scaling=ConfigDict(dict(factor=0.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position=8192)),
      norm_eps=1e-5,
      tie_embeddings=False,
      init_std=0.02,
      dtype='float32',        # compute dtype of activations and matmuls
      # storage dtype of the parameters: the master weights the optimizer updates. At
      # fine-tuning learning rates most updates are below bfloat16's spacing and round away.
      param_dtype='float32',
      # element type weight gradients are summed in across the devices that split the batch
      grad_reduce_dtype='float32',
      attention='xla',        # 'xla' everywhere, 'cudnn' fused flash attention on NVIDIA GPUs
      # cudnn: documents a packed row may hold (the loader refuses a row with more). cuDNN
      # keeps fp32 softmax statistics for each as if it filled the row: [rows·M, heads, T].
      max_documents=16,
      # What each layer keeps for its backward, pipelined or not (the rest is recomputed):
      # 'none' (everything), 'full' (only its input), 'dots' (weight-matmul outputs; reruns
      # attention), 'dots_except_mlp' (q, k, v and attention's output and statistics;
      # recomputes the MLP) or 'attention' (attention's output and statistics; recomputes
      # every matmul but not cuDNN's attention forward; with XLA's attention, nearly 'full')
      remat='none',
      # The loss makes logits this many positions at a time (0: the whole sequence at once),
      # taking each chunk's gradients as it goes: one [batch, loss_chunk, vocab] fp32 chunk
      # exists at a time, and nothing is recomputed in the backward.
      loss_chunk=1024,
      # the context the model is for: max_position_embeddings of an exported config.json, and
      # where generation stops. 0: data.seq_len
      max_position=0,
  ))

  # -1 means "whatever is left of the devices"; at most one axis may say so.
  # across_hosts: on several hosts, the axes (comma-separated, first filled first) whose
  # extent is split between hosts; the rest stay inside each host, on its fast links.
  c.mesh = ConfigDict(dict(data=1, fsdp=-1, pipe=1, tensor=1, across_hosts='data,pipe,fsdp,tensor'))

  # Logical axis name -> mesh axes it is split over (empty tuple: replicated).
  # This table is the one place that binds model axes to the mesh.
  # seq splits every activation along the sequence (context parallelism: attention gathers
  # each row's keys and values), e.g. seq=('fsdp',) with batch=('data',); act_seq splits the
  # residual stream and its norms further (sequence parallelism: act_seq=('tensor',) turns
  # the tensor all-reduces into reduce-scatters and all-gathers).
  c.sharding = ConfigDict(dict(rules=ConfigDict(dict(
      batch=('data', 'fsdp'),
      seq=(),
      act_seq=(),
      vocab=('tensor',),
      embed=('fsdp',),
      heads=('tensor',),
      kv_heads=('tensor',),
      head_dim=(),
      mlp=('tensor',),
      layers=('pipe',),
      norm=(),
      act_embed=(),
      act_heads=('tensor',),
      act_kv_heads=('tensor',),
      act_mlp=('tensor',),
      act_vocab=('tensor',),
  ))))
  # ZeRO over data, on top of what the rules split: 0 off; 1 the AdamW moments split over
  # data as well: the gradients' all-reduce becomes a reduce-scatter, each device updates its
  # slice of the parameters and the slices are all-gathered (the same bytes as the
  # all-reduce); 2 the fp32 gradient sum too, each micro-batch's gradients reduce-scattered
  # into it (train.micro_batches times the reduce-scatter traffic; with one micro-batch, 1's
  # program). Parameters stay whole over data. Means nothing when mesh.data=1.
  c.sharding.zero = 0

  # Used when mesh.pipe > 1: the layer stack is split into mesh.pipe stages.
  c.pipeline = ConfigDict(dict(
      schedule='gpipe',       # 'gpipe', or 'circular' (stage s holds blocks s, s+S, ...)
      repeats=1,              # circular: trips of each micro-batch round the stages (R ≥ 2)
      microbatches=0,         # M; 0: 2 × stages
      # 'step': all-gather fsdp-split stage weights once per step (more memory, one gather
      # and one gradient reduce-scatter per step); 'iteration': gather them in every
      # pipeline iteration (less memory, traffic repeated per micro-batch).
      gather_weights='step',
  ))

  c.train = ConfigDict(dict(
      steps=100,
      log_every=10,
      seed=0,
      global_batch=8,      # sequences per optimizer step, over all devices
      micro_batches=1,     # gradient accumulation: the step runs this many slices in turn
      peak_flops=0.0,      # peak FLOP/s of one device for MFU; 0: look the device up
      # Non-finite loss or gradients: False stops the run naming the step (the last good
      # checkpoint stays as it is); True skips that update and goes on.
      skip_nonfinite=False,
  ))

  c.optim = ConfigDict(dict(
      lr=3e-4,             # peak learning rate
      warmup_steps=10,     # update s of the first W takes lr·s/W; update W takes the peak
      # after warmup: 'cosine' or 'linear' decay to lr·min_lr_ratio, 'constant', or 'wsd'
      # (warmup-stable-decay: the peak until the last decay_steps, then linear decay)
      schedule='cosine',
      # cosine/linear: the updates after warmup the lr falls over (0: to train.steps), then
      # it stays at the final lr; wsd: the last updates, which it falls over (0: a fifth)
      decay_steps=0,
      min_lr_ratio=0.1,    # final lr = lr * min_lr_ratio
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,    # not applied to norm scales
      clip_norm=1.0,       # global gradient norm clip; 0 turns it off
      # z-loss: adds z_loss · log²Z per token (Z: the softmax's normaliser) to the objective,
      # keeping the logits from drifting; the logged loss stays the cross-entropy
      z_loss=0.0,
      # dtype the AdamW moments are stored in; 'bfloat16' halves their memory but loses
      # the small updates of low learning rates (gradients are always accumulated in fp32)
      state_dtype='float32',
  ))

  c.data = ConfigDict(dict(
      source='files',      # 'files': documents at data.path; 'synthetic': one fixed random batch
      path='',             # a file, a directory, or a glob of shards
      # 'auto' picks by extension (.jsonl, .parquet, .arrayrecord; anything else is text);
      # 'text': a document per file, 'lines': a document per line, 'arrayrecord': records of
      # pre-tokenised documents (little-endian int32 ids), 'chat' (never picked by 'auto'):
      # JSONL conversations {"messages": [{"role", "content"}, ...]}, rendered with the chat
      # template and trained on the assistant's turns only.
      format='auto',
      text_field='text',   # the text column of JSONL and Parquet records
      tokenizer='byte',    # 'byte' (built in), a Hugging Face tokenizer.json, or a SentencePiece .model
      # 'chat': a Jinja chat template file; '' takes the tokenizer's (chat_template.jinja, or
      # chat_template in tokenizer_config.json, beside its tokenizer.json)
      chat_template='',
      packing=True,        # pack documents into rows (attention stays inside each); False: one per row
      seq_len=128,
      eval_path='',        # held-out documents; or hold out a fraction of data.path:
      eval_fraction=0.0,
      prefetch=4,          # batches prepared ahead of the train step
      # Independent streams the documents are read in, each filling its block of rows of
      # every batch; a process reads the streams its rows come from. 0: one per process
      # (or what the run's checkpoint used). A fixed number makes the batches the same on
      # any number of processes.
      streams=0,
  ))

  c.eval = ConfigDict(dict(
      every=0,             # steps between evaluations on the held-out split; 0: never
      batches=4,           # batches per evaluation (of global_batch / micro_batches rows)
  ))

  c.checkpoint = ConfigDict(dict(
      dir='',              # default: <workdir>/checkpoints; a run resumes from its latest
      every=500,           # steps between saves (and a save at the last step); 0: never
      keep=3,              # newest checkpoints kept
      async_save=True,     # write in the background while training goes on
  ))
  # Start from the parameters of this checkpoint (a checkpoint dir or one step in it, or
  # 'hf:DIR', a Hugging Face Llama checkpoint) and fresh optimizer state: fine-tuning.
  # Ignored when the run has checkpoints of its own.
  c.init_from = ''

  # Many processes (hosts) as one run, through jax.distributed. Under SLURM, Open MPI or
  # Kubernetes the fields below are found from the environment; set them to launch by hand.
  c.distributed = ConfigDict(dict(
      coordinator_address='',  # host:port of process 0, reachable from every process
      num_processes=0,         # 0: from the cluster, or a single process when there is none
      process_id=-1,           # this process, 0 … num_processes-1; -1: from the cluster
      initialization_timeout=300,  # seconds for all processes to join before giving up
      heartbeat_timeout=100,   # seconds a process may go silent before the run stops with an error
  ))

  # Where the rows of <workdir>/metrics.jsonl go besides (process 0 only).
  c.metrics = ConfigDict(dict(
      tensorboard=True,    # TensorBoard event files in <workdir>/tensorboard, and the config
      wandb_project='',    # also log to this Weights & Biases project ('': no); needs wandb
  ))

  # A jax.profiler trace of steps start_step … start_step+steps-1 into <workdir>/profile.
  c.profile = ConfigDict(dict(
      start_step=0,        # the first step traced; 0: no trace. Past the first few, which warm up
      steps=3,             # steps traced; a few suffice and traces grow quickly
  ))
  return c


# ----------------------------------------------------------------------------- validation

def resolve_mesh(mesh_cfg: ConfigDict, num_devices: int) -> dict[str, int]:
  """Mesh axis sizes with a -1 filled in; errors when they do not cover the devices."""
  sizes = {a: int(mesh_cfg[a]) for a in MESH_AXES}
  for a, n in sizes.items():
    if n == 0 or n < -1:
      raise ConfigError(f'mesh.{a}={n}: an axis size must be a positive integer or -1 (the rest).')
  fill = [a for a, n in sizes.items() if n == -1]
  if len(fill) > 1:
    raise ConfigError(f'mesh: only one axis may be -1, got {", ".join(fill)}; '
                      'give the others explicit sizes.')
  known = math.prod(n for n in sizes.values() if n != -1)
  if fill:
    if num_devices % known:
      raise ConfigError(f'mesh: the fixed axes multiply to {known}, which does not divide the '
                        f'{num_devices} devices in use; change the mesh sizes.')
    sizes[fill[0]] = num_devices // known
  product = math.prod(sizes.values())
  if product != num_devices:
    shape = '×'.join(f'{a}={n}' for a, n in sizes.items())
    raise ConfigError(f'mesh: {shape} makes {product} devices but {num_devices} are in use; '
                      f'choose sizes whose product is {num_devices} (or set one axis to -1).')
  return sizes


def _choice(value, field: str, allowed: tuple[str, ...]):
  if value not in allowed:
    raise ConfigError(f'{field}={value!r} is unknown; use one of {", ".join(allowed)}.')


def validate(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  """Checks the fields against each other and the mesh (raises ConfigError), and keeps K/V
  heads whole where the mesh splits them finer than there are heads (the one rule it
  changes: `_replicate_shared_kv_heads`)."""
  m, t = cfg.model, cfg.train
  _choice(m.remat, 'model.remat', REMAT_POLICIES)
  _choice(m.attention, 'model.attention', ATTENTION_IMPLS)
  _choice(m.dtype, 'model.dtype', DTYPES)
  _choice(m.param_dtype, 'model.param_dtype', DTYPES)
  _choice(m.grad_reduce_dtype, 'model.grad_reduce_dtype', DTYPES)
  _validate_optim(cfg.optim)
  if cfg.metrics.wandb_project and importlib.util.find_spec('wandb') is None:
    raise ConfigError(f'metrics.wandb_project={cfg.metrics.wandb_project!r} needs the wandb '
                      "package: pip install wandb (or set metrics.wandb_project='').")
  _choice(cfg.data.source, 'data.source', DATA_SOURCES)
  if cfg.sharding.zero not in ZERO_STAGES:
    raise ConfigError(f'sharding.zero={cfg.sharding.zero!r} is unknown; use 0 (off), 1 (optimizer '
                      'state split over data) or 2 (and the gradient sum).')
  _choice(cfg.data.format, 'data.format', DATA_FORMATS)
  if cfg.cpu_devices < 0:
    raise ConfigError(f'cpu_devices={cfg.cpu_devices} must be at least 0 (0: JAX\'s default).')
  if not 0 <= cfg.data.eval_fraction < 1:
    raise ConfigError(f'data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1).')
  for field, least in (('eval.every', 0), ('eval.batches', 1), ('checkpoint.every', 0),
                       ('checkpoint.keep', 1), ('data.prefetch', 0), ('profile.start_step', 0),
                       ('profile.steps', 1)):
    section, name = field.split('.')
    if cfg[section][name] < least:
      raise ConfigError(f'{field}={cfg[section][name]} must be at least {least}.')
  if cfg.eval.every and (cfg.data.source != 'files' or
                         not (cfg.data.eval_path or cfg.data.eval_fraction)):
    raise ConfigError(f'eval.every={cfg.eval.every} needs a held-out split of file data: set '
                      'data.eval_path or data.eval_fraction, or eval.every=0.')

  for field in ('vocab_size', 'embed_dim', 'num_layers', 'num_heads', 'num_kv_heads',
                'head_dim', 'mlp_dim', 'max_documents'):
    if m[field] < 1:
      raise ConfigError(f'model.{field}={m[field]} must be positive.')
  if m.max_position < 0:
    raise ConfigError(f'model.max_position={m.max_position} must be at least 0 '
                      '(0: data.seq_len).')
  if m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for rotary embeddings.')
  # NaN and inf fail these too: either would reach the model and come out as a NaN loss.
  for field in ('rope_theta', 'norm_eps', 'init_std'):
    if not (math.isfinite(m[field]) and m[field] > 0):
      raise ConfigError(f'model.{field}={m[field]} must be a positive number.')
  _validate_rope_scaling(m.rope_scaling)
  if m.loss_chunk < 0 or (m.loss_chunk and cfg.data.seq_len > m.loss_chunk and
                          cfg.data.seq_len % m.loss_chunk):
    raise ConfigError(f'model.loss_chunk={m.loss_chunk} must divide data.seq_len='
                      f'{cfg.data.seq_len} (or be 0 for the whole sequence at once).')
  if m.attention == 'cudnn' and m.dtype != 'bfloat16':
    raise ConfigError(f"model.attention='cudnn' computes in bfloat16, but model.dtype="
                      f"{m.dtype!r}; set model.dtype='bfloat16' or use model.attention='xla'.")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f'model.num_heads={m.num_heads} is not a multiple of '
                      f'model.num_kv_heads={m.num_kv_heads}; grouped-query attention needs it.')

  for field in ('steps', 'log_every', 'global_batch', 'micro_batches'):
    if t[field] < 1:
      raise ConfigError(f'train.{field}={t[field]} must be at least 1.')
  if cfg.data.seq_len < 1:
    raise ConfigError(f'data.seq_len={cfg.data.seq_len} must be at least 1.')
  if not 0 <= t.seed < 2**32:  # the data's shuffle and the synthetic batch take no other
    raise ConfigError(f'train.seed={t.seed} must be in [0, 2**32).')
  if not (math.isfinite(t.peak_flops) and t.peak_flops >= 0):  # a negative one was ignored
    raise ConfigError(f'train.peak_flops={t.peak_flops} must be a device\'s peak FLOP/s, or 0 '
                      'to look the device up.')
  if cfg.pipeline.repeats < 1:
    raise ConfigError(f'pipeline.repeats={cfg.pipeline.repeats} must be at least 1.')
  if cfg.pipeline.microbatches < 0:
    raise ConfigError(f'pipeline.microbatches={cfg.pipeline.microbatches} must be at least 0 '
                      '(0: 2 × mesh.pipe).')
  shards, split = batch_shards(cfg.sharding.rules, mesh_shape), _batch_split(cfg)
  if t.global_batch % (shards * t.micro_batches):
    raise ConfigError(
        f'train.global_batch={t.global_batch} is not divisible by {split}×micro_batches = '
        f'{shards}×{t.micro_batches}; make it a multiple of {shards * t.micro_batches} or '
        'change train.micro_batches.')
  if mesh_shape['pipe'] > 1:
    _validate_pipeline(cfg, mesh_shape)

  across = [a.strip() for a in cfg.mesh.across_hosts.split(',') if a.strip()]
  if any(a not in MESH_AXES for a in across):
    raise ConfigError(f'mesh.across_hosts={cfg.mesh.across_hosts!r} names unknown axes '
                      f'{[a for a in across if a not in MESH_AXES]}; use a comma-separated list '
                      f'of {", ".join(MESH_AXES)}.')
  if cfg.data.streams < 0:
    raise ConfigError(f'data.streams={cfg.data.streams} must be at least 0 (0: one per process).')
  validate_distributed(cfg.distributed)

  rules = cfg.sharding.rules
  for name, axes in rules.items():
    unknown = [a for a in rule_axes(axes) if a not in MESH_AXES]
    if unknown:
      raise ConfigError(f'sharding.rules.{name}={rule_axes(axes)} names unknown mesh axes '
                        f'{unknown}; use {", ".join(MESH_AXES)}.')
  _validate_sequence_split(cfg, mesh_shape)
  _replicate_shared_kv_heads(cfg, mesh_shape)


def batch_shards(rules: ConfigDict, mesh_shape: dict[str, int]) -> int:
  """How many ways the batch's rows are split: the sizes of the batch rule's axes."""
  return math.prod(mesh_shape[a] for a in rule_axes(rules.batch))


def _batch_split(cfg: ConfigDict) -> str:
  """The batch rule's axes for a message, e.g. 'data×fsdp'."""
  return '×'.join(rule_axes(cfg.sharding.rules.batch)) or 'one (sharding.rules.batch=())'


# The rules whose axes each sequence split must keep clear of: they split other dimensions
# of the same activations (the residual stream for act_seq; every activation for seq).
SEQUENCE_CLASHES = {
    'seq': ('batch', 'act_seq', 'act_embed', 'act_heads', 'act_kv_heads', 'act_mlp', 'act_vocab'),
    'act_seq': ('batch', 'act_embed'),
}


def _validate_sequence_split(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  """sharding.rules.seq (context parallelism) and act_seq (sequence parallelism): over axes
  the step leaves to the compiler, splitting no other dimension of the same activations,
  into parts that divide the sequence."""
  rules = cfg.sharding.rules
  for name, others in SEQUENCE_CLASHES.items():
    axes = rule_axes(rules[name])
    by_hand = [a for a in axes if a in ('data', 'pipe')]
    if by_hand:
      raise ConfigError(f'sharding.rules.{name}={axes} names {by_hand[0]!r}, whose rows or '
                        "stages the train step splits by hand; split the sequence over 'fsdp' "
                        "or 'tensor'.")
    for other in others:
      common = [a for a in axes if a in rule_axes(rules[other])]
      if common:
        raise ConfigError(f'sharding.rules.{name}={axes} and sharding.rules.{other}='
                          f'{rule_axes(rules[other])} both split over {common[0]!r}; an axis '
                          'splits one dimension of an activation: take it out of one of them.')
  axes = rule_axes(rules.seq) + rule_axes(rules.act_seq)
  parts = math.prod(mesh_shape[a] for a in axes)
  if cfg.data.seq_len % parts:
    raise ConfigError(f'data.seq_len={cfg.data.seq_len} does not split over sharding.rules.seq '
                      f'and act_seq ({"×".join(axes)} = {parts}); make it a multiple of {parts} '
                      'or change the mesh or those rules.')


def rule_axes(axes) -> tuple[str, ...]:
  """A rules-table entry as a tuple of mesh axes (it may be given as one name)."""
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _replicate_shared_kv_heads(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  """Fewer K/V heads than the devices their rule splits them over (8 over tensor=16): each
  device's query heads then share one K/V head, so the K/V weights and activations are kept
  whole on those devices (their rules emptied) and `sharded_attention` takes each device's
  own K/V head from them, as Megatron and MaxText replicate them. A count that neither
  divides nor is divided by the split is left for `check_divisible` to name."""
  K = cfg.model.num_kv_heads
  for name in ('kv_heads', 'act_kv_heads'):
    parts = math.prod(mesh_shape[a] for a in rule_axes(cfg.sharding.rules[name]))
    if K % parts and parts % K == 0:
      cfg.sharding.rules[name] = ()


def context_length(cfg: ConfigDict) -> int:
  """The context the model is for: model.max_position, or the rows it trains on."""
  return cfg.model.max_position or cfg.data.seq_len


def _validate_optim(o: ConfigDict) -> None:
  """Each optimizer field in its meaningful range (NaN and inf fail too): a negative lr would
  train by gradient ascent, a negative weight decay would grow the weights."""
  _choice(o.schedule, 'optim.schedule', SCHEDULES)
  _choice(o.state_dtype, 'optim.state_dtype', DTYPES)
  ranges = {'lr': ('> 0', lambda v: v > 0), 'eps': ('> 0', lambda v: v > 0),
            'min_lr_ratio': ('in [0, 1]', lambda v: 0 <= v <= 1),
            'b1': ('in [0, 1)', lambda v: 0 <= v < 1), 'b2': ('in [0, 1)', lambda v: 0 <= v < 1),
            'weight_decay': ('>= 0', lambda v: v >= 0),
            'clip_norm': ('>= 0 (0: no clipping)', lambda v: v >= 0),
            'z_loss': ('>= 0 (0: off)', lambda v: v >= 0)}
  for field, (meaning, ok) in ranges.items():
    if not (math.isfinite(o[field]) and ok(o[field])):
      raise ConfigError(f'optim.{field}={o[field]} must be {meaning}.')
  for field in ('warmup_steps', 'decay_steps'):
    if o[field] < 0:
      raise ConfigError(f'optim.{field}={o[field]} must be at least 0.')


def _validate_rope_scaling(s: ConfigDict) -> None:
  """Llama-3 frequency scaling, as transformers checks it: factor 0 turns it off, else
  factor ≥ 1 and 0 < low_freq_factor < high_freq_factor (the blend divides by their gap)."""
  if s.factor == 0:
    return
  if not (math.isfinite(s.factor) and s.factor >= 1):
    raise ConfigError(f'model.rope_scaling.factor={s.factor} must be at least 1 (how many times '
                      'original_max_position the context grows), or 0 for no scaling.')
  if not 0 < s.low_freq_factor < s.high_freq_factor < math.inf:
    raise ConfigError(f'model.rope_scaling.low_freq_factor={s.low_freq_factor} and '
                      f'high_freq_factor={s.high_freq_factor} must have 0 < low < high '
                      '(Llama 3.1: 1 and 4).')
  if s.original_max_position < 1:
    raise ConfigError(f'model.rope_scaling.original_max_position={s.original_max_position} must '
                      'be the context length the model was trained for, e.g. 8192.')


def validate_distributed(d: ConfigDict) -> None:
  """The ranges of distributed.*. Processes join before the rest of the config is validated,
  so `distributed` calls this first too."""
  if d.num_processes < 0:
    raise ConfigError(f'distributed.num_processes={d.num_processes} must be positive (or 0: '
                      'from the cluster).')
  if d.process_id < -1:
    raise ConfigError(f'distributed.process_id={d.process_id} must be at least 0 (or -1: from '
                      'the cluster).')
  for field in ('initialization_timeout', 'heartbeat_timeout'):
    if d[field] < 1:
      raise ConfigError(f'distributed.{field}={d[field]} must be at least 1 (seconds).')


def pipeline_shape(cfg: ConfigDict, stages: int) -> tuple[int, int]:
  """(repeats, micro-batches) of the pipeline over `stages` stages."""
  p = cfg.pipeline
  return p.repeats, p.microbatches or 2 * stages


def _validate_pipeline(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  p, S = cfg.pipeline, mesh_shape['pipe']
  _choice(p.schedule, 'pipeline.schedule', PIPELINE_SCHEDULES)
  _choice(p.gather_weights, 'pipeline.gather_weights', GATHER_MODES)
  R, M = pipeline_shape(cfg, S)
  if p.schedule == 'gpipe' and R != 1:
    raise ConfigError(f"pipeline.repeats={R} needs pipeline.schedule='circular'; "
                      'set repeats=1 for gpipe.')
  if p.schedule == 'circular' and R < 2:
    raise ConfigError(f"pipeline.repeats={R}: the circular schedule needs repeats ≥ 2 "
                      "(or use pipeline.schedule='gpipe').")
  if cfg.model.num_layers % (S * R):
    raise ConfigError(f'model.num_layers={cfg.model.num_layers} is not divisible by '
                      f'pipe×repeats = {S}×{R}; change the layers, mesh.pipe or pipeline.repeats.')
  if M < S or M % S:
    raise ConfigError(f'pipeline.microbatches={M} is not a multiple of mesh.pipe={S}: each stage '
                      f'runs the output head on M/S of them; use {S}, {2 * S} (a smaller bubble) '
                      'or another multiple.')
  slice_rows = cfg.train.global_batch // cfg.train.micro_batches
  shards = batch_shards(cfg.sharding.rules, mesh_shape)
  if slice_rows % (M * shards):
    raise ConfigError(
        f'train.global_batch={cfg.train.global_batch} (÷ train.micro_batches='
        f'{cfg.train.micro_batches}) is not divisible by pipeline.microbatches×'
        f'{_batch_split(cfg)} = {M}×{shards}; make it a multiple of '
        f'{M * shards * cfg.train.micro_batches} or change pipeline.microbatches.')


# ----------------------------------------------------------------------------- command line

_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Run directory for metrics, logs and checkpoints; a run resumes '
                               'from its checkpoints (default: runs/<config name>).')


def _define_config_flag(argv: list[str]) -> flags.FlagHolder:
  """`--config` and its `--config.a.b` overrides, defined afresh for `argv`: config_flags reads
  the overrides from the argv it is given and defines a flag for each, so a second parse in
  one process (a notebook, a test) must not find the first one's."""
  for name in [n for n in flags.FLAGS if n == 'config' or n.startswith('config.')]:
    delattr(flags.FLAGS, name)
  return config_flags.DEFINE_config_file('config', None, 'Path to a config file in configs/.',
                                         sys_argv=argv)


def load_config(path: str) -> ConfigDict:
  """`get_config()` of a config file, without command-line overrides."""
  spec = importlib.util.spec_from_file_location('_jaxllm_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _unknown_override(config_path: str, argv: list[str]) -> str | None:
  """Names the first --config.a.b override whose field does not exist, with the known ones."""
  cfg = load_config(config_path)
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    keys = arg[len('--config.'):].split('=', 1)[0].split('.')
    node, seen = cfg, []
    for key in keys:
      if not isinstance(node, ConfigDict) or key not in node:
        where = '.'.join(seen) or 'the config'
        fields = ', '.join(sorted(node.keys())) if isinstance(node, ConfigDict) else ''
        return (f'--config.{".".join(keys)}: unknown config field {key!r} in {where}'
                + (f'; known fields: {fields}.' if fields else '.'))
      node, seen = node[key], seen + [key]
  return None


USAGE = """usage: python -m jaxllm.train --config configs/X.py [--config.SECTION.FIELD=VALUE ...] [--workdir DIR]

Any field of the config can be overridden; -1 on one mesh axis means the remaining devices.
Fields and their defaults:
"""


def parse_command_line(argv: list[str]) -> tuple[ConfigDict, str]:
  """Parses `--config FILE [--config.x.y=v ...] [--workdir DIR]`. Raises ConfigError."""
  if '--help' in argv or '-h' in argv:
    print(USAGE + str(default_config()))
    sys.exit(0)
  # `--config FILE` and `--config=FILE` are both accepted; normalise to the latter.
  normalised, i = [argv[0]], 1
  while i < len(argv):
    if argv[i] == '--config' and i + 1 < len(argv):
      normalised.append(f'--config={argv[i + 1]}')
      i += 2
    else:
      normalised.append(argv[i])
      i += 1
  config_path = next((a.split('=', 1)[1] for a in normalised if a.startswith('--config=')), None)
  if config_path is None:
    raise ConfigError('--config is required: pass a config file, e.g. --config configs/tiny.py.')
  if not os.path.isfile(config_path):
    raise ConfigError(f'--config {config_path}: no such file; pass a file from configs/, '
                      'e.g. configs/tiny.py.')
  config_flag = _define_config_flag(normalised)
  flags.FLAGS.unparse_flags()  # the other flags start from their defaults too
  try:
    flags.FLAGS(normalised)
    cfg = config_flag.value
  except (AttributeError, KeyError) as e:
    raise ConfigError(_unknown_override(config_path, normalised) or f'bad config override: {e}') from None
  except flags.Error as e:
    raise ConfigError(f'{str(e).splitlines()[0]}') from None
  # The same command twice uses the same directory, so a restarted run resumes.
  workdir = _WORKDIR.value or os.path.join(
      'runs', os.path.splitext(os.path.basename(config_path))[0])
  return cfg, workdir


def main_guard(main):
  """Runs `main(argv)`; a ConfigError becomes one line on stderr and exit status 2, a
  TrainingError one line and exit status 1. In a run of several processes any other error
  also ends this process at once (after its traceback), with status 1."""
  try:
    main(sys.argv)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    _exit(2)
  except TrainingError as e:
    print(f'error: {e}', file=sys.stderr)
    _exit(1)
  except Exception:
    if not _several_processes():
      raise
    traceback.print_exc()
    _exit(1)


def _several_processes() -> bool:
  import jax
  return jax.distributed.is_initialized()


def _exit(code: int) -> None:
  """sys.exit, except in a run of several processes: there the other processes may be gone
  already, and JAX's clean-up at exit would wait for them, so the process ends at once."""
  if _several_processes():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
