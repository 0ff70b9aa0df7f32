"""Training: a pure `train_step(state, batch, ...) -> (state, metrics)` and the loop around it.

The step is one `jax.jit` program over a device mesh with axes ('data', 'fsdp', 'tensor'): the
batch is split over 'data' and 'fsdp', parameters and optimiser state are placed by the
logical-axis rules in the config (FSDP over 'fsdp', heads/FFN over 'tensor'; with both of size 1
this is plain data parallelism), and XLA inserts the collectives. State buffers are donated so
an update does not need twice the memory.
"""

from __future__ import annotations

import errno
import functools
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax.training import train_state

from transformer_jax import (
  checkpointing,
  host_memory,
  imported_workdir,
  inference,
  metrics,
  sharding,
)
from transformer_jax.checkpointing import Checkpointer
from transformer_jax.config import TransformerConfig
from transformer_jax.data import batching, input_pipeline
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.decode import strip_after_eos
from transformer_jax.errors import CorruptCheckpointError, NonFiniteError, UserInputError
from transformer_jax.losses import label_smoothed_cross_entropy
from transformer_jax.metric_writers import MetricWriter, TrainingLog, format_duration, log
from transformer_jax.models import Transformer
from transformer_jax.optim import make_optimizer
from transformer_jax.preemption import PreemptionFlag as _PreemptionFlag
from transformer_jax.run_config import model_config_from, save_run_config, validate_run_config
from transformer_jax.workdir import Workdir, check_folder_writable


class TrainState(train_state.TrainState):
  """step, params, opt_state (from flax) + dropout key and the count of skipped updates."""

  dropout_rng: jax.Array  # uint32[2]; step t uses fold_in(dropout_rng, t).
  skipped_steps: jax.Array  # int32: updates skipped because the loss or a gradient was NaN/Inf.
  nonfinite_streak: jax.Array  # int32: consecutive skipped updates ending at the last step.


def shift_right(targets: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """Decoder inputs: [BOS, y_1, ..., y_{t-1}] from targets [y_1, ..., y_t]. [b, t] -> [b, t].

  With `segment_ids` (packed rows: example 1..k of the row, 0 = padding) each example is
  shifted on its own: its first position gets BOS, not the previous example's EOS, and
  padding positions get PAD.
  """
  bos = jnp.full_like(targets[:, :1], BOS_ID)
  shifted = jnp.concatenate([bos, targets[:, :-1]], axis=1)
  if segment_ids is None:
    return shifted
  previous = jnp.pad(segment_ids[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
  shifted = jnp.where(segment_ids != previous, BOS_ID, shifted)
  return jnp.where(segment_ids == 0, PAD_ID, shifted).astype(targets.dtype)


def compute_metrics(logits, targets, weights, label_smoothing):
  loss_sum, weight_sum = label_smoothed_cross_entropy(logits, targets, weights, label_smoothing)
  correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights)
  return {'loss_sum': loss_sum, 'token_count': weight_sum, 'correct_tokens': correct}


def train_step(
  state: TrainState,
  batch: dict,
  *,
  model: Transformer,
  learning_rate_fn,
  label_smoothing: float,
  grad_accum_steps: int = 1,
) -> tuple[TrainState, dict]:
  """One optimiser step on a batch {'inputs': [b, s], 'targets': [b, t]} (int32, 0 = pad).

  A packed batch also has 'inputs_segment_ids', 'targets_segment_ids', 'inputs_positions' and
  'targets_positions' (see batching.make_packed_iterator); the model then keeps its examples
  apart and the decoder inputs are shifted per example.

  With grad_accum_steps = k > 1 the batch is cut into k micro-batches of b/k rows, run one
  after another (a `lax.scan`, so activations of only one are alive at a time); their summed
  gradient, divided by the whole batch's token count, is exactly the gradient of the batch.
  """
  dropout_rng = jax.random.fold_in(state.dropout_rng, state.step)

  def loss_sum_and_metrics(params, micro_batch, rng):
    targets = micro_batch['targets']
    packing = batching.packing_model_args(micro_batch)
    logits = model.apply(
      {'params': params},
      micro_batch['inputs'],
      shift_right(targets, packing.get('tgt_segment_ids')),
      deterministic=False,
      rngs={'dropout': rng},
      **packing,
    )
    metrics = compute_metrics(
      logits, targets, (targets != PAD_ID).astype(jnp.float32), label_smoothing
    )
    return metrics['loss_sum'], metrics

  if grad_accum_steps == 1:
    # The gradient of the mean loss itself (not the sum's gradient divided afterwards): the
    # same value up to rounding, but rounding is what a run's trajectory is sensitive to, and
    # this keeps single-step runs bitwise what they were before accumulation existed.
    def mean_loss(params):
      loss_sum, metrics = loss_sum_and_metrics(params, batch, dropout_rng)
      return loss_sum / jnp.maximum(metrics['token_count'], 1.0), metrics

    grads, metrics = jax.grad(mean_loss, has_aux=True)(state.params)
  else:
    grad_fn = jax.grad(loss_sum_and_metrics, has_aux=True)
    # [b, ...] -> [k, b/k, ...], micro-batch j = rows j, j+k, j+2k, ...: each device's
    # contiguous block of rows holds its share of every micro-batch, so no data moves.
    micro_batches = jax.tree_util.tree_map(
      lambda x: jnp.moveaxis(
        x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]), 1, 0
      ),
      batch,
    )

    def accumulate(totals, micro):
      micro_batch, index = micro
      grads_and_metrics = grad_fn(state.params, micro_batch, jax.random.fold_in(dropout_rng, index))
      return jax.tree_util.tree_map(jnp.add, totals, grads_and_metrics), None

    # Accumulators: gradients like the parameters (and so sharded like them under FSDP).
    metric_shapes = jax.eval_shape(
      grad_fn, state.params, jax.tree_util.tree_map(lambda x: x[0], micro_batches), dropout_rng
    )[1]
    zeros = (
      jax.tree_util.tree_map(jnp.zeros_like, state.params),
      jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), metric_shapes),
    )
    (grads, metrics), _ = jax.lax.scan(
      accumulate, zeros, (micro_batches, jnp.arange(grad_accum_steps))
    )
    # The gradient of the mean loss over the real tokens of the whole (global) batch.
    grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(metrics['token_count'], 1.0), grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(metrics['loss_sum']) & jnp.isfinite(grad_norm)
  updated = state.apply_gradients(grads=grads)

  # A NaN/Inf loss or gradient skips the update: parameters and optimiser moments stay as they
  # were (so they are never non-finite), while the step (and so the data and dropout) advances.
  def keep_old(new, old):
    return jnp.where(finite, new, old)

  new_state = updated.replace(
    params=jax.tree_util.tree_map(keep_old, updated.params, state.params),
    opt_state=jax.tree_util.tree_map(keep_old, updated.opt_state, state.opt_state),
    skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
    nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + 1).astype(jnp.int32),
  )
  metrics['learning_rate'] = learning_rate_fn(state.step)
  metrics['grad_norm'] = grad_norm
  metrics['nonfinite_streak'] = new_state.nonfinite_streak
  return new_state, metrics


