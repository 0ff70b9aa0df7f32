"""The package's layout as rules read from its import graph (docs/layout.md draws it):

- the top level holds the commands (`python -m transformer_jax.X`), `cli` (their shared flags)
  and one subpackage per concern; libraries never import commands, only commands and `cli`
  touch flags, and commands are thin;
- arrows between subpackages that must never exist (`NEVER`), and no cycle among them, nor
  among the modules themselves (lazy imports count);
- one module imports orbax, batching never imports JAX, the StableHLO runner runs without us;
- the workdir's on-disk names live in `workdir/layout.py` alone; no module outgrows 600 lines;
- bench/ scripts never reach into tests/.

Each rule is a function over (module, what it imports) and is shown to fail on a planted
violation.
"""

import ast
import functools
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
  'transformer_jax.score',
}
# Modules allowed to define or parse flags besides the commands.
FLAG_MODULES = {'transformer_jax.cli'}
# By-hand checks that run as main but are no commands of the tool (testing/ utilities).
BY_HAND_CHECKS = {'transformer_jax.testing.marian_npz_check'}
# One folder per concern (docs/layout.md); beside them the top level holds only the commands,
# `cli` and the package's face.
SUBPACKAGES = {
  'benchmark',  # the benchmark command's package
  'checkpoints',
  'common',
  'data',
  'evaluation',
  'exporters',
  'importers',
  'inference',
  'model',
  'search',
  'serving',
  'testing',
  'training',
  'workdir',
}


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
    modules[name] = path
  return modules


MODULES = _modules()


@functools.cache  # Each file is parsed once for the many parametrized tests.
def _imports(path: pathlib.Path) -> frozenset[str]:
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
  return frozenset(names)


def _is_command(path: pathlib.Path) -> bool:
  return "__name__ == '__main__'" in path.read_text()


def test_the_commands_are_the_modules_that_run_as_main():
  assert {name for name, path in MODULES.items() if _is_command(path)} - BY_HAND_CHECKS == COMMANDS


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


def test_only_the_checkpointer_imports_orbax():
  importers = {
    name
    for name, path in MODULES.items()
    if any(i.split('.')[0] == 'orbax' for i in _imports(path))
  }
  assert importers == {'transformer_jax.checkpoints.checkpointer'}


def test_batching_never_imports_jax():
  batching_imports = _imports(MODULES['transformer_jax.data.batching'])
  assert not {i for i in batching_imports if i.split('.')[0] in ('jax', 'flax')}


def test_the_stablehlo_runner_needs_only_jax_numpy_and_sentencepiece():
  # It is copied into exported directories and run where transformer_jax is not installed.
  allowed = {'__future__', 'jax', 'numpy', 'sentencepiece'} | set(sys.stdlib_module_names)
  runner = MODULES['transformer_jax.exporters.stablehlo_runner']
  imported = {i.split('.')[0] for i in _imports(runner)}
  assert imported <= allowed, imported - allowed


# The workdir's on-disk names, as string literals: each must appear in workdir/layout.py and
# nowhere else in the package (tests, testing/, docs and configs may name them).
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


@functools.cache
def _string_literals(path: pathlib.Path) -> frozenset[str]:
  tree = ast.parse(path.read_text(), str(path))
  docstrings = {
    id(node.body[0].value)
    for node in ast.walk(tree)
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
    and node.body
    and isinstance(node.body[0], ast.Expr)
  }
  return frozenset(
    node.value
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
  )


# `--checkpoint=averaged` names a choice of parameters, not a path: parsed in inference.models,
# resolved to the workdir's path in checkpoints.served. "hypotheses" is also the JSON field of
# n-best lists (translate --output_format=jsonl, the server's answers).
_ALSO_A_FLAG_VALUE = {
  'averaged': {'transformer_jax.inference.models', 'transformer_jax.checkpoints.served'},
  'hypotheses': {'transformer_jax.inference.text_files', 'transformer_jax.serving.app'},
  # A transformers MarianMT folder's config.json (importers/hf_files.HF_CONFIG), not ours.
  'config.json': {'transformer_jax.importers.hf_files'},
}


@pytest.mark.parametrize('name', WORKDIR_NAMES)
def test_each_workdir_name_lives_in_workdir_py_alone(name):
  owners = {
    module
    for module, path in MODULES.items()
    if any(
      re.search(rf'(^|[/.]){re.escape(name)}($|[/])', literal) for literal in _string_literals(path)
    )
  }
  owners = {module for module in owners if _unit(module) != 'testing'}  # Test utilities may.
  assert owners - _ALSO_A_FLAG_VALUE.get(name, set()) == {'transformer_jax.workdir.layout'}, owners


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


# ---- The layout: subpackages by concern, and the arrows between them ----


def _unit(module: str) -> str | None:
  """The subpackage (or top-level module) a module of the package belongs to; None outside."""
  parts = module.split('.')
  if parts[0] != 'transformer_jax':
    return None
  return parts[1] if len(parts) > 1 else 'transformer_jax'


