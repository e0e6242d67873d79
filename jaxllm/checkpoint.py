"""Checkpoints through orbax: async saves of the train state, the data iterator's position and
the config; restores onto whatever mesh the run has now.

A checkpoint step directory holds three items: 'state' (step, params, optimizer state, in
layer order whatever the pipeline schedule), 'data' (the position of each data stream, one JSON
file per stream, so any number of processes can read it back) and 'config' (the run's config as
JSON). All processes write a checkpoint together, each its own shards and streams. Orbax
writes a step into a temporary directory and renames it when complete, so a save cut short by
a crash never looks like a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import jax
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from jaxllm.config import ConfigError, TrainingError, default_config
from jaxllm.data import Streams
from jaxllm.step import state_shapes

# Model fields that fix the parameters and their shapes; a checkpoint restores only where they
# all agree.
SHAPE_FIELDS = ('vocab_size', 'embed_dim', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
                'mlp_dim', 'tie_embeddings', 'param_dtype', 'qk_norm', 'qkv_bias', 'post_norms')
# model.moe's (the router's kind decides whether there are router biases).
MOE_SHAPE_FIELDS = ('experts', 'mlp_dim', 'shared_experts', 'shared_mlp_dim', 'first_dense',
                    'every', 'router')
SET_ASIDE_SUFFIX = '.unreadable'


def _warn(text: str) -> None:
  if jax.process_index() == 0:
    print(f'warning: {text}', file=sys.stderr)


def restore_target(abstract_state, shardings):
  """Shapes and dtypes with the *current* run's shardings: orbax reads each shard straight
  into its place on the new mesh, so no array is ever whole on one device."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_state, shardings)


def params_target(model_cfg: ConfigDict, mesh, rules):
  """The model's parameters as shapes with their shardings on `mesh`: what loading reads into."""
  _, abstract, shardings = state_shapes(model_cfg, optax.identity(), mesh, rules)
  return restore_target(abstract.params, shardings.params)


def router_bias_target(model_cfg: ConfigDict, mesh, rules):
  """The sigmoid routers' biases (TrainState.router_bias) as `params_target` gives the
  parameters; None for a model without them."""
  _, abstract, shardings = state_shapes(model_cfg, optax.identity(), mesh, rules)
  if abstract.router_bias is None:
    return None
  return restore_target(abstract.router_bias, shardings.router_bias)


class StreamPositions(ocp.CheckpointHandler):
  """The data position: `stream-S-of-N.json` per stream. Each process writes the streams it
  owns and reads the ones it needs, so a checkpoint of N processes restores on any number."""

  def save(self, directory: epath.Path, args: StreamPositionsSave):
    state = args.streams.get_state()
    for s in args.streams.owned:
      (directory / f'stream-{s}-of-{state["streams"]}.json').write_text(
          json.dumps(state['positions'][str(s)]))

  def restore(self, directory: epath.Path, args: StreamPositionsRestore):
    saved = [re.fullmatch(r'stream-(\d+)-of-(\d+)\.json', p.name) for p in directory.iterdir()]
    counts = {int(m[2]) for m in saved if m}
    if len(counts) != 1:
      raise ValueError(f'{directory} holds no data stream positions')
    (count,) = counts
    positions = {str(s): json.loads((directory / f'stream-{s}-of-{count}.json').read_text())
                 for s in args.streams.stream_ids(count)}
    args.streams.set_state({'streams': count, 'positions': positions})
    args.streams.start_prefetch()
    return args.streams


@ocp.args.register_with_handler(StreamPositions, for_save=True)
@dataclasses.dataclass
class StreamPositionsSave(ocp.args.CheckpointArgs):
  streams: Streams


@ocp.args.register_with_handler(StreamPositions, for_restore=True)
@dataclasses.dataclass
class StreamPositionsRestore(ocp.args.CheckpointArgs):
  streams: Streams


# Status codes tensorstore starts its errors with when the storage did not answer or refused
# the read, rather than finding the files missing or unreadable.
STORAGE_STATUSES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED', 'ABORTED',
                    'CANCELLED', 'PERMISSION_DENIED', 'UNAUTHENTICATED')


