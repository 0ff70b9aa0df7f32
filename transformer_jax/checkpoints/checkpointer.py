"""Checkpointing of training state plus input-pipeline position, via orbax.

This is the only module in the project that imports orbax: orbax's API moves quickly between
releases, so it is kept behind one small class. Written against orbax-checkpoint 0.12.8.

Each checkpoint step holds two items:
  * 'state': the training-state pytree (e.g. a flax TrainState), saved with StandardSave. Only
    pytree leaves are written; static fields such as TrainState.apply_fn / tx live in the
    treedef and are never serialized.
  * 'data': a small JSON dict (input-pipeline position), saved with JsonSave.

Restoring takes an *abstract* state (jax.ShapeDtypeStruct leaves with `.sharding` set): arrays
are read straight into the target sharding, so a checkpoint loads on another device layout.

Besides the step checkpoints there is a *params-only* checkpoint (the averaged parameters,
checkpoints/averaging.py): `save_params` writes DIRECTORY/params/ (the params pytree, orbax
StandardSave) and DIRECTORY/metadata.json (a small JSON dict, written last) into a hidden
sibling folder and renames it into place, so DIRECTORY either does not exist or holds a
complete checkpoint; `restore_params_from` and `read_metadata` read it back.

A save the disk refuses (`errors.STORAGE_ERRNOS`: full, read-only, ...), however orbax wraps
it, is a `StorageError` naming the step's (or params checkpoint's) folder; its temporary folder
is removed and the previous checkpoints are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from transformer_jax.checkpoints.checksums import (
  check_matches,
  checksums,
  leaves_by_name,
  verify_leaves,
)
from transformer_jax.common import errors, paths
from transformer_jax.common.errors import CorruptCheckpointError

_STATE = 'state'
_DATA = 'data'
# Key in the 'data' JSON of save()'s checksum of every state leaf, which restore() verifies:
# orbax 0.12.8 restored a flipped byte of its compressed chunks silently, with wrong values.
_CHECKSUMS = '_checksums'

# Layout of a params-only checkpoint (save_params / restore_params_from).
_PARAMS_ITEM = 'params'
_METADATA_FILE = 'metadata.json'


class Checkpointer:
  """Keeps the last `keep` checkpoints of (state, data_state) in `directory`."""

  def __init__(
    self,
    directory: str,
    *,
    keep: int | None = 3,
    async_save: bool = True,
    damaged_directory: str | None = None,
  ):
    # keep=None keeps every checkpoint (use it for read-only access, so that opening a
    # directory can never be what prunes it).
    # damaged_directory: where `quarantine` moves steps that do not read back (None: they stay
    # where they are, and restore_latest_valid cannot skip them).
    # orbax requires an absolute path; normalising here lets callers pass relative paths and
    # gives a stable string for error messages. gs:// stays remote: orbax and tensorstore write
    # Cloud Storage themselves.
    self.directory = paths.local_or_remote(directory)
    self.damaged_directory = damaged_directory
    # The last `keep`, and any step `keep_also` names (the best one, beyond them).
    self._also_kept = _KeepSteps()
    preservation = None
    if keep is not None:
      preservation = ocp.checkpoint_managers.AnyPreservationPolicy(
        [ocp.checkpoint_managers.LatestN(n=keep), self._also_kept]
      )
    options = ocp.CheckpointManagerOptions(
      create=True, enable_async_checkpointing=async_save, preservation_policy=preservation
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=(_STATE, _DATA)
    )
    self._in_flight_step: int | None = None  # Of an async save not yet waited for.

  # ---- queries ----

  def latest_step(self) -> int | None:
    """Newest finalized step, or None when the directory has no checkpoint."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All finalized steps still on disk, ascending."""
    return sorted(self._manager.all_steps())

  def read_data_state(self, step: int | None = None) -> dict:
    """The JSON data state saved with `step` (None = latest), without the state's arrays."""
    data = _step_data(self.directory / str(self._resolve_step(step)))
    data.pop(_CHECKSUMS, None)
    return data

  # ---- save ----

  def keep_also(self, step: int | None) -> None:
    """Keeps `step` (the best, `checkpoints.best`; None: none) beyond the last `keep` from the
    next save on; the step it named before is pruned then as any old one."""
    self._also_kept.steps = frozenset() if step is None else frozenset({int(step)})

  def save(self, step: int, state: Any, data_state: dict | None = None) -> bool:
    """Dispatches a save of `state` and `data_state` at `step`.

    With async saving this returns once device arrays are copied off and the write is running
    in the background; call `wait_until_finished` to block. Returns whether a save was started.
    A failed write (this one's, or the previous async save's) is a StorageError naming its step.
    """
    data = dict(data_state or {})
    data[_CHECKSUMS] = checksums(state)
    args = ocp.args.Composite(
      **{
        _STATE: ocp.args.StandardSave(state),
        _DATA: ocp.args.JsonSave(data),
      }
    )
    self.wait_until_finished()  # orbax would, in save(): here a failure names its own step.
    with self._writing(int(step)):
      started = bool(self._manager.save(int(step), args=args))
    self._in_flight_step = int(step) if started else None
    return started

  def _writing(self, step: int | None):
    """A failed write of `step` as a StorageError, after removing its (None: any step's)
    `<step>.orbax-checkpoint-tmp` folder: orbax never restores one, and it holds space."""

    def remove_unfinished():
      self._manager.reload()  # orbax's cached list of steps may have lost the last good one.
      if jax.process_index() != 0 or paths.is_gcs(self.directory):
        return
      for entry in os.listdir(self.directory):
        stem, _, rest = entry.partition('.')
        if rest.startswith('orbax-checkpoint-tmp') and (step is None or stem == str(step)):
          for _ in range(20):  # tensorstore may still be finishing writes into it.
            shutil.rmtree(self.directory / entry, ignore_errors=True)
            if not (self.directory / entry).exists():
              break
            time.sleep(0.1)

    where = self.directory / str(step) if step is not None else self.directory
    return errors.storage_errors_as(where, remove_unfinished)

  # ---- restore ----

  def _resolve_step(self, step: int | None) -> int:
    """Maps None to the latest step; raises FileNotFoundError if absent."""
    # An in-flight async save is not yet visible as a step; finish it first so
    # "save then restore" in the same process behaves as expected.
    self.wait_until_finished()
    if step is None:
      latest = self._manager.latest_step()
      if latest is None:
        raise FileNotFoundError(f'no checkpoint in {self.directory}')
      return latest
    steps = self.all_steps()
    if int(step) not in steps:
      raise FileNotFoundError(
        f'no checkpoint for step {step} in {self.directory} (available steps: {steps})'
      )
    return int(step)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores (state, data_state) at `step` (None = latest).

    `abstract_state` is a pytree of jax.ShapeDtypeStruct whose `.sharding`
    says where each restored array should live (e.g. from jax.eval_shape plus
    attached shardings). Its tree structure, including static fields, is used
    for the returned state.
    """
    step = self._resolve_step(step)
    if hasattr(abstract_state, 'params'):
      self._check_params_fit(step, abstract_state.params)
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          **{
            _STATE: ocp.args.StandardRestore(abstract_state),
            _DATA: ocp.args.JsonRestore(),
          }
        ),
      )
    except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
      raise self._corrupt(step, error) from None
    # JsonRestore returns None if the item was never written; normalise.
    data = dict(restored[_DATA] or {})
    self._verify(step, restored[_STATE], data.pop(_CHECKSUMS, None))
    return restored[_STATE], data

  def restore_latest_valid(
    self, abstract_state: Any, on_error=None
  ) -> tuple[Any, dict, int] | None:
    """(state, data_state, step) of the newest checkpoint that reads back intact, or None.

    Damaged checkpoints are moved to `damaged_directory` (newest first, see `quarantine`) and
    `on_error(CorruptCheckpointError)` is told about each, so training falls back to the
    previous good checkpoint, and later saves of those steps are not blocked by the wreck.
    """
    for step in reversed(self.all_steps()):
      try:
        state, data = self.restore(abstract_state, step)
        return state, data, step
      except CorruptCheckpointError as error:
        if self.damaged_directory is None:
          raise
        moved_to = self.quarantine(step)
        if on_error:
          on_error(CorruptCheckpointError(f'{error}; moved to {moved_to}'))
    return None

  def quarantine(self, step: int) -> str:
    """Moves a damaged step out of the checkpoint directory, keeping it for inspection."""
    if self.damaged_directory is None:
      raise ValueError('this Checkpointer was given no damaged_directory to move steps to')
    self.wait_until_finished()
    destination = paths.local_or_remote(self.damaged_directory) / (
      f'{step}-{time.strftime("%Y%m%d-%H%M%S")}-{uuid.uuid4().hex[:6]}'
    )
    if jax.process_index() == 0:
      paths.move(self.directory / str(step), destination)
    self._manager.reload()  # orbax caches the list of steps.
    return destination

  def _check_params_fit(self, step: int, abstract_params: Any) -> None:
    """A one-line UserInputError if the step's saved params are another model's (another
    size or layout): such a checkpoint is intact, so it is neither reported as damaged nor
    moved aside, and orbax is never asked to restore it (its failing threads print
    tracebacks)."""
    try:
      stored = _tree_metadata(self._state_dir(step))
    except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
      raise self._corrupt(step, error) from None
    if isinstance(stored, dict) and isinstance(stored.get('params'), dict):
      check_matches(
        f'checkpoint step {step} at {self.directory / str(step)}',
        stored['params'],
        abstract_params,
      )

  def _corrupt(self, step: int, error: Exception) -> CorruptCheckpointError:
    return _unreadable(f'checkpoint step {step} at {self.directory / str(step)}', error)

  def _verify(self, step: int, tree: Any, expected: dict | None, prefix: str = '') -> None:
    if expected is None:
      return  # Written before checksums existed (or by another tool): nothing to compare.
    for name, value in checksums(tree).items():
      name = prefix + name
      if name in expected and expected[name] != value:
        raise CorruptCheckpointError(
          f'checkpoint step {step} at {self.directory / str(step)} is damaged: '
          f'{name} does not match the checksum written with it'
        )

  def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
    """Restores only `state.params` at `step` (None = latest).

    For inference: no optimizer-state shapes are needed. StandardRestore in orbax 0.12.8 has
    no partial-restore option, so we read the 'state' item directory with a plain
    PyTreeCheckpointHandler and `partial_restore=True`, which skips every saved leaf not named
    in the target tree. The on-disk tree stores dataclass fields by name, so {'params': ...}
    addresses the TrainState's `params` field.
    """
    step = self._resolve_step(step)
    self._check_params_fit(step, abstract_params)
    item_dir = self._state_dir(step)
    target = {'params': abstract_params}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    try:
      with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
        restored = reader.restore(
          item_dir,
          args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
        )
      expected = _step_data(self.directory / str(step)).get(_CHECKSUMS)
    except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
      raise self._corrupt(step, error) from None
    self._verify(step, restored['params'], expected, prefix='params/')
    return restored['params']

  def restore_params_to_host(self, step: int | None = None) -> Any:
    """Restores `state.params` at `step` (None = latest) as host NumPy arrays.

    Needs no target: shapes and dtypes come from the checkpoint's own stored tree metadata, so
    the model never has to be built (used for averaging). Leaves keep their stored dtype
    (bfloat16 comes back as ml_dtypes.bfloat16). Only the params are read; optimizer state is
    skipped (partial restore).
    """
    return _params_to_host(self.directory, self._resolve_step(step))

  def _state_dir(self, step: int) -> epath.Path:
    # Locate the step folder the same way the manager names it (default name
    # format: plain step number) instead of hard-coding the naming scheme.
    name_format = ocp.step.standard_name_format()
    return name_format.find_step(self.directory, step).path / _STATE

  # ---- lifecycle ----

  def wait_until_finished(self) -> None:
    """Blocks until any background save is committed to disk (StorageError if it failed)."""
    step, self._in_flight_step = self._in_flight_step, None
    with self._writing(step):
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves, then releases orbax's resources (also after a failed save)."""
    try:
      self.wait_until_finished()
    finally:
      self._manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


