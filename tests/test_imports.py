"""The package's floors import one way: what splits and moves arrays (`parallel/`) knows nothing
of the model, the model nothing of the pipelines above it or of the cost model, and the
training runtime nothing of the cost model."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'jaxllm'


def jaxllm_imports(path: pathlib.Path) -> set[str]:
  """Every jaxllm module `path` imports, at the top or inside a function."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.add(node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
  return {m for m in found if m.split('.')[0] == 'jaxllm'}


# (the files, the packages none of them may import)
FLOORS = [
    ('parallel/*.py', ('jaxllm.model', 'jaxllm.pipeline', 'jaxllm.step', 'jaxllm.cost')),
    ('model/*.py', ('jaxllm.pipeline', 'jaxllm.step', 'jaxllm.cost', 'jaxllm.train')),
    ('pipeline/*.py', ('jaxllm.step', 'jaxllm.cost', 'jaxllm.train')),
    ('metrics.py', ('jaxllm.cost',)),
    ('backends.py', ('jaxllm.cost',)),
    ('step.py', ('jaxllm.cost', 'jaxllm.train')),
    ('train.py', ('jaxllm.cost',)),
    ('cost/*.py', ('jaxllm.train', 'jaxllm.tune', 'jaxllm.analyze')),
]


@pytest.mark.parametrize('pattern,forbidden', FLOORS, ids=[f for f, _ in FLOORS])
def test_floors_import_one_way(pattern, forbidden):
  files = sorted(PACKAGE.glob(pattern))
  assert files, pattern
  wrong = {f'{path.relative_to(PACKAGE)} imports {module}'
           for path in files for module in jaxllm_imports(path)
           if any(module == f or module.startswith(f + '.') for f in forbidden)}
  assert not wrong, sorted(wrong)


def test_the_checker_sees_imports_inside_functions(tmp_path):
  """A deferred import counts as much as one at the top (cost/tune once reached train.setup
  from inside a function)."""
  source = tmp_path / 'm.py'
  source.write_text('def f():\n  from jaxllm.train import setup\n  return setup\n')
  assert jaxllm_imports(source) == {'jaxllm.train'}
