"""The best checkpoint by a validation metric, and early stopping (`checkpoints.best`)."""

import logging
import math
import os

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transformer_jax.checkpoints.best import BestCheckpoint
from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common.errors import UserInputError
from transformer_jax.inference.translator import Translator
from transformer_jax.training import loop

from conftest import tiny_config

_VALUES = st.lists(
  st.one_of(st.floats(-5, 5, allow_nan=False), st.just(math.nan)), min_size=1, max_size=30
)


@given(values=_VALUES, patience=st.integers(0, 5))
def test_the_record_is_the_first_best_and_the_evaluations_since(values, patience):
  for metric, better in (('loss', min), ('bleu', max)):
    best = BestCheckpoint(metric, patience)
    improvements = [best.update(step, value) for step, value in enumerate(values, 1)]
    finite = [(value, step) for step, value in enumerate(values, 1) if not math.isnan(value)]
    if not finite:
      assert best.step is None and best.value is None and not any(improvements)
      continue
    value = better(v for v, _ in finite)
    first = min(step for v, step in finite if v == value)  # A tie is no improvement.
    assert (best.step, best.value) == (first, value)
    assert improvements[first - 1] and not any(improvements[first:])
    assert best.evaluations_since == len(values) - first
    assert best.exhausted == (patience > 0 and len(values) - first >= patience)
    # The record survives a checkpoint's JSON; another metric starts afresh.
    again = BestCheckpoint.from_json(best.to_json(), metric, patience)
    assert again == best
    assert BestCheckpoint.from_json(best.to_json(), 'chrf', patience).step is None


def test_the_checkpointer_keeps_the_best_beyond_the_last(tmp_path):
  checkpointer = Checkpointer(str(tmp_path / 'checkpoints'), keep=2, async_save=False)
  kept = []
  for step in range(1, 8):
    if step in (2, 6):
      checkpointer.keep_also({2: 2, 6: 5}[step])
    checkpointer.save(step, {'w': np.full(3, step, np.float32)}, {'note': step})
    kept.append(checkpointer.all_steps())
  assert kept[1:] == [[1, 2], [2, 3], [2, 3, 4], [2, 4, 5], [5, 6], [5, 6, 7]]
  assert checkpointer.read_data_state(5) == {'note': 5}
  checkpointer.close()
  # A checkpointer that is told of no best prunes it as any old step.
  checkpointer = Checkpointer(str(tmp_path / 'checkpoints'), keep=2, async_save=False)
  checkpointer.save(8, {'w': np.zeros(3, np.float32)})
  assert checkpointer.all_steps() == [7, 8]
  checkpointer.close()


# The validation loss each evaluation reports in the test below, by step (the rest of the
# evaluation is real): bests at 2, 4, 8, then 14 once the patience is raised.
_SCRIPTED_LOSS = {
  2: 5.0, 4: 4.0, 6: 4.5, 8: 3.0, 10: 3.0, 12: 3.5,
  14: 2.0, 16: 2.5, 18: 2.5, 20: 2.1,
}  # fmt: skip


def _steps_on_disk(workdir):
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as checkpointer:
    return checkpointer.all_steps()


def test_early_stopping_keeps_the_best_and_resumes_as_uninterrupted(
  tmp_path, data_dir, monkeypatch
):
  evaluate = loop._Run.evaluate

  def scripted(run, params, step):
    result = evaluate(run, params, step)
    return dict(result, loss=_SCRIPTED_LOSS.get(step, result['loss']))

  monkeypatch.setattr(loop._Run, 'evaluate', scripted)
  config = tiny_config(data_dir)
  config.num_train_steps = 100
  config.eval_every_steps = 2
  config.checkpoint_every_steps = 5
  config.keep_checkpoints = 1
  config.best_checkpoint_metric = 'loss'
  config.early_stopping_patience = 2

  # 6 (4.5) and 10 (a tie) do not improve on 4 and 8; 12 is the second evaluation in a row
  # without a better loss: the run stops there, and keeps 8 beside its last checkpoint.
  uninterrupted = tmp_path / 'uninterrupted'
  loop.train_and_evaluate(config, str(uninterrupted))
  assert _steps_on_disk(uninterrupted) == [8, 12]
  # Rerun: the patience has run out, nothing is trained.
  loop.train_and_evaluate(config, str(uninterrupted))
  assert _steps_on_disk(uninterrupted) == [8, 12]

  # --checkpoint=best is step 8: the parameters of the same run stopped at 8.
  reference = tmp_path / 'reference'
  config.num_train_steps, config.best_checkpoint_metric, config.early_stopping_patience = 8, '', 0
  loop.train_and_evaluate(config, str(reference))
  best_params = Translator.from_checkpoint(str(uninterrupted), 'best').params
  reference_params = Translator.from_checkpoint(str(reference), 8).params
  jax.tree_util.tree_map(np.testing.assert_array_equal, best_params, reference_params)
  with pytest.raises(UserInputError, match='records no best checkpoint'):
    Translator.from_checkpoint(str(reference), 'best')

  # Cut at step 9 (its last-step evaluation is not judged) and resumed: the same stop at 12,
  # the same parameters, bit for bit.
  resumed = tmp_path / 'resumed'
  config.num_train_steps, config.best_checkpoint_metric, config.early_stopping_patience = (
    9,
    'loss',
    2,
  )
  loop.train_and_evaluate(config, str(resumed))
  assert _steps_on_disk(resumed) == [8, 9]
  config.num_train_steps = 100
  loop.train_and_evaluate(config, str(resumed))
  assert _steps_on_disk(resumed) == [8, 12]
  jax.tree_util.tree_map(
    np.testing.assert_array_equal,
    Translator.from_checkpoint(str(resumed), 'latest').params,
    Translator.from_checkpoint(str(uninterrupted), 'latest').params,
  )

  # A larger patience trains on: 14 is a new best, and 16, 18, 20 are three without one.
  config.early_stopping_patience = 3
  loop.train_and_evaluate(config, str(resumed))
  assert _steps_on_disk(resumed) == [14, 20]


