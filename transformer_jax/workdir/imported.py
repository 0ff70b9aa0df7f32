"""The rules for a workdir made from a pretrained model (`python -m transformer_jax.import_marian`;
written by `importers.workdir_writer`), in one place:

    DIR/config.json   {'config': a run config (configs/default.py with the model's fields),
                       'model': the TransformerConfig, 'imported_from': where it came from}
    DIR/vocab.model   the model's vocabulary, a SentencePiece model in our id order
    DIR/target_vocab.model  optional: the same pieces and ids, segmenting target text as the
                      model's training did (OPUS-MT's target.spm), for fine-tuning
    DIR/imported/     the parameters, a params-only checkpoint (as DIR/averaged/)

1. Architecture (`adopt`): a run in an imported workdir takes the model's architecture and
   vocabulary whatever the command line says (a flag cannot resize a trained model); the data,
   the schedule and the training-only model fields (`model.config.TRAINING_ONLY_FIELDS`) are
   the command line's.
2. Resuming (`resume_baseline`): until fine-tuning has saved its first checkpoint, the data
   and training fields may differ from config.json's; afterwards resuming follows the usual
   rules (`training.run_config.save_run_config`). config.json keeps its 'imported_from'.
   The vocabulary is the imported parameters' from the start: the first fine-tuning run
   records its hash (config.json's 'identity'), and from then on a run with another one, or
   with none, is refused (`training.run_config.check_resume`); the data's identity is compared
   only once fine-tuning has saved a checkpoint.
3. Parameters (`imported_params_are_latest`): until training has saved a checkpoint, the
   imported parameters are the workdir's latest: translation serves them
   (`checkpoints.served`) and fine-tuning starts from them with a fresh optimiser state
   (`training.loop`).

The facts about checkpoints are the callers' to give (`trained`): the workdir layer sits below
the checkpoints.
"""

from __future__ import annotations

import ml_collections
from absl import logging

from transformer_jax.model.config import architecture_fields
from transformer_jax.workdir.layout import Workdir

# The key of config.json that marks an imported workdir (its value: where the model came from).
IMPORTED_KEY = 'imported_from'


def is_imported(saved: dict | None) -> bool:
  """Whether a saved run config (`Workdir.read_run_config_if_present`) is an imported model's."""
  return saved is not None and isinstance(saved.get(IMPORTED_KEY), dict)


def adopt(config: ml_collections.ConfigDict, workdir: Workdir) -> None:
  """Rule 1: for a run in an imported workdir, the model's architecture and vocabulary into
  `config` (in place), logging any field the command line set otherwise. Other workdirs:
  nothing."""
  saved = workdir.read_run_config_if_present()
  if not is_imported(saved):
    return
  changed = []
  for name in architecture_fields():
    value = saved['model'][name]
    if config.model[name] != value:
      changed.append(f'model.{name}: {config.model[name]!r} -> {value!r}')
      config.model[name] = value
  for name, value in (
    ('vocab_size', saved['model']['vocab_size']),
    ('vocab_model_type', saved['config']['vocab_model_type']),
  ):
    if config[name] != value:
      changed.append(f'{name}: {config[name]!r} -> {value!r}')
      config[name] = value
  if changed:
    logging.info(
      '%s holds an imported model: its architecture and vocabulary replace the config (%s)',
      workdir.path,
      ', '.join(changed),
    )


def resume_baseline(saved: dict | None, trained: bool) -> tuple[dict | None, dict]:
  """Rule 2: (the saved run config a new run must agree with, or None where any may be
  given; the entries config.json carries over) for the saved config `saved` of a workdir
  where training has (`trained`) or has not saved a checkpoint yet."""
  if not is_imported(saved):
    return saved, {}
  carried = {IMPORTED_KEY: saved[IMPORTED_KEY]}
  return (saved if trained else None), carried


def imported_params_are_latest(workdir: Workdir, trained: bool) -> bool:
  """Rule 3: whether the workdir's latest parameters are the imported ones (`workdir.imported`):
  an imported workdir where training (`trained`) has not saved a checkpoint yet."""
  return (
    not trained and is_imported(workdir.read_run_config_if_present()) and workdir.imported.exists()
  )
