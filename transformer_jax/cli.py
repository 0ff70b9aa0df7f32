"""What every command shares: the runner that maps exceptions to exit codes, the `--config`
flag, and parsing of flag values that several commands take.

Commands (`train.py`, `python -m transformer_jax.X`) are thin: they define flags and call
`run(main)`, whose `main` makes one library call. Library modules never import commands, and
only this module and the commands touch absl flags.

`run` also ends every command's faults of the disk and of its standard streams in one line
(`errors.py` lists the exit codes): a write the storage refused (a full disk, anywhere: a
checkpoint, an averaged checkpoint, an export, an output file, stdout) is `error: no space left
on device writing PATH (N.N MB free on the file system at MOUNT)` and exit 4, without the
tracebacks orbax's threads and tensorstore's callbacks print on their way; stdout or stderr a
pipe whose reader has gone ends quietly with 141; stdin or stdout closed (`<&-`, `>&-`) is one
line once it is read or written; stderr closed drops the messages (they never go to stdout).
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
import threading
from typing import Callable, NoReturn

import ml_collections
from absl import app, logging
from absl import flags as absl_flags
from ml_collections import config_flags

from transformer_jax.common import errors
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import quiet_library_logs

# The flags this module defines for the commands (`define_*_flag`) belong to the command that
# asks for them, so that its --help lists them: absl then skips this module as their definer.
absl_flags.disclaim_key_flags()

# What ml_collections raises for a bad `--config.field=value` (a misspelt field, a value of the
# wrong type) and, deferred to the first access of the flag, for a config file it cannot load.
_CONFIG_FLAG_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)


def exit_with_error(message: str, code: int = errors.EXIT_USER_ERROR) -> NoReturn:
  _say(f'error: {message}')
  sys.exit(code)


def run(main: Callable[[list[str]], None], *, config_flag: bool = False) -> None:
  """`absl.app.run(main)` with the project's errors as `error: <message>` and exit codes.

  `errors.EXIT_CODES` says which exception gives which status (2: the user's mistake, 3: a
  run stopped on NaN/Inf, 4: the disk failed a write); anything else is a bug and keeps its
  traceback. With `config_flag`, bad `--config` files and fields are one-line errors too (see
  `define_config_flag`). The standard streams' faults: see the module docstring.
  """
  _guard_standard_streams()
  sys.unraisablehook = _without_closed_loop_reports(sys.unraisablehook)
  threading.excepthook = _storage_failure_ends_the_command(threading.excepthook)

  def main_with_exit_codes(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    quiet_library_logs()
    logging.get_absl_handler().addFilter(_WithoutStorageFailureReports())
    try:
      main(argv)
      sys.stdout.flush()  # Now, not at exit, so that its failure is reported as any other.
    except Exception as error:  # pylint: disable=broad-except
      _exit_for(error)
      raise  # A bug: its traceback.

  try:
    app.run(main_with_exit_codes, flags_parser=parse_flags if config_flag else _parse_plain)
  except KeyboardInterrupt as interruption:  # Ctrl-C is no bug: no traceback.
    exit_interrupted(interruption)
  except SystemExit:
    try:  # What absl printed (--help) before Python's exit flushes it and reports a failure.
      sys.stdout.flush()
    except BrokenPipeError:
      _exit_now(errors.EXIT_BROKEN_PIPE)
    except Exception:  # pylint: disable=broad-except  # Its exit status is said already.
      pass
    raise
  except Exception as error:  # pylint: disable=broad-except  # Printing --help, before main.
    _exit_for(error)
    raise


def _exit_for(error: Exception) -> None:
  """Ends the command for an exception from its `main` as `run` says; returns for a bug."""
  if isinstance(error, BrokenPipeError) and _a_readers_pipe_is_gone():
    _exit_now(errors.EXIT_BROKEN_PIPE)  # As SIGPIPE would: nothing to say, and nobody to read it.
  code = errors.exit_code(error)
  if code == errors.EXIT_STORAGE_FAILED:
    failure = errors.storage_failure(error)
    _say(f'error: {errors.storage_failure_message(failure, _where_the_command_writes())}')
    # At once: Python's own exit would print the tracebacks of orbax's pending writes.
    _exit_now(code)
  if code is None:
    problem = _standard_stream_problem(error)
    if problem is None:
      return
    code, error = errors.EXIT_USER_ERROR, problem
  exit_with_error(str(error), code)


# The flags naming where commands write, most specific first (for a failure the OS did not name).
_OUTPUT_FLAGS = ('out', 'output', 'workdir', 'data_dir')


def _where_the_command_writes() -> tuple[str, str] | None:
  for name in _OUTPUT_FLAGS:
    with contextlib.suppress(AttributeError, absl_flags.Error):
      value = getattr(absl_flags.FLAGS, name)
      if isinstance(value, str) and value:
        return f'--{name}={value}', value
  return None


def _storage_failure_ends_the_command(hook):
  """threading.excepthook that ends the command as `run` does when a thread of its own (one
  that nobody waits for, as TensorBoard's writer) dies of a failed write: one line, exit 4."""

  def hook_ending_the_command(arguments):
    failure = errors.storage_failure(arguments.exc_value) if arguments.exc_value else None
    if failure is None:
      hook(arguments)
      return
    _say(f'error: {errors.storage_failure_message(failure, _where_the_command_writes())}')
    _exit_now(errors.EXIT_STORAGE_FAILED)

  return hook_ending_the_command


def _say(line: str) -> None:
  """A line on stderr, if there is anyone to read it."""
  with contextlib.suppress(OSError, ValueError):
    print(line, file=sys.stderr, flush=True)


def _exit_now(code: int) -> NoReturn:
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):  # A closed pipe or a full disk: nothing to add.
      stream.flush()
  os._exit(code)


