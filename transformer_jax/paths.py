"""Every path the project is given goes through here: local paths and `gs://` Cloud Storage.

`resolve(value, flag)` turns what the user typed into an `etils.epath.Path`: a local path made
absolute (so a later `chdir` cannot move it), or a `gs://bucket/...` path kept remote, never
turned into a local folder named `gs:`. Any other scheme (`s3://`, `http://`, ...) is a
one-line error naming the flag. `gs://` goes through fsspec's `gcsfs` (the `[gcs]` extra);
orbax and tensorstore write checkpoints there themselves.

`write_atomically` gives one write semantics on both: a reader never sees a half-written file
(locally: a temporary file renamed into place; on GCS an object appears only once its upload
completes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import uuid

from etils import epath

from transformer_jax.errors import UserInputError

Path = epath.Path
GCS_PREFIX = 'gs://'
_SCHEME = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')


def is_gcs(path: str | os.PathLike) -> bool:
  return os.fspath(path).startswith(GCS_PREFIX)


def resolve(value: str | os.PathLike, flag: str) -> epath.Path:
  """`value` as a Path: local ones absolute, `gs://` ones remote; others a one-line error."""
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
  """Writes `path` whole or not at all (see the module docstring)."""
  path = epath.Path(path)
  mode = 'wb' if isinstance(data, bytes) else 'w'
  if is_gcs(path):
    with path.open(mode) as f:  # The object exists only once the upload completes.
      f.write(data)
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f'.{path.name}.{uuid.uuid4().hex[:8]}.tmp'
  with tmp.open(mode) as f:
    f.write(data)
  os.replace(tmp, path)


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
