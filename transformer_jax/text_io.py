"""Plain-text files of sentences, one per line: reading them strictly, writing them whole.

The commands' inputs (`translate --input`, `evaluate --src/--ref`) and outputs (translations,
hypotheses) go through here, so line endings, encodings and half-written files are handled the
same way everywhere.
"""

from __future__ import annotations

import os
from typing import IO, Sequence

from transformer_jax import paths
from transformer_jax.errors import UserInputError


def check_readable_file(path: str, flag: str | None = None) -> None:
  """A one-line error unless `path` exists and is not a directory (pipes are fine:
  `--src=<(sacrebleu -t wmt14 ... --echo src)`); local or gs://."""
  name = f'{flag}={path}' if flag else str(path)
  resolved = paths.resolve(path, flag or 'path')
  if not resolved.exists():
    raise FileNotFoundError(f'{name}: no such file')
  if resolved.is_dir():
    raise UserInputError(f'{name}: is a directory, not a text file')


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
  lines: Sequence[str], path: str | os.PathLike | None, stdout: IO[str] | None = None
) -> None:
  """Writes one line per item (a newline inside an item becomes a space, so line N stays item
  N) to `path` (local or gs://), replacing it only once complete, or to `stdout` when `path`
  is None."""
  text = ''.join(line.replace('\n', ' ') + '\n' for line in lines)
  if path is None:
    stdout.write(text)
    stdout.flush()
    return
  paths.write_atomically(paths.resolve(path, '--output'), text)
