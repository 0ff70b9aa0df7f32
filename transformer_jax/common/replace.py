"""The one way the project replaces a local file or folder: a crash at any instant (kill -9,
a power loss) never leaves fewer than one complete copy. docs/reliability.md ("Replacing a
file or a folder") states the protocol; tests/replace_crash_test.py crashes it at every step.

A folder NAME is filled in a hidden sibling `.NAME.tmp-TOKEN`, which its owner holds an
`flock` on while it lives (the kernel drops it when the process dies, kill -9 included). Once
filled, every file and folder in it is fsynced and `MARKER`, holding TOKEN, is written last: a
staging folder whose marker names its own token is complete. It then takes the name under an
`flock` on the parent folder: where the file system can, one atomic exchange
(renameat2 RENAME_EXCHANGE), so NAME always holds a copy; elsewhere NAME goes aside to
`.NAME.old-TOKEN` first. The parent is fsynced, the marker removed from NAME, the old copy
(its marker first) deleted. The next replace of NAME recovers what a killed one left, under
the same parent lock: a complete staging folder is promoted, an `.old-*` is put back where
NAME is missing, and only then is anything else deleted; a folder another live process holds
is never touched.

A file is written to `.NAME.XXXXXXXX.tmp` (flocked while written), fsynced, renamed over NAME
(atomic: NAME is always the old or the new file), and the folder fsynced; temporary files of
dead writers are removed by the next write.

Every step that changes the file system is an `os` call (or `_exchange`), so that a test can
stop the process before any one of them.

flock conflicts between two opens of one folder even within a process, so a thread that
already holds a folder (its staging folder, while the block fills it with replaces of its own)
is granted that folder's parent lock without taking it again: `_holds` counts what this
process holds, by inode and thread. Another thread still waits for the flock.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import threading
import time
import uuid
from typing import Iterator

# Written last into a staging folder (its token inside): the folder is complete. Removed from
# the folder once it has taken its name, so a finished folder holds only what its writer put.
MARKER = '.transformer_jax-complete'
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2

# (st_dev, st_ino) of each folder or file this process holds an flock on -> [the holding
# thread's ident, how many holds]; `_holds_guard` guards it.
_holds: dict[tuple[int, int], list[int]] = {}
_holds_guard = threading.Lock()


@contextlib.contextmanager
def staged_folder(directory: str) -> Iterator[str]:
  """A hidden sibling folder to fill, which then replaces the local `directory` whole (the
  module docstring). On an error or Ctrl-C in the block the staging folder is removed and
  `directory` is left as it was; an OSError naming no file is raised naming `directory`."""
  parent, name = os.path.split(os.path.abspath(os.fspath(directory)))
  target = os.path.join(parent, name)
  os.makedirs(parent, exist_ok=True)
  token = uuid.uuid4().hex[:12]
  staging = os.path.join(parent, f'.{name}.tmp-{token}')
  # Made and locked under the parent's lock: another process's recovery never sees it unowned.
  with _parent_lock(parent) as locked:
    leftovers = _recover(parent, name) if locked else []
    os.mkdir(staging)  # 0777 less the umask: readable by others as the user's files are.
    owner = _try_lock(staging)
  _discard_all(leftovers)
  try:
    yield staging
    _seal(staging, token)
    with _parent_lock(parent):
      retired = _take_name(parent, name, staging, token)
    _discard(retired)
  except BaseException as error:
    # A library may still be creating files in the staging folder from a background thread
    # when the error reaches us (orbax, seen under load, for over 2 s): remove it until it has
    # stayed removed for half a second, for up to a minute.
    _remove_until_it_stays_removed(staging)
    raise_naming(error, target)
    raise
  finally:
    if owner is not None:
      _let_go(owner)


def recover(directory: str) -> None:
  """Finishes or undoes what a killed replace of the local `directory` left (the module
  docstring); `staged_folder` does this first. Nothing held by a live process is touched."""
  parent, name = os.path.split(os.path.abspath(os.fspath(directory)))
  if not os.path.isdir(parent):
    return
  with _parent_lock(parent) as locked:
    leftovers = _recover(parent, name) if locked else []
  _discard_all(leftovers)


def replace_file(destination: str, data: bytes, mode: int | None = None) -> None:
  """Replaces the local file `destination` with `data` (permission bits `mode`, else as a new
  file gets), whole and durably (the module docstring)."""
  folder, name = os.path.split(os.path.abspath(destination))
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, f'.{name}.{uuid.uuid4().hex[:8]}.tmp')
  with _parent_lock(folder) as locked:
    if locked:
      _remove_dead_temporaries(folder, name)
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    with contextlib.suppress(OSError):  # Without flock the file is only never cleaned up.
      fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    if mode is not None:
      os.fchmod(descriptor, mode)  # A file the user made private stays private.
    view = memoryview(data)
    while view:
      view = view[os.write(descriptor, view) :]
    os.fsync(descriptor)  # Else a power loss after the rename can bring back an empty file.
    os.replace(tmp, destination)  # Still locked: no cleaner removes it before it is renamed.
  except BaseException as error:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise_naming(error, destination)
    raise
  finally:
    os.close(descriptor)
  _fsync(folder)


def raise_naming(error: BaseException, path: str | os.PathLike) -> None:
  """Re-raises an OSError that names no file as one naming `path`, so that a full disk's
  one-line error (cli.run) says what was being written; any other error is left to `raise`."""
  if isinstance(error, OSError) and error.errno is not None and error.filename is None:
    raise OSError(error.errno, error.strerror, os.fspath(path)) from error


def _seal(staging: str, token: str) -> None:
  """Makes the staging folder complete: its contents durable, then the marker, durable."""
  for folder, _, names in os.walk(staging, topdown=False):
    for entry in names:
      _fsync(os.path.join(folder, entry))
    _fsync(folder)
  descriptor = os.open(os.path.join(staging, MARKER), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
  try:
    os.write(descriptor, token.encode())
    os.fsync(descriptor)
  finally:
    os.close(descriptor)
  _fsync(staging)


def _take_name(parent: str, name: str, staging: str, token: str) -> str | None:
  """The complete `staging` takes `name` (the parent lock held); returns where the old copy
  now lies, to delete, or None."""
  target = os.path.join(parent, name)
  retired = None
  if not os.path.lexists(target):
    os.rename(staging, target)
  elif _exchange(staging, target):
    retired = staging  # The old copy, its marker (if any) not naming this token.
  else:  # No atomic exchange here: for an instant NAME is missing, the old copy beside it.
    retired = os.path.join(parent, f'.{name}.old-{token}')
    os.rename(target, retired)
    try:
      os.rename(staging, target)
    except BaseException:
      os.rename(retired, target)
      raise
  _fsync(parent)
  with contextlib.suppress(FileNotFoundError):
    os.unlink(os.path.join(target, MARKER))
  return retired


def _recover(parent: str, name: str) -> list[tuple[str, int]]:
  """What a killed replace of `name` left, set right (the parent lock held): the newest
  complete staging folder takes the name, else a retired copy goes back where the name is
  missing. Returns the leftovers to delete, each with the lock held on it."""
  pattern = re.compile(rf'\.{re.escape(name)}\.(tmp|old)-([0-9a-f]+)')
  target = os.path.join(parent, name)
  complete, retired, garbage = [], [], []
  for entry in sorted(os.listdir(parent)):
    match = pattern.fullmatch(entry)
    path = os.path.join(parent, entry)
    if not match or not os.path.isdir(path):
      continue
    held = _try_lock(path)
    if held is None:
      continue  # A live process's (or one that cannot be locked): never touched.
    if match[1] == 'old':
      retired.append((path, held))
    elif _marker_token(path) == match[2]:
      complete.append((path, held))
    else:
      garbage.append((path, held))  # Never finished, or an old copy exchanged out.
  newest = lambda found: os.stat(os.path.join(found[0], MARKER)).st_mtime_ns  # noqa: E731
  complete.sort(key=newest)
  if complete:
    path, held = complete.pop()
    old = _take_name(parent, name, path, pattern.fullmatch(os.path.basename(path))[2])
    garbage += [(old, held)] if old else [(path, held)]
    garbage += complete + retired
  elif retired and not os.path.lexists(target):
    retired.sort(key=lambda found: os.stat(found[0]).st_mtime_ns)
    path, held = retired.pop()
    os.rename(path, target)  # The old copy back: the new one never became complete.
    _fsync(parent)
    garbage += [(path, held)] + retired
  else:
    garbage += retired
    with contextlib.suppress(OSError):  # A crash between taking the name and this removal.
      os.unlink(os.path.join(target, MARKER))
  return garbage


def _marker_token(folder: str) -> str | None:
  try:
    with open(os.path.join(folder, MARKER), encoding='ascii', errors='replace') as f:
      return f.read(64)
  except OSError:
    return None


def _discard(folder: str | None) -> None:
  """Deletes a copy no longer wanted, its marker first: half-deleted, it never reads as
  complete."""
  if folder is None:
    return
  with contextlib.suppress(OSError):
    os.unlink(os.path.join(folder, MARKER))
  shutil.rmtree(folder, ignore_errors=True)


def _discard_all(leftovers: list[tuple[str, int]]) -> None:
  for folder, held in leftovers:  # Locked until deleted: no one else promotes it meanwhile.
    try:
      _discard(folder)
    finally:
      _let_go(held)


def _remove_dead_temporaries(folder: str, name: str) -> None:
  pattern = re.compile(rf'\.{re.escape(name)}\.[0-9a-f]{{8}}\.tmp')
  for entry in os.listdir(folder):
    if pattern.fullmatch(entry):
      path = os.path.join(folder, entry)
      held = _try_lock(path)
      if held is not None:
        with contextlib.suppress(OSError):
          os.unlink(path)
        _let_go(held)


def _remove_until_it_stays_removed(folder: str, settle_s: float = 0.5, limit_s: float = 60) -> None:
  deadline = time.monotonic() + limit_s
  while True:
    shutil.rmtree(folder, ignore_errors=True)
    time.sleep(settle_s)
    if not os.path.exists(folder) or time.monotonic() > deadline:
      return


def _try_lock(path: str) -> int | None:
  """A descriptor holding an exclusive flock on `path`, or None: another process holds it,
  or it cannot be locked (then it counts as held)."""
  try:
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    os.close(descriptor)
    return None
  _note_hold(descriptor)
  return descriptor


def _note_hold(descriptor: int) -> None:
  """Records that this thread now holds the flock on `descriptor`'s inode."""
  key = _inode(descriptor)
  with _holds_guard:
    _holds.setdefault(key, [threading.get_ident(), 0])[1] += 1


