"""Tests for transformer_jax.training.losses against explicit NumPy definitions (tiny; CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.training.losses import (
  chunked_token_metrics,
  correct_tokens,
  label_smoothed_cross_entropy,
  symmetric_kl,
)

V = 7


def _log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _smoothed_targets(targets, eps, vocab):
  """q: 1 - eps on the target id, eps / (vocab - 1) on each other id."""
  q = np.full(targets.shape + (vocab,), eps / (vocab - 1))
  np.put_along_axis(q, targets[..., None], 1.0 - eps, axis=-1)
  return q


def _reference(logits, targets, weights, eps):
  """sum_tokens w * (-sum_v q log p + sum_v q log q), with 0 log 0 = 0."""
  q = _smoothed_targets(targets, eps, logits.shape[-1])
  cross_entropy = -(q * _log_softmax(logits)).sum(-1)
  neg_entropy = np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0).sum(-1)
  return float((weights * (cross_entropy + neg_entropy)).sum()), float(weights.sum())


def _example(seed=0):
  rng = np.random.default_rng(seed)
  logits = (3.0 * rng.normal(size=(2, 4, V))).astype(np.float32)
  targets = rng.integers(0, V, size=(2, 4)).astype(np.int32)
  weights = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)  # trailing padding
  return logits, targets, weights


@pytest.mark.parametrize('eps', [0.1, 0.3])
def test_matches_definition(eps):
  logits, targets, weights = _example()
  loss, total = label_smoothed_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), label_smoothing=eps
  )
  expected_loss, expected_total = _reference(logits, targets, weights, eps)
  assert total == expected_total == 5.0
  np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
  assert expected_loss > 1.0  # the example is far from a perfect prediction


def test_default_smoothing_is_0_1():
  logits, targets, weights = _example(1)
  loss, _ = label_smoothed_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  np.testing.assert_allclose(float(loss), _reference(logits, targets, weights, 0.1)[0], rtol=1e-5)


def test_padding_is_excluded():
  logits, targets, weights = _example()
  loss, total = label_smoothed_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)
  )
  # Whatever sits in the padded positions does not matter.
  garbage_logits = logits.copy()
  garbage_logits[weights == 0] = 1e4 * np.arange(V)
  garbage_targets = np.where(weights == 0, 0, targets).astype(np.int32)
  loss2, total2 = label_smoothed_cross_entropy(
    jnp.asarray(garbage_logits), jnp.asarray(garbage_targets), jnp.asarray(weights)
  )
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
  assert float(total2) == float(total) == 5.0
  # And the weights scale each token's term.
  loss3, total3 = label_smoothed_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(2.0 * weights)
  )
  np.testing.assert_allclose(float(loss3), 2.0 * float(loss), rtol=1e-6)
  assert float(total3) == 10.0


def test_no_smoothing_is_plain_cross_entropy():
  logits, targets, weights = _example(2)
  loss, _ = label_smoothed_cross_entropy(
    jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), label_smoothing=0.0
  )
  log_p = _log_softmax(logits)
  nll = -np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(float(loss), float((weights * nll).sum()), rtol=1e-5)


def test_no_smoothing_perfect_prediction_is_zero():
  targets = np.array([[3, 0, 6]], np.int32)
  logits = 100.0 * jax.nn.one_hot(targets, V)
  loss, total = label_smoothed_cross_entropy(
    logits, jnp.asarray(targets), jnp.ones((1, 3)), label_smoothing=0.0
  )
  assert float(total) == 3.0
  assert 0.0 <= float(loss) < 1e-6


@pytest.mark.parametrize('eps', [0.1, 0.25])
def test_minimum_is_at_q(eps):
  _, targets, weights = _example(3)
  q = _smoothed_targets(targets, eps, V)
  at_q = jnp.asarray(np.log(q), jnp.float32)

  def loss_fn(logits):
    return label_smoothed_cross_entropy(
      logits, jnp.asarray(targets), jnp.asarray(weights), label_smoothing=eps
    )[0]

  loss, grad = jax.value_and_grad(loss_fn)(at_q)
  assert abs(float(loss)) < 1e-5
  np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-6)  # softmax(log q) - q = 0
  # Any other logits score higher (the loss is a KL divergence to q, so >= 0).
  rng = np.random.default_rng(4)
  for _ in range(3):
    other = at_q + jnp.asarray(rng.normal(size=at_q.shape), jnp.float32)
    assert float(loss_fn(other)) > float(loss) + 1e-3
  # A peaked one-hot prediction is not optimal under smoothing.
  assert float(loss_fn(100.0 * jax.nn.one_hot(targets, V))) > 1.0


def test_correct_tokens_counts_targets_with_the_highest_logit():
  logits, targets, weights = _example(3)
  want = float(((logits.argmax(-1) == targets) * weights).sum())  # No ties in normal draws.
  assert float(correct_tokens(jnp.asarray(logits), targets, weights)) == want
  # Make every target the highest (one of them tied with another id): all weighted ones count.
  logits[..., 0] = 100.0
  assert float(correct_tokens(jnp.asarray(logits), np.zeros_like(targets), weights)) == 5.0
  logits[0, 0, 1] = 100.0  # A tie for the highest still counts as correct.
  assert float(correct_tokens(jnp.asarray(logits), np.zeros_like(targets), weights)) == 5.0
  logits[0, 0, 1] = 101.0
  assert float(correct_tokens(jnp.asarray(logits), np.zeros_like(targets), weights)) == 4.0


def test_symmetric_kl_matches_the_two_divergences():
  logits, _, weights = _example(5)
  other, _, _ = _example(6)
  p, q = np.exp(_log_softmax(logits)), np.exp(_log_softmax(other))
  kl_pq = (p * (np.log(p) - np.log(q))).sum(-1)
  kl_qp = (q * (np.log(q) - np.log(p))).sum(-1)
  want = float((weights * (kl_pq + kl_qp)).sum())
  assert want > 1.0
  got = symmetric_kl(jnp.asarray(logits), jnp.asarray(other), jnp.asarray(weights))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # Zero between equal predictions, and a shift of all logits changes no probability.
  assert float(symmetric_kl(jnp.asarray(logits), jnp.asarray(logits + 3.0), weights)) < 1e-5


def _projection(seed=7, m=5):
  matrix = jnp.asarray(np.random.default_rng(seed).normal(size=(m, V)), jnp.float32)
  return lambda x: x @ matrix  # [..., m] -> [..., V]


@pytest.mark.parametrize('rows_per_chunk', [3, 100])
def test_rdrop_metrics_are_the_copies_mean_plus_their_weighted_kl(rows_per_chunk):
  """Features [2b, t, m] whose rows 2i and 2i+1 are example i under two dropout masks: the
  loss and accuracy are the copies' means, the objective adds alpha / 4 x their symmetric KL
  (the last chunk padded when 3 rows per chunk)."""
  _, targets, weights = _example(8)
  b, t = targets.shape
  rng = np.random.default_rng(9)
  first, second = rng.normal(size=(2, b, t, 5)).astype(np.float32)
  paired = np.stack([first, second], axis=1).reshape(2 * b, t, 5)  # rows 2i, 2i+1: example i
  project = _projection()
  got = chunked_token_metrics(
    jnp.asarray(paired), project, targets, weights, 0.1, rows_per_chunk, rdrop_alpha=5.0
  )
  logits_1, logits_2 = np.asarray(project(first)), np.asarray(project(second))
  loss_1, _ = _reference(logits_1, targets, weights, 0.1)
  loss_2, _ = _reference(logits_2, targets, weights, 0.1)
  kl = float(symmetric_kl(jnp.asarray(logits_1), jnp.asarray(logits_2), weights))
  assert kl > 1.0
  np.testing.assert_allclose(float(got['loss_sum']), (loss_1 + loss_2) / 2, rtol=1e-5)
  assert float(got['token_count']) == weights.sum()
  np.testing.assert_allclose(float(got['rdrop_kl_sum']), kl, rtol=1e-5)
  np.testing.assert_allclose(
    float(got['objective_sum']), (loss_1 + loss_2) / 2 + 5.0 / 4 * kl, rtol=1e-5
  )

  def correct(logits):
    return float(((logits.argmax(-1) == targets) * weights).sum())

  np.testing.assert_allclose(
    float(got['correct_tokens']), (correct(logits_1) + correct(logits_2)) / 2
  )
  # One copy (no R-Drop): the plain loss, and the objective is the loss.
  single = chunked_token_metrics(jnp.asarray(first), project, targets, weights, 0.1, rows_per_chunk)
  np.testing.assert_allclose(float(single['loss_sum']), loss_1, rtol=1e-5)
  assert 'rdrop_kl_sum' not in single and single['objective_sum'] is single['loss_sum']
