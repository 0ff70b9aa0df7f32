"""The process's standard streams, and how a command ends on their faults and on the disk's.

`cli.run` uses these so that every command ends such faults in one line (`errors.py` lists the
exit codes): a write the storage refused (a full disk, anywhere: a checkpoint, an averaged
checkpoint, an export, an output file, stdout) is `error: no space left on device writing PATH
(N.N MB free on the file system at MOUNT)` and exit 4 (`exit_storage_failed`), without the
tracebacks orbax's threads (`StorageFailureReportFilter`, `storage_failure_ends_the_process`)
and tensorstore's callbacks (`without_closed_loop_reports`) print on their way; stdout or stderr
a pipe whose reader has gone (`readers_pipe_is_gone`) ends quietly with 141; stdin or stdout
closed (`<&-`, `>&-`) is one line once it is read or written, and open the wrong way (`0>FILE`,
`1<FILE`) one line too (`standard_stream_problem`); stderr closed drops the messages (they never
go to stdout). `guard_standard_streams` sets the streams up for all this at start.

Where the command writes (for a failure the OS did not name) comes from its flags: the callers
pass it in, as `(what to name, path)` or None.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging as python_logging
import os
import select
import sys
from typing import Callable, NoReturn

from transformer_jax.common import errors
from transformer_jax.common.errors import UserInputError

# Where a command writes, as `errors.storage_failure_message` takes it: (what to name, path).
Destination = tuple[str, str]


def say(line: str) -> None:
  """A line on stderr, if there is anyone to read it."""
  with contextlib.suppress(OSError, ValueError):
    print(line, file=sys.stderr, flush=True)


def exit_now(code: int) -> NoReturn:
  """Exits at once with `code`, after flushing stdout and stderr where they still can be."""
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):  # A closed pipe or a full disk: nothing to add.
      stream.flush()
  os._exit(code)


def exit_storage_failed(failure: OSError, where: Destination | None) -> NoReturn:
  """One line for a write the storage refused (`where`: the command's output, for a failure
  that names no path), then exit 4 at once: Python's own exit would print the tracebacks of
  orbax's pending writes."""
  say(f'error: {errors.storage_failure_message(failure, where)}')
  exit_now(errors.EXIT_STORAGE_FAILED)


def exit_interrupted(interruption: KeyboardInterrupt) -> NoReturn:
  """One line (what `errors.Interrupted` says was stopped, else `interrupted`), then exit 130,
  or 143 for SIGTERM (`errors.EXIT_CODES`), at once: an interrupted command has nothing left to
  save, and Python's own exit would wait for every thread still running (grain's prefetching,
  orbax's pools), some of them blocked for good on a queue that nobody reads any more."""
  print(str(interruption) or 'interrupted', file=sys.stderr)
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):  # A closed pipe: there is nothing to say there.
      stream.flush()
  os._exit(errors.exit_code(interruption))


def readers_pipe_is_gone() -> bool:
  """Whether stdout or stderr is a pipe (or socket) whose reading end has been closed."""
  poller = select.poll()
  for descriptor in (1, 2):
    poller.register(descriptor, select.POLLOUT)
  return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


# Each standard stream closed when the command started (`<&-`): the file descriptor is given
# to /dev/null, opened the wrong way round so that using it fails (a file opened later would
# take the number: C libraries' log lines would then go into a checkpoint), and Python's
# stream stands in with one that says what happened.
_WRONG_WAY = {0: os.O_WRONLY, 1: os.O_RDONLY, 2: os.O_WRONLY}
_CLOSED_HINTS = {
  'stdin': 'give the input as a file (--input=FILE, or < FILE)',
  'stdout': 'send it to a file (> FILE, or --output=FILE where the command has it) or /dev/null',
}


def guard_standard_streams() -> None:
  """Sets up the standard streams as the module docstring says: closed ones stood in for, and
  stdout's failed writes naming where it goes. Calling it again changes nothing."""
  for descriptor, flags in _WRONG_WAY.items():
    try:
      os.fstat(descriptor)
    except OSError:
      occupant = os.open(os.devnull, flags)
      if occupant != descriptor:
        os.dup2(occupant, descriptor)
        os.close(occupant)
  if sys.stdin is None:
    sys.stdin = _ClosedStream('stdin')
  if sys.stdout is None:
    sys.stdout = _ClosedStream('stdout')
  elif not isinstance(sys.stdout, _NamingStdout):
    sys.stdout = _NamingStdout(sys.stdout)
  if sys.stderr is None:  # Nobody to tell: messages go nowhere, never into stdout.
    sys.stderr = open(os.devnull, 'w', encoding='utf-8')  # pylint: disable=consider-using-with


