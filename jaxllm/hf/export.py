"""Writing parameters as a Hugging Face checkpoint (Llama, Qwen2/2.5, Qwen3, Mistral or Gemma 3;
with experts, Mixtral or Qwen3-MoE) that `from_pretrained` loads."""

from __future__ import annotations

import glob
import json
import math
import os
import sys

import jax
import numpy as np
from ml_collections import ConfigDict
from safetensors.numpy import save_file

from jaxllm.checkpoint import params_target, restore_params, saved_config
from jaxllm.config import ConfigError, context_length
from jaxllm.data.tokenizer import load_tokenizer
from jaxllm.hf.config import CONFIG_FILE, Vocabulary, hf_config
from jaxllm.hf.layout import layouts, param_name
from jaxllm.hf.load import INDEX_FILE
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.rules import derive


def _hf_tensors(params, model_cfg: ConfigDict):
  """(HF name, parameter, its index (layer, and expert) or None, layout) for every HF tensor,
  in HF's usual order (layer by layer)."""
  by_name = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  found = layouts(model_cfg)
  whole = lambda names: [(found[n].hf_name, by_name[n], None, found[n])
                         for n in names if n in found]
  layers = {}
  for n, layout in found.items():
    if not layout.stacked:
      continue
    for i, layer in enumerate(layout.layers):
      experts = [(e, (i, e)) for e in range(layout.experts)] if layout.experts else [(None, (i,))]
      layers.setdefault(layer, []).extend((layout.name(layer, e), by_name[n], index, layout)
                                          for e, index in experts)
  return (whole(['embed_VD']) + [t for layer in sorted(layers) for t in layers[layer]] +
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
  causal LM of the model's family (`jaxllm.hf.families.family_of`; with experts,
  `jaxllm.hf.experts`) in `dtype`: config.json and model.safetensors, or numbered files with an
  index when they are larger than `max_shard_bytes`. A model no family computes is refused
  before anything is written."""
  config = hf_config(model_cfg, dtype, vocabulary)
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
    for hf_name, x, index, layout in group:
      ours = np.asarray(jax.device_get(x if index is None else x[index]).astype(dtype))
      tensors[hf_name] = np.ascontiguousarray(layout.to_hf(ours))
      weight_map[hf_name] = file
      total += tensors[hf_name].nbytes
    save_file(tensors, os.path.join(out_dir, file), metadata={'format': 'pt'})
  if len(groups) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
    json.dump(config, f, indent=2)
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
  target = params_target(model_cfg, mesh, derive(cfg.sharding.rules, mesh.shape, model_cfg).rules)
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