class _KeepSteps:
  """An orbax preservation policy: keep the steps Checkpointer.keep_also names."""

  steps: frozenset[int] = frozenset()

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    return [checkpoint.step in self.steps for checkpoint in checkpoints]


# ---- reading a directory that training writes and prunes meanwhile (averaging) ----
# Files every finished step folder holds (orbax 0.12.8): the step's metadata, written just
# before the rename that finishes a save, and the 'state' item's tree metadata, which reading
# the params needs. Pruning unlinks a step's files (the step folder's own among the first)
# before its folders, so a step without them is being deleted, or was left half-deleted.
_STEP_METADATA_FILE = '_CHECKPOINT_METADATA'
_TREE_METADATA_FILE = '_METADATA'
# How long a step that failed to read is watched for being deleted before it counts as
# damaged: a local prune takes milliseconds, gs:// deletes object by object.
_PRUNE_SECONDS = 10.0


def list_steps(directory: str | epath.Path) -> tuple[list[int], list[int]]:
  """(complete, incomplete) steps of a step checkpoint directory as they are on disk now (no
  cached listing, unlike Checkpointer.all_steps), ascending. Incomplete: a save in flight
  (orbax's `<step>.orbax-checkpoint-tmp-<n>` folder; on gs://, a step folder without its commit
  marker), or a step being deleted or left half-deleted (see `_STEP_METADATA_FILE`)."""
  directory = paths.local_or_remote(directory)
  complete, incomplete = set(), set()
  for entry in directory.iterdir():
    name = entry.name.split('.')[0]  # '<step>.orbax-checkpoint-tmp-<n>' while being saved
    if name.isdigit():
      (complete if _is_complete_step(entry) else incomplete).add(int(name))
  return sorted(complete), sorted(incomplete - complete)


