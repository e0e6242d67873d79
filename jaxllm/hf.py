"""Hugging Face Llama checkpoints: import into jaxllm's sharded layout, and export back.

A checkpoint directory holds `config.json` and the weights in `model.safetensors`, or in
several `*.safetensors` files listed by `model.safetensors.index.json`. Importing reads each
device's block of every tensor straight into its place on the mesh: no device holds more of a
parameter than its own part. The two layouts differ only in how tensors are arranged: torch `Linear`
weights are [out, in] with the heads flattened, ours are [in, out] with heads as their own
axis and the layers stacked on a leading axis. The rotary embedding needs no change: ours
rotates the two halves of each head, as Hugging Face's `rotate_half` does.

    python -m jaxllm.hf export --checkpoint RUN_DIR/checkpoints[/STEP] --out DIR [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from ml_collections import ConfigDict
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxllm.backends import start_backends
from jaxllm.checkpoint import SHAPE_FIELDS, params_target, restore_params, saved_config
from jaxllm.config import DTYPES, ConfigError, context_length, default_config, main_guard
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.mesh import make_mesh
from jaxllm.model import available_attention

CONFIG_FILE = 'config.json'
INDEX_FILE = 'model.safetensors.index.json'
# Fields that change the model's function but not its shapes: a run may differ on purpose.
BEHAVIOUR_FIELDS = ('rope_theta', 'rope_scaling', 'norm_eps')

# ----------------------------------------------------------------------------- config


def _read_hf_config(path: str) -> dict:
  """config.json of a Llama checkpoint directory; ConfigError for anything else."""
  if not os.path.isdir(path):
    raise ConfigError(f'{path!r} is not a directory; give a Hugging Face checkpoint directory '
                      '(config.json and *.safetensors, as save_pretrained writes it).')
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise ConfigError(f'{config_path} does not exist; give the directory save_pretrained wrote '
                      '(it holds config.json beside the *.safetensors files).')
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'{config_path} could not be read as JSON ({e}); fix or re-save it.'
                      ) from None
  architectures = hf.get('architectures') or ['LlamaForCausalLM']
  if hf.get('model_type') != 'llama' or 'LlamaForCausalLM' not in architectures:
    raise ConfigError(f'{config_path}: model_type={hf.get("model_type")!r}, architectures='
                      f'{architectures} is not a Llama model; only LlamaForCausalLM checkpoints '
                      "(model_type 'llama') can be imported.")
  for key, supported in (('hidden_act', 'silu'), ('attention_bias', False), ('mlp_bias', False)):
    if hf.get(key, supported) != supported:
      raise ConfigError(f'{config_path}: {key}={hf[key]!r} is not supported; jaxllm\'s Llama '
                        f'needs {key}={supported!r}.')
  return hf


def _required(hf: dict, key: str, path: str):
  if hf.get(key) is None:
    raise ConfigError(f'{os.path.join(path, CONFIG_FILE)} has no {key!r}; add it (see the '
                      "model's original config.json).")
  return hf[key]


def _rope(hf: dict, path: str) -> tuple[float, dict]:
  """(rope_theta, llama3 scaling fields or {}), from transformers' old layout (rope_theta and
  rope_scaling) or its newer one (rope_parameters)."""
  rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10_000.0)))
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind == 'default':
    return theta, {}
  if kind != 'llama3':
    raise ConfigError(f'{os.path.join(path, CONFIG_FILE)}: rope_type={kind!r} is not supported; '
                      "jaxllm implements the plain rotary embedding and 'llama3' scaling.")
  return theta, dict(factor=float(rope['factor']),
                     low_freq_factor=float(rope['low_freq_factor']),
                     high_freq_factor=float(rope['high_freq_factor']),
                     original_max_position=int(rope['original_max_position_embeddings']))


def model_config(path: str) -> ConfigDict:
  """jaxllm's `model` config section for the checkpoint at `path`: the defaults, with every
  field the checkpoint decides set from its config.json. A bfloat16 checkpoint computes in
  bfloat16 (cuDNN's fused attention when JAX runs on GPUs), any other in float32; the master
  weights are float32 either way, so that fine-tuning's small updates are not rounded away."""
  hf = _read_hf_config(path)
  req = lambda key: _required(hf, key, path)
  heads = int(req('num_attention_heads'))
  theta, scaling = _rope(hf, path)
  stored = hf.get('torch_dtype') or hf.get('dtype') or 'float32'
  dtype = 'bfloat16' if stored == 'bfloat16' else 'float32'
  cfg = default_config().model
  cfg.update(
      vocab_size=int(req('vocab_size')),
      embed_dim=int(req('hidden_size')),
      num_layers=int(req('num_hidden_layers')),
      num_heads=heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or heads),
      head_dim=int(hf.get('head_dim') or req('hidden_size') // heads),
      mlp_dim=int(req('intermediate_size')),
      rope_theta=theta,
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),  # transformers' default
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      max_position=int(hf.get('max_position_embeddings') or 0),
      param_dtype='float32',
      dtype=dtype,
      attention='cudnn' if dtype == 'bfloat16' else 'xla')
  cfg.attention = available_attention(cfg, jax.default_backend())
  cfg.rope_scaling.update(scaling)
  return cfg


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """What config.json says of the tokenizer: its begin- and end-of-text ids (None: it has none)."""
  bos_id: int | None = None
  eos_id: int | None = None


