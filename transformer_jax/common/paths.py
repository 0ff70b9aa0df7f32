"""Every path the project is given goes through here: local paths and `gs://` Cloud Storage.

`resolve(value, flag)` turns what the user typed into an `etils.epath.Path`: a local path made
absolute (so a later `chdir` cannot move it), or a `gs://bucket/...` path kept remote, never
turned into a local folder named `gs:`. Any other scheme (`s3://`, `http://`, ...) is a
one-line error naming the flag. `gs://` goes through fsspec's `gcsfs` (the `[gcs]` extra);
orbax and tensorstore write checkpoints there themselves.

`write_atomically` gives one write semantics on both: a reader never sees a half-written file
(locally: a temporary file fsynced and renamed into place, `replace.replace_file`; on GCS an
object appears only once its upload completes). `staged_folder` replaces a local folder whole
(`replace.staged_folder`: never fewer than one complete copy, whatever instant a crash hits).
`write_output` is that for a command's output flag, without damaging what the path is: a
symlink is written through (its target replaced whole, the link kept), and a named pipe, a
terminal, `/dev/stdout` or bash's `>(gzip > out.gz)` (`/dev/fd/63`) is written in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import os
import re
import shutil
import stat
import sys

from etils import epath

from transformer_jax.common import replace
from transformer_jax.common.errors import UserInputError

Path = epath.Path
GCS_PREFIX = 'gs://'
_SCHEME = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')


def is_gcs(path: str | os.PathLike) -> bool:
  return os.fspath(path).startswith(GCS_PREFIX)


def resolve(value: str | os.PathLike, flag: str) -> epath.Path:
  """`value` as a Path: local ones absolute, `gs://` ones remote; others a one-line error."""
  if value is not None and not isinstance(value, (str, os.PathLike)):
    raise UserInputError(f'{flag} must be a path, got {type(value).__name__} {value!r}')
  text = os.fspath(value) if value is not None else ''
  if not text:
    raise UserInputError(f'{flag} is empty: name a directory or file')
  scheme = _SCHEME.match(text)
  if scheme and text.startswith(GCS_PREFIX):
    if len(text) == len(GCS_PREFIX) or text[len(GCS_PREFIX)] == '/':
      raise UserInputError(f'{flag}={text}: name a bucket, as in gs://BUCKET/path')
    check_gcs_support(flag, text)
    return epath.Path(text)
  if scheme:
    raise UserInputError(
      f'{flag}={text}: {scheme.group(1)}:// paths are not supported; use a local path or '
      'gs://BUCKET/...'
    )
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def check_gcs_support(flag: str, text: str) -> None:
  """gs:// without TensorFlow needs gcsfs; say how to get it instead of a deep ImportError."""
  if importlib.util.find_spec('gcsfs') is None and importlib.util.find_spec('tensorflow') is None:
    raise UserInputError(
      f"{flag}={text}: gs:// paths need Cloud Storage support: pip install -e '.[gcs]'"
    )
  if importlib.util.find_spec('fsspec') is not None:
    import fsspec.config  # pylint: disable=g-import-not-at-top

    # gcsfs caches folder listings per process: a checkpoint or lock written by tensorstore,
    # google-cloud-storage or another process would stay invisible to exists() and listdir.
    for protocol in ('gcs', 'gs'):
      fsspec.config.conf.setdefault(protocol, {}).setdefault('use_listings_cache', False)


def write_atomically(path: epath.Path, data: bytes | str) -> None:
  """Writes `path` whole or not at all, and durably (see the module docstring)."""
  path = epath.Path(path)
  if is_gcs(path):
    with path.open('wb' if isinstance(data, bytes) else 'w') as f:  # Appears once uploaded.
      f.write(data)
    return
  replace.replace_file(os.fspath(path), data.encode('utf-8') if isinstance(data, str) else data)


# A hidden sibling folder to fill, which then replaces a local folder whole (replace.py).
staged_folder = replace.staged_folder


def file_sha256(path: str | os.PathLike) -> str:
  """SHA-256 (hex) of a file's bytes, read 1 MiB at a time."""
  digest = hashlib.sha256()
  with epath.Path(path).open('rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


_STANDARD_STREAMS = {'/dev/stdin': 0, '/dev/stdout': 1, '/dev/stderr': 2}
_MAX_SYMLINKS = 40  # Linux's limit on links followed in one path.


def output_destination(path: str | os.PathLike) -> tuple[str, int | None]:
  """Where writing to the local `path` lands: `(final path, None)` after following symlinks (a
  chain of them too, or one whose target does not exist yet), or `(path, N)` for file
  descriptor N of this process, named as /dev/stdout, /dev/stderr, /dev/fd/N or
  /proc/self/fd/N (bash's process substitution `>(...)` passes /dev/fd/N). OSError (ELOOP,
  EACCES) when the links cannot be followed."""
  current = os.path.abspath(os.fspath(path))
  for _ in range(_MAX_SYMLINKS):
    descriptor = _file_descriptor(current)
    if descriptor is not None:
      return current, descriptor
    try:
      target = os.readlink(current)
    except OSError as error:
      if error.errno in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
        return current, None  # Not a link, or nothing there yet.
      raise
    # A relative target is relative to the link's real folder ('..' included).
    current = os.path.join(os.path.realpath(os.path.dirname(current)), target)
  raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))


