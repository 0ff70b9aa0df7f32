"""One run per workdir: an exclusive lock held for the life of the training process.

`fcntl.flock` locks belong to the open file description, so the kernel releases them when the
process ends for any reason — including SIGKILL — and a stale lock file never blocks a restart.
"""

from __future__ import annotations

import errno
import fcntl
import os

from transformer_jax.config import UserInputError

LOCK_FILE = '.lock'


class WorkdirLock:
  """Context manager: `with WorkdirLock(workdir): train...`; refuses if another process holds it."""

  def __init__(self, workdir: str, process_index: int = 0):
    # Process 0 of a multi-process job takes the same lock as a single-process run; the
    # others (which may share the workdir on one machine) each take their own.
    self.path = os.path.join(workdir, LOCK_FILE if process_index == 0
                             else f'{LOCK_FILE}.process{process_index}')
    self._file = None

  def acquire(self) -> 'WorkdirLock':
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    handle = open(self.path, 'a+')
    try:
      fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
      handle.seek(0)
      holder = handle.read().strip() or 'another process'
      handle.close()
      if error.errno in (errno.EAGAIN, errno.EACCES):
        raise UserInputError(f'{os.path.dirname(self.path)} is in use by a running training '
                             f'process ({holder}); wait for it to finish or use another '
                             '--workdir') from None
      raise
    handle.seek(0)
    handle.truncate()
    handle.write(f'pid {os.getpid()} on {os.uname().nodename}\n')
    handle.flush()
    self._file = handle
    return self

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self) -> 'WorkdirLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
