"""Hugging Face checkpoints (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 3): import into jaxllm's
sharded layout, and export back.

`config` maps config.json to the model section and back, `layout` says where each parameter
lives in the checkpoint's tensors, `load` reads them onto the mesh, `export` writes them;
`python -m jaxllm.hf export ...` is the command (`__main__`).
"""

from jaxllm.hf.config import Vocabulary, model_config
from jaxllm.hf.export import export, export_checkpoint
from jaxllm.hf.load import load, load_params, vocabulary

__all__ = ['Vocabulary', 'export', 'export_checkpoint', 'load', 'load_params', 'model_config',
           'vocabulary']