def _storage_failed(e: Exception) -> bool:
  """Whether a read failed for the storage's sake (an I/O error, a timeout, no permission),
  which the next try may not meet, rather than for what the checkpoint holds (a file missing
  or unparsable): such a checkpoint is not damaged, and is not set aside."""
  if isinstance(e, OSError):
    return not isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError))
  return str(e).startswith(STORAGE_STATUSES)


def _check_model_shape(saved: dict, model_cfg: ConfigDict, where: str) -> None:
  # A checkpoint saved before a field existed has its default.
  saved_moe = {**default_config().model.moe.to_dict(), **saved['model'].get('moe', {})}
  fields = [(f, saved['model'].get(f, default_config().model[f]), model_cfg[f])
            for f in SHAPE_FIELDS]
  fields += [(f'moe.{f}', saved_moe[f], model_cfg.moe[f]) for f in MOE_SHAPE_FIELDS]
  for field, was, now in fields:
    if was != now:
      raise ConfigError(f'checkpoint {where} was saved with model.{field}={was!r} but this run '
                        f'has model.{field}={now!r}; use the same model shape, or start a new '
                        'run (another --workdir or checkpoint.dir).')


def check_resumable(saved: dict, model_cfg: ConfigDict, where: str) -> None:
  """Whether a run of `model_cfg` can resume the train state of checkpoint `where`, saved by
  the run config `saved`: the parameters' shapes, and delayed FP8 scaling's state (its scales
  and amax histories, model.fp8_history long), agree. Raises ConfigError naming the field."""
  _check_model_shape(saved, model_cfg, where)
  defaults = default_config().model
  was = {f: saved['model'].get(f, defaults[f]) for f in ('fp8', 'fp8_history')}
  keeps = lambda fp8, history: (fp8 == 'delayed', history if fp8 == 'delayed' else None)
  if keeps(was['fp8'], was['fp8_history']) == keeps(model_cfg.fp8, model_cfg.fp8_history):
    return
  field = 'fp8' if was['fp8'] != model_cfg.fp8 else 'fp8_history'
  raise ConfigError(f'checkpoint {where} was saved with model.{field}={was[field]!r} but this '
                    f'run has model.{field}={model_cfg[field]!r}: delayed FP8 scaling keeps scales '
                    'and amax histories in the train state. Resume with the same, or start a '
                    f'new run from its parameters: init_from={where} and another --workdir (or '
                    'checkpoint.dir).')


def _saved_config(manager: ocp.CheckpointManager, step: int) -> dict:
  return manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config


def _reason(e: Exception, where: str) -> str:
  """Why checkpoint `where` did not read, in a few words; a TrainingError that stops the run
  where the storage failed the read (the checkpoint may be whole)."""
  reason = f'{type(e).__name__}: {(str(e).splitlines() or [""])[0][:200]}'
  if _storage_failed(e):
    raise TrainingError(f'checkpoint {where} could not be read ({reason}), a failure of the '
                        'storage rather than of its files: nothing was set aside; run again once '
                        'the storage reads.') from None
  return reason