def _file_descriptor(path: str) -> int | None:
  if path in _STANDARD_STREAMS:
    return _STANDARD_STREAMS[path]
  match = re.fullmatch(r'/(?:dev/fd|proc/(?:self|(\d+))/fd)/(\d+)', os.path.normpath(path))
  if match and match.group(1) in (None, str(os.getpid())):
    return int(match.group(2))
  return None


def write_output(path: str | os.PathLike, data: bytes | str) -> None:
  """Writes a command's output file (str as UTF-8) without damaging what `path` is.

  gs://: as `write_atomically`. A file descriptor (`output_destination`: /dev/stdout,
  /dev/fd/N) is written through a duplicate of it, at its current position, so a shell's
  `>>` still appends. A named pipe or a device (a terminal, /dev/null) is opened and written
  in place: no temporary file, nothing replaced. A regular file or a new path, also at the end
  of a symlink chain (the links are kept), is replaced whole: a temporary file in the same
  folder, with the old file's permission bits, renamed over it, and removed if anything fails.
  """
  if is_gcs(path):
    write_atomically(epath.Path(path), data)
    return
  data = data.encode('utf-8') if isinstance(data, str) else data
  destination, descriptor = output_destination(path)
  if descriptor is not None:
    for stream in (sys.stdout, sys.stderr):  # Keep the order of what was printed before.
      with contextlib.suppress(Exception):
        stream.flush()
    with os.fdopen(os.dup(descriptor), 'wb') as f:
      f.write(data)
    return
  try:
    mode = os.stat(destination).st_mode
  except FileNotFoundError:
    mode = None
  if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
    with open(destination, 'wb') as f:  # A named pipe's reader gets the lines as written.
      f.write(data)
    return
  replace.replace_file(destination, data, None if mode is None else stat.S_IMODE(mode))


def local_or_remote(value: str | os.PathLike) -> epath.Path:
  """A path given by code rather than a user: local ones made absolute, remote ones kept."""
  text = os.fspath(value)
  return epath.Path(text) if _SCHEME.match(text) else epath.Path(os.path.abspath(text))


def move(source: epath.Path, destination: epath.Path) -> None:
  """Moves a file or folder tree; on GCS object by object (copy, then delete)."""
  source, destination = epath.Path(source), epath.Path(destination)
  if is_gcs(source):
    import fsspec  # pylint: disable=g-import-not-at-top

    fsspec.filesystem('gcs').mv(os.fspath(source), os.fspath(destination), recursive=True)
    return
  destination.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(os.fspath(source), os.fspath(destination))


# --- Outputs kept apart from inputs and runs ------------------------------------------------

# Left in every folder an export command writes, so that `--force` may replace that folder
# later: a folder without it (a workdir, a home folder, someone's data) is never deleted.
EXPORT_MARKER = '.transformer_jax-export'
_MAX_FILES_COMPARED = 100_000  # A hard-linked output is compared with a run's files, at most.


def check_outputs_apart(
  outputs: dict[str, str | os.PathLike | None],
  inputs: dict[str, str | os.PathLike | None] | None = None,
  runs: dict[str, str | os.PathLike | None] | None = None,
  *,
  run_outputs: tuple[str | os.PathLike, ...] = (),
) -> None:
  """A one-line error unless each output path is apart from every input and every run folder.

  outputs: flag -> a file or folder the command writes; inputs: flag -> a file or folder it
  reads; runs: flag -> a workdir it reads (a run's files, which no output may replace).
  run_outputs: places inside a run the command writes by design (its default hypotheses
  folder, the server's export folder), allowed to lie inside the run.
  Call it before any work. `None` entries (an unset flag, stdin/stdout) are skipped.

  An output clashes with an input when both are the same file after resolving links, the same
  inode (a hard link, or a descriptor such as /dev/stdout redirected to the input), or when
  one is a folder that holds the other. It clashes with a run when it is the run's folder,
  holds it, or lies inside it (outside `run_outputs`), or is a hard link to a file in it.
  Devices (/dev/null) and pipes clash with nothing: writing them replaces no file.
  """
  reads = [(flag, _Place(value)) for flag, value in (inputs or {}).items() if value is not None]
  held = [(flag, _Place(value)) for flag, value in (runs or {}).items() if value is not None]
  allowed = [_Place(value) for value in run_outputs]
  for out_flag, out_value in outputs.items():
    if out_value is None:
      continue
    out = _Place(out_value)
    if out.is_stream:
      continue
    named = f'{out_flag}={os.fspath(out_value)}'
    for in_flag, source in reads:
      relation = _relation(out, source, hard_links_below=False)
      if relation:
        raise UserInputError(
          f'{named} {relation} {in_flag}={os.fspath(source.given)}: the command would write '
          'over what it reads; write the output elsewhere'
        )
    for run_flag, run in held:
      if any(out.key == place.key or out.lies_inside(place) for place in allowed):
        continue
      relation = _relation(out, run, hard_links_below=True)
      if relation:
        raise UserInputError(
          f'{named} {relation} {run_flag}={os.fspath(run.given)}, a run this command reads: '
          'writing there would damage it; write the output elsewhere'
        )


