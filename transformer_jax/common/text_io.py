"""Plain-text files of sentences, one per line: reading them strictly, writing them whole.

The commands' inputs (`translate --input` or stdin, `evaluate --src/--ref`, the text files
`prepare_text_dataset` trains on) and outputs (translations, hypotheses) go through here, so line
endings, encodings and half-written files are handled the same way everywhere.

Reading: one policy (`decode_text` for a whole file or piped stdin, `decode_lines` for a
terminal's lines as they are typed; the StableHLO export's runner, which may not import this
package, keeps a copy that tests/text_policy_test.py holds to the same answers). What is not
UTF-8 text is refused, with one line naming the file (`--flag=FILE` or `FILE`) and, where it is
one line's fault, the 1-based line (`FILE line N: ...`):

* a compressed file or an archive, by its first bytes (gzip, bzip2, xz, zstd, lz4, zip, 7z),
  named with the command that gets its text ("gzip-compressed, not UTF-8 text; decompress it
  first (gunzip -c FILE | ...)");
* UTF-16 or UTF-32 text, by its byte order mark (FF FE, FE FF, FF FE 00 00, 00 00 FE FF),
  named with the iconv command that converts it;
* a NUL byte (binary data, or UTF-16 without a byte order mark): its line;
* bytes that are not UTF-8: the line, the byte and its offset in the file;
* a U+FEFF after the very start (files joined with `cat` keep each one's byte order mark): its
  line, since an invisible character would change what is translated or scored;
* CR-only (old Mac) line endings: a CR and no '\n' anywhere.

Handled, not refused: ONE UTF-8 byte order mark at the very start is dropped (a file of nothing
but one has no lines); a line ends at '\n' and loses the CRs before it (CRLF); a CR inside a
line stays part of it (some corpora carry stray ones; lines are counted by '\n' only); a last
line without '\n' is a line; an empty file has no lines. The one exception: `translate` from a
terminal (`decode_lines(replace_invalid=True)`) turns bytes that are not UTF-8 into U+FFFD, so
that a terminal whose locale is not UTF-8 does not end the session; files and piped stdin never.
The metrics drop a U+FEFF at the start of the first sentence given through the Python API
(`without_byte_order_mark`), so that a byte order mark never changes a score.

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
import re
import shlex
import stat
from typing import IO, Iterable, Iterator, Sequence

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


_BOM = '\ufeff'


def read_lines(path: str, flag: str | None = None) -> list[str]:
  """The lines of a text file (local or gs://; a pipe such as bash's `<(...)` is read once),
  under the reading policy of the module docstring; errors name `flag=path` (or `path`)."""
  check_readable_file(path, flag)
  data = paths.resolve(path, flag or 'path').read_bytes()
  return decode_text(data, f'{flag}={path}' if flag else str(path), path)


def decode_text(data: bytes, name: str, path: str | None = None) -> list[str]:
  """The lines of a whole text's bytes, without their line endings, under the reading policy
  of the module docstring. A refusal is a UserInputError of one line naming `name` (and the
  line); `path` (default: the word FILE) fills in the command its advice gives."""
  _check_is_text(data, name, path)
  # (line, order within a line, error): the first line's problem is refused, as `decode_lines`
  # would, reading line by line.
  problems = []
  nul = data.find(b'\x00')
  if nul >= 0:
    line = data.count(b'\n', 0, nul) + 1
    problems.append((line, 0, _nul_error(name, line)))
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    line = data.count(b'\n', 0, error.start) + 1
    problems.append((line, 1, _invalid_utf8_error(name, line, data[error.start], error.start)))
    text = data.decode('utf-8', errors='replace')  # Only to find the problems of earlier lines.
  text = text.removeprefix(_BOM)
  stray = text.find(_BOM)
  if stray >= 0:
    line = text.count('\n', 0, stray) + 1
    problems.append((line, 2, _stray_bom_error(name, line)))
  if '\r' in text and '\n' not in text:
    problems.append((1, 3, _cr_only_error(name)))
  if problems:
    raise min(problems, key=lambda problem: problem[:2])[2]
  if not text:
    return []
  lines = text.split('\n')
  if lines[-1] == '':
    lines.pop()  # The final newline ends the last line; it does not start a new one.
  return [line.rstrip('\r') for line in lines] if '\r' in text else lines


def decode_lines(
  stream: Iterable[bytes], name: str, *, replace_invalid: bool = False
) -> Iterator[str]:
  """`decode_text`'s policy one line at a time, each line decoded as soon as it is read (a
  terminal's typing). `replace_invalid`: bytes that are not UTF-8 become U+FFFD instead of an
  error (a terminal whose locale is not UTF-8 should not end the session)."""
  offset = 0
  for number, raw in enumerate(stream, 1):
    if number == 1:
      _check_is_text(raw, name, None)
    nul = raw.find(b'\x00')
    if nul >= 0:
      raise _nul_error(name, number)
    try:
      text = raw.decode('utf-8')
    except UnicodeDecodeError as error:
      if not replace_invalid:
        raise _invalid_utf8_error(name, number, raw[error.start], offset + error.start) from None
      text = raw.decode('utf-8', errors='replace')
    offset += len(raw)
    if number == 1:
      text = text.removeprefix(_BOM)
      if not text:
        return  # A byte order mark alone is an empty file, not one empty line.
    if _BOM in text:
      raise _stray_bom_error(name, number)
    if text.endswith('\n'):
      text = text[:-1]
    elif number == 1 and '\r' in text:  # No '\n' anywhere: the whole input is this line.
      raise _cr_only_error(name)
    yield text.rstrip('\r')


def without_byte_order_mark(sentences: Sequence[str]) -> list[str]:
  """`sentences` with one U+FEFF removed from the start of the first: where the byte order mark
  of a file read with `open(FILE, encoding='utf-8')` lands. The metrics call it, so that a BOM
  never changes a score."""
  sentences = list(sentences)
  if sentences and isinstance(sentences[0], str) and sentences[0].startswith(_BOM):
    sentences[0] = sentences[0][1:]
  return sentences


# What a file that is not UTF-8 text starts with: (bytes at offset 0, what the file is, the
# command that gets its text). bzip2's 'BZh' and a level digit are followed by a block's magic,
# or by the end-of-stream magic of an empty stream, so that text starting 'BZh9' is not refused.
_NOT_TEXT = (
  (b'\x1f\x8b', 'gzip-compressed', 'decompress it first (gunzip -c FILE | ...)'),
  (
    re.compile(b'BZh[1-9](?:1AY&SY|\x17rE8P\x90)'),
    'bzip2-compressed',
    'decompress it first (bunzip2 -c FILE | ...)',
  ),
  (b'\xfd7zXZ\x00', 'xz-compressed', 'decompress it first (xz -dc FILE | ...)'),
  (b'\x28\xb5\x2f\xfd', 'zstd-compressed', 'decompress it first (zstd -dc FILE | ...)'),
  (b'\x04\x22\x4d\x18', 'lz4-compressed', 'decompress it first (lz4 -dc FILE | ...)'),
  (
    re.compile(b'PK(?:\x03\x04|\x05\x06|\x07\x08)'),
    'a zip archive',
    'extract the text file from it first (unzip -p FILE | ...)',
  ),
  (
    b"7z\xbc\xaf'\x1c",
    'a 7z archive',
    'extract the text file from it first (7z x -so FILE | ...)',
  ),
  # UTF-32's marks first: UTF-32LE's starts with UTF-16LE's.
  (
    b'\xff\xfe\x00\x00',
    'UTF-32LE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8 FILE | ...)',
  ),
  (
    b'\x00\x00\xfe\xff',
    'UTF-32BE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8 FILE | ...)',
  ),
  (
    b'\xff\xfe',
    'UTF-16LE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE | ...)',
  ),
  (
    b'\xfe\xff',
    'UTF-16BE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE | ...)',
  ),
)


def _check_is_text(start: bytes, name: str, path: str | None) -> None:
  for magic, what, advice in _NOT_TEXT:
    if magic.match(start) if isinstance(magic, re.Pattern) else start.startswith(magic):
      advice = advice.replace('FILE', shlex.quote(path) if path else 'FILE')
      raise UserInputError(f'{name}: {what}, not UTF-8 text; {advice}')


def _nul_error(name: str, line: int) -> UserInputError:
  return UserInputError(
    f'{name} line {line}: NUL byte; this looks like a binary file, expected UTF-8 text with '
    'one sentence per line'
  )


def _invalid_utf8_error(name: str, line: int, byte: int, offset: int) -> UserInputError:
  return UserInputError(
    f'{name} line {line}: invalid UTF-8 (byte 0x{byte:02x} at offset {offset}); convert the '
    'file to UTF-8'
  )


def _stray_bom_error(name: str, line: int) -> UserInputError:
  return UserInputError(
    f'{name} line {line}: a byte order mark (U+FEFF) after the start of the text (files joined '
    'with cat keep theirs); only one, at the very start, is allowed: remove it'
  )


def _cr_only_error(name: str) -> UserInputError:
  return UserInputError(
    f'{name} line 1: the file uses CR-only (old Mac) line endings; convert them to \\n'
  )


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
  """`paths.write_output`, with a failure as one line: the disk's (full, read-only, failing) a
  StorageError naming `path` (exit status 4), any other (a pipe's reader gone) a
  UserInputError naming `flag`."""
  from transformer_jax.common.errors import STORAGE_ERRNOS, StorageError

  resolved = paths.resolve(path, flag)
  try:
    paths.write_output(resolved, data)
  except OSError as error:
    if error.errno in STORAGE_ERRNOS:
      raise StorageError(error.errno, error.strerror, os.fspath(resolved)) from None
    raise UserInputError(f'{flag}={path}: cannot write it ({_reason(error)})') from None
