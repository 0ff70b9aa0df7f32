"""A training workdir on disk: the one place that knows its layout, its lock and its config.

    DIR/config.json             the resolved run config and model config, and the identity
                                of the vocabulary and data the parameters depend on
                                (`training.run_config`)
    DIR/vocab.model             the shared SentencePiece vocabulary
    DIR/target_vocab.model      optional: the same ids, segmenting targets (an imported target.spm)
    DIR/checkpoints/<step>/     orbax step checkpoints (state + input-pipeline position)
    DIR/averaged/               the averaged parameters (`python -m transformer_jax.average`)
    DIR/imported/               an imported model's parameters (`import_marian`), used until
                                the first training checkpoint and where fine-tuning starts
    DIR/damaged_checkpoints/    checkpoints that failed to read back, moved aside
    DIR/tensorboard/            TensorBoard event files
    DIR/token_cache/            token ids of each split, per dataset and vocabulary
    DIR/data/                   prepared tfds datasets, unless config.data_dir is set
    DIR/hypotheses/             `evaluate`'s translations
    DIR/ctranslate2_export/     the server's CTranslate2 export (`serve --engine=ctranslate2`)
    DIR/.lock                   held by the training process that owns the workdir

Everything else asks a `Workdir` for these paths. One run per workdir: `Workdir.lock()` takes
an exclusive `fcntl.flock`, which belongs to the open file description, so the kernel releases
it when the process ends for any reason (SIGKILL included) and a stale lock never blocks a
restart.
"""

from __future__ import annotations

import errno
import json
import os

from etils import epath

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.workdir import gcs_lock
from transformer_jax.workdir.lock import WorkdirLock

_CONFIG_FILE = 'config.json'
_VOCAB_FILE = 'vocab.model'
_TARGET_VOCAB_FILE = 'target_vocab.model'
_CHECKPOINTS = 'checkpoints'
_AVERAGED = 'averaged'
_IMPORTED = 'imported'
_DAMAGED_CHECKPOINTS = 'damaged_checkpoints'
_TENSORBOARD = 'tensorboard'
_TOKEN_CACHE = 'token_cache'
_DATA = 'data'
_HYPOTHESES = 'hypotheses'
_CTRANSLATE2_EXPORT = 'ctranslate2_export'
_LOCK_FILE = '.lock'
# config.json's record, beside 'config' and 'model', of the files the parameters depend on:
# {'vocab_sha256', 'target_vocab_sha256' (only where targets have their own model), 'data'
# (`input_pipeline.load_data_sources`' identity: the content, not the path)}.
IDENTITY_KEY = 'identity'
_VOCABULARY_HASHES = (('vocab_sha256', _VOCAB_FILE), ('target_vocab_sha256', _TARGET_VOCAB_FILE))


