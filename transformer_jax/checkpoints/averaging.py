"""Checkpoint averaging, as in the paper: the mean of the last N checkpoints' parameters.

`python -m transformer_jax.average --workdir=DIR --last=5` (paper: 5 for base, 20 for big)
reads DIR/checkpoints (the step checkpoints written by training) and writes the element-wise
mean of the parameters of the newest N of them to DIR/averaged, a params-only checkpoint (see
checkpointer.save_params) with metadata {'averaged_steps': [...], 'latest_step': ...}.

No model is built: each checkpoint's params are read to host NumPy using the checkpoint's own
stored shapes and dtypes, one checkpoint at a time, and summed in float64 (memory: the float64
sum plus one checkpoint's params, however large N is). The mean is cast back to each leaf's
stored dtype. Only N checkpoints still on disk can be averaged: training keeps the last
`keep_checkpoints`, so --last=5 needs keep_checkpoints >= 5.

It may run while training goes on in the same workdir: the directory is listed afresh (not
through the checkpoint library's cached listing), a checkpoint still being saved or being
pruned is skipped, also when it goes while being read
(`checkpointer.restore_complete_params_to_host`), and the log names every one skipped.

A disk that fails the write (full, over quota, read-only: `errors.STORAGE_ERRNOS`) is a
StorageError naming DIR/averaged (the command: one line, exit status 4); the previous averaged
checkpoint, if any, stays as it was, and no staging folder is left (`save_params`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.checkpoints.checkpointer import (
  list_steps,
  restore_complete_params_to_host,
  save_params,
)
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.progress import progress
from transformer_jax.workdir.layout import Workdir


def _describe(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='/')


def average_checkpoints(workdir: str, last: int) -> dict:
  """Averages the params of the newest `last` checkpoints of `workdir` into `workdir`/averaged.

  Fewer than `last` checkpoints on disk: averages all of them, with a warning. Safe while a
  training run saves and prunes checkpoints in the same workdir: a checkpoint still being
  written, or being deleted (before or while it is read), is skipped with a warning naming it,
  and the newest complete one not yet used takes its place. Returns the saved metadata plus
  'path' (the absolute output directory) and 'skipped_steps':
  {'averaged_steps': [ascending steps], 'latest_step': int, 'last_requested': int, 'path': str,
  'skipped_steps': [ascending steps]}.
  Raises UserInputError for `last` < 1, no checkpoints, a workdir it cannot write to, or
  checkpoints whose parameter trees differ (e.g. a workdir reused for another model);
  StorageError if the disk fails the write (the previous averaged checkpoint is kept).
  """
  if isinstance(last, bool) or not isinstance(last, (int, np.integer)) or last < 1:
    raise UserInputError(f'--last must be a positive number of checkpoints, got {last!r}')
  last = int(last)
  workdir = Workdir(workdir)
  checkpoint_dir = workdir.checkpoints
  if not checkpoint_dir.is_dir():
    raise UserInputError(f'no checkpoints in {checkpoint_dir}')
  workdir.check_writable()  # The result goes there: say so before reading anything.
  steps, incomplete = list_steps(checkpoint_dir)
  if incomplete:
    logging.warning(
      'skipping incomplete checkpoint(s) %s in %s: being written or deleted by a training run, '
      'or left so by one that was killed',
      _joined(incomplete),
      checkpoint_dir,
    )
  if not steps:
    raise UserInputError(f'no checkpoints in {checkpoint_dir}')
  if len(steps) < last:
    logging.warning(
      'only %d checkpoint(s) in %s (steps %s) but --last=%d: averaging all %d',
      len(steps),
      checkpoint_dir,
      steps,
      last,
      len(steps),
    )
  to_read = steps[-last:]
  mean = _Mean(checkpoint_dir)
  pruned = []  # Deleted while being read.
  with progress(total=len(to_read), unit='steps', description=f'averaging {checkpoint_dir}') as bar:
    while to_read:
      step = to_read.pop(0)
      params = restore_complete_params_to_host(checkpoint_dir, step)
      if params is None:
        pruned.append(step)
        unused = set(list_steps(checkpoint_dir)[0]) - set(mean.steps + pruned + to_read)
        if unused:  # Usually a newer one, saved meanwhile by the run that pruned this one.
          to_read.append(max(unused))
        continue
      mean.add(step, params)
      del params
      bar.update(1)
  if pruned:
    logging.warning(
      'checkpoint(s) %s in %s were deleted while being read (a training run prunes old '
      'checkpoints): averaged steps %s instead',
      _joined(pruned),
      checkpoint_dir,
      _joined(sorted(mean.steps)),
    )
  if not mean.steps:
    raise UserInputError(
      f'no checkpoints in {checkpoint_dir}: steps {_joined(pruned)} were deleted while being read'
    )
  metadata = {
    'averaged_steps': sorted(mean.steps),
    'latest_step': max(mean.steps),
    'last_requested': last,
  }
  path = save_params(workdir.averaged, mean.result(), metadata)
  return dict(metadata, path=path, skipped_steps=sorted(set(incomplete) | set(pruned)))


def _joined(steps) -> str:
  return ', '.join(str(step) for step in steps)


class _Mean:
  """The element-wise mean of params trees added one at a time, summed in float64.

  Floating leaves are averaged; any other leaf keeps the newest (highest-step) tree's value.
  Every tree must have the first one's structure, shapes and dtypes.
  """

  def __init__(self, checkpoint_dir):
    self.checkpoint_dir = checkpoint_dir
    self.steps: list[int] = []  # In the order added.
    self._reference = None  # (treedef, [(name, shape, dtype)]) of the first tree
    self._sums: list[np.ndarray | None] = []
    self._newest_leaves: list[np.ndarray | None] = []

  def add(self, step: int, params) -> None:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    signature = [(_describe(path), np.shape(leaf), np.asarray(leaf).dtype) for path, leaf in flat]
    if self._reference is None:
      self._reference = (treedef, signature)
      self._sums = [
        np.zeros(shape, np.float64) if jnp.issubdtype(dtype, jnp.floating) else None
        for _, shape, dtype in signature
      ]
    elif (treedef, signature) != self._reference:
      raise UserInputError(
        f'{self.checkpoint_dir}: step {step} has different parameters than step '
        f'{self.steps[0]} ({_first_difference(self._reference[1], signature)}); cannot '
        'average them'
      )
    for total, (_, leaf) in zip(self._sums, flat):
      if total is not None:
        total += np.asarray(leaf, np.float64)
    if not self.steps or step > max(self.steps):
      self._newest_leaves = [
        None if total is not None else np.asarray(leaf)
        for total, (_, leaf) in zip(self._sums, flat)
      ]
    self.steps.append(step)

  def result(self):
    treedef, signature = self._reference
    count = len(self.steps)
    averaged = [
      (total / count).astype(dtype) if total is not None else newest
      for total, newest, (_, _, dtype) in zip(self._sums, self._newest_leaves, signature)
    ]
    return jax.tree_util.tree_unflatten(treedef, averaged)


def _first_difference(reference, signature) -> str:
  by_name = {name: (shape, dtype) for name, shape, dtype in reference}
  other = {name: (shape, dtype) for name, shape, dtype in signature}
  for name in sorted(set(by_name) | set(other)):
    if name not in other:
      return f'{name} missing'
    if name not in by_name:
      return f'unexpected {name}'
    if by_name[name] != other[name]:
      (shape_a, dtype_a), (shape_b, dtype_b) = by_name[name], other[name]
      return f'{name}: {shape_b} {dtype_b} vs {shape_a} {dtype_a}'
  return 'tree structure differs'
