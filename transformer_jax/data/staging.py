"""Prepared datasets in Cloud Storage, read from a local copy on each host.

array_record, which tfds data sources read, cannot open gs:// (google/array_record#120), so a
dataset prepared into `gs://BUCKET/tfds` is copied once to a local cache, by default
`~/.cache/transformer_jax/gs/BUCKET/tfds/...` (or $TRANSFORMER_JAX_CACHE), and read from there:

- **verified**: every file's size and MD5 (as Cloud Storage lists them) are checked after the
  copy; a file that does not match is an error, never read.
- **reused**: a manifest of what was copied (name, size, MD5, generation per file) is written
  last; a later run whose bucket listing matches it copies nothing.
- **refreshed**: a file whose generation or MD5 in the bucket differs from the manifest (the
  dataset was prepared again) is copied again; files gone from the bucket are removed.
- **safe to start together**: processes of one host take an `flock` on the cache entry, so one
  copies while the others wait and then find it current.

Only the dataset's own folder (`<data_dir>/<name>/<config>/`) is staged, with progress in bytes.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os

import fsspec
from etils import epath

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import log
from transformer_jax.common.progress import progress

_MANIFEST = '.staged.json'
_CACHE_ENV = 'TRANSFORMER_JAX_CACHE'


def cache_root() -> epath.Path:
  root = os.environ.get(_CACHE_ENV) or os.path.join(
    os.path.expanduser('~'), '.cache', 'transformer_jax'
  )
  return epath.Path(root)


def local_data_dir(data_dir: str | os.PathLike) -> epath.Path:
  """Where `gs://BUCKET/path` is staged on this host: <cache root>/gs/BUCKET/path."""
  return cache_root() / 'gs' / os.fspath(data_dir)[len(paths.GCS_PREFIX) :].strip('/')


def _listing(fs, remote: str) -> dict[str, dict]:
  """{relative name: {'size', 'md5', 'generation'}} of every object under `remote`."""
  listed = {}
  for name, info in fs.find(remote, detail=True, withdirs=False).items():
    relative = name[len(remote.removeprefix(paths.GCS_PREFIX)) :].lstrip('/')
    if not relative or relative.endswith('/'):
      continue
    md5 = info.get('md5Hash')
    listed[relative] = {
      'size': int(info['size']),
      'md5': base64.b64decode(md5).hex() if md5 else None,
      'generation': str(info.get('generation', '')),
    }
  return listed


def _md5(path: epath.Path) -> str:
  digest = hashlib.md5()
  with path.open('rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


@contextlib.contextmanager
def _host_lock(directory: epath.Path):
  directory.mkdir(parents=True, exist_ok=True)
  with open(os.path.join(os.fspath(directory), '.staging.lock'), 'a+') as handle:
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # Waits while another process copies.
    try:
      yield
    finally:
      fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def stage(data_dir: str | os.PathLike, dataset_folder: str) -> epath.Path:
  """Copies `<data_dir>/<dataset_folder>` (gs://) to this host's cache if it is not current
  there; returns the local data_dir to read it from (see the module docstring)."""
  remote = f'{os.fspath(data_dir).rstrip("/")}/{dataset_folder.strip("/")}'
  local_root = local_data_dir(data_dir)
  local = local_root / dataset_folder
  fs = fsspec.filesystem('gcs')
  fs.invalidate_cache()  # A listing cached earlier in this process may predate a re-prepare.
  listed = _listing(fs, remote)
  if not listed:
    raise UserInputError(f'config.data_dir: nothing prepared at {remote}')
  with _host_lock(local):
    manifest_file = local / _MANIFEST
    staged = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
    if staged == listed:
      return local_root
    if manifest_file.exists():
      manifest_file.unlink()  # From here on the copy is incomplete until the manifest is back.
    for relative in set(staged) - set(listed):  # Gone from the bucket.
      (local / relative).unlink(missing_ok=True)
    changed = {name: info for name, info in listed.items() if staged.get(name) != info}
    with progress(
      total=sum(info['size'] for info in changed.values()),
      unit='B',
      unit_scale=True,
      description=f'staging {remote} to {local}',
    ) as bar:
      for relative, info in sorted(changed.items()):
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f'.{target.name}.partial'
        fs.get_file(f'{remote}/{relative}', os.fspath(tmp))
        size = os.path.getsize(tmp)
        if size != info['size'] or (info['md5'] and _md5(tmp) != info['md5']):
          tmp.unlink()
          raise UserInputError(
            f'{remote}/{relative}: the copy does not match the bucket (size {size} vs '
            f'{info["size"]}, or its MD5); the object may be changing: rerun'
          )
        os.replace(tmp, target)
        bar.update(info['size'])
    manifest_file.write_text(json.dumps(listed, indent=1, sort_keys=True))
  log(f'staged {len(changed)} of {len(listed)} files of {remote} into {local}')
  return local_root