def _let_go(descriptor: int) -> None:
  """Closes a descriptor `_try_lock` or `_parent_lock` returned, dropping its flock."""
  try:
    key = _inode(descriptor)
    with _holds_guard:
      hold = _holds.get(key)
      if hold is not None:
        hold[1] -= 1
        if hold[1] <= 0:
          del _holds[key]
  finally:
    os.close(descriptor)


def _held_by_this_thread(descriptor: int) -> bool:
  with _holds_guard:
    hold = _holds.get(_inode(descriptor))
    return hold is not None and hold[0] == threading.get_ident()


def _inode(descriptor: int) -> tuple[int, int]:
  status = os.fstat(descriptor)
  return status.st_dev, status.st_ino


@contextlib.contextmanager
def _parent_lock(parent: str) -> Iterator[bool]:
  """An flock on the folder itself while leftovers are recovered and a name is taken; False
  where it cannot be had (then nothing of others is recovered, so nothing is lost)."""
  try:
    descriptor = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except OSError:
    yield False
    return
  if _held_by_this_thread(descriptor):
    # This thread holds the folder already (it is the staging folder being filled): a second
    # flock would wait on ourselves forever.
    os.close(descriptor)
    yield True
    return
  try:
    fcntl.flock(descriptor, fcntl.LOCK_EX)
  except OSError:
    os.close(descriptor)
    yield False
    return
  _note_hold(descriptor)
  try:
    yield True
  finally:
    _let_go(descriptor)


def _fsync(path: str) -> None:
  """fsync of a file or a folder (a folder: the names in it), best effort where unsupported."""
  try:
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return
  try:
    os.fsync(descriptor)
  except OSError as error:
    if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
      raise
  finally:
    os.close(descriptor)


_libc = None


def _exchange(first: str, second: str) -> bool:
  """Swaps the two names atomically (Linux renameat2 RENAME_EXCHANGE); False where the C
  library or the file system cannot."""
  global _libc
  if _libc is None:
    try:
      _libc = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
      _libc = False
  if _libc is False:
    return False
  names = (_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
  if _libc(*names) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
    return False
  raise OSError(code, os.strerror(code), second)