def _is_complete_step(step_dir: epath.Path) -> bool:
  try:
    return (
      ocp.step.is_path_finalized(step_dir)
      and (step_dir / _STEP_METADATA_FILE).exists()
      and (step_dir / _STATE / _TREE_METADATA_FILE).exists()
    )
  except (OSError, ValueError):  # Gone while being looked at.
    return False


def restore_complete_params_to_host(directory: str | epath.Path, step: int) -> Any | None:
  """`Checkpointer.restore_params_to_host(step)` for a directory that a training process saves
  into and prunes meanwhile: None for a step that is not complete (`list_steps`) or stops being
  complete within `_PRUNE_SECONDS` of failing to read (it was being deleted). Only a step that
  stays complete and still does not read back raises (CorruptCheckpointError: damaged)."""
  step_dir = paths.local_or_remote(directory) / str(int(step))
  if not _is_complete_step(step_dir):
    return None
  try:
    return _params_to_host(directory, step)
  except CorruptCheckpointError:
    deadline = time.monotonic() + _PRUNE_SECONDS
    while _is_complete_step(step_dir):
      if time.monotonic() >= deadline:
        raise
      time.sleep(0.1)
    return None


def _params_to_host(directory: str | epath.Path, step: int) -> Any:
  """The params of step `step` as host NumPy arrays (see Checkpointer.restore_params_to_host)."""
  step_dir = paths.local_or_remote(directory) / str(int(step))
  where = f'checkpoint step {step} at {step_dir}'
  item_dir = step_dir / _STATE
  try:
    stored = _tree_metadata(item_dir)
  except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
    raise _unreadable(where, error) from None
  if not isinstance(stored, dict) or 'params' not in stored:
    raise ValueError(f'{item_dir}: the saved state has no params field')
  target = {
    'params': jax.tree.map(
      lambda meta: jax.ShapeDtypeStruct(meta.shape, meta.dtype), stored['params']
    )
  }
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  try:
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
      restored = reader.restore(
        item_dir,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
      )
  except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
    raise _unreadable(where, error) from None
  verify_leaves(where, restored['params'], _step_data(step_dir).get(_CHECKSUMS), prefix='params/')
  return restored['params']