@pytest.mark.parametrize(
  'fields, message',
  [
    ({'best_checkpoint_metric': 'perplexity'}, r'config\.best_checkpoint_metric must be one of'),
    ({'best_checkpoint_metric': 'chrf'}, r'config\.eval_decode_examples is 0'),
    (
      {'best_checkpoint_metric': 'bleu', 'eval_decode_examples': 16},
      r"config\.best_checkpoint_metric='bleu'.* reports no BLEU",
    ),
    ({'early_stopping_patience': 3}, r'config\.best_checkpoint_metric, which is not set'),
    (
      {'best_checkpoint_metric': 'loss', 'early_stopping_patience': -1},
      r'config\.early_stopping_patience',
    ),
  ],
)
def test_invalid_settings_are_refused_before_any_work(tmp_path, data_dir, fields, message):
  config = tiny_config(data_dir)
  config.update(fields)
  with pytest.raises(UserInputError, match=message):
    loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_a_nan_first_evaluation_stops_in_one_line_and_the_run_resumes(
  tmp_path, data_dir, monkeypatch, caplog
):
  # Issue 51 item 3: the first judged evaluation's loss is NaN (the rest of it is real) and the
  # patience is 1. A NaN is never the best, and counts as an evaluation without improvement:
  # the run stops there in one log line that says no finite loss was seen (this crashed
  # formatting the best value None, at the stop and again at every resume).
  evaluate = loop._Run.evaluate
  losses = {2: math.nan}

  def scripted(run, params, step):
    result = evaluate(run, params, step)
    return dict(result, loss=losses.get(step, result['loss']))

  monkeypatch.setattr(loop._Run, 'evaluate', scripted)
  config = tiny_config(data_dir)
  config.eval_every_steps = 2
  config.keep_checkpoints = 1
  config.best_checkpoint_metric = 'loss'
  config.early_stopping_patience = 1
  workdir = str(tmp_path / 'run')

  def messages():
    return [r.getMessage() for r in caplog.records if 'early_stopping_patience' in r.getMessage()]

  with caplog.at_level(logging.INFO):
    loop.train_and_evaluate(config, workdir)
  assert _steps_on_disk(workdir) == [2]
  assert messages() == [
    'config.early_stopping_patience (1) ran out (no finite validation loss in 1 evaluation): '
    'stopped at step 2 of 8, checkpoint saved'
  ]
  with pytest.raises(
    UserInputError,
    match=r'records no best checkpoint yet \(no finite validation loss in 1 evaluation\)',
  ):
    Translator.from_checkpoint(workdir, 'best')

  # Rerun: the patience has run out, nothing is trained, and it says so (no traceback).
  caplog.clear()
  with caplog.at_level(logging.INFO):
    loop.train_and_evaluate(config, workdir)
  assert _steps_on_disk(workdir) == [2]
  assert messages() == [
    'config.early_stopping_patience (1) ran out at step 2 (no finite validation loss in 1 '
    'evaluation); nothing to train'
  ]

  # A larger patience resumes from 2: 4 is the first finite loss, so the best.
  losses.update({4: 3.0, 6: 2.0, 8: 2.5})
  config.early_stopping_patience = 3
  loop.train_and_evaluate(config, workdir)
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as checkpointer:
    assert checkpointer.all_steps() == [6, 8]
    record = checkpointer.read_data_state(8)['best_checkpoint']
  assert (record['step'], record['value'], record['evaluations_since']) == (6, 2.0, 1)
