"""Crashes each replace the project does at every one of its steps (tests/replace_crash_test.py).

`python tests/helpers/crash_points.py ROOT` runs, for each replace below and k = 1, 2, ...: a
forked child that replaces the OLD copy with the NEW one and `os._exit`s just before its k-th
file-system step (an `os` call that creates, writes, fsyncs, renames or removes, or the
atomic exchange), until a child gets through. After each crash it checks that a complete copy
(OLD or NEW, nothing else) exists, then that the next replace, interrupted at once by a
Ctrl-C, still leaves one at the name with nothing hidden beside it, then that a full one
leaves NEW. It also traces one uninterrupted replace of each and checks its order: every
file fsynced before it takes the name, the folder fsynced after. Prints one line per failure
and exits 1 if any; prints the steps crashed at.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from transformer_jax.common import paths

try:
  from transformer_jax.common import replace
except ImportError:  # Before the replace protocol (issue 51): its folder steps only.
  replace = None

CRASHED = 17
_STEPS = ('mkdir', 'rename', 'replace', 'unlink', 'rmdir', 'open', 'write', 'fsync')
MARKER = getattr(replace, 'MARKER', '.transformer_jax-complete')

# What each folder replace holds, as the project's writers fill it.
FOLDERS = {
  'averaged': {'params/_METADATA': 'p', 'params/d/0': 'pp', 'metadata.json': '{}'},
  'export': {'model.bin': 'weights', 'config.json': '{}', '.transformer_jax-export': 'x'},
  'imported': {'vocab.model': 'v', 'imported/params/0': 'w', 'config.json': '{"a": 1}'},
}


def _fill(folder: str, files: dict[str, str], version: str) -> None:
  """Writes the files with os calls, so that a crash can also cut the filling short."""
  for relative, text in files.items():
    path = os.path.join(folder, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.write(descriptor, f'{version}:{text}'.encode())
    os.close(descriptor)


def _tree(folder: str) -> dict[str, str] | None:
  if not os.path.isdir(folder):
    return None
  found = {}
  for parent, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(parent, name)
      relative = os.path.relpath(path, folder)
      if relative != MARKER:  # Left by a crash after taking the name; removed next time.
        with open(path) as f:
          found[relative] = f.read()
  return found


def _expected(files: dict[str, str], version: str) -> dict[str, str]:
  return {relative: f'{version}:{text}' for relative, text in files.items()}


class Crash:
  """Patches the os steps (and the exchange) to count them and exit before the k-th; `trace`
  records (step, path) instead."""

  def __init__(self, at: int | None, trace: list | None = None):
    self.at, self.count, self.trace, self.names = at, 0, trace, {}

  def install(self) -> None:
    for step in _STEPS:
      setattr(os, step, self._wrap(step, getattr(os, step)))
    if replace is not None:
      replace._exchange = self._wrap('exchange', replace._exchange)

  def _wrap(self, step, real):
    def counted(*args, **kwargs):
      self.count += 1
      if self.at is not None and self.count >= self.at:
        os._exit(CRASHED)
      if self.trace is not None:
        where = args[0] if args else None
        if isinstance(where, int):
          where = self.names.get(where, where)
        self.trace.append((step, os.fspath(where) if isinstance(where, os.PathLike) else where))
      result = real(*args, **kwargs)
      if step == 'open' and self.trace is not None and 'dir_fd' not in kwargs:
        self.names[result] = os.fspath(args[0])
      return result

    return counted


def _replace_folder(target: str, files: dict[str, str]) -> None:
  with paths.staged_folder(target) as staging:
    _fill(staging, files, 'new')


def _interrupted_replace(target: str) -> None:
  try:
    with paths.staged_folder(target):
      raise KeyboardInterrupt  # The next command, stopped before it wrote anything.
  except KeyboardInterrupt:
    pass


def _in_child(work, crash: Crash | None) -> int:
  """Runs `work` in a forked child (with `crash` installed); its exit status."""
  pid = os.fork()
  if pid == 0:
    try:
      if crash is not None:
        crash.install()
      work()
      os._exit(0)
    except BaseException as error:  # noqa: BLE001
      print(f'child failed: {error!r}', flush=True)
      os._exit(3)
  return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _complete_beside(parent: str, name: str, files: dict[str, str]) -> list[str]:
  """The hidden siblings of `name` that hold a complete OLD or NEW copy."""
  complete = []
  for entry in os.listdir(parent):
    path = os.path.join(parent, entry)
    if entry.startswith(f'.{name}.old-'):
      tree = _tree(path)
    elif entry.startswith(f'.{name}.tmp-'):
      token = entry.rsplit('-', 1)[1]
      marker = os.path.join(path, MARKER)
      tree = _tree(path) if os.path.isfile(marker) and open(marker).read() == token else None
    else:
      continue
    if tree in (_expected(files, 'old'), _expected(files, 'new')):
      complete.append(entry)
  return complete


def check_folder(root: str, label: str, files: dict[str, str], exchange: bool) -> tuple:
  failures, k = [], 0
  while True:
    k += 1
    parent = os.path.join(root, f'{label}-{"exchange" if exchange else "rename"}')
    shutil.rmtree(parent, ignore_errors=True)
    target = os.path.join(parent, label)
    os.makedirs(target)
    _fill(target, files, 'old')
    status = _in_child(lambda: _replace_folder(target, files), Crash(k))
    where = f'{label} ({"exchange" if exchange else "two renames"}) crashed before step {k}'
    if status not in (0, CRASHED):
      return [f'{where}: the child failed ({status})'], k
    now = _tree(target)
    whole = (_expected(files, 'old'), _expected(files, 'new'))
    if now not in whole and not (now is None and _complete_beside(parent, label, files)):
      failures.append(f'{where}: no complete copy: {label}={now}, beside it {os.listdir(parent)}')
    elif exchange and now not in whole:
      failures.append(f'{where}: {label} is not whole ({now}) though the exchange is atomic')
    _interrupted_replace(target)
    now = _tree(target)
    if now not in whole:
      failures.append(f'{where}: after an interrupted next replace {label} is {now}')
    elif sorted(os.listdir(parent)) != [label] or os.path.exists(os.path.join(target, MARKER)):
      failures.append(f'{where}: left beside {label}: {sorted(os.listdir(parent))}')
    _replace_folder(target, files)
    if _tree(target) != _expected(files, 'new') or sorted(os.listdir(parent)) != [label]:
      failures.append(f'{where}: the next replace gave {_tree(target)}, {os.listdir(parent)}')
    if status == 0:
      return failures, k


def check_file(root: str, label: str, write, through_link: bool) -> tuple:
  failures, k = [], 0
  while True:
    k += 1
    parent = os.path.join(root, label)
    shutil.rmtree(parent, ignore_errors=True)
    os.makedirs(parent)
    target = os.path.join(parent, 'file.txt')
    with open(target, 'w') as f:
      f.write('old whole')
    named = target
    if through_link:
      named = os.path.join(parent, 'link.txt')
      os.symlink('file.txt', named)
    status = _in_child(lambda: write(named, 'new whole'), Crash(k))
    where = f'{label} crashed before step {k}'
    with open(target) as f:
      now = f.read()
    if status not in (0, CRASHED) or now not in ('old whole', 'new whole'):
      failures.append(f'{where}: status {status}, the file holds {now!r}')
    write(named, 'new whole')
    expected = sorted(['file.txt'] + (['link.txt'] if through_link else []))
    if sorted(os.listdir(parent)) != expected:
      failures.append(f'{where}: the next write left {sorted(os.listdir(parent))}')
    if status == 0:
      return failures, k


def check_order(root: str) -> list[str]:
  """One traced replace of a folder and of a file: every file written into what takes the
  name is fsynced before it does (a temporary file too), and the folder is fsynced after."""
  parent = os.path.join(root, 'traced')
  target = os.path.join(parent, 'export')
  os.makedirs(target)
  _fill(target, FOLDERS['export'], 'old')

  def traced():
    trace: list = []
    Crash(None, trace).install()
    _replace_folder(target, FOLDERS['export'])
    paths.write_atomically(paths.Path(os.path.join(parent, 'config.json')), 'x')
    with open(os.path.join(root, 'trace.json'), 'w') as f:
      json.dump(trace, f)

  if _in_child(traced, None) != 0:
    return ['the traced replace failed']
  with open(os.path.join(root, 'trace.json')) as f:
    trace = json.load(f)
  failures = []
  for index, (step, where) in enumerate(trace):
    if step not in ('rename', 'replace', 'exchange') or not os.path.basename(where).startswith('.'):
      continue  # Only what takes a name (the old copy going aside is not written).
    before = trace[:index]
    synced = {w for s, w in before if s == 'fsync'}
    written = {w for s, w in before if s == 'open' and str(w).startswith(where + '/')}
    stale = sorted(written - synced) + ([where] if where not in synced else [])
    if stale:
      failures.append(f'{step} of {where} before the fsync of {stale}')
    if parent not in {w for s, w in trace[index:] if s == 'fsync'}:
      failures.append(f'{step} of {where}: the folder {parent} is not fsynced after it')
  return failures


def main(root: str) -> int:
  # An interrupted replace waits for background writers (orbax) to stop filling its staging
  # folder; these writers have none, and the 0.5 s wait would be most of the test's time.
  owner = replace if replace is not None else paths
  removal = owner._remove_until_it_stays_removed
  owner._remove_until_it_stays_removed = lambda folder: removal(folder, settle_s=0)
  failures, steps = [], {}
  for exchange in (True, False):
    if replace is not None and not exchange:
      replace._exchange = lambda first, second: False  # A file system without RENAME_EXCHANGE.
    for label, files in FOLDERS.items():
      found, steps[f'{label}/{exchange}'] = check_folder(root, label, files, exchange)
      failures += found
  for label, write, link in (
    ('config.json', lambda path, text: paths.write_atomically(paths.Path(path), text), False),
    ('output', paths.write_output, False),
    ('output-symlink', paths.write_output, True),
  ):
    found, steps[label] = check_file(root, label, write, link)
    failures += found
  failures += check_order(root)
  for failure in failures:
    print(failure)
  print(f'steps: {steps}')
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1]))
