"""One training run per workdir in Cloud Storage, where no `flock` exists.

The lock is one object, `<workdir>/.lock`, holding JSON that names its holder. Cloud Storage
preconditions make every change to it atomic, against the object's generation (a number that
changes with every write):

- **acquire**: create the object only if absent (`ifGenerationMatch=0`). If it exists and its
  holder's heartbeat is older than the expiry, take it over by overwriting exactly the
  generation that was read (`ifGenerationMatch=<generation>`): of several processes trying at
  once, one wins and the others see 412 and are refused. Otherwise refuse, naming the holder
  and when the lock expires.
- **heartbeat**: while held, a daemon thread rewrites the object every `expiry / 4` seconds,
  again only if it is still the generation this process wrote. A `kill -9`ed holder stops
  beating, so its lock expires and the next run takes it over instead of finding the workdir
  locked forever. If the rewrite fails with 412, another process took the lock (this one was
  stopped for longer than the expiry): `lost` is set and an error is logged; the training loop
  stops on it rather than write checkpoints beside another run.
- **release**: delete the object, only if it is still ours.

Expiry is judged by the heartbeat time written in the object against this host's clock, so
hosts' clocks must agree to well within the expiry (default 10 minutes; NTP keeps them within
milliseconds). Uses google-cloud-storage (the `[gcs]` extra), which honours
STORAGE_EMULATOR_HOST for tests.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from transformer_jax.common.errors import UserInputError

DEFAULT_EXPIRY_SECONDS = 600.0


def _bucket_and_name(path: str) -> tuple[str, str]:
  bucket, _, name = os.fspath(path)[len('gs://') :].partition('/')
  return bucket, name


class GcsLock:
  """Context manager: `with GcsLock('gs://b/run/.lock'): train...`; refuses a live holder."""

  def __init__(self, path: str, expiry_seconds: float = DEFAULT_EXPIRY_SECONDS, clock=time.time):
    if expiry_seconds <= 0:
      raise UserInputError(f'lock expiry must be positive, got {expiry_seconds!r}')
    self.path = os.fspath(path)
    self.expiry_seconds = float(expiry_seconds)
    self.holder = f'pid {os.getpid()} on {socket.gethostname()}'
    self.lost = False
    self._clock = clock
    self._token = uuid.uuid4().hex
    self._generation = None
    self._stop = threading.Event()
    self._thread = None
    self._blob = None

  def _object(self):
    from google.cloud import storage  # pylint: disable=g-import-not-at-top

    bucket, name = _bucket_and_name(self.path)
    return storage.Client().bucket(bucket).blob(name)

  def _content(self) -> str:
    return json.dumps(
      {
        'holder': self.holder,
        'token': self._token,
        'heartbeat': self._clock(),
        'expiry_seconds': self.expiry_seconds,
      }
    )

  def _write(self, if_generation_match: int) -> None:
    self._blob.upload_from_string(
      self._content(), content_type='application/json', if_generation_match=if_generation_match
    )
    self._generation = self._blob.generation

  def acquire(self) -> 'GcsLock':
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top

    self._blob = self._object()
    try:
      self._write(if_generation_match=0)
    except exceptions.PreconditionFailed:
      self._take_over_if_expired()
    self._thread = threading.Thread(target=self._beat, name='gcs-lock-heartbeat', daemon=True)
    self._thread.start()
    return self

  def _take_over_if_expired(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top

    workdir = self.path.rsplit('/', 1)[0]
    for _ in range(3):  # The holder may release or beat between our reads: look again.
      try:
        current = self._object()
        current.reload()
        saved = json.loads(current.download_as_bytes(if_generation_match=current.generation))
      except exceptions.NotFound:
        try:
          self._write(if_generation_match=0)  # Released meanwhile.
          return
        except exceptions.PreconditionFailed:
          continue
      except exceptions.PreconditionFailed:
        continue
      except ValueError:  # Not JSON: not a lock this project wrote; treat it as expired.
        saved = {'holder': 'unreadable lock', 'heartbeat': 0.0}
      age = self._clock() - float(saved.get('heartbeat', 0.0))
      expiry = float(saved.get('expiry_seconds', self.expiry_seconds))
      if age < expiry:
        raise UserInputError(
          f'{workdir} is in use by a running training process ({saved.get("holder")}, last '
          f'heartbeat {age:.0f} s ago; its lock expires {expiry - age:.0f} s after its last '
          'heartbeat); wait for it to finish or use another --workdir'
        )
      try:
        self._write(if_generation_match=current.generation)
        logging.warning(
          'took over the lock of %s from %s, silent for %.0f s', workdir, saved.get('holder'), age
        )
        return
      except exceptions.PreconditionFailed:
        continue  # Another process took it over first (or the holder came back): look again.
    raise UserInputError(f'{workdir}: could not take the lock (others are competing for it)')

  def _beat(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top

    while not self._stop.wait(self.expiry_seconds / 4):
      try:
        self._write(if_generation_match=self._generation)
      except exceptions.PreconditionFailed:
        self.lost = True
        logging.error('lost the lock of %s: another process took it over', self.path)
        return
      except Exception as error:  # pylint: disable=broad-except
        # A transient network error: the next beat retries, well within the expiry.
        logging.warning('lock heartbeat of %s failed (%s); retrying', self.path, error)

  def release(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top

    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._generation is not None and not self.lost:
      try:
        self._blob.delete(if_generation_match=self._generation)
      except (exceptions.PreconditionFailed, exceptions.NotFound):
        pass  # No longer ours: leave it to its holder.
      self._generation = None

  def __enter__(self) -> 'GcsLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
