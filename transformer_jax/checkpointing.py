"""Checkpointing of training state plus input-pipeline position, via orbax.

This is the only module in the project that imports orbax: orbax's API moves
quickly between releases, so it is kept behind one small class. Written against
orbax-checkpoint 0.12.8.

Each checkpoint step holds two items:
  * 'state': the training-state pytree (e.g. a flax TrainState), saved with
    StandardSave. Only pytree leaves are written; static fields such as
    TrainState.apply_fn / tx live in the treedef and are never serialized.
  * 'data': a small JSON dict (input-pipeline position), saved with JsonSave.

Restoring takes an *abstract* state (jax.ShapeDtypeStruct leaves with
`.sharding` set) so arrays are read straight into the target sharding. This is
what makes a checkpoint written on one device layout loadable on another.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

_STATE = 'state'
_DATA = 'data'


class Checkpointer:
  """Keeps the last `keep` checkpoints of (state, data_state) in `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    # orbax requires an absolute path; normalising here lets callers pass
    # relative paths and gives a stable string for error messages.
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(_STATE, _DATA))

  # ---- queries ----

  def latest_step(self) -> int | None:
    """Newest finalized step, or None when the directory has no checkpoint."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All finalized steps still on disk, ascending."""
    return sorted(self._manager.all_steps())

  # ---- save ----

  def save(self, step: int, state: Any, data_state: dict | None = None, *,
           force: bool = False) -> bool:
    """Dispatches a save of `state` and `data_state` at `step`.

    With async saving this returns once device arrays are copied off and the
    write is running in the background; call `wait_until_finished` to block.
    `force` saves even if the manager's save policy would skip this step.
    Returns whether a save was started.
    """
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(state),
        _DATA: ocp.args.JsonSave(dict(data_state or {})),
    })
    return bool(self._manager.save(int(step), args=args, force=force))

  # ---- restore ----

  def _resolve_step(self, step: int | None) -> int:
    """Maps None to the latest step; raises FileNotFoundError if absent."""
    # An in-flight async save is not yet visible as a step; finish it first so
    # "save then restore" in the same process behaves as expected.
    self._manager.wait_until_finished()
    if step is None:
      latest = self._manager.latest_step()
      if latest is None:
        raise FileNotFoundError(f'no checkpoint in {self.directory}')
      return latest
    steps = self.all_steps()
    if int(step) not in steps:
      raise FileNotFoundError(
          f'no checkpoint for step {step} in {self.directory} '
          f'(available steps: {steps})')
    return int(step)

  def restore(self, abstract_state: Any,
              step: int | None = None) -> tuple[Any, dict]:
    """Restores (state, data_state) at `step` (None = latest).

    `abstract_state` is a pytree of jax.ShapeDtypeStruct whose `.sharding`
    says where each restored array should live (e.g. from jax.eval_shape plus
    attached shardings). Its tree structure, including static fields, is used
    for the returned state.
    """
    step = self._resolve_step(step)
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract_state),
        _DATA: ocp.args.JsonRestore(),
    }))
    # JsonRestore returns None if the item was never written; normalise.
    return restored[_STATE], dict(restored[_DATA] or {})

  def restore_params(self, abstract_params: Any,
                     step: int | None = None) -> Any:
    """Restores only `state.params` at `step` (None = latest).

    For inference: no optimizer-state shapes are needed. StandardRestore in
    orbax 0.12.8 has no partial-restore option, so we read the 'state' item
    directory with a plain PyTreeCheckpointHandler and `partial_restore=True`,
    which skips every saved leaf not named in the target tree. The on-disk
    tree stores dataclass fields by name, so {'params': ...} addresses the
    TrainState's `params` field.
    """
    step = self._resolve_step(step)
    # Locate the step folder the same way the manager names it (default name
    # format: plain step number) instead of hard-coding the naming scheme.
    name_format = ocp.step.standard_name_format()
    step_dir = name_format.find_step(self.directory, step).path
    item_dir = step_dir / _STATE
    target = {'params': abstract_params}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
      restored = reader.restore(item_dir, args=ocp.args.PyTreeRestore(
          item=target, restore_args=restore_args, partial_restore=True))
    return restored['params']

  # ---- lifecycle ----

  def wait_until_finished(self) -> None:
    """Blocks until any background save has been committed to disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves, then releases orbax's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
