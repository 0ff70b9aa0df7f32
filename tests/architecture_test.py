"""The package's layout as rules read from its import graph: libraries never import commands,
only commands and `cli` touch flags, one module imports orbax, search never imports the model,
batching never imports JAX, and the workdir's on-disk names live in `workdir.py` alone."""

import ast
import os
import pathlib
import re
import sys

import pytest

from conftest import REPO_ROOT

PACKAGE = pathlib.Path(REPO_ROOT) / 'transformer_jax'
# `python -m transformer_jax.X`: thin shells over library calls (train.py is one too, outside).
COMMANDS = {
  'transformer_jax.translate',
  'transformer_jax.evaluate',
  'transformer_jax.average',
  'transformer_jax.plot_attention',
  'transformer_jax.prepare_data',
  'transformer_jax.benchmark.__main__',
  'transformer_jax.export',
  'transformer_jax.serve',
  'transformer_jax.import_marian',
}
# Modules allowed to define or parse flags besides the commands.
FLAG_MODULES = {'transformer_jax.cli'}


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
    modules[name] = path
  return modules


MODULES = _modules()


def _imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports, at any depth of the file (lazy imports count)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      # `from transformer_jax import inference` imports the module transformer_jax.inference.
      names.update(
        f'{node.module}.{alias.name}'
        for alias in node.names
        if f'{node.module}.{alias.name}' in MODULES
      )
  return names


def _is_command(path: pathlib.Path) -> bool:
  return "__name__ == '__main__'" in path.read_text()


def test_the_commands_are_the_modules_that_run_as_main():
  assert {name for name, path in MODULES.items() if _is_command(path)} == COMMANDS


@pytest.mark.parametrize('name', sorted(set(MODULES) - COMMANDS))
def test_a_library_module_never_imports_a_command_or_flags(name):
  imported = _imports(MODULES[name])
  assert not imported & COMMANDS, f'{name} imports the command(s) {imported & COMMANDS}'
  if name not in FLAG_MODULES:
    flag_imports = {'absl.flags', 'absl.app', 'ml_collections.config_flags'} & imported
    assert not flag_imports, f'{name} imports {flag_imports}: flags belong to commands and cli'


def test_the_check_sees_a_library_that_imports_a_command(tmp_path):
  # The rule above must be able to fail: a library importing `transformer_jax.translate`.
  bad = tmp_path / 'bad.py'
  bad.write_text('from transformer_jax import translate\nimport transformer_jax.evaluate\n')
  assert {'transformer_jax.translate', 'transformer_jax.evaluate'} <= _imports(bad) & COMMANDS


@pytest.mark.parametrize('name', sorted(COMMANDS))
def test_a_command_is_a_thin_shell(name):
  # Flags, one library call, printing: the work itself lives in library modules.
  tree = ast.parse(MODULES[name].read_text())
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  assert not [node for node in tree.body if isinstance(node, ast.ClassDef)]
  assert set(functions) <= {'_define_flags', 'main', 'run'}, set(functions)
  statements = len(functions['main'].body)
  assert statements <= 8, f'{name}: main has {statements} statements'


def test_only_checkpointing_imports_orbax():
  importers = {
    name
    for name, path in MODULES.items()
    if any(i.split('.')[0] == 'orbax' for i in _imports(path))
  }
  assert importers == {'transformer_jax.checkpointing'}


def test_search_never_imports_the_model_and_batching_never_imports_jax():
  # decode.py and its candidate selection import nothing else of the package.
  search = {'transformer_jax.decode', 'transformer_jax.beam_candidates'}
  for name in search:
    assert {i for i in _imports(MODULES[name]) if i.startswith('transformer_jax')} <= search
  batching_imports = _imports(MODULES['transformer_jax.data.batching'])
  assert not {i for i in batching_imports if i.split('.')[0] in ('jax', 'flax')}


def test_the_stablehlo_runner_needs_only_jax_numpy_and_sentencepiece():
  # It is copied into exported directories and run where transformer_jax is not installed.
  allowed = {'__future__', 'jax', 'numpy', 'sentencepiece'} | set(sys.stdlib_module_names)
  imported = {i.split('.')[0] for i in _imports(MODULES['transformer_jax.stablehlo_runner'])}
  assert imported <= allowed, imported - allowed


# The workdir's on-disk names, as string literals: each must appear in workdir.py and nowhere
# else in the package (tests, docs and configs may name them).
WORKDIR_NAMES = (
  'config.json',
  'vocab.model',
  'target_vocab.model',
  'checkpoints',
  'averaged',
  'imported',
  'damaged_checkpoints',
  'tensorboard',
  'token_cache',
  'hypotheses',
  'ctranslate2_export',
  '.lock',
)


def _string_literals(path: pathlib.Path) -> set[str]:
  tree = ast.parse(path.read_text(), str(path))
  docstrings = {
    id(node.body[0].value)
    for node in ast.walk(tree)
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
    and node.body
    and isinstance(node.body[0], ast.Expr)
  }
  return {
    node.value
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
  }


# `--checkpoint=averaged` names a choice of parameters, not a path: parsed in cli, resolved to
# the workdir's path in inference.
_ALSO_A_FLAG_VALUE = {'averaged': {'transformer_jax.cli', 'transformer_jax.inference'}}


@pytest.mark.parametrize('name', WORKDIR_NAMES)
def test_each_workdir_name_lives_in_workdir_py_alone(name):
  owners = {
    module
    for module, path in MODULES.items()
    if any(
      re.search(rf'(^|[/.]){re.escape(name)}($|[/])', literal) for literal in _string_literals(path)
    )
  }
  assert owners - _ALSO_A_FLAG_VALUE.get(name, set()) == {'transformer_jax.workdir'}, owners


def test_no_module_outgrows_one_concern():
  sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
  assert not {name: size for name, size in sizes.items() if size > 600}


def test_configs_are_not_a_top_level_package():
  # configs/ installs as transformer_jax.configs; a top-level `configs` would collide with
  # other projects' packages of that name.
  with open(os.path.join(REPO_ROOT, 'pyproject.toml')) as f:
    pyproject = f.read()
  assert '"transformer_jax.configs" = "configs"' in pyproject
  assert re.search(r'packages = \[[^\]]*"configs"', pyproject) is None