def _a_readers_pipe_is_gone() -> bool:
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


def _guard_standard_streams() -> None:
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


def _standard_stream_problem(error: Exception) -> UserInputError | None:
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


def _without_closed_loop_reports(hook):
  """sys.unraisablehook without tensorstore's reports of a write finishing after orbax closed
  the event loop that waited for it (one traceback per array, after a failed save)."""

  def hook_without_them(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
      return
    hook(unraisable)

  return hook_without_them


class _WithoutStorageFailureReports(python_logging.Filter):
  """Drops libraries' error records (with tracebacks) of a write the storage refused: orbax
  logs one from each thread of a failed save; `run` then says it once, in one line."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    if record.levelno < python_logging.ERROR or 'transformer_jax' in record.pathname:
      return True
    failure = record.exc_info[1] if record.exc_info else None
    return failure is None or errors.storage_failure(failure) is None


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


_HELP_FLAGS = ('--help', '-h', '-?', '--helpshort', '--helpfull', '--helpxml')


def _help_exits_zero(parse: Callable[[list[str]], list[str]], argv: list[str]) -> list[str]:
  """absl exits 1 after printing --help; asking for help is not an error."""
  try:
    return parse(argv)
  except SystemExit as exit_:
    if exit_.code == 1 and any(arg.split('=')[0] in _HELP_FLAGS for arg in argv[1:]):
      sys.exit(0)
    raise


def _parse_or_exit_2(argv: list[str]) -> list[str]:
  """absl's parsing, with a bad flag (an unknown name, a missing required flag, a value of the
  wrong type) as one `error:` line and status 2: absl prints 'FATAL Flags parsing error' and
  exits 1, the status of a bug."""
  try:
    return absl_flags.FLAGS(argv)
  except absl_flags.Error as error:
    message = ' '.join(line.strip() for line in str(error).splitlines() if line.strip())
    exit_with_error(f'{message} (--helpfull lists every flag)')


def _parse_plain(argv: list[str]) -> list[str]:
  return _help_exits_zero(_parse_or_exit_2, argv)


def define_beam_rule_flag() -> None:
  """--beam_rule, for the commands that decode (translate, evaluate): decode.BEAM_RULES."""
  from transformer_jax.search import decode  # jax: only for the commands that decode.

  absl_flags.DEFINE_enum(
    'beam_rule',
    'exact',
    list(decode.BEAM_RULES),
    "How beam search ends hypotheses and stops: 'exact' (until no beam can beat the finished "
    "ones) or 'ctranslate2' (CTranslate2's; with --alpha=0 its outputs exactly).",
  )


_WORKDIR_HELP = 'Training workdir (config.json, vocab.model, checkpoints).'


def define_workdir_flag(help_text: str = _WORKDIR_HELP, default: str | None = None) -> None:
  """--workdir, the folder of one training run (every command that reads or writes one)."""
  absl_flags.DEFINE_string('workdir', default, help_text)


def define_checkpoint_flag() -> None:
  """--checkpoint, which parameters of a workdir to use (read with `checkpoint_flag_value`)."""
  absl_flags.DEFINE_string(
    'checkpoint',
    None,
    "Step number, 'averaged' or 'latest' (default: the averaged checkpoint if current, else "
    'the latest).',
  )


def define_config_flag(default: str, help_text: str, lock_config: bool = True) -> None:
  """`--config=FILE` (`get_config()` returning a ConfigDict) with `--config.field=value`.

  ml_collections applies the overrides as soon as a file is loaded (the default file: while
  the flag is defined) and reports a misspelt field or a missing file as a traceback; here they
  are one line and exit status 2. Commands then call `run(main, config_flag=True)` and read the
  config with `loaded_config()`.
  """
  try:
    config_flags.DEFINE_config_file('config', default, help_text, lock_config=lock_config)
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the config errors above as one line (for `app.run`)."""
  try:
    return _help_exits_zero(_parse_or_exit_2, argv)
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


def loaded_config(flag_values) -> ml_collections.ConfigDict:
  """The `--config` flag's ConfigDict, or a one-line error if its file did not load."""
  try:
    config = flag_values.config
    config.keys()  # A file that did not load is a stand-in that raises on first use.
    return config
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


def config_flag_message(error: BaseException) -> str:
  """One line for ml_collections' multi-line config-flag errors."""
  if isinstance(error, SyntaxError):
    return f'--config: {error}'  # Names the file and line.
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]  # AttributeError(KeyError("'name'\nDid you mean ...?"))
  text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()] or [repr(error)]
  if isinstance(error, KeyError):
    hint = f' ({lines[1]})' if len(lines) > 1 else ''
    return f'--config.*: the config has no field {lines[0]}{hint}'
  if isinstance(error, OSError):
    # "Failed loading config file ...", "Attempted [...]:", the path, then the cause.
    return f'--config: {lines[-1]}'
  return f'--config: {" ".join(lines)}'


def checkpoint_flag_value(value: str | None) -> int | str | None:
  """--checkpoint: a step number, 'averaged' or 'latest' (None: the default choice)."""
  if value is None or value in ('averaged', 'latest'):
    return value
  try:
    return int(value)
  except ValueError:
    raise UserInputError(
      f"--checkpoint must be a step number, 'averaged' or 'latest', got {value!r}"
    ) from None
