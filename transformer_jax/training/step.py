"""The pure training step: `train_step(state, batch, ...) -> (state, metrics)` (gradient
accumulation, NaN/Inf updates skipped and counted), `eval_step`, and the decoder's shifted
inputs. Jitted over the mesh by `training.trainer.Trainer`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from transformer_jax.data import batching
from transformer_jax.data.tokenizer import BOS_ID, PAD_ID
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import optim
from transformer_jax.training.losses import (
  chunked_token_metrics,
  correct_tokens,
  label_smoothed_cross_entropy,
)


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
  correct = correct_tokens(logits, targets, weights)
  return {'loss_sum': loss_sum, 'token_count': weight_sum, 'correct_tokens': correct}


def train_step(
  state: TrainState,
  batch: dict,
  *,
  model: Transformer,
  learning_rate_fn,
  label_smoothing: float,
  grad_accum_steps: int = 1,
  loss_rows_per_chunk: int = 0,
  rdrop_alpha: float = 0.0,
) -> tuple[TrainState, dict]:
  """One optimiser step on a batch {'inputs': [b, s], 'targets': [b, t]} (int32, 0 = pad).

  A packed batch also has 'inputs_segment_ids', 'targets_segment_ids', 'inputs_positions' and
  'targets_positions' (see batching.make_packed_iterator); the model then keeps its examples
  apart and the decoder inputs are shifted per example.

  With loss_rows_per_chunk = r > 0 the loss projects the decoder's output to logits a few
  target positions (about r rows) at a time (`losses.chunked_token_metrics`): the same loss
  and gradient up to rounding, without the [b, t, vocab] logits in memory.

  With grad_accum_steps = k > 1 the batch is cut into k micro-batches of b/k rows, run one
  after another (a `lax.scan`, so activations of only one are alive at a time); their summed
  gradient, divided by the whole batch's token count, is exactly the gradient of the batch.

  With rdrop_alpha > 0 (R-Drop, Liang et al., 2021) each example runs twice under different
  dropout masks (a batch of 2b rows, so a step costs about two), and the loss adds the two
  copies' symmetric KL divergence, weighted by rdrop_alpha (`losses.chunked_token_metrics`);
  the metrics' loss is the copies' mean label-smoothed cross-entropy, and 'rdrop_kl_sum' their
  summed KL(p1 || p2) + KL(p2 || p1).
  """
  dropout_rng = jax.random.fold_in(state.dropout_rng, state.step)

  def loss_sum_and_metrics(params, micro_batch, rng):
    targets = micro_batch['targets']
    weights = (targets != PAD_ID).astype(jnp.float32)
    if rdrop_alpha:
      # [b, ...] -> [2b, ...]: rows 2i and 2i+1 are example i (adjacent, so a device's block
      # of rows keeps both copies of its examples).
      micro_batch = jax.tree_util.tree_map(lambda x: jnp.repeat(x, 2, axis=0), micro_batch)
    packing = batching.packing_model_args(micro_batch)
    apply = functools.partial(
      model.apply,
      {'params': params},
      micro_batch['inputs'],
      shift_right(micro_batch['targets'], packing.get('tgt_segment_ids')),
      deterministic=False,
      rngs={'dropout': rng},
      **packing,
    )
    if loss_rows_per_chunk or rdrop_alpha:
      metrics = chunked_token_metrics(
        apply(method=Transformer.features),  # [b, t, m], or [2b, t, m] with R-Drop
        lambda x: model.apply({'params': params}, x, method=Transformer.output_logits),
        targets,
        weights,
        label_smoothing,
        # Without chunks, R-Drop's loss takes all positions at once.
        loss_rows_per_chunk or 2 * targets.size,
        rdrop_alpha,
      )
      objective_sum = metrics.pop('objective_sum')
    else:
      metrics = compute_metrics(apply(), targets, weights, label_smoothing)
      objective_sum = metrics['loss_sum']
    return objective_sum, metrics

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
  # The rate of the update just applied; a timed cooldown's factor is in the optimiser state.
  metrics['learning_rate'] = learning_rate_fn(state.step) * optim.learning_rate_factor(
    state.opt_state
  )
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
