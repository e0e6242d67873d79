"""Checks a config's fields against each other and the mesh: each problem is a ConfigError
that names the field and the fix. Nothing here changes the config; what follows from it for a
run (the rules it shards by) is `jaxllm.parallel.rules.derive`'s."""

from __future__ import annotations

import importlib.util
import math

from ml_collections import ConfigDict

from jaxllm.config import (ATTENTION_IMPLS, DATA_FORMATS, DATA_SOURCES, DISPATCHES, DTYPES,
                           FP8_RECIPES, GATHER_MODES, LAYER_TYPES, MESH_AXES, MLP_ACTIVATIONS,
                           ONE_F_ONE_B_SCHEDULES, PIPELINE_SCHEDULES, REMAT_POLICIES,
                           ROPE_SCALINGS, ROUND_TRIP_SCHEDULES, ROUTERS, SCHEDULES, ZERO_STAGES,
                           ConfigError, layer_types, pipeline_shape, scan_units)
from jaxllm.model import LOGICAL_SHAPES
from jaxllm.model.grouped_matmul import IMPLEMENTATIONS as GROUPED_MATMULS
from jaxllm.parallel.rules import batch_shards, collision, mesh_axes, parts

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
  """Checks the fields against each other and the mesh (raises ConfigError). It never changes
  the config: what follows from it (the rules a run shards by) is
  `jaxllm.parallel.rules.derive`'s."""
  m, t = cfg.model, cfg.train
  _choice(m.remat, 'model.remat', REMAT_POLICIES)
  _choice(m.attention, 'model.attention', ATTENTION_IMPLS)
  _choice(m.dtype, 'model.dtype', DTYPES)
  _choice(m.param_dtype, 'model.param_dtype', DTYPES)
  _choice(m.grad_reduce_dtype, 'model.grad_reduce_dtype', DTYPES)
  _validate_optim(cfg.optim, t.steps)
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
  _validate_block_options(m)
  _validate_moe(cfg, mesh_shape)
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
    unknown = [a for a in mesh_axes(axes) if a not in MESH_AXES]
    if unknown:
      raise ConfigError(f'sharding.rules.{name}={mesh_axes(axes)} names unknown mesh axes '
                        f'{unknown}; use {", ".join(MESH_AXES)}.')
  _validate_sequence_split(cfg, mesh_shape)
  _validate_collective_matmul(cfg)
  _validate_fp8(cfg.model)


def _batch_split(cfg: ConfigDict) -> str:
  """The batch rule's axes for a message, e.g. 'data×fsdp'."""
  return '×'.join(mesh_axes(cfg.sharding.rules.batch)) or 'one (sharding.rules.batch=())'


