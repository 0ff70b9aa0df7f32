"""Ensembles for the searches of `decode`: several step functions decode as one.

Each member's logits become log-probabilities (log_softmax, in float32), and the ensemble's
log-probability of a token is log(sum_m w_m * p_m) (weights normalised to sum 1, uniform by
default), the log of the (weighted) mean of the members' probabilities. The combined step
returns these log-probabilities where a step function returns logits: every search here is
invariant to what softmax removes (greedy takes the argmax; beam search normalises the logits
itself, `candidates.best_extensions`), so they decode the mixture.

The members' caches travel together as a tuple (member m's cache at index m), and
`ensemble_reorder` / `ensemble_extend` apply each member's own reorder / extend to its part.
Like `decode`, this never imports the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.search.candidates import mask_never_predicted
from transformer_jax.search.steps import ExtendFn, ReorderFn, StepFn, Steps


def normalised_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
  """`weights` (None: uniform) for `count` members, scaled to sum 1. ValueError unless there
  are `count` of them, each finite and > 0."""
  if count < 1:
    raise ValueError('an ensemble needs at least one member')
  if weights is None:
    return (1.0 / count,) * count
  values = np.asarray(weights, np.float64)
  if values.shape != (count,):
    raise ValueError(f'{values.size} weights given for {count} ensemble members')
  if not np.all(np.isfinite(values) & (values > 0)):
    raise ValueError(f'ensemble weights must be finite and > 0, got {list(weights)}')
  return tuple(float(w) for w in values / values.sum())


def combine_log_probs(
  logits: Sequence[jax.Array],
  weights: Sequence[float] | None = None,
  *,
  pad_id: int | None = None,
  bos_id: int | None = None,
) -> jax.Array:
  """log(sum_m w_m * softmax(logits[m])) over the last axis: float32 [..., vocab].

  logits: one array [..., vocab] per member (any float dtype; same shape). pad_id, bos_id: the
  tokens the searches never emit (`candidates.mask_never_predicted`): each member's
  distribution is then normalised without them, as the searches normalise a single model's,
  before the members are mixed.

  Computed as best + log1p(sum_m w_m * expm1(lp_m - best)), best the members' largest
  log-prob per token (the log-sum-exp with the maximum factored out): where the members agree
  every expm1 is exactly 0, so a member ensembled with itself, or alone, gives exactly its own
  log_softmax, whatever the weights (a plain logsumexp of lp_m + log w_m is off by rounding).
  """
  log_probs = []
  for member in logits:
    member = jnp.asarray(member, jnp.float32)
    if pad_id is not None:
      member = mask_never_predicted(member, pad_id, bos_id)
    log_probs.append(jax.nn.log_softmax(member, axis=-1))
  return mix_log_probs(log_probs, weights)


def mix_log_probs(
  log_probs: Sequence[jax.Array], weights: Sequence[float] | None = None
) -> jax.Array:
  """log(sum_m w_m * exp(log_probs[m])), elementwise: the mixture of the members'
  log-probabilities of the same events (`combine_log_probs`' whole distributions, or scoring's
  one token per position), computed as `combine_log_probs` says: exact for equal members."""
  weights = normalised_weights(weights, len(log_probs))
  if len(log_probs) == 1:
    return jnp.asarray(log_probs[0], jnp.float32)
  stacked = jnp.stack([jnp.asarray(lp, jnp.float32) for lp in log_probs])  # [m, ...]
  best = jnp.max(stacked, axis=0)
  # Where equal (-inf included: PAD in every member) the gap is 0, not -inf - -inf = NaN.
  gaps = jnp.where(stacked == best, 0.0, stacked - best)
  scale = jnp.asarray(weights, jnp.float32).reshape((-1,) + (1,) * best.ndim)
  return best + jnp.log1p(jnp.sum(scale * jnp.expm1(gaps), axis=0))


def ensemble_step_fn(
  step_fns: Sequence[StepFn],
  weights: Sequence[float] | None = None,
  *,
  pad_id: int | None = None,
  bos_id: int | None = None,
) -> StepFn:
  """One step function over a tuple of the members' caches: step_fn(token_ids, caches) ->
  (log-probs float32 [rows, vocab] of the mixture, new caches). Every member sees the same
  tokens; `weights`, `pad_id`, `bos_id`: as `combine_log_probs`. The log-probs stand for
  logits: right for every search of `decode` (softmax-invariant). A search that transforms
  logits before the softmax (a sampling temperature) then transforms the mixture's log-probs."""
  step_fns = tuple(step_fns)
  weights = normalised_weights(weights, len(step_fns))

  def step_fn(token_ids, caches):
    if len(caches) != len(step_fns):
      raise ValueError(f'{len(caches)} caches for {len(step_fns)} ensemble members')
    results = [member(token_ids, cache) for member, cache in zip(step_fns, caches)]
    combined = combine_log_probs(
      [logits for logits, _ in results], weights, pad_id=pad_id, bos_id=bos_id
    )
    return combined, tuple(cache for _, cache in results)

  return step_fn


def ensemble_reorder(reorders: Sequence[ReorderFn]) -> ReorderFn:
  """beam_search's reorder_cache for a tuple of caches: member m's reorders[m] on its own."""
  reorders = tuple(reorders)

  def reorder(caches: tuple, rows: jax.Array) -> tuple:
    return tuple(member(cache, rows) for member, cache in zip(reorders, caches, strict=True))

  return reorder


def ensemble_extend(extends: Sequence[ExtendFn]) -> ExtendFn:
  """beam_search's extend_cache for a tuple of caches: member m's extends[m] on its own."""
  extends = tuple(extends)

  def extend(caches: tuple, length: Any) -> tuple:
    return tuple(member(cache, length) for member, cache in zip(extends, caches, strict=True))

  return extend


def ensemble_steps(
  members: Sequence[Steps],
  weights: Sequence[float] | None = None,
  *,
  pad_id: int | None = None,
  bos_id: int | None = None,
) -> Steps:
  """The members' `Steps` as one: the mixture's step (`ensemble_step_fn`), the tuple of their
  caches made, reordered and grown each by its own functions. Members grow their caches
  through the first member's lengths (they decode the same steps)."""
  members = tuple(members)
  first = members[0]
  grows = all(member.extend is not None for member in members)
  return Steps(
    step=ensemble_step_fn(
      [member.step for member in members], weights, pad_id=pad_id, bos_id=bos_id
    ),
    init_cache=lambda positions, beam_size: tuple(
      member.init_cache(positions, beam_size) for member in members
    ),
    reorder=ensemble_reorder([member.reorder for member in members]),
    extend=ensemble_extend([member.extend for member in members]) if grows else None,
    cache_lengths=first.cache_lengths if grows else None,
  )
