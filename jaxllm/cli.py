"""The command line every command shares: `--config FILE [--config.a.b=v ...] [--workdir DIR]`,
and `main_guard`, which turns a ConfigError or TrainingError into one line and an exit status."""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback

from absl import flags
from ml_collections import ConfigDict, config_flags

from jaxllm.config import ConfigError, TrainingError, default_config

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


CONFIG_HELP = """
Any field of the config can be overridden (--config.SECTION.FIELD=VALUE); -1 on one mesh axis
means the remaining devices. Fields and their defaults:
"""


def usage_lines(doc: str) -> list[str]:
  """A command's usage, from its docstring: the first paragraph where that is the command
  (`python -m jaxllm.X ...`), else the indented `python ...` block a script's docstring holds."""
  paragraphs = doc.strip().split('\n\n')
  if paragraphs[0].lstrip('`').startswith('python '):
    return [line.strip('` ') for line in paragraphs[0].splitlines()]
  block = next((p for p in paragraphs if p.lstrip().startswith('python ')), '')
  return [' '.join(line.split()) for line in block.splitlines()]  # continuations' indents too


def _installed_library(module: str) -> bool:
  """Whether `module` is an installed library's. The script run as the main module defines its
  flags under a name of its own (its path, or '-m' under `python -m`), which is not."""
  path = getattr(sys.modules.get(module), '__file__', None) or ''
  return 'site-packages' in path or 'dist-packages' in path


def command_help(doc: str) -> str:
  """`--help`'s text: the command's usage, the flags of its own (those jaxllm and the script
  define, not its libraries') with their defaults, then every config field."""
  own = [f for module, module_flags in flags.FLAGS.flags_by_module_dict().items()
         if module.startswith('jaxllm') or not _installed_library(module) for f in module_flags
         if f.name != 'workdir' or '--workdir' in doc]  # the one a run's commands share
  lines = ['usage: ' + '\n       '.join(usage_lines(doc))]
  if own:
    lines += ['', 'Flags:'] + [f'  --{f.name} (default: {f.default_as_str or "none"}): {f.help}'
                               for f in own]
  return '\n'.join(lines) + '\n' + CONFIG_HELP + str(default_config())


def parse_command_line(argv: list[str], doc: str = '') -> tuple[ConfigDict, str]:
  """Parses `--config FILE [--config.x.y=v ...] [--workdir DIR]` and the command's own flags;
  `--help` prints `command_help(doc)`, `doc` being the command's docstring, and exits. Raises
  ConfigError."""
  if '--help' in argv or '-h' in argv:
    print(command_help(doc or f'python {argv[0]} --config configs/X.py [--config.a.b=v ...]'))
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