# ---- params-only checkpoints ----


def _tree_metadata(item_dir: Any) -> Any:
  """The stored pytree of per-leaf metadata (shape, dtype) of a PyTree item."""
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
  # orbax 0.12.8 wraps the tree in a TreeMetadata; older releases returned it.
  return getattr(metadata, 'tree', metadata)


def _unreadable(where: str, error: Exception) -> CorruptCheckpointError:
  """One-line CorruptCheckpointError for a checkpoint orbax/tensorstore could not read."""
  # Tensorstore's messages run to many lines of JSON spec: the first line only.
  first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
  return CorruptCheckpointError(
    f'{where} is damaged or incomplete ({type(error).__name__}: {first_line})'
  )


def _step_data(step_dir: epath.Path) -> dict:
  """A step's 'data' item (save()'s data_state and checksums), {} for a step without one."""
  data_file = step_dir / _DATA / 'metadata'
  try:
    data = json.loads(data_file.read_text()) if data_file.exists() else {}
    if not isinstance(data, dict):
      raise ValueError(f'a JSON {type(data).__name__}, not an object')
  except (OSError, ValueError) as error:
    raise _unreadable(f'checkpoint step {step_dir.name} at {step_dir}', error) from None
  return data


# Reserved key in metadata.json under which save_params records a checksum of every params
# leaf: as in step checkpoints, a flipped byte in an array file can restore silently with
# wrong values (orbax 0.12.8), so restore_params_from verifies these. read_metadata hides it.
_PARAMS_CHECKSUMS = '_checksums'


