"""Training: the loss falls, a resumed run equals an uninterrupted one, bad configs are refused."""

import functools
import os

import flax
import jax
import numpy as np
import pytest

from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common.errors import UserInputError
from transformer_jax.data import input_pipeline
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.inference.translator import Translator
from transformer_jax.training import loop, metric_writers, optim, run_config
from transformer_jax.training import step as training_step
from transformer_jax.training import trainer as training_trainer
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config


def _final_params(workdir):
  """(latest step, its parameters) of a workdir, restored on one device."""
  with Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False) as checkpointer:
    step = checkpointer.latest_step()
  return step, Translator.from_checkpoint(workdir, step).params


def test_shift_right_starts_with_bos():
  targets = np.array([[5, 6, 1, 0], [7, 1, 0, 0]])
  np.testing.assert_array_equal(training_step.shift_right(targets), [[2, 5, 6, 1], [2, 7, 1, 0]])


def test_training_lowers_the_loss(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 80
  config.warmup_steps = 20
  config.learning_rate_scale = 0.15  # Peak lr 0.15 * 32^-0.5 * 20^-0.5 = 5.9e-3.
  config.eval_every_steps = 80
  config.checkpoint_every_steps = 80
  metrics = loop.train_and_evaluate(config, str(tmp_path))

  # The same model untrained (same seed, same vocabulary), on the same validation batches.
  tokenizer = Tokenizer.load(str(tmp_path / 'vocab.model'))
  trainer = training_trainer.Trainer(
    config, run_config.model_config_from(config, tokenizer.vocab_size)
  )
  sources = input_pipeline.load_data_sources(config, data_dir)
  split = input_pipeline.TokenizedSplit.build(sources['validation'], tokenizer, config)
  batches = input_pipeline.make_eval_batches(split, config, batch_size=64)
  untrained = trainer.evaluate(trainer.init_state(config.seed).params, batches)

  assert untrained['loss'] > 3.5, untrained  # ~log(96) minus the smoothing entropy.
  assert metrics['loss'] < 0.6 * untrained['loss'], (metrics, untrained)
  assert metrics['token_accuracy'] > 0.4, metrics
  # What TensorBoard holds reads back without TensorFlow (bench/validation_curve.py's input).
  scalars = metric_writers.read_scalars(tmp_path / 'tensorboard')
  assert [step for step, _, _ in scalars['eval/loss']] == [80]
  assert scalars['eval/loss'][0][2] == pytest.approx(metrics['loss'], rel=1e-6)
  assert [step for step, _, _ in scalars['train/loss']] == list(range(4, 81, 4))


def test_read_scalars_keeps_what_precedes_a_record_cut_short(tmp_path):
  writer = metric_writers.MetricWriter(tmp_path, enabled=True)
  for step in (1, 2, 3):
    writer.write_scalars(step, {'eval/bleu': step * 10.0})
  writer.close()
  (events,) = tmp_path.glob('events.out.tfevents.*')
  assert [v for _, _, v in metric_writers.read_scalars(tmp_path)['eval/bleu']] == [10, 20, 30]
  events.write_bytes(events.read_bytes()[:-7])  # a crash in the middle of the last record
  assert [v for _, _, v in metric_writers.read_scalars(tmp_path)['eval/bleu']] == [10, 20]


def test_resume_with_a_different_model_is_refused(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 4
  loop.train_and_evaluate(config, str(tmp_path))
  config.model.d_ff = 128
  with pytest.raises(UserInputError, match='model.d_ff: 64 -> 128'):
    loop.train_and_evaluate(config, str(tmp_path))
  config.model.d_ff = 64
  config.seed = 1
  with pytest.raises(UserInputError, match='seed: 0 -> 1'):
    loop.train_and_evaluate(config, str(tmp_path))
  # Safe fields may change: more steps and other intervals resume fine.
  config.seed = 0
  config.num_train_steps = 6
  config.log_every_steps = 2
  config.checkpoint_every_steps = 3
  loop.train_and_evaluate(config, str(tmp_path))


def test_time_limit_ends_the_run_with_an_evaluation_and_a_checkpoint(tmp_path, data_dir):
  # A limit passed by the first step: that step is the run's last, evaluated and saved as the
  # final step of a finished run is, and a rerun resumes from it for another limit.
  config = tiny_config(data_dir)
  config.num_train_steps = 50
  config.eval_every_steps = 20
  config.checkpoint_every_steps = 20
  config.train_time_limit_minutes = 1e-6
  metrics = loop.train_and_evaluate(config, str(tmp_path))
  assert 'preempted' not in metrics and metrics['loss'] > 0, metrics
  assert _final_params(tmp_path)[0] == 1
  scalars = metric_writers.read_scalars(tmp_path / 'tensorboard')
  assert [step for step, _, _ in scalars['eval/loss']] == [1]
  assert [step for step, _, _ in scalars['train/loss']] == [1]

  # Without a limit the rerun trains the remaining steps, evaluating at 20, 40 and the last.
  config.train_time_limit_minutes = 0.0
  loop.train_and_evaluate(config, str(tmp_path))
  assert _final_params(tmp_path)[0] == 50
  scalars = metric_writers.read_scalars(tmp_path / 'tensorboard')
  assert [step for step, _, _ in scalars['eval/loss']] == [1, 20, 40, 50]


class _TickingClock:
  """Seconds that advance by one at every reading, jumping a day ahead from reading
  `jump_at` on. The loop reads its budget's clock once per step (`loop._TimeLimit`), so a
  budget in minutes ends, and its cooldown starts, at the same step in every run."""

  def __init__(self, jump_at: int | None = None):
    self.readings, self.jump_at = 0, jump_at

  def __call__(self) -> float:
    self.readings += 1
    jumped = self.jump_at is not None and self.readings >= self.jump_at
    return self.readings + (86_400.0 if jumped else 0.0)


def test_timed_cooldown_ends_the_budget_and_resumes_as_uninterrupted(
  tmp_path, data_dir, monkeypatch
):
  config = tiny_config(data_dir)
  config.num_train_steps = 200
  config.log_every_steps = 1
  config.checkpoint_every_steps = 10
  config.train_time_limit_minutes = 1.0  # 60 readings of the clock.
  config.cooldown_minutes = 0.25
  # Readings: 1 at the start, 2 after the first step, then step s reads s + 2. At step 44,
  # 15 s are left and 43 steps took 44 s: the cooldown is int(43 / 44 * 15) = 14 steps, and the
  # run stops at step 58, before the limit (step 59).
  monkeypatch.setattr(loop, '_wall_clock', _TickingClock())
  uninterrupted = tmp_path / 'uninterrupted'
  loop.train_and_evaluate(config, str(uninterrupted))
  step, params = _final_params(uninterrupted)
  assert step == 58
  rates = {
    s: v
    for s, _, v in metric_writers.read_scalars(uninterrupted / 'tensorboard')['train/learning_rate']
  }
  assert sorted(rates) == list(range(1, 59))
  schedule = optim.rsqrt_schedule(config.model.d_model, config.warmup_steps, 0.3)
  for s in range(1, 59):  # Step s applies update s - 1 at schedule(s - 1) x the factor.
    factor = min(1.0, (59 - s) / 14)
    assert rates[s] == pytest.approx(float(schedule(s - 1)) * factor, rel=1e-5), s
  # Rerun: the cooldown is over, nothing is left to train.
  loop.train_and_evaluate(config, str(uninterrupted))
  assert _final_params(uninterrupted)[0] == 58

  # The same run cut by its limit at step 50 (its clock jumps at the 52nd reading), mid-
  # cooldown, then resumed with a fresh budget: the cooldown comes back with the checkpoint,
  # and the run ends at step 58 with the same parameters, bit for bit.
  resumed = tmp_path / 'resumed'
  monkeypatch.setattr(loop, '_wall_clock', _TickingClock(jump_at=52))
  loop.train_and_evaluate(config, str(resumed))
  assert _final_params(resumed)[0] == 50
  monkeypatch.setattr(loop, '_wall_clock', _TickingClock())
  loop.train_and_evaluate(config, str(resumed))
  step, resumed_params = _final_params(resumed)
  assert step == 58
  jax.tree_util.tree_map(np.testing.assert_array_equal, resumed_params, params)

  # Its state is in the optimiser's: a resume may not switch it off.
  config.cooldown_minutes = 0.0
  with pytest.raises(UserInputError, match=r'config\.cooldown_minutes > 0: True -> False'):
    loop.train_and_evaluate(config, str(resumed))
  # And it is one cooldown or the other, checked before any work.
  config.cooldown_minutes, config.cooldown_fraction = 0.25, 0.1
  with pytest.raises(UserInputError, match='are two cooldowns'):
    loop.train_and_evaluate(config, str(tmp_path / 'both'))
  assert not (tmp_path / 'both').exists()


@pytest.mark.parametrize(
  'field, value',
  [
    ('per_device_batch_size', 0),
    ('num_train_steps', -5),
    ('loss_rows_per_chunk', -1),
    ('rdrop_alpha', -1.0),
    ('rdrop_alpha', 5.0),  # The tiny config has no dropout: nothing for R-Drop to compare.
    ('weight_decay', -0.1),
    ('weight_decay', float('nan')),
    ('cooldown_minutes', -1.0),
    ('cooldown_minutes', 5.0),  # The tiny config has no time limit for it to end.
  ],
)
def test_invalid_config_names_the_field(tmp_path, data_dir, field, value):
  config = tiny_config(data_dir)
  config[field] = value
  with pytest.raises(UserInputError, match=f'config.{field}'):
    loop.train_and_evaluate(config, str(tmp_path))


def test_weight_decay_shrinks_the_matrices_and_resumes(tmp_path, data_dir, tiny_workdir):
  config = tiny_config(data_dir)
  config.weight_decay = 1.0
  loop.train_and_evaluate(config, str(tmp_path))
  step, decayed = _final_params(tmp_path)
  assert step == 8
  _, plain = _final_params(tiny_workdir)  # The same run without weight decay.

  def squared_norms(params, matrices):
    flat = flax.traverse_util.flatten_dict(params)
    names = {'kernel', 'embedding'}
    return sum(float(np.sum(np.square(x))) for k, x in flat.items() if (k[-1] in names) == matrices)

  # Each step moves every matrix by -lr x 1.0 x itself besides Adam's step: the matrices' squared
  # norm ends 0.888x the plain run's. Vectors (biases, layer-norm scales, stacked per layer:
  # [layers, d]) are not decayed; they differ only through the gradients (1.00004x).
  assert squared_norms(decayed, True) < 0.95 * squared_norms(plain, True)
  assert squared_norms(decayed, False) == pytest.approx(squared_norms(plain, False), rel=1e-3)

  # AdamW's state restores: its rate may change on resume, but not to or from 0.
  config.num_train_steps, config.weight_decay = 12, 0.5
  loop.train_and_evaluate(config, str(tmp_path))
  assert _final_params(tmp_path)[0] == 12
  config.num_train_steps, config.weight_decay = 16, 0.0
  with pytest.raises(UserInputError, match=r'config\.weight_decay > 0: True -> False'):
    loop.train_and_evaluate(config, str(tmp_path))
  assert _final_params(tmp_path)[0] == 12


def test_invalid_model_size_names_the_field(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.model.num_heads = 3  # 32 is not divisible by 3.
  with pytest.raises(UserInputError, match='d_model=32 is not divisible by num_heads=3'):
    loop.train_and_evaluate(config, str(tmp_path))


# Eight devices equal one: tests/sharding_test.py trains the same tiny model for two steps on
# one device and on meshes (8, 1, 1), (1, 8, 1) and (2, 1, 4) and compares loss and parameters.


def test_gradient_accumulation_chunked_loss_and_unrolled_layers_equal_the_plain_step(tmp_path):
  """Two steps of the same packed batch give the same loss, gradient norm and parameters
  with the gradient accumulated over 4 micro-batches, with the loss projected a few positions
  at a time with the layer loops unrolled (2 + 2 layers; 24 rows per chunk: 3 of the 16
  positions of 8 rows, so the last chunk is padded), and with all of them and R-Drop at once
  (6 rows: 3 positions of each 2-row micro-batch; R-Drop's two copies of each example are the
  same without dropout, so its KL term is 0 and its loss the plain one)."""
  config = tiny_config(str(tmp_path))
  config.learning_rate_scale = 1.0
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  model_config = run_config.model_config_from(config, vocab_size=40)  # No dropout by default.
  rng = np.random.default_rng(0)
  rows = 8
  # Rows of very different lengths, so the micro-batches hold different numbers of tokens:
  # only dividing the summed gradient by the whole batch's token count matches one batch.
  lengths = np.array([1, 14, 3, 16, 2, 9, 16, 5])
  targets = np.where(np.arange(16) < lengths[:, None], rng.integers(3, 40, (rows, 16)), 0)
  batch = {
    'inputs': rng.integers(3, 40, (rows, 24)).astype(np.int32),
    'targets': targets.astype(np.int32),
  }
  # Packed rows (two examples per row where there is room), so every array of a packed batch
  # is cut into micro-batches; sharding_test covers plain batches under FSDP.
  segments = np.where(np.arange(16) < lengths[:, None], 1 + (np.arange(16) >= 6), 0)
  batch['targets_segment_ids'] = segments.astype(np.int32)
  batch['targets_positions'] = np.where(
    segments == 2, np.arange(16) - 6, np.arange(16) * (segments > 0)
  ).astype(np.int32)
  batch['inputs_segment_ids'] = np.ones((rows, 24), np.int32)
  batch['inputs_positions'] = np.tile(np.arange(24, dtype=np.int32), (rows, 1))
  results = {}
  # (gradient accumulation steps, loss rows per chunk, unrolled layers, R-Drop's alpha)
  # The last is all four at once: without dropout R-Drop's copies are the plain step's rows.
  variants = [(1, 0, False, 0.0), (4, 0, False, 0.0), (1, 24, True, 0.0), (4, 6, True, 5.0)]
  for k, rows_per_chunk, unroll, rdrop_alpha in variants:
    config.grad_accum_steps = k
    config.loss_rows_per_chunk = rows_per_chunk
    config.rdrop_alpha = rdrop_alpha
    variant_model = model_config.replace(unroll_layers=unroll)
    trainer = training_trainer.Trainer(config, variant_model)
    state = trainer.init_state(seed=3)
    for _ in range(2):  # Two steps: the second starts from the accumulated update.
      state, metrics = trainer.step(state, batch)
    results[k, rows_per_chunk, unroll, rdrop_alpha] = jax.device_get((state.params, metrics))
    if rdrop_alpha:
      assert abs(float(metrics['rdrop_kl_sum'])) < 1e-4
  params_1, metrics_1 = results[variants[0]]
  for variant in variants[1:]:
    params_k, metrics_k = results[variant]
    np.testing.assert_allclose(metrics_k['correct_tokens'], metrics_1['correct_tokens'])
    np.testing.assert_allclose(metrics_k['loss_sum'], metrics_1['loss_sum'], rtol=1e-5)
    assert metrics_k['token_count'] == metrics_1['token_count'] == lengths.sum()
    np.testing.assert_allclose(metrics_k['grad_norm'], metrics_1['grad_norm'], rtol=1e-4)
    for got, want in zip(jax.tree.leaves(params_k), jax.tree.leaves(params_1)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # And the update is not trivially zero: the parameters moved.
  initial = jax.device_get(training_trainer.Trainer(config, model_config).init_state(seed=3).params)
  moved = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(initial))
  )
  assert moved > 1e-4, moved


def test_trainers_of_one_configuration_share_their_programs_and_no_other(tmp_path):
  """A second Trainer of the same settings reuses the first one's jitted programs (a second run
  in one process neither traces nor compiles); each setting the programs depend on gives new
  ones, so a changed value is never run with a program built for the old one."""
  config = tiny_config(str(tmp_path))
  model_config = run_config.model_config_from(config, vocab_size=40)
  first = training_trainer.Trainer(config, model_config)
  again = training_trainer.Trainer(config.copy_and_resolve_references(), model_config)
  assert again.train_step is first.train_step and again.eval_step is first.eval_step
  assert again.optimizer is first.optimizer  # TrainState's static field: part of jit's key.
  changes = {
    'label_smoothing': 0.2,
    'learning_rate_scale': 0.5,
    'warmup_steps': 7,
    'adam_b2': 0.99,
    'weight_decay': 0.01,
    'grad_clip_norm': 1.0,
    'grad_accum_steps': 2,
    'loss_rows_per_chunk': 8,
    'rdrop_alpha': 1.0,
    'max_target_length': 16,
  }
  for field, value in changes.items():
    changed = config.copy_and_resolve_references()
    changed[field] = value
    other = training_trainer.Trainer(changed, model_config)
    assert other.train_step is not first.train_step, field
  dropout = training_trainer.Trainer(config, model_config.replace(dropout_rate=0.3))
  assert dropout.train_step is not first.train_step
  training_trainer.forget_programs()  # For code patched in between (bench/levers.py).
  assert training_trainer.Trainer(config, model_config).train_step is not first.train_step
  # And the changed value is the one computed with: the same parameters and batch, evaluated
  # with label smoothing 0.1 and 0.
  rng = np.random.default_rng(0)
  batch = {
    'inputs': rng.integers(3, 40, (4, 8)).astype(np.int32),
    'targets': rng.integers(3, 40, (4, 8)).astype(np.int32),
  }
  params = first.init_state(seed=0).params
  unsmoothed = config.copy_and_resolve_references()
  unsmoothed.label_smoothing = 0.0
  smoothed_loss = first.evaluate(params, [batch])['loss']
  plain_loss = training_trainer.Trainer(unsmoothed, model_config).evaluate(params, [batch])['loss']
  assert abs(plain_loss - smoothed_loss) > 0.1, (plain_loss, smoothed_loss)  # 4.89 vs 4.16


def test_rdrop_brings_the_two_dropout_predictions_together(tmp_path):
  """Trained on one batch with dropout 0.3, R-Drop (alpha 5) leaves two dropout passes of
  the model disagreeing less (their symmetric KL per token) than the same training without it;
  its logged loss is the copies' label-smoothed cross-entropy, close to the plain run's."""
  config = tiny_config(str(tmp_path))
  config.learning_rate_scale = 1.0
  config.warmup_steps = 10
  config.model.dropout_rate = 0.3
  model_config = run_config.model_config_from(config, vocab_size=40)
  rng = np.random.default_rng(1)
  lengths = rng.integers(4, 16, 16)
  batch = {
    'inputs': np.where(np.arange(16) < lengths[:, None], rng.integers(3, 40, (16, 16)), 0),
    'targets': np.where(np.arange(16) < lengths[:, None], rng.integers(3, 40, (16, 16)), 0),
  }
  batch = {key: value.astype(np.int32) for key, value in batch.items()}
  disagreement, losses = {}, {}
  probe = None
  for alpha in (0.0, 5.0):
    config.rdrop_alpha = alpha
    trainer = training_trainer.Trainer(config, model_config)
    state = trainer.init_state(seed=0)
    for _ in range(20):
      state, metrics = trainer.step(state, batch)
    losses[alpha] = float(metrics['loss_sum']) / float(metrics['token_count'])
    # Two dropout passes of the trained model over the batch (masks unlike training's): R-Drop's
    # own step measures them (one program for both models).
    probe = probe or jax.jit(
      functools.partial(
        training_step.train_step,
        model=trainer.model,
        learning_rate_fn=trainer.learning_rate_fn,
        label_smoothing=config.label_smoothing,
        rdrop_alpha=1.0,
      )
    )
    _, probe_metrics = probe(state.replace(step=state.step + 1000), batch)
    disagreement[alpha] = float(probe_metrics['rdrop_kl_sum']) / float(probe_metrics['token_count'])
  assert disagreement[5.0] < 0.5 * disagreement[0.0], disagreement
  assert abs(losses[5.0] - losses[0.0]) < 0.5 * losses[0.0], losses


def test_bfloat16_loss_curve_tracks_float32(tmp_path, data_dir):
  """bf16 activations and matmuls (float32 parameters, softmax and loss) learn like float32."""
  config = tiny_config(data_dir)
  config.learning_rate_scale = 0.15
  config.warmup_steps = 20
  sources = input_pipeline.load_data_sources(config, data_dir)
  tokenizer = input_pipeline.load_or_train_tokenizer(
    config, Workdir(str(tmp_path)), sources['train']
  )
  split = input_pipeline.TokenizedSplit.build(sources['train'], tokenizer, config)
  iterator = input_pipeline.make_fixed_iterator(split, config, batch_size=16, seed=0)
  batches = [next(iterator) for _ in range(60)]
  curves = {}
  for dtype in ('float32', 'bfloat16'):
    config.model.dtype = dtype
    trainer = training_trainer.Trainer(
      config, run_config.model_config_from(config, tokenizer.vocab_size)
    )
    state = trainer.init_state(seed=0)
    losses = []
    for batch in batches:
      state, metrics = trainer.step(state, batch)
      losses.append(float(metrics['loss_sum'] / metrics['token_count']))
    curves[dtype] = np.array(losses).reshape(6, 10).mean(axis=1)  # Means of 10 steps.
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
  f32, bf16 = curves['float32'], curves['bfloat16']
  assert f32[-1] < 0.75 * f32[0], f32  # It learns ...
  np.testing.assert_allclose(bf16, f32, rtol=0.01)  # ... and bf16 stays within 1% all along.
  assert not np.array_equal(bf16, f32)  # (bf16 really computed something different.)