def check_replaceable_folder(directory: str | os.PathLike, flag: str, force: bool) -> None:
  """A one-line error unless the export folder `directory` may be written: new, or (with
  `force`) an empty folder or one an earlier export wrote (it holds `EXPORT_MARKER`).
  Anything else, such as a workdir, a folder holding one or someone's files, is never
  replaced, even with --force."""
  directory = os.fspath(directory)
  named = f'{flag}={directory}'
  if not os.path.lexists(directory):
    return
  if not os.path.isdir(directory):
    raise UserInputError(f'{named} is a file, not a folder')
  if os.listdir(directory) and not os.path.isfile(os.path.join(directory, EXPORT_MARKER)):
    raise UserInputError(
      f'{named} exists and was not written by an export (it has no {EXPORT_MARKER} file), '
      'so it is never replaced, even with --force; give a new folder'
    )
  if not force:
    raise UserInputError(f'{named} is already there (pass --force to replace it)')


def mark_export_folder(directory: str | os.PathLike) -> None:
  """Leaves `EXPORT_MARKER` in a folder an export writes (see `check_replaceable_folder`)."""
  with open(os.path.join(os.fspath(directory), EXPORT_MARKER), 'w', encoding='utf-8') as f:
    f.write('Written by a transformer_jax export; `--force` may replace this folder.\n')


class _Place:
  """A path as the file system sees it: its real location and, if it exists, its inode."""

  def __init__(self, value: str | os.PathLike):
    self.given = value
    text = os.fspath(value)
    self.remote = is_gcs(text)
    self.is_stream = False
    self.stat = None
    if self.remote:
      self.key = text.rstrip('/')
      return
    try:
      destination, descriptor = output_destination(text)
    except OSError:
      destination, descriptor = os.path.abspath(text), None
    if descriptor is not None:
      # /dev/stdout and the like: what the descriptor is open on decides.
      with contextlib.suppress(OSError):
        self.stat = os.fstat(descriptor)
      self.key = None
      self.is_stream = self.stat is None or not stat.S_ISREG(self.stat.st_mode)
      return
    self.key = os.path.realpath(destination)
    with contextlib.suppress(OSError):
      self.stat = os.stat(self.key)
    if self.stat is not None and not (
      stat.S_ISREG(self.stat.st_mode) or stat.S_ISDIR(self.stat.st_mode)
    ):
      self.is_stream = True  # A named pipe or a device replaces no file.

  @property
  def inode(self) -> tuple[int, int] | None:
    return None if self.stat is None else (self.stat.st_dev, self.stat.st_ino)

  @property
  def is_dir(self) -> bool:
    return self.stat is not None and stat.S_ISDIR(self.stat.st_mode)

  def lies_inside(self, other: '_Place') -> bool:
    if self.key is None or other.key is None or self.remote != other.remote:
      return False
    return self.key.startswith(other.key.rstrip('/') + '/')


def _relation(out: _Place, other: _Place, *, hard_links_below: bool) -> str | None:
  """How `out` clashes with `other` (words for the error), or None."""
  if out.key is not None and out.key == other.key:
    return 'is'
  if out.inode is not None and out.inode == other.inode:
    return 'is the same file (a hard link or a redirection) as'
  if other.lies_inside(out):
    return 'is a folder holding'
  if out.lies_inside(other):
    return 'lies inside'
  if hard_links_below and other.is_dir and _is_hard_link_into(out, other):
    return 'is a hard link to a file in'
  return None


def _is_hard_link_into(out: _Place, folder: _Place) -> bool:
  """Whether the existing regular file `out` is another name of a file under `folder`."""
  if out.stat is None or not stat.S_ISREG(out.stat.st_mode) or out.stat.st_nlink < 2:
    return False
  seen = 0
  for parent, _, names in os.walk(folder.key):
    for name in names:
      seen += 1
      if seen > _MAX_FILES_COMPARED:
        return False
      with contextlib.suppress(OSError):
        found = os.stat(os.path.join(parent, name), follow_symlinks=False)
        if (found.st_dev, found.st_ino) == out.inode:
          return True
  return False
