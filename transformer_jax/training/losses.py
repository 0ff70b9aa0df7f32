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


def symmetric_kl(logits_a: jax.Array, logits_b: jax.Array, weights: jax.Array) -> jax.Array:
  """sum over tokens of weights * (KL(p_a || p_b) + KL(p_b || p_a)), from logits [..., v] and
  weights [...]. The two KLs together are sum_v (p_a - p_b)(log p_a - log p_b): one pass."""
  log_p_a = jax.nn.log_softmax(logits_a.astype(jnp.float32), axis=-1)
  log_p_b = jax.nn.log_softmax(logits_b.astype(jnp.float32), axis=-1)
  per_token = jnp.sum((jnp.exp(log_p_a) - jnp.exp(log_p_b)) * (log_p_a - log_p_b), axis=-1)
  return jnp.sum(per_token * weights)


def chunked_token_metrics(
  features: jax.Array,
  project,
  targets: jax.Array,
  weights: jax.Array,
  label_smoothing: float,
  rows_per_chunk: int,
  rdrop_alpha: float = 0.0,
) -> dict[str, jax.Array]:
  """`label_smoothed_cross_entropy` and `correct_tokens` from the decoder's output features
  [b, t, m] and `project` ([..., m] -> float32 logits [..., v]), a few target positions at a
  time, so that the [b, t, v] logits never exist whole. Returns the metrics dict of
  `training.step.compute_metrics` (loss_sum, token_count, correct_tokens) and 'objective_sum',
  the sum whose mean over token_count is minimised.

  Each chunk of c = ceil(rows_per_chunk / b) positions is projected, reduced and dropped; its
  backward pass projects it again (`jax.checkpoint`: one more [rows, m] x [m, v] product)
  instead of keeping its logits. Alone, on a 2-core CPU at [4096, 128] x [128, 8000], the
  loss's forward and backward fall from 190 to 131 ms (one chunk's logits stay in the cache
  while the reductions read them); in the whole Multi30k step it is as fast as the whole
  logits (bench/README.md), so what it buys there is memory. Chunks run along the target
  positions, so the batch axis (the one sharded over devices) is untouched. Padding positions
  added to fill the last chunk have weight 0.

  R-Drop (Liang et al., 2021), when features is [2b, t, m]: rows 2i and 2i+1 are the same
  example under two dropout masks. loss_sum and correct_tokens are then the means of the two
  copies' (so the logged loss reads as without R-Drop), and the objective adds
  rdrop_alpha / 4 x (KL(p1 || p2) + KL(p2 || p1)) per token: the paper's
  NLL_1 + NLL_2 + alpha / 2 x (KL + KL), halved, as fairseq's `reg_alpha` weighs it.
  """
  b, t = targets.shape
  copies = features.shape[0] // b
  m = features.shape[-1]
  # [copies * b, t, m] -> [b, t, copies, m]: an example's copies are adjacent rows, so a device
  # holding a block of rows holds both copies of each of its examples.
  features = jnp.moveaxis(features.reshape(b, copies, t, m), 1, 2)
  positions = max(1, min(t, -(-rows_per_chunk // (b * copies))))
  chunks = -(-t // positions)
  padding = chunks * positions - t
  if padding:
    features = jnp.pad(features, ((0, 0), (0, padding), (0, 0), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padding)))
    weights = jnp.pad(weights, ((0, 0), (0, padding)))

  def to_chunks(x):  # [b, chunks * c, ...] -> [chunks, b, c, ...]
    return jnp.moveaxis(x.reshape(b, chunks, positions, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def chunk_metrics(chunk):
    chunk_features, chunk_targets, chunk_weights = chunk
    logits = project(chunk_features)  # [b, c, copies, v]
    copy_targets = jnp.broadcast_to(chunk_targets[..., None], logits.shape[:-1])
    copy_weights = jnp.broadcast_to(chunk_weights[..., None], logits.shape[:-1]) / copies
    loss_sum, weight_sum = label_smoothed_cross_entropy(
      logits, copy_targets, copy_weights, label_smoothing
    )
    kl_sum = (
      symmetric_kl(logits[:, :, 0], logits[:, :, 1], chunk_weights)
      if copies == 2
      else jnp.zeros((), jnp.float32)
    )
    return loss_sum, weight_sum, correct_tokens(logits, copy_targets, copy_weights), kl_sum

  loss_sums, weight_sums, corrects, kl_sums = jax.lax.map(
    chunk_metrics, (to_chunks(features), to_chunks(targets), to_chunks(weights))
  )
  loss_sum = jnp.sum(loss_sums)
  metrics = {
    'loss_sum': loss_sum,
    'token_count': jnp.sum(weight_sums),
    'correct_tokens': jnp.sum(corrects),
    'objective_sum': loss_sum,
  }
  if copies == 2:
    metrics['rdrop_kl_sum'] = jnp.sum(kl_sums)
    metrics['objective_sum'] = loss_sum + rdrop_alpha / 4 * metrics['rdrop_kl_sum']
  return metrics