def test_the_top_level_holds_commands_cli_and_one_folder_per_concern():
  top = {path.name for path in PACKAGE.iterdir() if not path.name.startswith(('.', '__pycache__'))}
  folders = {name for name in top if (PACKAGE / name).is_dir()}
  files = {name for name in top if name.endswith('.py')}
  assert folders == SUBPACKAGES, folders ^ SUBPACKAGES
  commands = {f'{name.split(".")[-1]}.py' for name in COMMANDS if name.count('.') == 1}
  assert files == commands | {'__init__.py', 'cli.py'}, files - commands
  for folder in SUBPACKAGES:  # Each with a face (docstring, and what it exports).
    face = PACKAGE / folder / '__init__.py'
    assert face.exists() and ast.get_docstring(ast.parse(face.read_text())), folder


# Arrows that must never exist (issue 25). ONLY: a subpackage that may import nothing of the
# package but these (not the top level either); NEVER: subpackages another must never import.
ONLY = {'common': set(), 'model': {'common'}, 'search': set()}
NEVER = {
  'data': {'model', 'training', 'inference'},
  'training': {'importers', 'exporters', 'serving'},
  'inference': {'training', 'serving'},
  'exporters': {'training'},
}
# No library imports the test utilities or the benchmark's command package.
_TEST_AND_BENCH_ONLY = {'testing', 'benchmark'}


def arrow_violations(module: str, imported: set[str]) -> list[str]:
  """The rules above that `module` (a dotted name in the package) breaks by importing
  `imported`."""
  source = _unit(module)
  wrong = []
  for name in sorted(imported):
    target = _unit(name)
    if target is None or target == source:
      continue
    if source in ONLY and target not in ONLY[source]:
      allowed = ', '.join(sorted(ONLY[source])) or 'nothing'
      wrong.append(f'{module} imports {name} ({source}/ may import {allowed} of the package)')
    if target in NEVER.get(source, ()):
      wrong.append(f'{module} imports {name} ({source}/ must never import {target}/)')
    if target in _TEST_AND_BENCH_ONLY and source not in _TEST_AND_BENCH_ONLY:
      wrong.append(f'{module} imports {name} ({target}/ is for tests and bench/ only)')
  return wrong


@pytest.mark.parametrize('name', sorted(MODULES))
def test_no_arrow_that_must_never_exist(name):
  assert not arrow_violations(name, _imports(MODULES[name]))


@pytest.mark.parametrize(
  'module, imported',
  [
    ('transformer_jax.common.progress', 'transformer_jax.training.metric_writers'),
    ('transformer_jax.common.paths', 'transformer_jax.model.config'),
    ('transformer_jax.model.transformer', 'transformer_jax.workdir.layout'),
    ('transformer_jax.model.config', 'transformer_jax'),
    ('transformer_jax.search.decode', 'transformer_jax.model.transformer'),
    ('transformer_jax.search.decode', 'transformer_jax.common.errors'),
    ('transformer_jax.data.input_pipeline', 'transformer_jax.model.config'),
    ('transformer_jax.data.tokenizer', 'transformer_jax.training.metric_writers'),
    ('transformer_jax.data.staging', 'transformer_jax.inference.translator'),
    ('transformer_jax.training.run_config', 'transformer_jax.importers.workdir_writer'),
    ('transformer_jax.training.loop', 'transformer_jax.exporters.ctranslate2_spec'),
    ('transformer_jax.training.trainer', 'transformer_jax.serving.app'),
    ('transformer_jax.inference.translator', 'transformer_jax.training.trainer'),
    ('transformer_jax.inference.decoding', 'transformer_jax.serving.batcher'),
    ('transformer_jax.exporters.stablehlo', 'transformer_jax.training.step'),
    ('transformer_jax.serving.app', 'transformer_jax.testing.marian_npz'),
  ],
)
def test_each_never_arrow_can_fail(module, imported):
  assert arrow_violations(module, {imported}), (module, imported)


def subpackage_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle among subpackages (as a path a -> b -> ... -> a), or None."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
      if nxt not in state:
        found = visit(nxt, path + [nxt])
        if found:
          return found
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [node])
      if found:
        return found
  return None


def _subpackage_graph() -> dict[str, set[str]]:
  graph = {}
  for name, path in MODULES.items():
    source = _unit(name)
    if source not in SUBPACKAGES:
      continue
    for imported in _imports(path):
      target = _unit(imported)
      if target in SUBPACKAGES and target != source:
        graph.setdefault(source, set()).add(target)
  return graph


def test_the_subpackages_import_each_other_without_a_cycle():
  # Python needs the modules acyclic; the folders acyclic too keep each one's face importable
  # first, and say which concern builds on which (docs/layout.md lists the layers).
  assert subpackage_cycle(_subpackage_graph()) is None


def test_the_cycle_check_can_fail():
  graph = _subpackage_graph()
  graph.setdefault('workdir', set()).add('checkpoints')  # checkpoints imports workdir already.
  assert subpackage_cycle(graph) in (
    ['checkpoints', 'workdir', 'checkpoints'],
    ['workdir', 'checkpoints', 'workdir'],
  )


