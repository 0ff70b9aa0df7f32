"""Files from outside, read within bounds: a Marian model's options (`special:model.yml`), an
OPUS-MT folder's decoder.yml, vocabularies (.yml, .json, .spm). They are whoever published the
model's, so each is a one-line `UserInputError` naming the file when it is not what it claims.

`read_bounded` reads only a regular file (a FIFO or /dev/zero would be read for ever) of at
most its cap. YAML can say far more than its bytes: an alias (`*a`) repeats its anchor's whole
subtree without copying it, so a dozen lines of nine aliases each are 9^12 leaves to anything
that walks the result (a comparison, repr, json.dumps), the "billion laughs"; a run of `[`
nests past Python's recursion limit. Marian writes neither anchors nor aliases and its options
nest two deep, so `events` refuses any anchor or alias and nesting deeper than MAX_DEPTH: what
is left is a tree no larger than its capped text.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

from transformer_jax.common.errors import UserInputError, one_line

# Caps in bytes. Marian's options are under 2 KB and a decoder.yml a few hundred bytes; the
# worst YAML of 64 KiB (one-character list items: 32k nodes) loads in 0.3 s and 11 MB.
MAX_OPTIONS_BYTES = 64 << 10
# The largest published vocabularies (250k pieces: mBART, NLLB) are about 5 MB as .yml or .spm.
# A .spm can cost 28 times its bytes to parse (an empty piece is 2 bytes): 450 MB at the cap.
MAX_VOCABULARY_BYTES = 16 << 20
# Marian's options nest two deep (a list in the map), a vocabulary one.
MAX_DEPTH = 16


def read_bounded(path: str, limit: int, what: str) -> bytes:
  """The bytes of the regular file `path`, a `what` (the error's words), if at most `limit`
  bytes; FileNotFoundError if there is none (callers say what was looked for)."""
  try:
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):  # Before open(): opening a FIFO blocks.
      raise UserInputError(f'{path}: not a regular file (a {what} is expected)')
    data = b''
    if info.st_size <= limit:
      with open(path, 'rb') as f:
        data = f.read(limit + 1)  # limit + 1: a file that grew meanwhile is refused as well.
  except FileNotFoundError:
    raise
  except OSError as error:
    raise UserInputError(f'{path}: cannot be read ({one_line(error)})') from None
  if info.st_size > limit or len(data) > limit:
    raise UserInputError(f'{path}: larger than {_size(limit)}, more than any {what}')
  return data


def decode(data: bytes, path: str) -> str:
  """UTF-8 text, or a one-line error naming the first bad byte."""
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as error:
    raise UserInputError(f'{path}: not UTF-8 text (byte {error.start})') from None


def _size(limit: int) -> str:
  return f'{limit >> 20} MiB' if limit >= 1 << 20 else f'{limit >> 10} KiB'


def _loader(kind: str):
  """libyaml's loader of that kind ('Base', 'Safe') where PyYAML was built with it."""
  import yaml

  return getattr(yaml, f'C{kind}Loader', None) or getattr(yaml, f'{kind}Loader')


def events(text: str, source: str) -> Iterator[Any]:
  """The parse events of `text` (yaml.parse, base loader) one at a time, so that a long file
  is never held as nodes; an anchor, an alias, nesting deeper than MAX_DEPTH or a syntax error
  is a UserInputError naming `source` and the line."""
  import yaml

  depth = 0
  try:
    for event in yaml.parse(text, Loader=_loader('Base')):
      where = f'{source}: line {event.start_mark.line + 1}'
      if isinstance(event, yaml.AliasEvent) or getattr(event, 'anchor', None) is not None:
        raise UserInputError(
          f'{where}: YAML anchors and aliases (&name, *name) are refused: they can repeat a '
          'subtree billions of times'
        )
      if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
        depth += 1
        if depth > MAX_DEPTH:
          raise UserInputError(f'{where}: nested deeper than {MAX_DEPTH} levels')
      elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
        depth -= 1
      yield event
  except yaml.YAMLError as error:
    raise UserInputError(f'{source}: not valid YAML ({one_line(error)})') from None


def load(text: str, source: str) -> Any:
  """The one document of `text` as plain Python (yaml.safe_load's types), once `events`
  accepts all of it; a value PyYAML cannot build (an integer of 5000 digits, a 13th month) is a
  UserInputError too."""
  import yaml

  for _ in events(text, source):
    pass
  try:
    return yaml.load(text, Loader=_loader('Safe'))
  except (yaml.YAMLError, ValueError, TypeError, OverflowError) as error:
    raise UserInputError(f'{source}: not valid YAML ({one_line(error)})') from None


def load_file(path: str, limit: int, what: str) -> Any:
  """`load` of the UTF-8 file `path`, a `what`, of at most `limit` bytes (`read_bounded`)."""
  return load(decode(read_bounded(path, limit, what), path), path)
