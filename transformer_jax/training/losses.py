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
