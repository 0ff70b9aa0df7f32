"""Checkpoint averaging, as in the paper: the mean of the last N checkpoints' parameters.

`python -m transformer_jax.average --workdir=DIR --last=5` (paper: 5 for base, 20 for big)
reads DIR/checkpoints (the step checkpoints written by training) and writes the element-wise
mean of the parameters of the newest N of them to DIR/averaged, a params-only checkpoint (see
checkpointing.save_params) with metadata {'averaged_steps': [...], 'latest_step': ...}.

No model is built: each checkpoint's params are read to host NumPy using the checkpoint's own
stored shapes and dtypes, one checkpoint at a time, and summed in float64 (memory: the float64
sum plus one checkpoint's params, however large N is). The mean is cast back to each leaf's
stored dtype. Only N checkpoints still on disk can be averaged: training keeps the last
`keep_checkpoints`, so --last=5 needs keep_checkpoints >= 5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.checkpointing import Checkpointer, save_params
from transformer_jax.errors import UserInputError
from transformer_jax.progress import progress
from transformer_jax.workdir import Workdir


def _describe(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='/')


def average_checkpoints(workdir: str, last: int) -> dict:
  """Averages the params of the newest `last` checkpoints of `workdir` into `workdir`/averaged.

  Fewer than `last` checkpoints on disk: averages all of them, with a warning. Returns the
  saved metadata plus 'path' (the absolute output directory):
  {'averaged_steps': [ascending steps], 'latest_step': int, 'last_requested': int, 'path': str}.
  Raises UserInputError for `last` < 1, no checkpoints, or checkpoints whose parameter trees
  differ (e.g. a workdir reused for another model).
  """
  if isinstance(last, bool) or not isinstance(last, (int, np.integer)) or last < 1:
    raise UserInputError(f'--last must be a positive number of checkpoints, got {last!r}')
  last = int(last)
  workdir = Workdir(workdir)
  checkpoint_dir = workdir.checkpoints
  if not checkpoint_dir.is_dir():  # do not let the Checkpointer create it
    raise UserInputError(f'no checkpoints in {checkpoint_dir}')
  # keep=None: opening read-only must never prune anything.
  with Checkpointer(checkpoint_dir, keep=None, async_save=False) as checkpointer:
    steps = checkpointer.all_steps()
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
    chosen = steps[-last:]
    reference = None  # (treedef, [(name, shape, dtype)]) of the first checkpoint read
    sums: list[np.ndarray | None] = []
    latest_leaves: list[np.ndarray | None] = []
    for step in progress(chosen, unit='steps', description=f'averaging {checkpoint_dir}'):
      params = checkpointer.restore_params_to_host(step)
      flat, treedef = jax.tree_util.tree_flatten_with_path(params)
      signature = [(_describe(path), np.shape(leaf), np.asarray(leaf).dtype) for path, leaf in flat]
      if reference is None:
        reference = (treedef, signature)
        # Floating leaves are averaged; any other leaf keeps the newest checkpoint's value.
        sums = [
          np.zeros(shape, np.float64) if jnp.issubdtype(dtype, jnp.floating) else None
          for _, shape, dtype in signature
        ]
      elif (treedef, signature) != reference:
        raise UserInputError(
          f'{checkpoint_dir}: step {step} has different parameters than step {chosen[0]} '
          f'({_first_difference(reference[1], signature)}); cannot average them'
        )
      for index, (_, leaf) in enumerate(flat):
        if sums[index] is not None:
          sums[index] += np.asarray(leaf, np.float64)
      latest_leaves = [
        None if total is not None else np.asarray(leaf) for total, (_, leaf) in zip(sums, flat)
      ]
      del params, flat
  treedef, signature = reference
  count = len(chosen)
  averaged = [
    (total / count).astype(dtype) if total is not None else latest
    for total, latest, (_, _, dtype) in zip(sums, latest_leaves, signature)
  ]
  del sums
  metadata = {
    'averaged_steps': [int(s) for s in chosen],
    'latest_step': int(chosen[-1]),
    'last_requested': last,
  }
  path = save_params(workdir.averaged, jax.tree_util.tree_unflatten(treedef, averaged), metadata)
  return dict(metadata, path=path)


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
