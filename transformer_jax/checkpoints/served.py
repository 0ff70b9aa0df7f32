"""Which parameters a workdir serves (translate, evaluate, export, serve): a step, 'latest',
'averaged', 'best' (the step training kept by config.best_checkpoint_metric), or by default
the average where it is up to date with the latest checkpoint, else the latest checkpoint, else
an imported model's parameters (`workdir.imported`, rule 3)."""

from __future__ import annotations

from absl import logging

from transformer_jax.checkpoints import best
from transformer_jax.checkpoints.checkpointer import (
  Checkpointer,
  is_params_checkpoint,
  read_metadata,
  restore_params_from,
)
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.workdir import imported
from transformer_jax.workdir.layout import Workdir


def restore_served_params(workdir: Workdir, checkpoint: int | str | None, abstract_params):
  """The parameters `checkpoint` names (None: the default choice of the module docstring),
  restored to the structure, shapes and shardings of `abstract_params`."""
  if not (checkpoint in (None, 'averaged', 'best', 'latest') or is_integer(checkpoint)):
    raise UserInputError(
      f"checkpoint must be a step number, 'averaged', 'best' or 'latest', got {checkpoint!r}"
    )
  averaged = workdir.averaged
  with Checkpointer(workdir.checkpoints, keep=None, async_save=False) as checkpointer:
    if checkpoint == 'averaged' or (checkpoint is None and is_params_checkpoint(averaged)):
      if not is_params_checkpoint(averaged):
        raise FileNotFoundError(
          f'no averaged checkpoint in {averaged}: run '
          f'`python -m transformer_jax.average --workdir={workdir.path}`'
        )
      made_from = read_metadata(averaged).get('latest_step')
      latest = checkpointer.latest_step()
      if checkpoint == 'averaged' or made_from == latest:
        logging.info(
          'loading the average of checkpoints %s from %s',
          read_metadata(averaged).get('averaged_steps'),
          averaged,
        )
        return restore_params_from(averaged, abstract_params)
      logging.warning(
        '%s was made up to step %s but the latest checkpoint is %s; loading the '
        'latest (rerun transformer_jax.average to refresh it)',
        averaged,
        made_from,
        latest,
      )
    if checkpoint == 'best':
      return checkpointer.restore_params(abstract_params, _best_step(workdir, checkpointer))
    step = None if checkpoint in (None, 'latest') else int(checkpoint)
    trained = checkpointer.latest_step() is not None
    if step is None and imported.imported_params_are_latest(workdir, trained):
      logging.info('loading the imported model from %s', workdir.imported)
      return restore_params_from(workdir.imported, abstract_params)
    return checkpointer.restore_params(abstract_params, step)


def _best_step(workdir: Workdir, checkpointer: Checkpointer) -> int:
  """The best step the latest checkpoint records (`checkpoints.best`)."""
  latest = checkpointer.latest_step()
  data_state = {} if latest is None else checkpointer.read_data_state(latest)
  step = best.best_step(data_state)
  record = data_state.get(best.DATA_KEY)
  if step is None and record and record.get('metric') in best.METRIC_MODES:
    # Judged, but never by a finite value (every evaluation NaN): no best exists yet.
    judged = best.BestCheckpoint.from_json(record, record['metric'], 0)
    raise UserInputError(
      f'{workdir.path} records no best checkpoint yet ({judged.describe()}): '
      '--checkpoint=latest or a step loads one'
    )
  if step is None:
    raise UserInputError(
      f'{workdir.path} records no best checkpoint: train with '
      'config.best_checkpoint_metric (e.g. --config.best_checkpoint_metric=bleu)'
    )
  logging.info('loading the best checkpoint, step %d, from %s', step, checkpointer.directory)
  return step
