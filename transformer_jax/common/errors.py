"""The project's exceptions, the exit codes commands give them, and the type checks they use.

A mistake in what the user gave (a config value, a flag, a file) is a `UserInputError`: one line
naming the field, file or line, no traceback. `cli.run` turns each exception below into
`error: <message>` on stderr (an interruption: its message alone, or `interrupted`) and the exit
status in `EXIT_CODES`:

  0    success (also a run stopped by SIGTERM/SIGINT after saving its checkpoint)
  1    a bug: an unexpected exception, with its traceback
  2    user error: bad config, flag or input file; a missing or damaged workdir or checkpoint
  3    training stopped because the loss or gradients stayed NaN/Inf
  4    the storage failed a write: no space left on device (ENOSPC), disk quota exceeded
       (EDQUOT), file too large (EFBIG), a file system (re)mounted read-only (EROFS), an
       input/output error (EIO). The line names the path and the space left on its file system:
       `error: no space left on device writing PATH (N.N MB free on the file system at MOUNT)`.
       What was written before stays: a checkpoint, averaged checkpoint or export that failed is
       removed, the previous one is kept, and rerunning once there is space resumes.
  130  stopped by Ctrl-C (SIGINT) with nothing to save: training during start-up (before its
       first step), or any other command; 143 (128 + 15) for SIGTERM. One line, no traceback.
  141  (128 + SIGPIPE) stdout or stderr is a pipe whose reader has gone (`translate | head -1`):
       nothing is printed, as for a command that SIGPIPE ends, so `set -o pipefail` sees it.

stdin or stdout closed (`<&-`, `>&-`) or open the wrong way: one line, exit 2, once the command
reads or writes it. stderr closed (`2>&-`): the command runs as usual, its messages are dropped
(not sent to stdout) and the exit status is as above.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
from typing import Any


class UserInputError(ValueError):
  """A problem with what the user gave (config, files, flags): one line, no traceback."""


class CorruptCheckpointError(RuntimeError):
  """A checkpoint that exists but cannot be read back intact."""


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with a NaN/Inf loss or gradient."""


class Interrupted(KeyboardInterrupt):
  """A command stopped by SIGINT or SIGTERM before it had anything to save; its message says
  what was stopped. A KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

  def __init__(self, message: str, signum: int = signal.SIGINT):
    super().__init__(message)
    self.signum = int(signum)


class StorageError(OSError):
  """A write that the storage refused or lost (see `STORAGE_ERRNOS`), as an OSError whose
  `filename` is what was being written (a checkpoint step's folder, an output file)."""


EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
EXIT_STORAGE_FAILED = 4
# 128 + the signal's number, as a shell reports a command that a signal ended: 130 for Ctrl-C.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

# Exception type -> exit status of a command (first match wins); then any exception caused by
# an OSError with one of STORAGE_ERRNOS (`storage_failure`) gives EXIT_STORAGE_FAILED.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
  (UserInputError, EXIT_USER_ERROR),
  (FileNotFoundError, EXIT_USER_ERROR),
  (CorruptCheckpointError, EXIT_USER_ERROR),
  (NonFiniteError, EXIT_NONFINITE),
  (StorageError, EXIT_STORAGE_FAILED),
  (KeyboardInterrupt, EXIT_INTERRUPTED),
)

# The disk, not the program or its input: full, over quota, a file larger than the file system
# takes, remounted read-only after an error, failing. A rerun once it is fixed goes on.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def exit_code(error: BaseException) -> int | None:
  """The documented exit status for `error`, or None for an unexpected exception (a bug)."""
  if isinstance(error, Interrupted):
    return 128 + error.signum  # 143 for SIGTERM
  for error_type, code in EXIT_CODES:
    if isinstance(error, error_type):
      return code
  if storage_failure(error) is not None:
    return EXIT_STORAGE_FAILED
  return None


# How libraries written in C++ report an OS error in an exception's message. tensorstore
# (orbax's array writer), in a ValueError: 'RESOURCE_EXHAUSTED: Error writing ... at local file
# "FOLDER": Failed writing: "PATH": ... No space left on device [os_error_code='28']'.
# array_record (tfds's writer), in a RuntimeError: 'Failed to finalize writing of split
# "train": write() failed: No space left on device; writing PATH; at byte 299008; ...'.
_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]")
_STORAGE_STRERRORS = {os.strerror(code): code for code in STORAGE_ERRNOS}
# The file first, else the folder.
_MESSAGE_PATHS = (
  re.compile(r'Failed writing: "([^"]+)"'),
  re.compile(r'; writing (/[^;]+);'),
  re.compile(r'local file "([^"]+)"'),
)


def _errno_in_message(text: str) -> int | None:
  found = _TENSORSTORE_ERRNO.search(text)
  if found:
    return int(found.group(1)) if int(found.group(1)) in STORAGE_ERRNOS else None
  for strerror, code in _STORAGE_STRERRORS.items():
    if strerror in text:
      return code
  return None