def is_params_checkpoint(directory: str | epath.Path) -> bool:
  """Whether `directory` holds a complete params-only checkpoint."""
  directory = paths.local_or_remote(directory)
  return (directory / _METADATA_FILE).is_file() and (directory / _PARAMS_ITEM).is_dir()


def _require_params_checkpoint(directory: str | epath.Path) -> epath.Path:
  directory = paths.local_or_remote(directory)
  if not is_params_checkpoint(directory):
    raise FileNotFoundError(f'no params checkpoint in {directory}')
  return directory


def save_params(directory: str, params: Any, metadata: dict | None = None) -> str:
  """Writes `params` plus a JSON `metadata` dict as a params-only checkpoint.

  `params` is a pytree of NumPy or jax arrays; the checksum of each (as stored, in its own
  dtype) goes into metadata.json, under a key `metadata` may not use, for restore_params_from
  to verify. An existing checkpoint at `directory` is replaced. Locally everything is first
  written to a hidden sibling folder (orbax commits the params inside it, metadata.json last),
  which then replaces `directory` by the replace protocol (`paths.staged_folder`,
  docs/reliability.md): a crash at any instant leaves the old checkpoint or the new one,
  whole, and the next save recovers what it left. In a bucket the old metadata.json goes first
  (`_save_params_to_gcs`). A failed write (a full disk) is a StorageError naming `directory`,
  with the staging folder removed and the old checkpoint kept. Single-process only. Returns
  the absolute path written.
  """
  if jax.process_count() > 1:
    raise RuntimeError('save_params writes from one process; run it in a single-process job')
  directory = paths.local_or_remote(directory)
  metadata = dict(metadata or {})
  if _PARAMS_CHECKSUMS in metadata:
    raise ValueError(f'save_params: metadata key {_PARAMS_CHECKSUMS!r} is reserved')
  # A leaf that is not an array fails before any I/O: orbax would fail on it
  # from a background thread, after it had started creating files.
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
      raise TypeError(
        f'save_params: leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array'
      )
  # Likewise serialise first, so a metadata dict that is not JSON fails before any I/O.
  metadata_text = json.dumps(
    dict(metadata, **{_PARAMS_CHECKSUMS: checksums(params)}), indent=2, sort_keys=True
  )
  if paths.is_gcs(directory):
    _save_params_to_gcs(directory, params, metadata_text)
    return str(directory)
  directory = os.fspath(directory)
  with errors.storage_errors_as(directory), paths.staged_folder(directory) as staging:
    with ocp.StandardCheckpointer() as writer:
      writer.save(os.path.join(staging, _PARAMS_ITEM), params)
      writer.wait_until_finished()
    with open(os.path.join(staging, _METADATA_FILE), 'w') as f:
      f.write(metadata_text + '\n')
      f.flush()
      os.fsync(f.fileno())
  return directory


