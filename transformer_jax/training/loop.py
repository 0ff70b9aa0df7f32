"""Training: `train_and_evaluate(config, workdir)`, the loop around `training.step.train_step`.

Every config and permission check first (before any data work), the workdir's lock, data,
vocabulary and run config, then the steps with evaluations, checkpoints (resumed from the
latest intact one), preemption (SIGTERM/SIGINT save and return) and NaN/Inf guards."""

from __future__ import annotations

import errno
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer_jax.checkpoints.best import DATA_KEY as BEST_CHECKPOINT_KEY
from transformer_jax.checkpoints.best import BestCheckpoint
from transformer_jax.checkpoints.checkpointer import Checkpointer, restore_params_from
from transformer_jax.common.errors import CorruptCheckpointError, NonFiniteError, UserInputError
from transformer_jax.common.log import format_duration, log
from transformer_jax.data import input_pipeline, subword_sampling
from transformer_jax.evaluation import metrics
from transformer_jax.training import host_memory, optim
from transformer_jax.training.metric_writers import MetricWriter, TrainingLog
from transformer_jax.training.preemption import PreemptionFlag as _PreemptionFlag
from transformer_jax.training.run_config import (
  check_resume,
  model_config_from,
  parameters_folder,
  save_run_config,
  validate_run_config,
)
from transformer_jax.training.step import TrainState
from transformer_jax.training.trainer import Trainer, decode_split
from transformer_jax.workdir import imported
from transformer_jax.workdir.layout import Workdir, check_folder_writable


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (resuming from the workdir's latest checkpoint if any), evaluates, checkpoints.

  Returns the last evaluation's metrics (and the final test exact match when configured).
  SIGTERM/SIGINT save a checkpoint at the current step and return early with 'preempted': 1;
  before the first step they raise `errors.Interrupted` (see `preemption.py`). Every config
  and permission check runs first, before any data is prepared.
  """
  # First: it covers only threads JAX starts afterwards.
  host_memory.reuse_freed_memory_if_configured(config)
  workdir = Workdir(workdir)
  workdir.check_not_a_file()
  imported.adopt(config, workdir)  # A pretrained model's architecture and vocabulary.
  validate_run_config(config)
  workdir.check_writable()  # Before the lock, a file in it.
  if config.data_dir:  # One that exists may be read-only: a shared, prepared one is only read.
    check_folder_writable(config.data_dir, 'config.data_dir', unless_it_exists=True)
  lock = workdir.lock(jax.process_index(), config.lock_expiry_seconds)
  with lock, _PreemptionFlag() as preemption:
    try:
      return _train_and_evaluate(config, workdir, preemption, lock)
    except Exception:
      if preemption.start_up_interruption is None:
        raise
      # A library made its own error of the interruption (SentencePiece: a RuntimeError).
      raise preemption.start_up_interruption from None


class _Run:
  """What the loop works with: data, vocabulary, trainer, checkpointer, writer."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: Workdir):
    self.config = config
    # A resume that would change what the parameters depend on is refused before any data is
    # prepared (into the workdir, without config.data_dir) or any vocabulary trained.
    self.sources = input_pipeline.load_data_sources(
      config,
      config.data_dir or workdir.data,
      check_identity=lambda data: check_resume(config, workdir, data),
    )
    self.tokenizer = input_pipeline.load_or_train_tokenizer(
      config,
      workdir,
      self.sources[config.train_split],
      trained=parameters_folder(workdir) is not None,
    )
    self.model_config = model_config_from(config, self.tokenizer.vocab_size)
    save_run_config(config, self.model_config, workdir, self.sources['identity'])
    self.tokenized = input_pipeline.tokenized_splits(
      self.sources,
      self.tokenizer,
      config,
      workdir,
      target_tokenizer=input_pipeline.load_target_tokenizer(workdir),
    )
    self.trainer = Trainer(config, self.model_config)
    train_split = self.tokenized[config.train_split]
    if config.subword_sampling:
      train_split = subword_sampling.SampledSplit.from_source(
        self.sources[config.train_split],
        self.tokenizer,
        config,
        target_tokenizer=input_pipeline.load_target_tokenizer(workdir),
      )
    self.train_iterator = input_pipeline.make_train_iterator(
      train_split,
      config,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      local_device_count=jax.local_device_count(),
    )
    self.eval_batches = input_pipeline.make_eval_batches(
      self.tokenized[config.eval_split], config, batch_size=config.eval_batch_size
    )
    self.checkpointer = Checkpointer(
      workdir.checkpoints,
      keep=config.keep_checkpoints,
      damaged_directory=workdir.damaged_checkpoints,
    )
    self.writer = MetricWriter(workdir.tensorboard)
    self.workdir = workdir
    # The best evaluation so far by config.best_checkpoint_metric (None: not tracked).
    self.best: BestCheckpoint | None = None

  def restore_or_init(self) -> TrainState:
    """The latest intact checkpoint's state (and input position), else a fresh state."""
    damaged = []
    restored = self.checkpointer.restore_latest_valid(
      self.trainer.abstract_state,
      on_error=lambda error: (
        damaged.append(error),
        logging.warning('%s; falling back to the previous checkpoint', error),
      ),
    )
    if restored is None and damaged:
      raise CorruptCheckpointError(
        f'every checkpoint in {self.checkpointer.directory} was damaged and has been moved '
        f'aside (newest: {damaged[0]}); rerun to start from scratch, or repair them by hand'
      )
    if self.config.best_checkpoint_metric:
      # Continued from the checkpoint's record, and kept beyond the last keep_checkpoints.
      self.best = BestCheckpoint.from_json(
        restored[1].get(BEST_CHECKPOINT_KEY) if restored else None,
        self.config.best_checkpoint_metric,
        self.config.early_stopping_patience,
      )
      self.checkpointer.keep_also(self.best.step)
    if restored is None:
      state = self.trainer.init_state(self.config.seed)
      if imported.imported_params_are_latest(self.workdir, trained=False):
        # Fine-tuning an imported model: its parameters, a fresh optimiser state.
        params = restore_params_from(str(self.workdir.imported), self.trainer.abstract_state.params)
        state = state.replace(params=params)
        log(f'fine-tuning the imported model in {self.workdir.imported}')
      return state
    state, data_state, _ = restored
    self.train_iterator.set_state(data_state['train_iterator'])
    log(f'resumed from {self.checkpointer.directory} at step {int(state.step)}')
    return state

  def evaluate(self, params, step: int) -> dict[str, float]:
    config = self.config
    result = self.trainer.evaluate(params, self.eval_batches)
    if config.eval_decode_examples:
      texts = self.decode_split(params, config.eval_split, config.eval_decode_examples)
      with_bleu = metrics.bleu_is_meaningful(config.dataset)
      result.update(metrics.translation_metrics(texts[1], texts[2], with_bleu=with_bleu))
      self.writer.write_texts(step, {'eval/samples': _samples_markdown(*texts)})
    self.writer.write_scalars(step, {f'eval/{k}': v for k, v in result.items()})
    log(f'eval step {step}: ' + ', '.join(f'{k} {v:.4f}' for k, v in result.items()))
    return result

  def test(self, params, step: int) -> dict[str, float]:
    """Greedy exact match on the test split (by category where the task has them), chrF, and
    BLEU where it means something (`metrics.bleu_is_meaningful`)."""
    sources, references, hypotheses = self.decode_split(params, self.config.test_split, None)
    categories = metrics.sentence_categories(self.config.dataset, sources)
    with_bleu = metrics.bleu_is_meaningful(self.config.dataset)
    test = metrics.translation_metrics(
      references, hypotheses, categories=categories, with_bleu=with_bleu
    )
    self.writer.write_scalars(step, {f'test/{k}': v for k, v in test.items()})
    hits = sum(h == r for h, r in zip(hypotheses, references))
    bleu = f'BLEU {test["bleu"]:.2f}, ' if with_bleu else ''
    lines = [
      f'test exact match (greedy, {len(references):,} sentences): '
      f'{100 * test["exact_match"]:.2f}% ({hits:,}/{len(references):,}); '
      f'{bleu}chrF {test["chrf"]:.2f}'
    ]
    if categories is not None:
      by_category = metrics.exact_match_by_category(references, hypotheses, categories)
      lines += ['test exact match by category:', *metrics.format_categories(by_category)]
    for line in lines:
      log(line)
    return {f'test_{k}': v for k, v in test.items()}

  def decode_split(self, params, split: str, max_examples: int | None):
    return decode_split(
      self.trainer,
      params,
      self.sources[split],
      self.tokenized[split],
      self.tokenizer,
      self.config,
      max_examples,
    )

  def save(self, state: TrainState, step: int) -> None:
    # Skipped updates keep parameters finite; this guards against anything else.
    if not bool(self.trainer.all_finite(state.params)):
      raise NonFiniteError(f'parameters are not finite at step {step}; not checkpointing')
    data_state = {'train_iterator': self.train_iterator.get_state()}
    if self.best is not None:
      data_state[BEST_CHECKPOINT_KEY] = self.best.to_json()
    self.checkpointer.save(step, state, data_state)

  def judge(self, step: int, result: dict[str, float]) -> tuple[bool, bool]:
    """(whether the evaluation at `step` is the best so far, whether the patience ran out) by
    config.best_checkpoint_metric."""
    if self.best is None:
      return False, False
    value = result[self.best.metric]
    if jax.process_count() > 1:  # The first process's value, so that all save alike.
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      value = float(multihost_utils.broadcast_one_to_all(np.float32(value)))
    improved = self.best.update(step, value)
    if improved:
      self.checkpointer.keep_also(step)
      log(f'new {self.best.describe()}')
    return improved, self.best.exhausted

  def close(self) -> None:
    self.checkpointer.close()
    self.writer.close()


def _train_and_evaluate(
  config, workdir: Workdir, preemption: _PreemptionFlag, lock
) -> dict[str, float]:
  time_limit = _TimeLimit(
    config.train_time_limit_minutes,
    config.cooldown_minutes,
    config.log_every_steps,
    _wall_clock,
  )
  try:
    run = _Run(config, workdir)
  except OSError as error:  # What the checks above cannot see: a read-only file or subfolder.
    if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not error.filename:
      raise
    raise UserInputError(f'cannot use {error.filename}: {error.strerror}') from None
  try:
    return _loop(run, preemption, workdir, lock, time_limit)
  finally:
    run.close()


def _every(step: int, interval: int, last_step: int) -> bool:
  return step % interval == 0 or step == last_step


# The wall clock of the time budget (tests give the loop a clock of their own).
_wall_clock = time.time


class _TimeLimit:
  """`config.train_time_limit_minutes` of wall clock (0: none), as fairseq's --stop-time-hours,
  and the timed cooldown at its end (`config.cooldown_minutes`).

  Counted from the start of this invocation's data preparation, so a budget such as "2 hours of
  train.py" holds on any machine whatever its speed; a resumed run gets the whole limit again.
  The clock is read once per step (`check`). With several processes the first one's clock
  decides, at log steps (one broadcast each), so that all of them stop, and place the cooldown,
  at the same step with the same length.
  """

  def __init__(self, minutes: float, cooldown_minutes: float, check_every_steps: int, clock):
    self.minutes, self.cooldown_minutes = minutes, cooldown_minutes
    self._check_every, self._clock = check_every_steps, clock
    self._start = clock()
    self._rate_origin = None  # (time, step) after this invocation's first (compiling) step.
    self.cooldown_placed = False

  def mark_first_step(self, step: int) -> None:
    """The step rate is measured from here: the compilation is not a step's cost."""
    if self.cooldown_minutes:
      self._rate_origin = (self._clock(), step)

  def check(self, step: int) -> tuple[bool, int | None]:
    """(whether the limit is reached, the length in steps of the cooldown to place now, once:
    the steps that fit in the minutes left at this invocation's measured rate, evaluations and
    checkpoints included)."""
    if not self.minutes:
      return False, None
    if jax.process_count() > 1 and step % self._check_every:
      return False, None
    now = self._clock()
    reached = now - self._start >= 60 * self.minutes
    length = -1
    if self.cooldown_minutes and not self.cooldown_placed and self._rate_origin is not None:
      left = 60 * self.minutes - (now - self._start)
      origin_time, origin_step = self._rate_origin
      if left <= 60 * self.cooldown_minutes and step > origin_step and now > origin_time:
        rate = (step - origin_step) / (now - origin_time)
        length = max(1, int(rate * max(left, 0.0)))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      decided = multihost_utils.broadcast_one_to_all(np.array([reached, length], np.int32))
      reached, length = bool(decided[0]), int(decided[1])
    if length < 0:
      return bool(reached), None
    self.cooldown_placed = True
    return bool(reached), length


def _loop(
  run: _Run, preemption: _PreemptionFlag, workdir: Workdir, lock, time_limit: _TimeLimit
) -> dict[str, float]:
  config, trainer = run.config, run.trainer
  run_start = time.time()
  state = run.restore_or_init()
  start_step = step = int(state.step)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  log(f'model: {num_params:,} parameters, {run.model_config}')
  # A timed cooldown placed before this invocation ends the run where it ends.
  cooldown_end = None
  remaining = optim.timed_cooldown_remaining(state.opt_state)
  if remaining is not None:
    time_limit.cooldown_placed, cooldown_end = True, start_step + remaining
  final_step = min(config.num_train_steps, cooldown_end or config.num_train_steps)
  if run.best is not None and run.best.exhausted:  # Stopped early before: nothing to train.
    log(
      f'config.early_stopping_patience ({run.best.patience}) ran out at step {start_step} '
      f'({run.best.describe()}); nothing to train'
    )
    final_step = start_step
  training_log = TrainingLog(run.writer, final_step, start_step)
  eval_metrics: dict[str, float] = {}
  previous_metrics = None
  for step in range(start_step + 1, final_step + 1):
    if step == start_step + 1:  # Otherwise the tens of seconds XLA takes pass in silence.
      log('compiling the training step')
      compile_start = time.time()
    state, step_metrics = trainer.step(state, next(run.train_iterator))
    if step == start_step + 1:
      jax.block_until_ready(step_metrics)
      log(f'training step compiled and run once in {format_duration(time.time() - compile_start)}')
      time_limit.mark_first_step(step)
    training_log.add(step_metrics)
    # Check the previous step's streak: it is done by now, so this does not stall the device.
    if previous_metrics is not None:
      streak = int(previous_metrics['nonfinite_streak'])
      if streak >= config.max_consecutive_nonfinite_steps:
        raise NonFiniteError(
          f'loss or gradients were NaN/Inf for {streak} consecutive steps '
          f'({step - streak}..{step - 1}); stopping. The latest checkpoint '
          f'({run.checkpointer.latest_step()}) holds finite parameters: lower the learning '
          'rate or inspect the data before resuming'
        )
    previous_metrics = step_metrics
    if lock.lost:  # Another run took over a gs:// workdir's lock (gcs_lock.py): stop writing.
      raise UserInputError(
        f'{workdir}: another training process took over this workdir after this one was '
        f'silent longer than its lock expiry; stopping at step {step} without saving'
      )
    # The last step: the configured one, the first past the time limit, or the cooldown's end.
    limit_reached, cooldown_length = time_limit.check(step)
    if cooldown_length is not None:
      state = trainer.start_cooldown(state, np.int32(cooldown_length))
      cooldown_end = step + cooldown_length
      training_log.final_step = min(config.num_train_steps, cooldown_end)
      log(
        f'config.cooldown_minutes ({time_limit.cooldown_minutes:g}) left at step {step}: the '
        f'learning rate falls linearly to 0 over the next {cooldown_length:,} steps (the '
        f'measured rate), ending the run at step {cooldown_end:,}'
      )
    stop = None
    if step == cooldown_end:
      stop = 'the timed cooldown ended'
    elif limit_reached:
      stop = f'config.train_time_limit_minutes ({time_limit.minutes:g}) reached'
    last_step = step if stop else config.num_train_steps
    if _every(step, config.log_every_steps, last_step):
      training_log.write(step, int(jax.device_get(state.skipped_steps)))
    if preemption.should_stop(step):
      run.save(state, step)
      run.checkpointer.wait_until_finished()
      log(
        f'{preemption.signal_name or "preemption"} received: checkpoint saved at step {step}; '
        'rerun the same command to resume'
      )
      return {**eval_metrics, 'preempted': 1.0, 'step': float(step)}
    improved = patience_ran_out = False
    if _every(step, config.eval_every_steps, last_step):
      eval_metrics = run.evaluate(state.params, step)
      # Only the evaluations every eval_every_steps are judged, not one at a run's last step:
      # a run cut and resumed then keeps the same record as the uninterrupted one.
      if step % config.eval_every_steps == 0:
        improved, patience_ran_out = run.judge(step, eval_metrics)
      if patience_ran_out and not stop:
        stop = (
          f'config.early_stopping_patience ({run.best.patience}) ran out ({run.best.describe()})'
        )
        if not _every(step, config.log_every_steps, last_step):  # Its last window, logged.
          training_log.write(step, int(jax.device_get(state.skipped_steps)))
    # A new best is saved at once, as is the step where the run stops.
    if _every(step, config.checkpoint_every_steps, step if stop else last_step) or improved:
      run.save(state, step)
      training_log.restart_clock()
    if stop and step < config.num_train_steps:
      log(f'{stop}: stopped at step {step} of {config.num_train_steps}, checkpoint saved')
      break
  if not eval_metrics:  # Nothing left to train: report on the restored state.
    eval_metrics = run.evaluate(state.params, step)
  run.checkpointer.wait_until_finished()
  if config.final_test_decode:
    eval_metrics.update(run.test(state.params, step))
  log(f'done in {format_duration(time.time() - run_start)}; workdir {workdir.path}')
  return eval_metrics


def _samples_markdown(sources, references, hypotheses, count: int = 3) -> str:
  rows = ['| source | reference | greedy |', '|---|---|---|']
  for triple in list(zip(sources, references, hypotheses))[:count]:
    rows.append('| ' + ' | '.join(t.replace('|', '\\|') for t in triple) + ' |')
  return '\n'.join(rows)
