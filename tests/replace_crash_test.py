"""The replace protocol (transformer_jax/common/replace.py, docs/reliability.md) under a crash
at every one of its steps, under a second live writer, and as the one way the project's
replaces go (issue 51)."""

import ast
import os
import pathlib
import subprocess
import sys
import threading

from transformer_jax.common import paths, replace

from conftest import REPO_ROOT

PACKAGE = pathlib.Path(REPO_ROOT) / 'transformer_jax'


def test_every_replace_keeps_a_complete_copy_whatever_step_a_crash_hits(tmp_path):
  # One process forks a child per crash point (hundreds of them, about 2 s in all): the
  # averaged checkpoint, both exports and an imported workdir as folders, with the atomic
  # exchange and without it; config.json and output files (through a symlink too) as files.
  result = subprocess.run(
    [sys.executable, os.path.join('tests', 'helpers', 'crash_points.py'), str(tmp_path)],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
  assert 'steps: {' in result.stdout


def test_a_staging_folder_a_live_writer_holds_is_never_removed(tmp_path):
  # Two servers exporting into one workdir: the second's start must leave the first's
  # half-written folder alone, and the first then still takes the name.
  target = str(tmp_path / 'ctranslate2_export')
  first = paths.staged_folder(target)
  staging = first.__enter__()
  (pathlib.Path(staging) / 'model.bin').write_text('first')
  with paths.staged_folder(target) as second:
    (pathlib.Path(second) / 'model.bin').write_text('second')
  assert (pathlib.Path(staging) / 'model.bin').read_text() == 'first'
  first.__exit__(None, None, None)
  assert sorted(os.listdir(tmp_path)) == ['ctranslate2_export']
  assert os.listdir(target) == ['model.bin']
  assert (pathlib.Path(target) / 'model.bin').read_text() == 'first'


def test_a_killed_replaces_complete_copy_is_promoted_and_its_old_one_restored(tmp_path):
  target = tmp_path / 'averaged'
  # Killed between its two renames (no exchange): the old copy aside, the new one complete.
  (tmp_path / '.averaged.old-ab12').mkdir()
  (tmp_path / '.averaged.old-ab12' / 'f').write_text('old')
  new = tmp_path / '.averaged.tmp-ab12'
  new.mkdir()
  (new / 'f').write_text('new')
  (new / replace.MARKER).write_text('ab12')
  replace.recover(str(target))
  assert os.listdir(tmp_path) == ['averaged'] and os.listdir(target) == ['f']
  assert (target / 'f').read_text() == 'new'
  # Killed before its new copy was complete (no marker), with the old one aside: put back.
  target.rename(tmp_path / '.averaged.old-cd34')
  (tmp_path / '.averaged.tmp-cd34').mkdir()
  (tmp_path / '.averaged.tmp-cd34' / 'f').write_text('half')
  replace.recover(str(target))
  assert os.listdir(tmp_path) == ['averaged'] and (target / 'f').read_text() == 'new'


# The project's replaces of a file or folder and what they must go through.
_REPLACES = {
  'checkpoints/checkpointer.py': 'staged_folder',  # averaged/ and imported parameters
  'exporters/ctranslate2_spec.py': 'staged_folder',
  'exporters/stablehlo.py': 'staged_folder',
  'serving/ctranslate2_engine.py': 'staged_folder',
  'importers/workdir_writer.py': 'staged_folder',
  'workdir/layout.py': 'write_atomically',  # config.json
  'common/text_io.py': 'write_output',  # translations, evaluate's hypotheses, plots
}
# Renames and removals elsewhere, each of something that is not a replace: orbax's own
# commit protocol serves step checkpoints (a failed step's temporary folder removed; a
# damaged step moved aside), and a bucket's dataset staged into a cache file by file.
_OTHER_RENAMES = {
  'checkpoints/checkpointer.py': 2,
  'data/staging.py': 1,
  'importers/workdir_writer.py': 1,  # in a bucket only, where a folder has no rename
}


def _calls(path: pathlib.Path) -> list[str]:
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      names.append(node.func.attr)
  return names


def test_every_replace_of_the_project_goes_through_the_protocol():
  for module, function in _REPLACES.items():
    assert function in _calls(PACKAGE / module), f'{module} no longer calls {function}'
  moves = {'rename', 'replace', 'rmtree', 'move', 'renames'}
  found = {}
  for path in PACKAGE.rglob('*.py'):
    module = path.relative_to(PACKAGE).as_posix()
    if module == 'common/replace.py':
      continue
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        named = owner.id if isinstance(owner, ast.Name) else getattr(owner, 'attr', '')
        if node.func.attr in moves and (named in ('os', 'shutil') or node.func.attr == 'rmtree'):
          count += 1
    if count:
      found[module] = count
  found.pop('common/paths.py', None)  # paths.move: a quarantined step, on GCS object by object
  assert found == _OTHER_RENAMES


def _finishes_within(seconds, work):
  # A daemon thread, so that a regression fails the test instead of hanging the suite.
  outcome = []
  thread = threading.Thread(target=lambda: outcome.append(work()), daemon=True)
  thread.start()
  thread.join(seconds)
  return outcome


def test_replaces_inside_a_staging_folder_do_not_wait_on_their_own_lock(tmp_path):
  # A forced re-import fills its staging folder with replaces of its own (config.json, the
  # parameters' folder): each takes the staging folder's lock, which this thread holds.
  target = tmp_path / 'model'

  def nested():
    with paths.staged_folder(str(target)) as staging:
      paths.write_atomically(paths.resolve(os.path.join(staging, 'config.json'), 'x'), '{}')
      with paths.staged_folder(os.path.join(staging, 'params')) as inner:
        pathlib.Path(inner, 'weights').write_text('w')
    return sorted(str(p.relative_to(target)) for p in target.rglob('*'))

  assert _finishes_within(30, nested) == [['config.json', 'params', 'params/weights']]


def test_another_thread_waits_for_a_folder_this_one_holds(tmp_path):
  # Granting a held lock again is for the holding thread only: another thread of the process
  # waits for the flock as another process would.
  first = paths.staged_folder(str(tmp_path / 'out'))
  staging = first.__enter__()
  acquired = threading.Event()

  def lock_it():
    with replace._parent_lock(staging):
      acquired.set()

  thread = threading.Thread(target=lock_it, daemon=True)
  thread.start()
  assert not acquired.wait(1)
  pathlib.Path(staging, 'f').write_text('first')
  first.__exit__(None, None, None)  # Lets go of the staging folder (now named out/).
  assert acquired.wait(30)
  assert os.listdir(tmp_path) == ['out']