class Checkpoints:
  """The checkpoints of one run directory: save every `checkpoint.every` steps, keep the newest
  `checkpoint.keep`, and restore the newest one that reads back."""

  def __init__(self, directory: str, ckpt_cfg: ConfigDict):
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      probe = os.path.join(self.directory, f'.write-test-{os.getpid()}')
      open(probe, 'w').close()
      os.remove(probe)
    except OSError as e:
      raise ConfigError(f'checkpoint.dir={self.directory!r} is not writable ({e.strerror}); '
                        'point checkpoint.dir (or --workdir) at a directory you can write to.'
                        ) from None
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.keep, enable_async_checkpointing=ckpt_cfg.async_save, create=True))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, batches, cfg: ConfigDict) -> None:
    """Starts writing `state` (in layer order) and the data position reached after `step`.

    Returns once the arrays are copied off the devices; the files are written in the
    background while training goes on."""
    items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(cfg.to_dict()))
    if isinstance(batches, Streams):
      items['data'] = StreamPositionsSave(batches)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore_latest(self, target, batches, model_cfg: ConfigDict):
    """The newest checkpoint that reads back, restored into `target`'s shapes and shardings
    (and `batches` moved to its data position); None when there is none.

    A checkpoint whose files fail to read while an older one reads is set aside (renamed,
    never deleted) with a warning. When none reads, that is an error: nothing is set aside.
    A read the storage fails (`_storage_failed`) stops the run, nothing set aside.
    """
    steps = self.steps()
    failures = []
    for step in reversed(steps):
      where = os.path.join(self.directory, str(step))
      try:
        saved = _saved_config(self.manager, step)
      except Exception as e:  # a damaged or missing config item
        failures.append((step, f'config: {_reason(e, where)}'))
        continue
      check_resumable(saved, model_cfg, where)  # a mismatch is the user's to fix: no fallback
      items = dict(state=ocp.args.StandardRestore(target))
      if isinstance(batches, Streams):
        items['data'] = StreamPositionsRestore(batches)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # orbax and tensorstore raise many kinds for damaged files
        failures.append((step, _reason(e, where)))
        continue
      for bad_step, reason in failures:
        bad = os.path.join(self.directory, str(bad_step))
        if jax.process_index() == 0:
          os.replace(bad, bad + SET_ASIDE_SUFFIX)
        _warn(f'checkpoint {bad} could not be read ({reason}); set it aside as '
              f'{bad}{SET_ASIDE_SUFFIX} and resumed from step {step}.')
      if failures:
        multihost_utils.sync_global_devices('jaxllm: damaged checkpoints set aside')
        self.manager.reload()
      return restored.state
    if failures:
      step, reason = failures[0]
      raise ConfigError(f'no checkpoint in {self.directory} could be read (step {step}: '
                        f'{reason}); move the directory away to start afresh, or fix it.')
    return None

  def wait(self) -> None:
    """Blocks until every save in flight is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def _open_checkpoint(path: str, field: str) -> tuple[ocp.CheckpointManager, str, int]:
  """A read-only manager of a checkpoint directory, its directory and the step meant: the
  newest, or the one `path` names when it is a step directory. `field` names the setting the
  path came from, for errors."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ConfigError(f'{field}={path!r} is not a directory; give a checkpoint directory '
                      'or one of its step directories.')
  if os.path.isdir(os.path.join(path, 'state')):  # a step directory
    directory, step = os.path.dirname(path), int(os.path.basename(path))
  else:
    directory, step = path, None
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
  step = step if step is not None else manager.latest_step()
  if step is None:
    manager.close()
    raise ConfigError(f'{field}={path!r} holds no checkpoints; give a directory that '
                      'train wrote checkpoints into.')
  return manager, directory, step


def saved_config(path: str, field: str = 'init_from') -> ConfigDict:
  """The run config that a checkpoint directory's newest step, or one step directory, was
  saved with, over today's defaults (a run saved before a field existed lacks it)."""
  manager, _, step = _open_checkpoint(path, field)
  try:
    cfg = default_config()
    cfg.update(_saved_config(manager, step))
    return cfg
  finally:
    manager.close()


def restore_params(path: str, target_params, model_cfg: ConfigDict, field: str = 'init_from'):
  """Parameters only, from a checkpoint directory (its newest step) or one step directory in
  it, laid out as `target_params` says: the start of a fine-tuning run."""
  return _restore_state_item(path, 'params', target_params, model_cfg, field)


def restore_router_bias(path: str, target, model_cfg: ConfigDict, field: str = 'init_from'):
  """The sigmoid routers' biases, as `restore_params` the parameters: the model routes by
  them, so fine-tuning and generating take them with the parameters."""
  return _restore_state_item(path, 'router_bias', target, model_cfg, field)


def _restore_state_item(path: str, item: str, target, model_cfg: ConfigDict, field: str):
  """One item of the train state ('params', 'router_bias') of a checkpoint directory's newest
  step or one step directory, laid out as `target` says."""
  manager, directory, step = _open_checkpoint(path, field)
  try:
    _check_model_shape(_saved_config(manager, step), model_cfg,
                       os.path.join(directory, str(step)))
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item={item: target},
            restore_args={item: ocp.checkpoint_utils.construct_restore_args(target)},
            partial_restore=True)))
  finally:
    manager.close()
  return restored.state[item]
