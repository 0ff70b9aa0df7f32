"""No command writes over what it reads or what a run holds (`paths.check_outputs_apart`).

Every output flag is compared with the command's inputs and with the workdir it reads: the same
file after links, the same inode (a hard link, a redirected /dev/stdout), a folder holding or
lying inside one. `export --force` replaces only a folder an earlier export wrote. Each case
asserts a one-line error and that nothing on disk changed.
"""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.evaluation import test_set
from transformer_jax.exporters import ctranslate2_spec, stablehlo
from transformer_jax.importers import workdir_writer
from transformer_jax.inference import attention_plots
from transformer_jax.inference.text_files import translate_text
from transformer_jax.serving import ctranslate2_engine

from conftest import REPO_ROOT


def _snapshot(folder) -> dict[str, str]:
  """Every file under `folder` (relative path -> SHA-256 of its bytes)."""
  found = {}
  for parent, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(parent, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return found


@pytest.fixture(scope='module')
def workdir(tiny_workdir, tmp_path_factory):
  """A copy of the session's workdir: a test that failed to refuse must not damage the
  shared one."""
  path = tmp_path_factory.mktemp('clash') / 'run'
  shutil.copytree(tiny_workdir, path)
  return str(path)


@pytest.fixture
def unchanged(workdir):
  """Asserts, after the test, that the workdir holds exactly what it held before."""
  before = _snapshot(workdir)
  yield
  assert _snapshot(workdir) == before


def _refused(call, match):
  with pytest.raises(UserInputError, match=match) as error:
    call()
  assert '\n' not in str(error.value)
  return str(error.value)


# --- The helper on its own --------------------------------------------------------------


def test_each_kind_of_clash_is_found(tmp_path):
  source = tmp_path / 'source.txt'
  source.write_text('hello\n')
  os.symlink(source, tmp_path / 'link.txt')
  os.link(source, tmp_path / 'hard.txt')
  run = tmp_path / 'run'
  (run / 'checkpoints').mkdir(parents=True)
  (run / 'vocab.model').write_text('pieces')
  os.link(run / 'vocab.model', tmp_path / 'vocab-copy.model')
  cases = {
    'same path': ({'--out': source}, {'--in': source}, {}, r'^--out=\S+ is --in='),
    'relative path': ({'--out': os.path.relpath(source)}, {'--in': source}, {}, ' is --in='),
    'symlink': ({'--out': tmp_path / 'link.txt'}, {'--in': source}, {}, ' is --in='),
    'hard link': ({'--out': tmp_path / 'hard.txt'}, {'--in': source}, {}, 'the same file'),
    'folder holding the input': ({'--out': tmp_path}, {'--in': source}, {}, 'a folder holding'),
    'the run': ({'--out': run}, {}, {'--workdir': run}, r' is --workdir=\S+, a run this'),
    'folder holding the run': ({'--out': tmp_path}, {}, {'--workdir': run}, 'folder holding'),
    'inside the run': ({'--out': run / 'vocab.model'}, {}, {'--workdir': run}, 'lies inside'),
    'new file in the run': ({'--out': run / 'new.txt'}, {}, {'--workdir': run}, 'lies inside'),
    'hard link into the run': (
      {'--out': tmp_path / 'vocab-copy.model'},
      {},
      {'--workdir': run},
      'a hard link to a file in --workdir',
    ),
  }
  for name, (outputs, inputs, runs, match) in cases.items():
    with pytest.raises(UserInputError, match=match):
      paths.check_outputs_apart(outputs, inputs, runs)
    assert name  # (named for the reader; pytest shows the failing dict on error)


def test_outputs_apart_or_allowed_pass(tmp_path):
  source = tmp_path / 'source.txt'
  source.write_text('hello\n')
  run = tmp_path / 'run'
  run.mkdir()
  paths.check_outputs_apart(
    {'--out': tmp_path / 'out.txt', '--unset': None},
    {'--in': source, '--also-unset': None},
    {'--workdir': run},
  )
  # Devices replace no file: /dev/null as both input and output is fine.
  paths.check_outputs_apart({'--out': '/dev/null'}, {'--in': '/dev/null'})
  # A place the command writes inside the run by design.
  paths.check_outputs_apart(
    {'--out': run / 'hypotheses' / 'x.txt'},
    runs={'--workdir': run},
    run_outputs=(run / 'hypotheses',),
  )
  paths.check_outputs_apart({'--out': 'gs://b/out'}, {'--in': 'gs://b/in'}, {'--w': 'gs://b/w'})
  with pytest.raises(UserInputError, match='lies inside --w=gs://b/w'):
    paths.check_outputs_apart({'--out': 'gs://b/w/vocab.model'}, runs={'--w': 'gs://b/w/'})


def test_stdout_redirected_to_the_input_is_found(tmp_path):
  source = tmp_path / 'source.txt'
  source.write_text('hello\n')
  code = (
    'from transformer_jax.common import paths\n'
    f"paths.check_outputs_apart({{'--output': '/dev/stdout'}}, {{'--input': {str(source)!r}}})\n"
  )
  with open(source, 'ab') as stdout:  # As a shell's `>> source.txt`.
    result = subprocess.run(
      [sys.executable, '-c', code], stdout=stdout, stderr=subprocess.PIPE, text=True
    )
  assert result.returncode == 1 and 'the same file (a hard link or a redirection)' in result.stderr


def test_an_export_folder_is_replaced_only_when_an_export_wrote_it(tmp_path):
  someones = tmp_path / 'someones'
  someones.mkdir()
  (someones / 'thesis.tex').write_text('years of work')
  for force in (False, True):
    _refused(
      lambda f=force: paths.check_replaceable_folder(someones, '--out', f),
      r'--out=\S+ exists and was not written by an export .*never replaced, even with --force',
    )
  marked = tmp_path / 'marked'
  marked.mkdir()
  paths.mark_export_folder(marked)
  _refused(lambda: paths.check_replaceable_folder(marked, '--out', False), 'pass --force')
  paths.check_replaceable_folder(marked, '--out', True)
  (tmp_path / 'empty').mkdir()
  paths.check_replaceable_folder(tmp_path / 'empty', '--out', True)
  paths.check_replaceable_folder(tmp_path / 'new', '--out', False)


# --- Each command ----------------------------------------------------------------------


def test_translate_never_writes_over_its_input_or_the_run(workdir, tmp_path, unchanged):
  source = tmp_path / 'source.txt'
  source.write_text('seven\neleven\n')
  os.symlink(source, tmp_path / 'link.txt')
  os.link(source, tmp_path / 'hard.txt')
  for output in (source, tmp_path / 'link.txt', tmp_path / 'hard.txt'):
    _refused(
      lambda o=output: translate_text(workdir, input_path=str(source), output_path=str(o)),
      r'^--output=\S+ (is|is the same file .*) --input=',
    )
  for output in ('vocab.model', 'config.json', 'translations.txt'):
    _refused(
      lambda o=output: translate_text(
        workdir, input_path=str(source), output_path=os.path.join(workdir, o)
      ),
      r'^--output=\S+ lies inside --workdir=\S+, a run this command reads',
    )
  assert source.read_text() == 'seven\neleven\n'


def test_evaluate_never_writes_over_its_sources_or_references(workdir, tmp_path, unchanged):
  src, ref = tmp_path / 'test.en', tmp_path / 'test.de'
  src.write_text('seven\n')
  ref.write_text('sieben\n')
  for flag, path in (('--src', src), ('--ref', ref)):
    _refused(
      lambda p=path: test_set.evaluate_files(workdir, str(src), str(ref), out=str(p)),
      rf'^--out=\S+ is {flag}=',
    )
  _refused(
    lambda: test_set.evaluate_files(
      workdir, str(src), str(ref), out=os.path.join(workdir, 'vocab.model')
    ),
    'lies inside --workdir',
  )
  assert (src.read_text(), ref.read_text()) == ('seven\n', 'sieben\n')


@pytest.mark.parametrize('exporter', [stablehlo.export, ctranslate2_spec.export])
def test_export_never_replaces_a_run_even_with_force(exporter, workdir, unchanged):
  parent = os.path.dirname(workdir)
  for out, match in (
    (workdir, 'was not written by an export'),
    (parent, 'was not written by an export'),
    (os.path.join(workdir, 'checkpoints'), 'was not written by an export'),
    (os.path.join(workdir, 'export'), 'lies inside --workdir'),
  ):
    _refused(lambda o=out: exporter(workdir, o, force=True), match)
  assert os.listdir(parent) == ['run']


def test_the_servers_export_folder_stays_out_of_the_run(workdir, tmp_path, unchanged):
  for directory, match in (
    (workdir, r'--ctranslate2_dir=\S+ is --workdir'),
    (os.path.dirname(workdir), 'is a folder holding --workdir'),
    (os.path.join(workdir, 'checkpoints'), 'lies inside --workdir'),
  ):
    _refused(lambda d=directory: ctranslate2_engine.prepare(workdir, None, 'int8', d), match)


def test_plot_attention_never_writes_into_the_run(workdir, unchanged):
  _refused(
    lambda: attention_plots.plot_translation(
      workdir, 'seven', os.path.join(workdir, 'attention.png')
    ),
    r'^--out=\S+ lies inside --workdir',
  )


def test_the_commands_refuse_before_any_work(workdir, tmp_path, unchanged):
  source = tmp_path / 'source.txt'
  source.write_text('seven\n')
  runs = {
    'translate': [f'--workdir={workdir}', f'--input={source}', f'--output={source}'],
    'export': [f'--workdir={workdir}', '--format=stablehlo', f'--out={workdir}', '--force'],
  }
  for command, args in runs.items():
    result = subprocess.run(
      [sys.executable, '-m', f'transformer_jax.{command}', *args],
      capture_output=True,
      text=True,
      cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: --'), result.stderr
  assert source.read_text() == 'seven\n'


def test_import_marian_never_writes_its_workdir_over_the_model(tmp_path):
  opus = tmp_path / 'opus-mt-en-de'
  opus.mkdir()
  (opus / 'opus.bpe32k-bpe32k.transformer.model1.npz.best-perplexity.npz').write_bytes(b'PK')
  (opus / 'source.spm').write_bytes(b'spm')
  before = _snapshot(opus)
  npz = str(next(opus.glob('*.npz')))
  for model, workdir, match in (
    (str(opus), str(opus), r'^--workdir=\S+ is --model='),
    (npz, str(opus), r'^--workdir=\S+ is a folder holding --model='),
    (str(opus), str(opus / 'imported'), r'^--workdir=\S+ lies inside --model='),
  ):
    _refused(lambda m=model, w=workdir: workdir_writer.import_marian_model(m, w), match)
  _refused(
    lambda: workdir_writer.import_marian_model(npz, str(tmp_path), spm=str(opus / 'source.spm')),
    'is a folder holding --model',
  )
  assert _snapshot(opus) == before and sorted(os.listdir(tmp_path)) == ['opus-mt-en-de']
