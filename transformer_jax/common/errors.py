"""The project's exceptions, the exit codes commands give them, and the type checks they use.

A mistake in what the user gave (a config value, a flag, a file) is a `UserInputError`: one line
naming the field, file or line, no traceback. `cli.run` turns each exception below into
`error: <message>` on stderr (an interruption: its message alone, or `interrupted`) and the exit
status in `EXIT_CODES`:

  0    success (also a run stopped by SIGTERM/SIGINT after saving its checkpoint)
  1    a bug: an unexpected exception, with its traceback
  2    user error: bad config, flag or input file; a missing or damaged workdir or checkpoint
  3    training stopped because the loss or gradients stayed NaN/Inf
  130  stopped by Ctrl-C (SIGINT) with nothing to save: training during start-up (before its
       first step), or any other command; 143 (128 + 15) for SIGTERM. One line, no traceback.
"""

from __future__ import annotations

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


EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
# 128 + the signal's number, as a shell reports a command that a signal ended: 130 for Ctrl-C.
EXIT_INTERRUPTED = 128 + signal.SIGINT

# Exception type -> exit status of a command (first match wins).
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
  (UserInputError, EXIT_USER_ERROR),
  (FileNotFoundError, EXIT_USER_ERROR),
  (CorruptCheckpointError, EXIT_USER_ERROR),
  (NonFiniteError, EXIT_NONFINITE),
  (KeyboardInterrupt, EXIT_INTERRUPTED),
)


def exit_code(error: BaseException) -> int | None:
  """The documented exit status for `error`, or None for an unexpected exception (a bug)."""
  if isinstance(error, Interrupted):
    return 128 + error.signum  # 143 for SIGTERM
  for error_type, code in EXIT_CODES:
    if isinstance(error, error_type):
      return code
  return None


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