class _ClosedStream:
  """sys.stdin or sys.stdout of a command started with it closed: reading or writing it is a
  UserInputError (one line, exit 2); flushing it at exit is nothing."""

  def __init__(self, name: str):
    self.name = name

  def _closed(self, *args, **kwargs) -> NoReturn:
    del args, kwargs
    raise UserInputError(f'{self.name} is closed: {_CLOSED_HINTS[self.name]}')

  read = readline = readlines = write = writelines = __iter__ = __next__ = _closed
  closed, encoding = False, 'utf-8'

  @property
  def buffer(self) -> '_ClosedStream':
    return self

  def fileno(self) -> int:
    raise io.UnsupportedOperation(f'{self.name} is closed')

  def isatty(self) -> bool:
    return False

  def flush(self) -> None:
    pass


class _NamingStdout:
  """sys.stdout, with a failed write naming where stdout goes (`> /full/disk/out.txt`,
  /dev/full) as the OS does not: `errors.storage_failure_message` needs a path."""

  def __init__(self, stream):
    self._stream = stream

  def __getattr__(self, name):
    return getattr(self._stream, name)

  def write(self, text):
    with self._naming_failures():
      return self._stream.write(text)

  def writelines(self, lines):
    with self._naming_failures():
      return self._stream.writelines(lines)

  def flush(self):
    with self._naming_failures():
      return self._stream.flush()

  @contextlib.contextmanager
  def _naming_failures(self):
    try:
      yield
    except OSError as error:
      if error.filename is not None or error.errno not in errors.STORAGE_ERRNOS:
        raise
      try:
        target = os.readlink(f'/proc/self/fd/{self._stream.fileno()}')
      except (OSError, ValueError):
        target = ''
      name = target if target.startswith('/') else 'stdout'
      raise errors.StorageError(error.errno, error.strerror, name) from error


def standard_stream_problem(error: Exception) -> UserInputError | None:
  """A Bad file descriptor error from stdin or stdout open the wrong way (`0>FILE`, `1<FILE`),
  as one line."""
  if not isinstance(error, OSError) or error.errno != errno.EBADF:
    return None
  for descriptor, name, wrong_way, purpose in (
    (0, 'stdin', os.O_WRONLY, 'reading'),
    (1, 'stdout', os.O_RDONLY, 'writing'),
  ):
    with contextlib.suppress(OSError):
      if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE == wrong_way:
        return UserInputError(f'{name} is not open for {purpose}: {_CLOSED_HINTS[name]}')
  return None


def storage_failure_ends_the_process(hook, where_it_writes: Callable[[], Destination | None]):
  """threading.excepthook that ends the process as `exit_storage_failed` does when a thread of
  its own (one that nobody waits for, as TensorBoard's writer) dies of a failed write: one line,
  exit 4. `where_it_writes` is asked only then."""

  def hook_ending_the_process(arguments):
    failure = errors.storage_failure(arguments.exc_value) if arguments.exc_value else None
    if failure is None:
      hook(arguments)
      return
    exit_storage_failed(failure, where_it_writes())

  return hook_ending_the_process


def without_closed_loop_reports(hook):
  """sys.unraisablehook without tensorstore's reports of a write finishing after orbax closed
  the event loop that waited for it (one traceback per array, after a failed save)."""

  def hook_without_them(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
      return
    hook(unraisable)

  return hook_without_them


class StorageFailureReportFilter(python_logging.Filter):
  """Drops libraries' error records (with tracebacks) of a write the storage refused: orbax
  logs one from each thread of a failed save; the command then says it once, in one line."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    if record.levelno < python_logging.ERROR or 'transformer_jax' in record.pathname:
      return True
    failure = record.exc_info[1] if record.exc_info else None
    return failure is None or errors.storage_failure(failure) is None