@functools.cache
def _package_imports(path: pathlib.Path) -> frozenset[str]:
  """The package's modules `path` imports, at any depth (lazy imports count), as Python loads
  them: `from package import module` imports that module, not the package's face (a name that
  is no module, `from transformer_jax.inference import Translator`, does import the face)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      submodules = {f'{node.module}.{alias.name}' for alias in node.names}
      names.update(submodules & set(MODULES))
      if submodules - set(MODULES):
        names.add(node.module)
  return frozenset(name for name in names if name in MODULES)


def _module_graph() -> dict[str, set[str]]:
  return {
    name: set(_package_imports(path)) - {name}
    for name, path in MODULES.items()
    if name not in COMMANDS
  }


def test_the_modules_import_each_other_without_a_cycle():
  # A cycle hidden by a lazy import (translator <-> scoring once) still ties the modules into
  # one: neither can be read, tested or changed alone, and the import order decides whether
  # the program starts. Issue 49: the graph of modules is a DAG, not only that of folders.
  assert subpackage_cycle(_module_graph()) is None


def test_the_module_cycle_check_can_fail():
  graph = _module_graph()
  # translator imports alignments; the other way round (AttentionMaps once lived in
  # translator.py, imported lazily the other way) closes a cycle.
  graph['transformer_jax.inference.alignments'].add('transformer_jax.inference.translator')
  cycle = subpackage_cycle(graph)
  assert cycle and {
    'transformer_jax.inference.alignments',
    'transformer_jax.inference.translator',
  } <= set(cycle), cycle


def test_a_lazy_import_counts_for_the_module_graph(tmp_path):
  planted = tmp_path / 'planted.py'
  planted.write_text(
    'def f():\n  from transformer_jax.inference import translator\n'
    'from transformer_jax.inference import Translator\n'
  )
  assert _package_imports(planted) == {
    'transformer_jax.inference.translator',
    'transformer_jax.inference',
  }


BENCH = pathlib.Path(REPO_ROOT) / 'bench'
TESTS = pathlib.Path(REPO_ROOT) / 'tests'


def bench_reaches_into_tests(source: str) -> list[str]:
  """How a bench/ script's source reaches into tests/: a sys.path entry naming it, or an
  import of one of its modules (conftest, a *_test, helpers)."""
  test_modules = {path.stem for path in TESTS.glob('*.py')} | {'helpers'}
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [node.module]
    else:
      names = []
    found += [f'imports {n}' for n in names if n.split('.')[0] in test_modules]
    if isinstance(node, ast.Constant) and node.value == 'tests':
      found.append("names the folder 'tests'")
  return found


@pytest.mark.parametrize('script', sorted(p.name for p in BENCH.glob('*.py')))
def test_bench_never_imports_tests(script):
  assert not bench_reaches_into_tests((BENCH / script).read_text())


def test_the_bench_check_can_fail():
  planted = (
    "import os, sys\nsys.path.insert(0, os.path.join(REPO, 'tests'))\nimport conftest\n"
    'from helpers import gcs_emulator\n'
  )
  assert sorted(bench_reaches_into_tests(planted)) == [
    'imports conftest',
    'imports helpers',
    "names the folder 'tests'",
  ]


def face_shadows(face_source: str, package: str, submodules: set[str]) -> list[str]:
  """Names a package's `__init__` binds that are also its submodules: `from package import
  name` would then give the face's object, not the module (`common.log`, the function, once
  hid `common/log.py`)."""
  bound = set()
  for node in ast.parse(face_source).body:
    if isinstance(node, ast.ImportFrom) and node.module != package:
      bound.update(alias.asname or alias.name for alias in node.names)
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      bound.add(node.name)
    elif isinstance(node, ast.Assign):
      bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return sorted(bound & submodules)


@pytest.mark.parametrize('folder', sorted(SUBPACKAGES))
def test_no_face_hides_a_module_of_its_package(folder):
  submodules = {path.stem for path in (PACKAGE / folder).glob('*.py')} - {'__init__'}
  face = (PACKAGE / folder / '__init__.py').read_text()
  assert not face_shadows(face, f'transformer_jax.{folder}', submodules)


def test_the_shadow_check_can_fail():
  planted = 'from transformer_jax.common.log import log\n'
  assert face_shadows(planted, 'transformer_jax.common', {'log', 'paths'}) == ['log']


def test_every_subpackage_is_installed():
  # pyproject.toml lists the packages a wheel holds: a folder missing there installs nowhere.
  with open(os.path.join(REPO_ROOT, 'pyproject.toml')) as f:
    listed = re.search(r'packages = \[([^\]]*)\]', f.read()).group(1)
  installed = set(re.findall(r'"transformer_jax\.(\w+)"', listed))
  assert installed == SUBPACKAGES | {'configs'}, installed ^ (SUBPACKAGES | {'configs'})
