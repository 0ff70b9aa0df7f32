"""One training run per local workdir: `WorkdirLock`, an exclusive `fcntl.flock` on
`<workdir>/.lock`. The flock belongs to the open file description, so the kernel releases it
when the process ends for any reason (SIGKILL included) and a stale lock never blocks a restart.
Cloud Storage has no flock: `workdir.gcs_lock`."""

from __future__ import annotations

import errno
import fcntl
import os

from transformer_jax.common.errors import UserInputError


class WorkdirLock:
  """Context manager holding an exclusive lock file; refuses if another process holds it."""

  lost = False  # An flock cannot be taken away while its process lives.

  def __init__(self, path: str):
    self.path = path
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
        raise UserInputError(
          f'{os.path.dirname(self.path)} is in use by a running training '
          f'process ({holder}); wait for it to finish or use another '
          '--workdir'
        ) from None
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