def _validate_sequence_split(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  """sharding.rules.seq (context parallelism) and act_seq (sequence parallelism): over axes
  the step leaves to the compiler, splitting no other dimension of the same activations (the
  check of every rule, `_validate_one_axis_per_dimension`, made here after the first so that
  a sequence over data says what to use instead), into parts that divide the sequence."""
  rules = cfg.sharding.rules
  for name in ('seq', 'act_seq'):
    axes = mesh_axes(rules[name])
    by_hand = [a for a in axes if a in ('data', 'pipe')]
    if by_hand:
      raise ConfigError(f'sharding.rules.{name}={axes} names {by_hand[0]!r}, whose rows or '
                        "stages the train step splits by hand; split the sequence over 'fsdp' "
                        "or 'tensor'.")
  _validate_one_axis_per_dimension(rules)
  axes = mesh_axes(rules.seq) + mesh_axes(rules.act_seq)
  parts = math.prod(mesh_shape[a] for a in axes)
  if cfg.data.seq_len % parts:
    raise ConfigError(f'data.seq_len={cfg.data.seq_len} does not split over sharding.rules.seq '
                      f'and act_seq ({"×".join(axes)} = {parts}); make it a multiple of {parts} '
                      'or change the mesh or those rules.')


def _validate_one_axis_per_dimension(rules: ConfigDict) -> None:
  """A sharding splits each dimension of an array over its own mesh axes: no mesh axis may
  split two, in any array the model lays out (`jaxllm.model.LOGICAL_SHAPES`), else JAX
  refuses the sharding when the step is built."""
  for shape in LOGICAL_SHAPES:
    found = collision(rules, shape)
    if not found:
      continue
    axis, first, second = found
    if first == second:
      raise ConfigError(f'sharding.rules.{first}={mesh_axes(rules[first])} names {axis!r} '
                        'twice; name each mesh axis once.')
    dims = ', '.join('·'.join(e) if isinstance(e, tuple) else e or '-' for e in shape)
    raise ConfigError(f'sharding.rules.{first}={mesh_axes(rules[first])} and sharding.rules.'
                      f'{second}={mesh_axes(rules[second])} both split over {axis!r}, but one '
                      f'array has both axes ([{dims}]); a mesh axis splits one dimension of an '
                      'array: take it out of one of the rules.')


def _validate_collective_matmul(cfg: ConfigDict) -> None:
  """model.collective_matmul hides sequence parallelism's tensor collectives behind matmuls,
  so it needs act_seq over tensor (on tensor=1 it does nothing, as act_seq does nothing); that
  the sequence divides is `_validate_sequence_split`'s check."""
  act_seq = mesh_axes(cfg.sharding.rules.act_seq)
  if cfg.model.collective_matmul and act_seq != ('tensor',):
    raise ConfigError('model.collective_matmul=True overlaps the tensor all-gathers and '
                      'reduce-scatters of sequence parallelism with the matmuls, but '
                      f"sharding.rules.act_seq={act_seq}; set sharding.rules.act_seq=('tensor',) "
                      'or model.collective_matmul=False.')


def _validate_optim(o: ConfigDict, train_steps: int) -> None:
  """Each optimizer field in its meaningful range (NaN and inf fail too): a negative lr would
  train by gradient ascent, a negative weight decay would grow the weights. 'wsd' decays over
  the last updates of `train_steps`: warmup must end before that decay begins. (A warmup
  longer than the run is no error: the run warms up over all of it, `optim.warmup_steps()`.)"""
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
  # As `jaxllm.optim.lr_schedule` takes it: past it, wsd would start the decay after warmup
  # and end the run part-way down it, not at lr·min_lr_ratio.
  decay = o.decay_steps or max(train_steps // 5, 1)
  if o.schedule == 'wsd' and o.warmup_steps + decay > train_steps:
    decay_text = (f'optim.decay_steps={o.decay_steps}' if o.decay_steps else
                  f'optim.decay_steps=0 (a fifth of train.steps: {decay})')
    raise ConfigError(f"optim.schedule='wsd' needs optim.warmup_steps + decay ≤ train.steps, but "
                      f'optim.warmup_steps={o.warmup_steps} + {decay_text} > '
                      f'train.steps={train_steps}: lower optim.warmup_steps or optim.decay_steps, '
                      'or raise train.steps.')


def _validate_rope_scaling(s: ConfigDict) -> None:
  """RoPE frequency scaling, as transformers checks it: factor 0 turns it off, else
  factor ≥ 1 and, for Llama 3's, 0 < low_freq_factor < high_freq_factor (the blend divides by
  their gap)."""
  _choice(s.kind, 'model.rope_scaling.kind', ROPE_SCALINGS)
  if s.factor == 0:
    return
  if not (math.isfinite(s.factor) and s.factor >= 1):
    raise ConfigError(f'model.rope_scaling.factor={s.factor} must be at least 1 (how many times '
                      'original_max_position the context grows), or 0 for no scaling.')
  if s.kind == 'linear':
    return
  if not 0 < s.low_freq_factor < s.high_freq_factor < math.inf:
    raise ConfigError(f'model.rope_scaling.low_freq_factor={s.low_freq_factor} and '
                      f'high_freq_factor={s.high_freq_factor} must have 0 < low < high '
                      '(Llama 3.1: 1 and 4).')
  if s.original_max_position < 1:
    raise ConfigError(f'model.rope_scaling.original_max_position={s.original_max_position} must '
                      'be the context length the model was trained for, e.g. 8192.')


def _validate_block_options(m: ConfigDict) -> None:
  """The fields other families set (model.qk_norm ... sliding_rope_theta): each in its range,
  and a window exactly where some layer slides."""
  _choice(m.mlp_activation, 'model.mlp_activation', MLP_ACTIVATIONS)
  pattern = tuple(m.layer_types)
  if not 1 <= len(pattern) <= m.num_layers or any(t not in LAYER_TYPES for t in pattern):
    raise ConfigError(f'model.layer_types={pattern} must be 1 to model.num_layers={m.num_layers} '
                      f"of {', '.join(LAYER_TYPES)}, repeated over the layers: e.g. ('sliding',) "
                      "for every layer, or ('sliding',) * 5 + ('full',).")
  sliding = 'sliding' in layer_types(m)
  if m.sliding_window < 0 or (sliding and m.sliding_window == 0):
    raise ConfigError(f'model.sliding_window={m.sliding_window}: the sliding layers of '
                      f'model.layer_types={pattern} need the positions each query sees, itself '
                      "included (e.g. 4096), or make every layer 'full'.")
  if m.sliding_window and not sliding:
    raise ConfigError(f'model.sliding_window={m.sliding_window} but no layer of '
                      f"model.layer_types={pattern} is 'sliding'; set model.layer_types="
                      "('sliding',) to window every layer, or model.sliding_window=0.")
  for field in ('attention_scale', 'sliding_rope_theta'):
    if not (math.isfinite(m[field]) and m[field] >= 0):
      raise ConfigError(f'model.{field}={m[field]} must be a positive number, or 0 for the '
                        'default.')
  if m.sliding_rope_theta and not sliding:
    raise ConfigError(f'model.sliding_rope_theta={m.sliding_rope_theta} but no layer of '
                      f"model.layer_types={pattern} is 'sliding'; set it to 0.")


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


def _validate_pipeline(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  p, S = cfg.pipeline, mesh_shape['pipe']
  _validate_pipe_rules(cfg.sharding.rules, S)
  _choice(p.schedule, 'pipeline.schedule', PIPELINE_SCHEDULES)
  _choice(p.gather_weights, 'pipeline.gather_weights', GATHER_MODES)
  R, M = pipeline_shape(cfg, S)
  if p.schedule not in ROUND_TRIP_SCHEDULES and R != 1:
    round_trips = {v: k for k, v in ROUND_TRIP_SCHEDULES.items()}[p.schedule]
    raise ConfigError(f'pipeline.repeats={R} needs pipeline.schedule='
                      f"'{round_trips}'; set repeats=1 for {p.schedule}.")
  if p.schedule in ROUND_TRIP_SCHEDULES and R < 2:
    plain = ROUND_TRIP_SCHEDULES[p.schedule]
    raise ConfigError(f"pipeline.repeats={R}: the {p.schedule} schedule needs repeats ≥ 2 "
                      f"(or use pipeline.schedule='{plain}').")
  units = scan_units(cfg.model)
  if units % (S * R):
    what = (f'model.num_layers={units}' if units == cfg.model.num_layers else
            f'the scanned MoE layers (model.num_layers={cfg.model.num_layers} after '
            f'model.moe.first_dense, in groups of model.moe.every: {units})')
    raise ConfigError(f'{what} is not divisible by pipe×repeats = {S}×{R}; change the layers, '
                      'mesh.pipe or pipeline.repeats.')
  if p.schedule in ('gpipe', 'circular') and (M < S or M % S):
    raise ConfigError(f'pipeline.microbatches={M} is not a multiple of mesh.pipe={S}: each stage '
                      f'runs the output head on M/S of them; use {S}, {2 * S} (a smaller bubble) '
                      "or another multiple (pipeline.schedule='1f1b' takes any).")
  if p.schedule == 'interleaved_1f1b' and M % S:
    raise ConfigError(f'pipeline.microbatches={M} is not a multiple of mesh.pipe={S}: '
                      'interleaved 1F1B sends micro-batches round the stages in groups of '
                      f'{S}; use {S}, {2 * S} or another multiple.')
  if p.schedule in ONE_F_ONE_B_SCHEDULES:
    if p.gather_weights != 'step':
      raise ConfigError(f"pipeline.gather_weights='{p.gather_weights}' is not built for "
                        f"pipeline.schedule='{p.schedule}'; use gather_weights='step'.")
    if cfg.model.fp8 != 'none':
      raise ConfigError(f"model.fp8='{cfg.model.fp8}' is not built for pipeline.schedule="
                        f"'{p.schedule}'; use model.fp8='none' or schedule 'gpipe'/'circular'.")
  slice_rows = cfg.train.global_batch // cfg.train.micro_batches
  shards = batch_shards(cfg.sharding.rules, mesh_shape)
  if slice_rows % (M * shards):
    raise ConfigError(
        f'train.global_batch={cfg.train.global_batch} (÷ train.micro_batches='
        f'{cfg.train.micro_batches}) is not divisible by pipeline.microbatches×'
        f'{_batch_split(cfg)} = {M}×{shards}; make it a multiple of '
        f'{M * shards * cfg.train.micro_batches} or change pipeline.microbatches.')


def _validate_moe(cfg: ConfigDict, mesh_shape: dict[str, int]) -> None:
  """model.moe: its ranges and choices, its layers, its experts against the devices the rules
  split them over, and what it does not combine with."""
  m, moe, rules = cfg.model, cfg.model.moe, cfg.sharding.rules
  if moe.experts < 0:
    raise ConfigError(f'model.moe.experts={moe.experts} must be at least 0 (0: dense layers).')
  if not moe.experts:
    return
  if not 1 <= moe.top_k <= moe.experts:
    raise ConfigError(f'model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts='
                      f'{moe.experts}; lower top_k or raise experts.')
  for field in ('mlp_dim', 'shared_experts', 'shared_mlp_dim', 'first_dense'):
    if moe[field] < 0:
      raise ConfigError(f'model.moe.{field}={moe[field]} must be at least 0.')
  if moe.every < 1:
    raise ConfigError(f'model.moe.every={moe.every} must be at least 1 (1: every layer after '
                      'model.moe.first_dense has experts).')
  _choice(moe.router, 'model.moe.router', ROUTERS)
  _choice(moe.dispatch, 'model.moe.dispatch', DISPATCHES)
  _choice(moe.grouped_matmul, 'model.moe.grouped_matmul', GROUPED_MATMULS)
  if not (math.isfinite(moe.capacity_factor) and moe.capacity_factor >= 0):
    raise ConfigError(f'model.moe.capacity_factor={moe.capacity_factor} must be at least 0 '
                      '(0: dropless; e.g. 1.25: each expert takes 1.25× an even share).')
  for field in ('aux_loss', 'z_loss', 'bias_rate'):
    if not (math.isfinite(moe[field]) and moe[field] >= 0):
      raise ConfigError(f'model.moe.{field}={moe[field]} must be at least 0 (0: off).')
  if not (math.isfinite(moe.route_scale) and moe.route_scale > 0):
    raise ConfigError(f'model.moe.route_scale={moe.route_scale} must be a positive number.')
  if moe.first_dense >= m.num_layers:
    raise ConfigError(f'model.moe.first_dense={moe.first_dense} leaves no layer of '
                      f'model.num_layers={m.num_layers} for the experts; lower it, or set '
                      'model.moe.experts=0 for a dense model.')
  if (m.num_layers - moe.first_dense) % moe.every:
    raise ConfigError(f'model.num_layers={m.num_layers} less model.moe.first_dense='
                      f'{moe.first_dense} is not a multiple of model.moe.every={moe.every}: '
                      'the layers after the first dense ones come in groups of every, the last '
                      'with experts; change one of them.')
  # A mesh axis in both experts and expert_mlp (or layers) is the rules' check's.
  experts_axes = mesh_axes(rules.experts)
  ep = parts(experts_axes, mesh_shape)
  if moe.experts % ep:
    split = '×'.join(f'{a}={mesh_shape[a]}' for a in experts_axes)
    raise ConfigError(f'model.moe.experts={moe.experts} does not split over the {ep} '
                      f'expert-parallel devices (sharding.rules.experts={experts_axes}: {split}); '
                      f'make it a multiple of {ep}, or change the mesh or sharding.rules.experts.')
  if len(set(layer_types(m))) > 1:  # the expert stacks carry no per-layer attention type
    raise ConfigError(f'model.layer_types={tuple(m.layer_types)} mixes full and sliding layers, '
                      f'which is not built for experts (model.moe.experts={moe.experts}); make '
                      "every layer 'full', or every layer 'sliding' (a window everywhere).")
  if m.fp8 != 'none':
    raise ConfigError(f"model.fp8='{m.fp8}' is not built for experts (model.moe.experts="
                      f"{moe.experts}); use model.fp8='none'.")
  if mesh_shape['pipe'] > 1:
    if cfg.pipeline.schedule in ONE_F_ONE_B_SCHEDULES:
      raise ConfigError(f"pipeline.schedule='{cfg.pipeline.schedule}' is not built for experts "
                        f"(model.moe.experts={moe.experts}); use schedule 'gpipe' or 'circular'.")
    if moe.first_dense:
      raise ConfigError(f'model.moe.first_dense={moe.first_dense} is not built for pipelines '
                        f'(mesh.pipe={mesh_shape["pipe"]}): the first dense layers are a stack '
                        'of their own; set it to 0 or mesh.pipe=1.')


def _validate_pipe_rules(rules: ConfigDict, stages: int) -> None:
  """A pipeline cuts the layer stack into stages over 'pipe': the layers rule must name 'pipe'
  and nothing else, and no other rule 'pipe'. Otherwise stages run blocks not their own
  (layers=(): every stage runs stage 0's, and the other layers never train), or the pipeline
  runs by hand over an axis that also splits something else (vocab=('pipe',): a NaN loss)."""
  layers = mesh_axes(rules.layers)
  if layers != ('pipe',):
    raise ConfigError(f"sharding.rules.layers={layers}: mesh.pipe={stages} cuts the layer stack "
                      "into stages over 'pipe', so the layers rule must be ('pipe',) alone; set "
                      "sharding.rules.layers=('pipe',) (the default) or mesh.pipe=1.")
  for name, axes in rules.items():
    if name != 'layers' and 'pipe' in mesh_axes(axes):
      raise ConfigError(f"sharding.rules.{name}={mesh_axes(axes)} names 'pipe', which the "
                        f'pipeline (mesh.pipe={stages}) keeps for the stages of the layer stack; '
                        f"take 'pipe' out of sharding.rules.{name}.")


def _validate_fp8(model_cfg: ConfigDict) -> None:
  """model.fp8's recipe, its history, and what it does not combine with."""
  _choice(model_cfg.fp8, 'model.fp8', FP8_RECIPES)
  if model_cfg.fp8 == 'delayed' and model_cfg.fp8_history < 1:
    raise ConfigError(f'model.fp8_history={model_cfg.fp8_history} must be at least 1 (steps '
                      'of amaxes a delayed scale is taken from).')
  if model_cfg.fp8 != 'none' and model_cfg.collective_matmul:
    raise ConfigError(f'model.fp8={model_cfg.fp8!r} and model.collective_matmul=True: the '
                      "collective matmul's rings run bf16 blocks; set one of them off.")