class Workdir:
  """Paths inside one workdir (local and absolute, or gs://), its lock, and its saved config."""

  def __init__(self, path: str | os.PathLike | epath.Path, flag: str = '--workdir'):
    self.path = paths.resolve(path, flag)

  def __repr__(self) -> str:
    return f'Workdir({str(self.path)!r})'

  def __str__(self) -> str:
    return str(self.path)

  @property
  def is_remote(self) -> bool:
    return paths.is_gcs(self.path)

  @property
  def config_file(self) -> epath.Path:
    return self.path / _CONFIG_FILE

  @property
  def vocab_file(self) -> epath.Path:
    return self.path / _VOCAB_FILE

  @property
  def target_vocab_file(self) -> epath.Path:
    """Only in workdirs whose targets are segmented by another model than their sources (an
    imported OPUS-MT model's target.spm): the same pieces and ids as vocab_file."""
    return self.path / _TARGET_VOCAB_FILE

  @property
  def checkpoints(self) -> epath.Path:
    return self.path / _CHECKPOINTS

  @property
  def averaged(self) -> epath.Path:
    return self.path / _AVERAGED

  @property
  def imported(self) -> epath.Path:
    """An imported model's parameters (a params-only checkpoint, as `averaged`)."""
    return self.path / _IMPORTED

  @property
  def damaged_checkpoints(self) -> epath.Path:
    return self.path / _DAMAGED_CHECKPOINTS

  @property
  def tensorboard(self) -> epath.Path:
    return self.path / _TENSORBOARD

  @property
  def data(self) -> epath.Path:
    """Where prepared datasets go when the config does not name a data_dir."""
    return self.path / _DATA

  @property
  def ctranslate2_export(self) -> epath.Path:
    """Where `serve --engine=ctranslate2` keeps its export, unless --ctranslate2_dir is given."""
    return self.path / _CTRANSLATE2_EXPORT

  @property
  def hypotheses_folder(self) -> epath.Path:
    """Where `evaluate` writes its hypotheses unless --out is given."""
    return self.path / _HYPOTHESES

  def token_cache_file(self, dataset_name: str, split: str) -> epath.Path:
    return self.path / _TOKEN_CACHE / f'{dataset_name.replace("/", "_")}-{split}.npz'

  def hypotheses_file(
    self,
    source_path: str,
    checkpoint: object,
    beam_size: int,
    alpha: float,
    beam_rule: str = 'exact',
  ) -> epath.Path:
    """Named by every decoding option, so a sweep over them keeps each run's output."""
    rule = '' if beam_rule == 'exact' or beam_size == 1 else f'.{beam_rule}'
    name = (
      f'{epath.Path(source_path).name}.{checkpoint or "default"}.beam{beam_size}{rule}'
      f'.alpha{alpha:g}.txt'
    )
    return self.hypotheses_folder / name

  def check_not_a_file(self) -> None:
    if self.path.exists() and not self.path.is_dir():
      raise UserInputError(f'--workdir={self.path} exists and is not a directory')

  def check_writable(self, flag: str = '--workdir') -> None:
    """A one-line error naming the path unless files can be created in the workdir (or, when
    it does not exist yet, in the folder it will be made in): call it before any work."""
    check_folder_writable(self.path, flag)

  def read_run_config(self) -> dict:
    """The saved {'config': ..., 'model': ...} of a trained workdir."""
    saved = self.read_run_config_if_present()
    if saved is None:
      raise FileNotFoundError(f'{self.config_file} not found: is {self.path} a training workdir?')
    return saved

  def read_run_config_if_present(self) -> dict | None:
    """The saved run config, None if there is none; anything else in its place is refused."""
    if not self.config_file.exists():
      return None
    if self.config_file.is_dir():
      raise UserInputError(f'{self.config_file}: is a directory, not the saved run config')
    try:
      saved = json.loads(self.config_file.read_text())
    except json.JSONDecodeError as error:
      raise UserInputError(f'{self.config_file}: not valid JSON ({error})') from None
    except ValueError:  # Not UTF-8 (e.g. saved as UTF-16 by an editor).
      raise UserInputError(f'{self.config_file}: not UTF-8 text') from None
    if not isinstance(saved, dict):
      raise UserInputError(
        f'{self.config_file}: expected a JSON object, got {type(saved).__name__}'
      )
    for section in ('config', 'model'):
      if not isinstance(saved.get(section), dict):
        raise UserInputError(
          f'{self.config_file}: not a run config written by train.py (its "{section}" '
          f'section is {"missing" if section not in saved else repr(saved[section])})'
        )
    return saved

  def vocabulary_identity(self) -> dict[str, str]:
    """The SHA-256 of each vocabulary file there is, under its `IDENTITY_KEY` name."""
    return {
      key: paths.file_sha256(self.path / name)
      for key, name in _VOCABULARY_HASHES
      if name == _VOCAB_FILE or (self.path / name).exists()
    }

  def vocabulary_changes(self, recorded: dict) -> list[str]:
    """How the vocabulary files differ from the hashes `recorded` in config.json's identity
    (`vocabulary vocab.model: sha256 1234abcd5678 -> 9876fedc4321`); none when nothing was
    recorded (a workdir from before the record existed)."""
    if 'vocab_sha256' not in recorded:
      return []
    now = self.vocabulary_identity()
    return [
      f'vocabulary {name}: {_digest(recorded.get(key))} -> {_digest(now.get(key))}'
      for key, name in _VOCABULARY_HASHES
      if recorded.get(key) != now.get(key)
    ]

  def check_vocabulary_unchanged(self, saved: dict) -> None:
    """A one-line error when a vocabulary file is not the one the parameters were trained
    with (its hash in `saved`, the run config): its pieces would get other ids, and every
    translation would be garbage without a word of warning."""
    recorded = saved.get(IDENTITY_KEY)
    changes = self.vocabulary_changes(recorded) if isinstance(recorded, dict) else []
    if changes:
      raise UserInputError(
        f'{self.path}: {"; ".join(changes)} since the parameters were trained (recorded in '
        f'{_CONFIG_FILE}); restore the original file'
      )

  def write_run_config(self, resolved: dict) -> None:
    paths.write_atomically(self.config_file, json.dumps(resolved, indent=2, sort_keys=True))

  def lock(
    self, process_index: int = 0, expiry_seconds: float = gcs_lock.DEFAULT_EXPIRY_SECONDS
  ) -> 'WorkdirLock | gcs_lock.GcsLock':
    """The lock a training process holds: `with workdir.lock(jax.process_index()): ...`.

    A local workdir: an `flock` (released by the kernel when the process dies). A gs://
    workdir: an object with generation preconditions and a heartbeat, which a killed holder
    stops, so it expires after `expiry_seconds` (see gcs_lock.py).
    """
    # Process 0 of a multi-process job takes the same lock as a single-process run; the
    # others (which may share the workdir on one machine) each take their own.
    name = _LOCK_FILE if process_index == 0 else f'{_LOCK_FILE}.process{process_index}'
    if self.is_remote:
      return gcs_lock.GcsLock(os.fspath(self.path / name), expiry_seconds)
    return WorkdirLock(os.fspath(self.path / name))


def _digest(sha256: str | None) -> str:
  return f'sha256 {sha256[:12]}' if sha256 else 'none'


def check_folder_writable(
  value: str | os.PathLike, flag: str, *, unless_it_exists: bool = False
) -> None:
  """A one-line error `FLAG=PATH: ...` unless files can be created in the folder `value`, or
  in its nearest existing ancestor while it does not exist (it is made later).
  `unless_it_exists`: check only a folder still to be made.

  Asks twice: `os.access`, then a real attempt (an empty file created and removed), because
  `os.access` answers from the caller's powers, which a file system need not honour (NFS with
  root_squash, a read-only mount). gs:// paths are not probed: permissions there are the
  bucket's IAM, and probing would cost a round trip per run.
  """
  path = paths.resolve(value, flag)
  if paths.is_gcs(path) or (unless_it_exists and path.exists()):
    return
  name = f'{flag}={path}'
  folder = os.fspath(path)
  while not os.path.lexists(folder):
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    raise UserInputError(f'{name}: {folder} is not a directory')
  if not os.access(folder, os.W_OK | os.X_OK):
    raise UserInputError(f'{name}: cannot create files in {folder} ({os.strerror(errno.EACCES)})')
  probe = os.path.join(folder, f'.write-check.{os.getpid()}.{os.urandom(4).hex()}.tmp')
  try:
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
  except OSError as error:
    reason = error.strerror or str(error)
    raise UserInputError(f'{name}: cannot create files in {folder} ({reason})') from None
  os.unlink(probe)
