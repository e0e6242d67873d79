"""Reading a Hugging Face checkpoint (any family of `families`, Mixtral or Qwen3-MoE) onto the
mesh: `config.json` beside `model.safetensors`, or beside several `*.safetensors` files listed by
`model.safetensors.index.json`. Each device reads its block of every tensor straight into its
place: no device holds more of a parameter than its own part."""

from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from ml_collections import ConfigDict
from safetensors import safe_open

from jaxllm.checkpoint import params_target
from jaxllm.config import ConfigError
from jaxllm.hf.config import Vocabulary, read_hf_config, check_model_matches, model_config
from jaxllm.hf.layout import Layout, hf_names, layouts, param_name
from jaxllm.model import with_available_attention
from jaxllm.parallel.rules import derive

INDEX_FILE = 'model.safetensors.index.json'


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


def _read(files: SafetensorsFiles, layout: Layout, layer: int | None, index):
  """The block `index` of one layer's (or an unstacked) parameter: per-expert parameters
  from each of the experts' tensors that `index` asks for."""
  if not layout.experts:
    return layout.read(files.reader(layout.name(layer)), index)
  experts = range(*index[0].indices(layout.experts))
  return np.stack([layout.read(files.reader(layout.name(layer, e)), index[1:])
                   for e in experts])


def _load_param(files: SafetensorsFiles, layout: Layout, target: jax.ShapeDtypeStruct):
  """One parameter as a global array on `target`'s sharding, each device's block read from
  the files (blocks shared by several devices are read once)."""
  read = {}

  def block(index):
    key = tuple((s.start, s.stop) for s in index)  # slices are unhashable before Python 3.12
    if key not in read:
      if layout.stacked:
        layers = layout.layers[index[0]]
        data = np.stack([_read(files, layout, i, index[1:]) for i in layers])
      else:
        data = _read(files, layout, None, index)
      read[key] = data.astype(target.dtype)
    return read[key]

  return jax.make_array_from_callback(target.shape, target.sharding, block)


def fused_experts(files: SafetensorsFiles, model_cfg: ConfigDict, family: str) -> bool:
  """Whether the checkpoint holds each layer's experts fused (transformers 5's in-memory
  layout) rather than a tensor each (what save_pretrained writes)."""
  fused = layouts(model_cfg, family, fused_experts=True)
  return any(layout.name(layout.layers[0]) in files.file_of
             for name, layout in fused.items() if name.endswith('mlp.w_down_EFD'))


def load_params(path: str, target_params, model_cfg: ConfigDict):
  """The checkpoint's parameters laid out as `target_params` (shapes, dtypes and shardings,
  see `jaxllm.checkpoint.restore_target`) says, for a model with `model_cfg`, whose shapes
  must match the checkpoint's (ConfigError naming the field)."""
  path = os.path.abspath(path)
  check_model_matches(path, model_cfg)
  files = SafetensorsFiles(path)
  family = read_hf_config(path)['model_type']
  fused = bool(model_cfg.moe.experts) and fused_experts(files, model_cfg, family)
  found = layouts(model_cfg, family if model_cfg.moe.experts else None, fused)
  for layout in found.values():  # every problem before any reading
    for name in hf_names(layout):
      files.check(name, layout.hf_shape)
  return jax.tree_util.tree_map_with_path(
      lambda p, target: _load_param(files, found[param_name(p)], target), target_params)


def load(path: str, mesh, rules) -> tuple[ConfigDict, nnx.State]:
  """(model config, parameters) of the Hugging Face checkpoint at `path`, for inference:
  the parameters are stored in the compute dtype (as the checkpoint stores them).

  The parameters are an nnx.State laid out like `nnx.split(Transformer(model_cfg, ...))[1]`,
  sharded on `mesh` under the logical `rules` (cfg.sharding.rules); each device reads only its
  own blocks of the files."""
  model_cfg = with_available_attention(model_config(path), mesh.devices.flat[0].platform)
  model_cfg.param_dtype = model_cfg.dtype
  rules = derive(rules, mesh.shape, model_cfg).rules
  return model_cfg, load_params(path, params_target(model_cfg, mesh, rules), model_cfg)


def vocabulary(path: str) -> Vocabulary:
  """The begin- and end-of-text ids the checkpoint's config.json gives."""
  hf = read_hf_config(path)
  return Vocabulary(hf.get('bos_token_id'), hf.get('eos_token_id'))
