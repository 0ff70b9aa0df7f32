"""Plain-text files of sentences, one per line: reading them strictly, writing them whole.

The commands' inputs (`translate --input`, `evaluate --src/--ref`) and outputs (translations,
hypotheses) go through here, so line endings, encodings and half-written files are handled the
same way everywhere.

Every path is checked before any work (before a checkpoint is restored or a sentence decoded),
so a typo or a permission problem costs seconds, not a test set's translations, and is one line
naming the flag and the path:

* inputs (`check_readable_file`): exist, are not a folder, and can be opened for reading;
* outputs (`check_writable_output`): not a folder; an existing file must be writable, and a new
  one's folder must exist (an explicit output flag never creates folders: a typo in one would
  quietly make a tree somewhere) and accept new files. The default hypotheses file of
  `evaluate` is the exception: its folders inside the workdir are made as needed, so the
  nearest existing one must accept new folders.

"Writable" is asked of the file system twice: `os.access`, then a real attempt (opening the file
for appending without writing anything, creating and removing an empty file in the folder),
because `os.access` answers from the caller's powers, and root's are not always honoured (NFS
with root_squash, say). gs:// paths are only checked for their scheme.

Outputs are then written by `paths.write_output`: a symlink keeps being a link to a file now
holding the new lines, a named pipe or /dev/stdout (or bash's `>(gzip > out.gz)`) is written in
place, and a regular file is replaced whole, never half-written.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import IO, Sequence

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError


def check_readable_file(path: str, flag: str | None = None) -> None:
  """A one-line error unless `path` exists, is not a directory and can be read (pipes are fine:
  `--src=<(sacrebleu -t wmt14 ... --echo src)`); local or gs://."""
  name = f'{flag}={path}' if flag else str(path)
  resolved = paths.resolve(path, flag or 'path')
  if paths.is_gcs(resolved):
    if not resolved.exists():
      raise FileNotFoundError(f'{name}: no such file')
    if resolved.is_dir():
      raise UserInputError(f'{name}: is a directory, not a text file')
    return
  try:
    mode = os.stat(resolved).st_mode
  except FileNotFoundError:
    raise FileNotFoundError(f'{name}: no such file') from None
  except OSError as error:  # A folder on the way that may not be entered, a symlink loop.
    raise UserInputError(f'{name}: cannot read it ({_reason(error)})') from None
  if stat.S_ISDIR(mode):
    raise UserInputError(f'{name}: is a directory, not a text file')
  if not os.access(resolved, os.R_OK):
    raise UserInputError(f'{name}: cannot read it ({os.strerror(errno.EACCES)})')
  if stat.S_ISREG(mode):  # Not a pipe: opening one would take its writer's place.
    try:
      os.close(os.open(resolved, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as error:
      raise UserInputError(f'{name}: cannot read it ({_reason(error)})') from None


def check_writable_output(
  path: str | os.PathLike, flag: str, *, make_folders: bool = False
) -> None:
  """A one-line error naming `flag` and `path` unless the command can write its output there
  (see the module docstring): call it before any work. `make_folders`: the path is a default
  inside the workdir, whose missing folders `write_output` creates."""
  name = f'{flag}={path}' if not make_folders else f'{flag} (default {path})'
  resolved = paths.resolve(path, flag)
  if paths.is_gcs(resolved):
    return
  try:
    destination, descriptor = paths.output_destination(resolved)
  except OSError as error:
    raise UserInputError(f'{name}: {_reason(error)}') from None
  if descriptor is not None:
    try:
      access = fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
      raise UserInputError(f'{name}: file descriptor {descriptor} is not open') from None
    if access == os.O_RDONLY:
      raise UserInputError(f'{name}: file descriptor {descriptor} is open for reading only')
    return
  try:
    mode = os.stat(destination).st_mode
  except (FileNotFoundError, NotADirectoryError):
    mode = None
  except OSError as error:
    raise UserInputError(f'{name}: {_reason(error)}') from None
  if mode is None:
    _check_new_file_folder(os.path.dirname(destination), name, make_folders)
  elif stat.S_ISDIR(mode):
    raise UserInputError(f'{name}: is a directory; name a file to write')
  elif stat.S_ISSOCK(mode):
    raise UserInputError(f'{name}: is a socket, not a file')
  elif not os.access(destination, os.W_OK):
    raise UserInputError(f'{name}: cannot write to it ({os.strerror(errno.EACCES)})')
  elif stat.S_ISREG(mode):
    try:  # Appending nothing changes nothing, but fails where writing would.
      os.close(os.open(destination, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC))
    except OSError as error:
      raise UserInputError(f'{name}: cannot write to it ({_reason(error)})') from None
    # Replaced whole: a new file is written next to it, then renamed over it.
    _check_can_create_files(os.path.dirname(destination), name, ' to replace it whole')
  # A named pipe or a device is written in place: being writable is all it needs.


def _check_new_file_folder(folder: str, name: str, make_folders: bool) -> None:
  existing = folder
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UserInputError(f'{name}: {existing} is not a folder')
  if existing != folder and not make_folders:
    raise UserInputError(f'{name}: folder {folder} does not exist (create it first)')
  _check_can_create_files(existing, name)


def _check_can_create_files(folder: str, name: str, purpose: str = '') -> None:
  if not os.access(folder, os.W_OK | os.X_OK):
    reason = os.strerror(errno.EACCES)
    raise UserInputError(f'{name}: cannot create files in {folder}{purpose} ({reason})')
  probe = os.path.join(folder, f'.write-check.{os.getpid()}.{os.urandom(4).hex()}.tmp')
  try:
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
  except OSError as error:
    reason = _reason(error)
    raise UserInputError(f'{name}: cannot create files in {folder}{purpose} ({reason})') from None
  os.unlink(probe)


def _reason(error: OSError) -> str:
  return error.strerror or str(error)


def read_lines(path: str, flag: str | None = None) -> list[str]:
  """Lines of a UTF-8 text file (local or gs://) without their line endings (CRLF too)."""
  check_readable_file(path, flag)
  data = paths.resolve(path, flag or 'path').read_bytes()
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    line = data[: error.start].count(b'\n') + 1
    raise UserInputError(f'{path}:{line}: not valid UTF-8') from None
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()  # The final newline ends the last line; it does not start a new one.
  return [line.rstrip('\r') for line in lines]


def decode_line(raw: bytes) -> str:
  """One line read in binary: bytes that are not UTF-8 become U+FFFD instead of an error."""
  return raw.decode('utf-8', errors='replace').rstrip('\r\n')


def write_lines(
  lines: Sequence[str],
  path: str | os.PathLike | None,
  stdout: IO[str] | None = None,
  flag: str = '--output',
) -> None:
  """Writes one line per item (a newline inside an item becomes a space, so line N stays item
  N) to `path` (local or gs://; see `paths.write_output`: a regular file is replaced only once
  complete, a symlink, a named pipe or /dev/stdout is not replaced), or to `stdout` when `path`
  is None."""
  text = ''.join(line.replace('\n', ' ') + '\n' for line in lines)
  if path is None:
    stdout.write(text)
    stdout.flush()
    return
  write_output(path, text, flag)


def write_output(path: str | os.PathLike, data: bytes | str, flag: str) -> None:
  """`paths.write_output`, with a failure (a full disk, a pipe's reader gone) as one line."""
  resolved = paths.resolve(path, flag)
  try:
    paths.write_output(resolved, data)
  except OSError as error:
    raise UserInputError(f'{flag}={path}: cannot write it ({_reason(error)})') from None