def storage_failure(error: BaseException) -> OSError | None:
  """The OSError with one of STORAGE_ERRNOS that `error` is or was caused by, else None.

  Looks through `__cause__`, `__context__` (unless suppressed with `from None`), the members
  of an ExceptionGroup and exceptions given as arguments (orbax wraps what the OS said); an
  exception that carries the OS error only in its message (tensorstore's, array_record's: see
  above) comes back as an OSError with that errno and the path the message names."""
  seen: set[int] = set()
  pending = [error]
  while pending:
    current = pending.pop(0)
    if current is None or id(current) in seen:
      continue
    seen.add(id(current))
    if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
      return current
    text = '' if isinstance(current, OSError) else _text(current)
    code = _errno_in_message(text)
    if code is not None:
      named = [found.group(1) for found in (p.search(text) for p in _MESSAGE_PATHS) if found]
      return OSError(code, os.strerror(code), named[0] if named else None)
    pending.append(current.__cause__)
    if not current.__suppress_context__:
      pending.append(current.__context__)
    pending.extend(getattr(current, 'exceptions', ()))  # An ExceptionGroup.
    pending.extend(arg for arg in current.args if isinstance(arg, BaseException))
  return None


@contextlib.contextmanager
def storage_errors_as(where: str | os.PathLike, clean_up=lambda: None):
  """A failed write (`storage_failure`, however wrapped) as one StorageError naming `where`,
  after `clean_up()`."""
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except  # orbax wraps what the OS said.
    failure = storage_failure(error)
    if failure is None:
      raise
    with contextlib.suppress(OSError):
      clean_up()
    raise StorageError(failure.errno, failure.strerror, os.fspath(where)) from error


def _text(error: BaseException) -> str:
  try:
    return str(error)
  except Exception:  # pylint: disable=broad-except  # A broken __str__ is no reason to fail.
    return ''


def storage_failure_message(
  failure: OSError, near: tuple[str, str | os.PathLike] | None = None
) -> str:
  """One line for a failed write: what the OS said, the path written (the failure's filename)
  and the space left on its file system, as in
  `no space left on device writing PATH (1.2 MB free on the file system at /data)`.
  `near`: (a name for it, a path) where the command writes, whose file system's free space is
  given instead when the OS did not name the file (a write to an open file)."""
  reason = failure.strerror or os.strerror(failure.errno)
  reason = reason[:1].lower() + reason[1:]
  if failure.filename is None:
    note = free_space_note(near[1], near[0]) if near else ''
    return f'{reason} writing a file the system did not name{note}'
  verb = 'on' if failure.errno == errno.EIO else 'writing'  # EIO may be a read as well.
  return f'{reason} {verb} {os.fsdecode(failure.filename)}{free_space_note(failure.filename)}'


def free_space_note(path: str | os.PathLike, name: str | None = None) -> str:
  """' (N.N MB free on the file system at MOUNT)' for a local path (or its nearest existing
  folder), with ' of NAME,' after 'file system' if given; '' for a device (/dev/full), gs://
  or what cannot be asked."""
  text = os.fsdecode(path)
  if '://' in text:
    return ''
  existing = os.path.abspath(text)
  try:
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    if not (os.path.isfile(existing) or os.path.isdir(existing)):
      return ''  # A device or a pipe: its file system's space is not what it ran out of.
    free = shutil.disk_usage(existing).free
  except OSError:
    return ''
  mount = existing
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  of = f' of {name},' if name else ''
  return f' ({_size(free)} free on the file system{of} at {mount})'


def _size(num_bytes: int) -> str:
  if num_bytes >= 10**10:
    return f'{num_bytes / 10**9:.1f} GB'
  return f'{num_bytes / 10**6:.1f} MB'


def one_line(error: BaseException) -> str:
  """A library's error message on one line (for a UserInputError that quotes it)."""
  return ' '.join(str(error).split())


def is_integer(value: Any) -> bool:
  """A Python int that is not a bool (True would pass as 1)."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
  """A Python int or float that is not a bool."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_integer(name: str, value: Any) -> None:
  if not is_integer(value) or value <= 0:
    raise UserInputError(f'{name} must be a positive integer, got {value!r}')


def check_integer_at_least(name: str, value: Any, least: int) -> None:
  if not is_integer(value) or value < least:
    raise UserInputError(f'{name} must be an integer >= {least}, got {value!r}')


def check_fraction(name: str, value: Any) -> None:
  """A probability-like rate in [0, 1)."""
  if not is_number(value) or not 0.0 <= value < 1.0:
    raise UserInputError(f'{name} must be in [0, 1), got {value!r}')


def check_number_at_least(name: str, value: Any, least: float, *, strict: bool = False) -> None:
  """A number >= least (> least with strict); NaN never passes."""
  ok = is_number(value) and (value > least if strict else value >= least)
  if not ok:
    relation = '>' if strict else '>='
    what = 'a positive number' if strict and least == 0 else f'a number {relation} {least}'
    raise UserInputError(f'{name} must be {what}, got {value!r}')
