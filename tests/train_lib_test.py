"""Training: the loss falls, a resumed run equals an uninterrupted one, bad configs are refused."""

import os

import jax
import numpy as np
import pytest

from conftest import tiny_config
from transformer_jax import input_pipeline, train_lib
from transformer_jax.checkpointing import Checkpointer
from transformer_jax.config import UserInputError
from transformer_jax.tokenizer import Tokenizer
from transformer_jax.translate import Translator


def _final_params(workdir):
  """(latest step, its parameters) of a workdir, restored on one device."""
  with Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False) as checkpointer:
    step = checkpointer.latest_step()
  return step, Translator.from_checkpoint(workdir, step).params


def test_shift_right_starts_with_bos():
  targets = np.array([[5, 6, 1, 0], [7, 1, 0, 0]])
  np.testing.assert_array_equal(train_lib.shift_right(targets),
                                [[2, 5, 6, 1], [2, 7, 1, 0]])


def test_training_lowers_the_loss(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 80
  config.warmup_steps = 20
  config.learning_rate_scale = 0.15  # Peak lr 0.15 * 32^-0.5 * 20^-0.5 = 5.9e-3.
  config.eval_every_steps = 80
  config.checkpoint_every_steps = 80
  metrics = train_lib.train_and_evaluate(config, str(tmp_path))

  # The same model untrained (same seed, same vocabulary), on the same validation batches.
  tokenizer = Tokenizer.load(str(tmp_path / 'vocab.model'))
  trainer = train_lib.Trainer(config, train_lib.model_config_from(config, tokenizer.vocab_size))
  sources = input_pipeline.load_data_sources(config, data_dir)
  split = input_pipeline.TokenizedSplit.build(sources['validation'], tokenizer, config)
  batches = input_pipeline.make_eval_batches(split, config, batch_size=64)
  untrained = trainer.evaluate(trainer.init_state(config.seed).params, batches)

  assert untrained['loss'] > 3.5, untrained  # ~log(96) minus the smoothing entropy.
  assert metrics['loss'] < 0.6 * untrained['loss'], (metrics, untrained)
  assert metrics['token_accuracy'] > 0.4, metrics


def test_resumed_run_equals_uninterrupted_run(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 8
  train_lib.train_and_evaluate(config, str(tmp_path / 'straight'))

  interrupted = str(tmp_path / 'interrupted')
  config.num_train_steps = 4
  train_lib.train_and_evaluate(config, interrupted)
  config.num_train_steps = 8
  train_lib.train_and_evaluate(config, interrupted)  # Same command again: resumes at 4.

  step_a, params_a = _final_params(str(tmp_path / 'straight'))
  step_b, params_b = _final_params(interrupted)
  assert step_a == step_b == 8
  for a, b in zip(jax.tree_util.tree_leaves(params_a), jax.tree_util.tree_leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # Bitwise.


def test_resume_with_a_different_model_is_refused(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 4
  train_lib.train_and_evaluate(config, str(tmp_path))
  config.model.d_ff = 128
  with pytest.raises(UserInputError, match='model.d_ff: 64 -> 128'):
    train_lib.train_and_evaluate(config, str(tmp_path))
  config.model.d_ff = 64
  config.seed = 1
  with pytest.raises(UserInputError, match='seed: 0 -> 1'):
    train_lib.train_and_evaluate(config, str(tmp_path))
  # Safe fields may change: more steps and other intervals resume fine.
  config.seed = 0
  config.num_train_steps = 6
  config.log_every_steps = 2
  config.checkpoint_every_steps = 3
  train_lib.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize('field, value', [('per_device_batch_size', 0),
                                          ('num_train_steps', -5)])
def test_invalid_config_names_the_field(tmp_path, data_dir, field, value):
  config = tiny_config(data_dir)
  config[field] = value
  with pytest.raises(UserInputError, match=f'config.{field}'):
    train_lib.train_and_evaluate(config, str(tmp_path))


def test_invalid_model_size_names_the_field(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.model.num_heads = 3  # 32 is not divisible by 3.
  with pytest.raises(UserInputError, match='d_model=32 is not divisible by num_heads=3'):
    train_lib.train_and_evaluate(config, str(tmp_path))


# Eight devices equal one: tests/sharding_test.py trains the same tiny model for two steps on
# one device and on meshes (8, 1, 1), (1, 8, 1) and (2, 1, 4) and compares loss and parameters.
