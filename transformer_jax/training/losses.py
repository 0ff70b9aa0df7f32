"""Label-smoothed cross-entropy over non-padding target tokens, without a one-hot matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(
  logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.1
) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy against the smoothed target distribution q, minus q's entropy.

  q puts `1 - label_smoothing` on the target and spreads `label_smoothing` evenly over the
  other `vocab - 1` ids (tensor2tensor's definition). Subtracting the entropy of q makes a
  perfect prediction score 0, so the reported loss reads like a KL divergence.

  Computed from log-softmax statistics (the target's log-probability and the sum of all
  log-probabilities), so the [b, t, v] smoothed-target matrix is never materialised.

  Args:
    logits: float [b, t, v].
    targets: int [b, t].
    weights: float [b, t], 1 for real tokens, 0 for padding.
    label_smoothing: epsilon in [0, 1).

  Returns:
    (sum of per-token losses weighted by `weights`, sum of weights).
  """
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = label_smoothing / (vocab_size - 1)
  logits = logits.astype(jnp.float32)
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)  # [b, t]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  target_log_prob = target_logit - log_normalizer
  sum_log_probs = jnp.sum(logits, axis=-1) - vocab_size * log_normalizer
  cross_entropy = -(
    confidence * target_log_prob + low_confidence * (sum_log_probs - target_log_prob)
  )
  # Entropy of q: -sum q log q, with 0 log 0 = 0.
  normalizing_constant = -(
    confidence * jnp.log(confidence)
    + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
  )
  per_token = (cross_entropy - normalizing_constant) * weights
  return jnp.sum(per_token), jnp.sum(weights)


def correct_tokens(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """How many weighted targets [b, t] have the highest of their logits [b, t, v] (a tie for the
  highest counts as correct).

  Not `argmax(logits) == targets`: XLA:CPU's argmax is a separate index-carrying reduction over
  the logits (52 ms of a 700 ms Multi30k step), while the maximum here fuses with the
  log-sum-exp's own.
  """
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum((target_logit >= jnp.max(logits, axis=-1)) * weights)


def chunked_token_metrics(
  features: jax.Array,
  project,
  targets: jax.Array,
  weights: jax.Array,
  label_smoothing: float,
  rows_per_chunk: int,
) -> dict[str, jax.Array]:
  """`label_smoothed_cross_entropy` and `correct_tokens` from the decoder's output features
  [b, t, m] and `project` ([b, c, m] -> float32 logits [b, c, v]), a few target positions at a
  time, so that the [b, t, v] logits never exist whole. Returns the metrics dict of
  `training.step.compute_metrics` (loss_sum, token_count, correct_tokens).

  Each chunk of c = ceil(rows_per_chunk / b) positions is projected, reduced and dropped; its
  backward pass projects it again (`jax.checkpoint`: one more [rows, m] x [m, v] product)
  instead of keeping its logits. Alone, on a 2-core CPU at [4096, 128] x [128, 8000], the
  loss's forward and backward fall from 190 to 131 ms (one chunk's logits stay in the cache
  while the reductions read them); in the whole Multi30k step it is as fast as the whole
  logits (bench/README.md), so what it buys there is memory. Chunks run along the target
  positions, so the batch axis (the one sharded over devices) is untouched. Padding positions
  added to fill the last chunk have weight 0.
  """
  b, t, m = features.shape
  positions = max(1, min(t, -(-rows_per_chunk // b)))
  chunks = -(-t // positions)
  padding = chunks * positions - t
  if padding:
    features = jnp.pad(features, ((0, 0), (0, padding), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padding)))
    weights = jnp.pad(weights, ((0, 0), (0, padding)))

  def to_chunks(x):  # [b, chunks * c, ...] -> [chunks, b, c, ...]
    return jnp.moveaxis(x.reshape(b, chunks, positions, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def chunk_metrics(chunk):
    chunk_features, chunk_targets, chunk_weights = chunk
    logits = project(chunk_features)  # [b, c, v]
    loss_sum, weight_sum = label_smoothed_cross_entropy(
      logits, chunk_targets, chunk_weights, label_smoothing
    )
    return loss_sum, weight_sum, correct_tokens(logits, chunk_targets, chunk_weights)

  loss_sums, weight_sums, corrects = jax.lax.map(
    chunk_metrics, (to_chunks(features), to_chunks(targets), to_chunks(weights))
  )
  return {
    'loss_sum': jnp.sum(loss_sums),
    'token_count': jnp.sum(weight_sums),
    'correct_tokens': jnp.sum(corrects),
  }