def hf_config(model_cfg: ConfigDict, dtype: str, vocabulary: Vocabulary) -> dict:
  """config.json of a LlamaForCausalLM with jaxllm's `model_cfg`, stored in `dtype`.
  `model_cfg.max_position` must be set: transformers takes 2048 for a config without it."""
  m = model_cfg
  hf = dict(architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=m.vocab_size,
            hidden_size=m.embed_dim, intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim, hidden_act='silu', rms_norm_eps=m.norm_eps,
            rope_theta=m.rope_theta, rope_scaling=None, tie_word_embeddings=m.tie_embeddings,
            attention_bias=False, mlp_bias=False, torch_dtype=dtype,
            max_position_embeddings=m.max_position, bos_token_id=vocabulary.bos_id,
            eos_token_id=vocabulary.eos_id)
  s = m.rope_scaling
  if s.factor > 0:
    hf['rope_scaling'] = dict(rope_type='llama3', factor=s.factor,
                              low_freq_factor=s.low_freq_factor,
                              high_freq_factor=s.high_freq_factor,
                              original_max_position_embeddings=s.original_max_position)
  return hf


def check_model_matches(path: str, model_cfg: ConfigDict) -> None:
  """The run's `model_cfg` must have the checkpoint's shapes (ConfigError naming the field);
  a different RoPE or norm epsilon is allowed (e.g. a longer context) but noted."""
  hf_cfg = model_config(path)
  for field in SHAPE_FIELDS:
    if field == 'param_dtype':  # tensors are converted to the run's storage dtype
      continue
    if hf_cfg[field] != model_cfg[field]:
      raise ConfigError(
          f'model.{field}={model_cfg[field]!r} but the Hugging Face checkpoint {path} has '
          f'{field}={hf_cfg[field]!r}; set model.{field}={hf_cfg[field]!r}, or build the model '
          'section with jaxllm.hf.model_config (see the README).')
  plain = lambda v: v.to_dict() if isinstance(v, ConfigDict) else v
  for field in BEHAVIOUR_FIELDS:
    if hf_cfg[field] != model_cfg[field] and jax.process_index() == 0:
      print(f'note: model.{field} differs from the Hugging Face checkpoint {path} '
            f'({plain(model_cfg[field])} here, {plain(hf_cfg[field])} there).', file=sys.stderr)


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where one of our parameters lives in a Hugging Face tensor.

  Viewed through `hf_dims` (each HF axis split into the sizes of our axes it holds, e.g.
  q_proj's [N·H, D] as ((N, H), (D,))), the HF tensor has our axes in another order: our
  axis i is axis `order[i]` of that view. Stacked parameters have a tensor per layer, '{}'
  in `hf_name` standing for the layer index.
  """
  hf_name: str
  hf_dims: tuple[tuple[int, ...], ...]
  order: tuple[int, ...]

  @property
  def stacked(self) -> bool:
    return '{}' in self.hf_name

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(math.prod(sizes) for sizes in self.hf_dims)

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    """One layer's (or an unstacked) parameter in the HF layout."""
    return np.transpose(ours, np.argsort(self.order)).reshape(self.hf_shape)

  def read(self, read_hf, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` of our layout (one layer's axes), from `read_hf(hf_index)` which reads
    part of the HF tensor: only the rows and columns that hold the block."""
    view_dims = [size for sizes in self.hf_dims for size in sizes]
    view_index = [None] * len(view_dims)
    for ours, axis in enumerate(self.order):
      view_index[axis] = index[ours]
    # Per HF axis: the range its outermost view axis asks for, inner view axes whole
    # (contiguous in the file); the inner axes' own slices are taken after reshaping.
    hf_index, block_shape, inner_index, axis = [], [], [], 0
    for sizes in self.hf_dims:
      start, stop, _ = view_index[axis].indices(sizes[0])
      inner = math.prod(sizes[1:])
      hf_index.append(slice(start * inner, stop * inner))
      block_shape += [stop - start, *sizes[1:]]
      inner_index += [slice(None), *view_index[axis + 1:axis + len(sizes)]]
      axis += len(sizes)
    block = read_hf(tuple(hf_index))
    return block.reshape(block_shape)[tuple(inner_index)].transpose(self.order)


def layouts(model_cfg: ConfigDict) -> dict[str, Layout]:
  """Our parameters by dotted name ('blocks.attn.wq_DNH') → their place in a HF Llama."""
  m = model_cfg
  V, D, N, K, H, F = m.vocab_size, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  layer = 'model.layers.{}.'
  found = {
      'embed_VD': Layout('model.embed_tokens.weight', ((V,), (D,)), (0, 1)),
      'final_norm.scale': Layout('model.norm.weight', ((D,),), (0,)),
      'blocks.attn_norm.scale': Layout(layer + 'input_layernorm.weight', ((D,),), (0,)),
      'blocks.mlp_norm.scale': Layout(layer + 'post_attention_layernorm.weight', ((D,),), (0,)),
      # torch Linear weights are [out, in]; the heads are flattened into `out` head-major.
      'blocks.attn.wq_DNH': Layout(layer + 'self_attn.q_proj.weight', ((N, H), (D,)), (2, 0, 1)),
      'blocks.attn.wk_DKH': Layout(layer + 'self_attn.k_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'blocks.attn.wv_DKH': Layout(layer + 'self_attn.v_proj.weight', ((K, H), (D,)), (2, 0, 1)),
      'blocks.attn.wo_NHD': Layout(layer + 'self_attn.o_proj.weight', ((D,), (N, H)), (1, 2, 0)),
      'blocks.mlp.w_gate_DF': Layout(layer + 'mlp.gate_proj.weight', ((F,), (D,)), (1, 0)),
      'blocks.mlp.w_up_DF': Layout(layer + 'mlp.up_proj.weight', ((F,), (D,)), (1, 0)),
      'blocks.mlp.w_down_FD': Layout(layer + 'mlp.down_proj.weight', ((D,), (F,)), (1, 0)),
  }
  if not m.tie_embeddings:
    found['head_DV'] = Layout('lm_head.weight', ((V,), (D,)), (1, 0))
  return found


def _hf_names(layout: Layout, num_layers: int) -> list[str]:
  layers = range(num_layers) if layout.stacked else [None]
  return [layout.hf_name.format(i) for i in layers]


def param_name(path) -> str:
  """'blocks.attn.wq_DNH' for a tree path (of an nnx.State or a plain nested dict)."""
  return '.'.join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


# ----------------------------------------------------------------------------- import


class SafetensorsFiles:
  """The tensors of a checkpoint directory by name, over its one or many files."""

  def __init__(self, path: str):
    self.path = path
    self._files = {}
    # safetensors' 'flax' framework reads bfloat16 (numpy's cannot) into jax arrays: they are
    # made on this one host device, not on whatever mesh the caller has in scope.
    self._host = jax.make_mesh((1,), ('host',), axis_types=(AxisType.Auto,),
                               devices=jax.local_devices(backend='cpu')[:1])
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
      with open(index_path) as f:
        self.file_of = {name: os.path.join(path, file)
                        for name, file in json.load(f)['weight_map'].items()}
    else:
      self.file_of = {}
      for file in sorted(glob.glob(os.path.join(path, '*.safetensors'))):
        self.file_of.update((name, file) for name in self._open(file).keys())
    if not self.file_of:
      raise ConfigError(f'{path} holds no *.safetensors weights; save the model with '
                        'save_pretrained(..., safe_serialization=True).')

  def _open(self, file: str):
    if file not in self._files:
      if not os.path.isfile(file):
        raise ConfigError(f'{file} is listed in {INDEX_FILE} but does not exist; copy the '
                          'missing file or re-save the checkpoint.')
      self._files[file] = safe_open(file, framework='flax')
    return self._files[file]

  def _tensor(self, name: str):
    """A lazy slice of tensor `name`: indexing reads just that part of the file."""
    return self._open(self.file_of[name]).get_slice(name)

  def reader(self, name: str):
    """`read(index)`: part `index` of tensor `name` as a numpy array."""
    def read(index):
      with jax.set_mesh(self._host):
        return np.asarray(self._tensor(name)[index])
    return read

  def check(self, name: str, shape: tuple[int, ...]) -> None:
    """ConfigError unless tensor `name` exists with `shape`."""
    if name not in self.file_of:
      raise ConfigError(f'{self.path}: tensor {name!r} is missing from the safetensors files; '
                        'the checkpoint is incomplete or config.json does not describe it — '
                        're-save it with save_pretrained.')
    found = tuple(self._tensor(name).get_shape())
    if found != shape:
      raise ConfigError(f'{self.path}: tensor {name!r} has shape {list(found)} but config.json '
                        f'implies {list(shape)}; config.json and the weights disagree — fix '
                        'config.json or re-save the checkpoint.')


def _load_param(files: SafetensorsFiles, layout: Layout, target: jax.ShapeDtypeStruct):
  """One parameter as a global array on `target`'s sharding, each device's block read from
  the files (blocks shared by several devices are read once)."""
  read = {}

  def block(index):
    key = tuple((s.start, s.stop) for s in index)  # slices are unhashable before Python 3.12
    if key not in read:
      if layout.stacked:
        layers = range(*index[0].indices(target.shape[0]))
        data = np.stack([layout.read(files.reader(layout.hf_name.format(i)), index[1:])
                         for i in layers])
      else:
        data = layout.read(files.reader(layout.hf_name), index)
      read[key] = data.astype(target.dtype)
    return read[key]

  return jax.make_array_from_callback(target.shape, target.sharding, block)


def load_params(path: str, target_params, model_cfg: ConfigDict):
  """The checkpoint's parameters laid out as `target_params` (shapes, dtypes and shardings,
  see `jaxllm.checkpoint.restore_target`) says, for a model with `model_cfg`, whose shapes
  must match the checkpoint's (ConfigError naming the field)."""
  path = os.path.abspath(path)
  check_model_matches(path, model_cfg)
  files = SafetensorsFiles(path)
  found = layouts(model_cfg)
  for layout in found.values():  # every problem before any reading
    for name in _hf_names(layout, model_cfg.num_layers):
      files.check(name, layout.hf_shape)
  return jax.tree_util.tree_map_with_path(
      lambda p, target: _load_param(files, found[param_name(p)], target), target_params)


def load(path: str, mesh, rules) -> tuple[ConfigDict, nnx.State]:
  """(model config, parameters) of the Hugging Face Llama checkpoint at `path`, for inference:
  the parameters are stored in the compute dtype (as the checkpoint stores them).

  The parameters are an nnx.State laid out like `nnx.split(Transformer(model_cfg, ...))[1]`,
  sharded on `mesh` under the logical `rules` (cfg.sharding.rules); each device reads only its
  own blocks of the files."""
  model_cfg = model_config(path)
  model_cfg.param_dtype = model_cfg.dtype
  return model_cfg, load_params(path, params_target(model_cfg, mesh, rules), model_cfg)


def vocabulary(path: str) -> Vocabulary:
  """The begin- and end-of-text ids the checkpoint's config.json gives."""
  hf = _read_hf_config(path)
  return Vocabulary(hf.get('bos_token_id'), hf.get('eos_token_id'))


# ----------------------------------------------------------------------------- export


def _hf_tensors(params, model_cfg: ConfigDict):
  """(HF name, parameter, layer or None, layout) for every HF tensor, in HF's usual order."""
  by_name = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  found = layouts(model_cfg)
  whole = lambda names: [(found[n].hf_name, by_name[n], None, found[n])
                         for n in names if n in found]
  stacked = [(n, layout) for n, layout in found.items() if layout.stacked]
  return (whole(['embed_VD']) +
          [(layout.hf_name.format(i), by_name[n], i, layout)
           for i in range(model_cfg.num_layers) for n, layout in stacked] +
          whole(['final_norm.scale', 'head_DV']))


def _shard_groups(entries, itemsize: int, max_shard_bytes: int) -> list[list]:
  """Consecutive tensors of `itemsize` bytes an element grouped into files of at most
  `max_shard_bytes` (a larger tensor gets a file of its own)."""
  groups, size = [[]], 0
  for entry in entries:
    nbytes = math.prod(entry[3].hf_shape) * itemsize
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(entry)
    size += nbytes
  return groups


def export(params, model_cfg: ConfigDict, out_dir: str, dtype: str, vocabulary: Vocabulary,
           max_shard_bytes: int = 5 * 10**9) -> None:
  """Writes `params` (layer order, as checkpoints and `load` hold them) as a Hugging Face
  LlamaForCausalLM in `dtype`: config.json and model.safetensors, or numbered files with an
  index when they are larger than `max_shard_bytes`."""
  if glob.glob(os.path.join(out_dir, '*.safetensors')):
    raise ConfigError(f'{out_dir} already holds *.safetensors files; export into an empty or '
                      'new directory.')
  os.makedirs(out_dir, exist_ok=True)
  entries = _hf_tensors(params, model_cfg)
  groups = _shard_groups(entries, np.dtype(dtype).itemsize, max_shard_bytes)
  names = (['model.safetensors'] if len(groups) == 1 else
           [f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors' for i in range(len(groups))])
  weight_map, total = {}, 0
  for file, group in zip(names, groups):
    tensors = {}
    for hf_name, x, layer, layout in group:
      ours = np.asarray(jax.device_get(x if layer is None else x[layer]).astype(dtype))
      tensors[hf_name] = np.ascontiguousarray(layout.to_hf(ours))
      weight_map[hf_name] = file
      total += tensors[hf_name].nbytes
    save_file(tensors, os.path.join(out_dir, file), metadata={'format': 'pt'})
  if len(groups) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
    json.dump(hf_config(model_cfg, dtype, vocabulary), f, indent=2)
    f.write('\n')


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 10**9) -> None:
  """Exports the parameters of a jaxllm checkpoint (a checkpoint directory's newest step, or
  one step directory), restored into host memory, in `dtype` (default: the run's compute
  dtype, model.dtype: bfloat16 for a run that started from a bfloat16 checkpoint)."""
  cfg = saved_config(checkpoint, '--checkpoint')
  model_cfg = cfg.model
  host = jax.local_devices(backend='cpu')[:1]
  mesh = make_mesh(dict(data=1, fsdp=1, pipe=1, tensor=1), host)
  target = params_target(model_cfg, mesh, cfg.sharding.rules)
  params = restore_params(checkpoint, target, model_cfg, '--checkpoint')
  model_cfg.max_position = context_length(cfg)
  export(params, model_cfg, out_dir, dtype or model_cfg.dtype, _run_vocabulary(cfg),
         max_shard_bytes)


def _run_vocabulary(cfg: ConfigDict) -> Vocabulary:
  """The special ids of the run's tokenizer (data.tokenizer); none, with a note, when it can
  no longer be read."""
  try:
    tokenizer = load_tokenizer(cfg.data)
  except ConfigError as e:
    print(f'note: config.json gets no bos_token_id or eos_token_id: {e}', file=sys.stderr)
    return Vocabulary()
  return Vocabulary(tokenizer.bos_id, tokenizer.eos_id)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog='python -m jaxllm.hf',
                                   description='Hugging Face Llama checkpoints.')
  commands = parser.add_subparsers(dest='command', required=True)
  export_cmd = commands.add_parser('export', help='a jaxllm checkpoint → a HF checkpoint dir')
  export_cmd.add_argument('--checkpoint', required=True,
                          help='RUN_DIR/checkpoints (its newest step) or one step directory')
  export_cmd.add_argument('--out', required=True, help='the directory to write')
  export_cmd.add_argument('--dtype', choices=DTYPES, default=None,
                          help="the tensors' dtype (default: the run's model.dtype)")
  export_cmd.add_argument('--max-shard-gb', type=float, default=5.0,
                          help='split the weights into files of at most this size (GB)')
  args = parser.parse_args(argv[1:])
  if not 0 < args.max_shard_gb < math.inf:
    raise ConfigError(f'--max-shard-gb={args.max_shard_gb} must be a positive number of GB, '
                      'e.g. 5.')
  start_backends()
  export_checkpoint(args.checkpoint, args.out, args.dtype, int(args.max_shard_gb * 10**9))
  print(f'exported {args.checkpoint} to {args.out}')


def cli() -> None:
  """The `jaxllm-hf` command (pyproject's console script): `python -m jaxllm.hf`."""
  main_guard(main)


if __name__ == '__main__':
  cli()