def _save_params_to_gcs(directory: epath.Path, params: Any, metadata_text: str) -> None:
  """save_params on Cloud Storage, which has no atomic rename of a folder: the old
  metadata.json goes first (from then on the old checkpoint reads as absent, not as a mix),
  the params are written, and the new metadata.json, one object that appears whole, last."""
  metadata_file = directory / _METADATA_FILE
  if metadata_file.exists():
    metadata_file.unlink()
  if directory.exists():
    directory.rmtree()
  with ocp.StandardCheckpointer() as writer:
    writer.save(directory / _PARAMS_ITEM, params)
    writer.wait_until_finished()
  metadata_file.write_text(metadata_text + '\n')


def _read_metadata_file(directory: epath.Path) -> dict:
  """metadata.json of the params checkpoint at `directory`, reserved keys included."""
  try:
    metadata = json.loads((directory / _METADATA_FILE).read_text())
  except ValueError as error:  # bad JSON or bad UTF-8: the file was damaged after the save
    raise _unreadable(f'params checkpoint at {directory}', error) from None
  if not isinstance(metadata, dict):
    raise CorruptCheckpointError(
      f'params checkpoint at {directory} is damaged: '
      f'{_METADATA_FILE} holds a {type(metadata).__name__}, '
      f'not a dict'
    )
  return metadata


def read_metadata(directory: str) -> dict:
  """The metadata dict given to save_params for the params checkpoint at `directory`."""
  metadata = _read_metadata_file(_require_params_checkpoint(directory))
  metadata.pop(_PARAMS_CHECKSUMS, None)
  return metadata


def restore_params_from(directory: str, abstract_params: Any) -> Any:
  """Restores a params-only checkpoint into the layout of `abstract_params`.

  `abstract_params` is a pytree of jax.ShapeDtypeStruct with `.sharding` set
  (as for Checkpointer.restore_params); arrays are read straight into those
  shardings and cast to the target dtypes. The tree structure and shapes must
  match the saved ones, else UserInputError (one line); no checkpoint at
  `directory` -> FileNotFoundError. Every leaf is checked against the checksum
  save_params recorded; a mismatch, or files orbax cannot read, raise
  CorruptCheckpointError (one line, naming `directory`).
  """
  directory = _require_params_checkpoint(directory)
  where = f'params checkpoint at {directory}'
  item_dir = directory / _PARAMS_ITEM
  expected = _read_metadata_file(directory).get(_PARAMS_CHECKSUMS)
  try:
    stored = _tree_metadata(item_dir)
  except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
    raise _unreadable(where, error) from None
  check_matches(directory, stored, abstract_params)  # outside the try: a UserInputError
  # The checksums are of the arrays as saved, so read them in their stored dtype (into the
  # target shardings), verify, and only then cast to the dtypes asked for.
  stored_dtypes = {name: meta.dtype for name, meta in leaves_by_name(stored).items()}
  read_as = jax.tree_util.tree_map_with_path(
    lambda path, leaf: jax.ShapeDtypeStruct(
      leaf.shape,
      stored_dtypes[jax.tree_util.keystr(path, simple=True, separator='/')],
      sharding=getattr(leaf, 'sharding', None),
    ),
    abstract_params,
  )
  try:
    with ocp.StandardCheckpointer() as reader:
      restored = reader.restore(item_dir, read_as)
  except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable".
    raise _unreadable(where, error) from None
  verify_leaves(where, restored, expected)
  return jax.tree.map(
    lambda x, leaf: x if x.dtype == leaf.dtype else x.astype(leaf.dtype), restored, abstract_params
  )