def eval_step(params, batch: dict, *, model: Transformer, label_smoothing: float) -> dict:
  targets = batch['targets']
  weights = (targets != PAD_ID).astype(jnp.float32)
  packing = batching.packing_model_args(batch)
  logits = model.apply(
    {'params': params},
    batch['inputs'],
    shift_right(targets, packing.get('tgt_segment_ids')),
    **packing,
  )
  return compute_metrics(logits, targets, weights, label_smoothing)


class Trainer:
  """Owns the mesh, the jitted steps and the state shardings for one model and config.

  The config is taken as valid (`run_config.validate_run_config`); a mesh or rule that does not
  fit is a ValueError here.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    model_config: TransformerConfig,
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.config = config
    self.model_config = model_config
    self.model = Transformer(model_config)
    self.mesh = mesh if mesh is not None else sharding.create_mesh(tuple(config.mesh_shape))
    self.rules = sharding.normalize_rules(config.logical_axis_rules)
    self.optimizer, self.learning_rate_fn = make_optimizer(
      d_model=model_config.d_model,
      warmup_steps=config.warmup_steps,
      learning_rate_scale=config.learning_rate_scale,
      total_steps=config.num_train_steps,
      cooldown_steps=round(config.cooldown_fraction * config.num_train_steps),
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      grad_clip_norm=config.grad_clip_norm,
      schedule=config.learning_rate_schedule,
      learning_rate=config.learning_rate,
    )
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    abstract = jax.eval_shape(self._init_state, jax.random.PRNGKey(0))
    self.state_shardings = sharding.logical_shardings(abstract, self.mesh, self.rules)
    self.abstract_state = jax.tree_util.tree_map(
      lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
      nn.meta.unbox(abstract),
      self.state_shardings,
    )
    replicated = sharding.replicated(self.mesh)
    self.train_step = jax.jit(
      functools.partial(
        train_step,
        model=self.model,
        learning_rate_fn=self.learning_rate_fn,
        label_smoothing=config.label_smoothing,
        grad_accum_steps=config.grad_accum_steps,
      ),
      in_shardings=(self.state_shardings, self.batch_sharding),
      out_shardings=(self.state_shardings, replicated),
      donate_argnums=(0,),
    )
    self.eval_step = jax.jit(
      functools.partial(eval_step, model=self.model, label_smoothing=config.label_smoothing),
      in_shardings=(self.state_shardings.params, self.batch_sharding),
      out_shardings=replicated,
    )
    self.all_finite = jax.jit(
      lambda params: jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(params)])
      ),
      in_shardings=(self.state_shardings.params,),
      out_shardings=replicated,
    )
    self.greedy_decode = jax.jit(
      functools.partial(
        inference.greedy_decode, self.model, max_decode_len=config.max_target_length
      ),
      in_shardings=(self.state_shardings.params, self.batch_sharding),
      out_shardings=replicated,
    )

  def _init_state(self, rng) -> TrainState:
    params_rng, dropout_rng = jax.random.split(rng)
    source = jnp.ones((1, self.config.max_source_length), jnp.int32)
    target = jnp.ones((1, self.config.max_target_length), jnp.int32)
    params = self.model.init({'params': params_rng}, source, target)['params']
    return TrainState.create(
      apply_fn=self.model.apply,
      params=params,
      tx=self.optimizer,
      dropout_rng=dropout_rng,
      skipped_steps=jnp.zeros((), jnp.int32),
      nonfinite_streak=jnp.zeros((), jnp.int32),
    )

  def init_state(self, seed: int) -> TrainState:
    """Parameters and optimiser state created directly in their shardings."""
    state, _ = sharding.sharded_init(
      self._init_state,
      self.mesh,
      self.rules,
      jax.random.PRNGKey(seed),
      shardings=self.state_shardings,
    )
    return state

  def global_batch(self, local_batch: dict) -> dict:
    """This process's rows -> global arrays, rows split jointly over ('data', 'fsdp').

    Devices that differ only in their 'tensor' coordinate hold the same rows.
    """
    # Batch shards this process feeds (at least 1: a shard may span processes).
    local_shards = max(1, sharding.data_parallel_size(self.mesh) // jax.process_count())
    for key, value in local_batch.items():
      if np.shape(value)[0] % local_shards:
        raise ValueError(
          f'batch {key!r} has {np.shape(value)[0]} rows, not divisible by the '
          f'{local_shards} data-parallel shards of mesh {dict(self.mesh.shape)}'
        )
    return {
      key: jax.make_array_from_process_local_data(self.batch_sharding, value)
      for key, value in local_batch.items()
    }

  def global_batch_from_full(self, full_batch: dict) -> dict:
    """A batch every process holds whole (evaluation) -> global arrays, each device its rows."""
    return {
      key: jax.make_array_from_callback(
        np.shape(value), self.batch_sharding, lambda index, value=value: value[index]
      )
      for key, value in full_batch.items()
    }

  def step(self, state, local_batch):
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return self.train_step(state, self.global_batch(local_batch))

  def evaluate(self, params, batches) -> dict[str, float]:
    totals: dict[str, Any] = {}
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      for batch in batches:
        metrics = self.eval_step(params, self.global_batch_from_full(batch))
        totals = metrics if not totals else jax.tree_util.tree_map(jnp.add, totals, metrics)
    totals = jax.device_get(totals)
    count = max(float(totals['token_count']), 1.0)
    return {
      'loss': float(totals['loss_sum']) / count,
      'token_accuracy': float(totals['correct_tokens']) / count,
    }

  def decode_batches(self, params, batches) -> list[list[int]]:
    """Greedy output ids (EOS and padding removed) for every row of every batch."""
    outputs = []
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      for batch in batches:
        src = self.global_batch_from_full({'inputs': batch['inputs']})['inputs']
        tokens = np.asarray(jax.device_get(self.greedy_decode(params, src)))
        outputs.extend(strip_after_eos(tokens, EOS_ID, pad_id=PAD_ID))
    return outputs


def decode_split(
  trainer: Trainer,
  params,
  source,
  tokenized: input_pipeline.TokenizedSplit,
  tokenizer: Tokenizer,
  config: ml_collections.ConfigDict,
  max_examples: int | None,
) -> tuple[list[str], list[str], list[str]]:
  """(sources, references, greedy hypotheses) for the first `max_examples` of a split."""
  batches = input_pipeline.make_eval_batches(
    tokenized, config, batch_size=config.eval_batch_size, max_examples=max_examples
  )
  sources, references = input_pipeline.eval_texts(source, config, max_examples)
  outputs = trainer.decode_batches(params, batches)[: len(references)]  # Drop filler rows.
  return sources, references, [tokenizer.decode(ids) for ids in outputs]


def _samples_markdown(sources, references, hypotheses, count: int = 3) -> str:
  rows = ['| source | reference | greedy |', '|---|---|---|']
  for triple in list(zip(sources, references, hypotheses))[:count]:
    rows.append('| ' + ' | '.join(t.replace('|', '\\|') for t in triple) + ' |')
  return '\n'.join(rows)


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
  imported_workdir.adopt(config, workdir)  # A pretrained model's architecture and vocabulary.
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
    self.sources = input_pipeline.load_data_sources(config, config.data_dir or workdir.data)
    self.tokenizer = input_pipeline.load_or_train_tokenizer(
      config, workdir, self.sources[config.train_split]
    )
    self.model_config = model_config_from(config, self.tokenizer.vocab_size)
    save_run_config(config, self.model_config, workdir)
    self.tokenized = input_pipeline.tokenized_splits(
      self.sources,
      self.tokenizer,
      config,
      workdir,
      target_tokenizer=input_pipeline.load_target_tokenizer(workdir),
    )
    self.trainer = Trainer(config, self.model_config)
    self.train_iterator = input_pipeline.make_train_iterator(
      self.tokenized[config.train_split],
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
    self.imported = str(workdir.imported)

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
    if restored is None:
      state = self.trainer.init_state(self.config.seed)
      if checkpointing.is_params_checkpoint(self.imported):
        # Fine-tuning an imported model: its parameters, a fresh optimiser state.
        params = checkpointing.restore_params_from(
          self.imported, self.trainer.abstract_state.params
        )
        state = state.replace(params=params)
        log(f'fine-tuning the imported model in {self.imported}')
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
    self.checkpointer.save(step, state, {'train_iterator': self.train_iterator.get_state()})

  def close(self) -> None:
    self.checkpointer.close()
    self.writer.close()


def _train_and_evaluate(
  config, workdir: Workdir, preemption: _PreemptionFlag, lock
) -> dict[str, float]:
  try:
    run = _Run(config, workdir)
  except OSError as error:  # What the checks above cannot see: a read-only file or subfolder.
    if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not error.filename:
      raise
    raise UserInputError(f'cannot use {error.filename}: {error.strerror}') from None
  try:
    return _loop(run, preemption, workdir, lock)
  finally:
    run.close()


def _every(step: int, interval: int, last_step: int) -> bool:
  return step % interval == 0 or step == last_step


def _loop(run: _Run, preemption: _PreemptionFlag, workdir: Workdir, lock) -> dict[str, float]:
  config, trainer = run.config, run.trainer
  run_start = time.time()
  state = run.restore_or_init()
  start_step = step = int(state.step)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  log(f'model: {num_params:,} parameters, {run.model_config}')
  training_log = TrainingLog(run.writer, config.num_train_steps, start_step)
  eval_metrics: dict[str, float] = {}
  previous_metrics = None
  for step in range(start_step + 1, config.num_train_steps + 1):
    if step == start_step + 1:  # Otherwise the tens of seconds XLA takes pass in silence.
      log('compiling the training step')
      compile_start = time.time()
    state, step_metrics = trainer.step(state, next(run.train_iterator))
    if step == start_step + 1:
      jax.block_until_ready(step_metrics)
      log(f'training step compiled and run once in {format_duration(time.time() - compile_start)}')
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
    if _every(step, config.log_every_steps, config.num_train_steps):
      training_log.write(step, int(jax.device_get(state.skipped_steps)))
    if preemption.should_stop(step):
      run.save(state, step)
      run.checkpointer.wait_until_finished()
      log(
        f'{preemption.signal_name or "preemption"} received: checkpoint saved at step {step}; '
        'rerun the same command to resume'
      )
      return {**eval_metrics, 'preempted': 1.0, 'step': float(step)}
    if _every(step, config.eval_every_steps, config.num_train_steps):
      eval_metrics = run.evaluate(state.params, step)
    if _every(step, config.checkpoint_every_steps, config.num_train_steps):
      run.save(state, step)
      training_log.restart_clock()
  if not eval_metrics:  # Nothing left to train: report on the restored state.
    eval_metrics = run.evaluate(state.params, step)
  run.checkpointer.wait_until_finished()
  if config.final_test_decode:
    eval_metrics.update(run.test(state.params, step))
  log(f'done in {format_duration(time.time() - run_start)}; workdir {workdir.path}')
  return eval_metrics
