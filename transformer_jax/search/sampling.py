"""Random sampling (temperature, top-k, nucleus), driven by a step function like decode's greedy
search, in decode's output convention (int32 [batch, max_decode_len], EOS kept, pad after; PAD
never drawn). Like decode, it never imports the model.

Each sentence draws from its own PRNG key: step t's draw uses fold_in(key, t) and the row's own
logits only, so a sentence's output depends on its key and its source, never on which other
sentences share the batch (or on their count, or on its row).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.search.candidates import top_k_by_blocks
from transformer_jax.search.steps import LogitsFn, StepFn, Steps
from transformer_jax.search.token_loop import (
  cached_next_logits,
  check_lengths,
  token_loop,
  uncached_next_logits,
)


def sampling_option_problem(temperature, top_k, top_p) -> str | None:
  """The one-line reason the sampling options are invalid, or None if they are valid.

  temperature: finite and > 0; top_k: an integer >= 0 (0: off); top_p: in (0, 1] (1: off).
  Values that are not Python or NumPy numbers (traced arrays) pass: they are not known yet.
  """

  def known(value) -> bool:
    return not isinstance(value, np.ndarray | jax.Array)  # jax.Array covers tracers

  if known(temperature) and not (
    _is_real(temperature) and math.isfinite(temperature) and temperature > 0
  ):
    return f'temperature must be a finite number > 0, got {temperature!r}'
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
    return f'top_k must be an integer >= 0 (0: no top-k filter), got {top_k!r}'
  if known(top_p) and not (_is_real(top_p) and 0 < top_p <= 1):
    return f'top_p must be a number in (0, 1] (1: no nucleus filter), got {top_p!r}'
  return None


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_one(value) -> bool:
  """Whether a filter's parameter is statically 1 (the filter is then skipped)."""
  return isinstance(value, numbers.Real) and value == 1


def filter_logits(logits: jax.Array, *, temperature=1.0, top_k: int = 0, top_p=1.0) -> jax.Array:
  """The logits [b, vocab] sampling draws from: float32, divided by temperature, then -inf
  outside the top_k most probable tokens (ties: lower id first), then -inf outside the nucleus of
  what is left: the fewest most probable tokens whose renormalised probabilities sum to at least
  top_p (always the most probable one).

  temperature and top_p may be traced, of shape () or [b] (per row); top_k is static. A filter
  whose parameter is statically off (temperature 1, top_k 0 or >= vocab, top_p 1) costs nothing.
  """
  logits = logits.astype(jnp.float32)
  b, vocab = logits.shape
  rows = jnp.arange(b)[:, None]
  if not _is_one(temperature):
    logits = logits / jnp.reshape(jnp.asarray(temperature, jnp.float32), (-1, 1))
  if 0 < top_k < vocab:
    _, index, _ = top_k_by_blocks(logits, top_k)
    keep = jnp.zeros(logits.shape, jnp.bool_).at[rows, index].set(True)
    logits = jnp.where(keep, logits, -jnp.inf)
  if not _is_one(top_p):
    logits = jnp.where(_nucleus(logits, top_p), logits, -jnp.inf)
  return logits


def _nucleus(logits: jax.Array, top_p) -> jax.Array:
  """bool [b, vocab]: the fewest most probable tokens whose probabilities sum to >= top_p
  (ties: lower id first), i.e. those whose mass before them in that order is < top_p.

  Without sorting (a sort of the vocabulary per row and step cost 12x a greedy step at 37k
  pieces): a bisection on the probabilities' float32 bit patterns (non-negative floats order as
  their bits) finds the largest probability t with mass{p >= t} >= top_p in 32 masked sums;
  every token above t is in, and of the tokens at t those that fit, in id order.
  """
  probs = jax.nn.softmax(logits, axis=-1)  # [b, v]; filtered tokens 0
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
  top_p = jnp.reshape(jnp.asarray(top_p, jnp.float32), (-1, 1))

  def mass_from(threshold):  # [b, 1]: the probability of the tokens at or above threshold
    return jnp.sum(jnp.where(bits >= threshold, probs, 0.0), axis=-1, keepdims=True)

  def halve(_, bounds):
    low, high = bounds  # mass_from(low) >= top_p > mass_from(high)
    middle = low + (high - low) // 2
    reaches = mass_from(middle) >= top_p
    return jnp.where(reaches, middle, low), jnp.where(reaches, high, middle)

  initial = (jnp.zeros_like(bits[:, :1]), jnp.max(bits, axis=-1, keepdims=True) + 1)
  threshold, _ = jax.lax.fori_loop(0, 32, halve, initial)  # [b, 1], a probability's bits
  above, at = bits > threshold, bits == threshold
  mass_above = jnp.sum(jnp.where(above, probs, 0.0), axis=-1, keepdims=True)
  value = jax.lax.bitcast_convert_type(threshold, jnp.float32)
  ties_before = jnp.cumsum(at, axis=-1) - 1  # [b, v]: earlier tokens at the threshold
  # The most probable token always stays (its mass before is 0 < top_p).
  return above | (at & (mass_above + ties_before * value < top_p))


def _draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
  """One token per row from softmax(logits) [b, v] with one uniform number per row, by the
  inverse of the cumulative distribution (jax.random.categorical's Gumbel-max draws v numbers
  per row: 4x a greedy step's cost at 37k pieces). Filtered (-inf) tokens weigh 0 and are never
  drawn."""
  return _draw_weighted(keys, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))[:, 0]


def _draw_weighted(keys: jax.Array, weights: jax.Array, draws: int = 1) -> jax.Array:
  """int32 [b, draws]: independent draws (the first with the row's key, the r-th with
  fold_in(key, r)) from unnormalised non-negative weights [b, v] (at least one positive per
  row).

  The inverse CDF in two levels, since a cumsum over the whole vocabulary costs XLA:CPU 7 times
  a softmax at [32, 37000]: the cumulative mass of blocks of ~sqrt(v) tokens picks the block,
  the cumulative mass inside that one block picks the token (about 1 ms in all). Float rounding
  at either end falls back to the nearest token that has weight, so a zero weight is never
  drawn.
  """
  b, vocab = weights.shape
  block = max(1, math.isqrt(vocab))
  blocks = -(-vocab // block)
  padded = jnp.pad(weights, ((0, 0), (0, blocks * block - vocab)))
  per_block = padded.reshape(b, blocks, block)  # [b, blocks, block]
  block_mass = jnp.sum(per_block, axis=-1)  # [b, blocks]
  cumulative = jnp.cumsum(block_mass, axis=-1)
  uniform = jax.vmap(lambda key: _uniforms(key, draws))(keys)  # [b, draws] in [0, 1)
  target = uniform * cumulative[:, -1:]
  # The first block whose cumulative mass exceeds the target (it has mass), or the last that has.
  chosen = _first_above(cumulative[:, None], target, block_mass[:, None])  # [b, draws]
  inside = jnp.take_along_axis(per_block, chosen[..., None], axis=1)  # [b, draws, block]
  mass_before = jnp.take_along_axis(cumulative - block_mass, chosen, axis=-1)
  remainder = jnp.maximum(target - mass_before, 0.0)
  index = _first_above(jnp.cumsum(inside, axis=-1), remainder, inside)
  return (chosen * block + index).astype(jnp.int32)


def _uniforms(key: jax.Array, draws: int) -> jax.Array:
  """float32 [draws] in [0, 1): the first from key, the r-th from fold_in(key, r)."""
  keys = [key] + [jax.random.fold_in(key, r) for r in range(1, draws)]
  return jnp.stack([jax.random.uniform(k, ()) for k in keys])


def _first_above(cumulative: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
  """int [...]: the first position whose cumulative [..., n] exceeds target [...] (>= 0): one
  with mass, since the cumulative only rises there; if none does (rounding), the last with mass.
  cumulative and mass broadcast against each other over the leading axes."""
  index = jnp.sum(cumulative <= target[..., None], axis=-1)
  last = mass.shape[-1] - 1 - jnp.argmax(mass[..., ::-1] > 0, axis=-1)
  return jnp.minimum(index, last)


# Candidates drawn at once for the nucleus (_draw_from_nucleus): each lands in it with
# probability >= top_p, so at top_p 0.9 all 3 miss for 1 row in 1,000 (then a loop runs). Each
# check is a masked sum over the vocabulary (~1 ms at [32, 37000]): 3 measured fastest of 1-4.
_NUCLEUS_CANDIDATES = 3


def _draw_from_nucleus(keys: jax.Array, logits: jax.Array, top_p) -> jax.Array:
  """One token per row from softmax(logits) [b, v] renormalised over its top_p nucleus (the
  set `filter_logits` keeps), without finding the nucleus first: by rejection.

  A token is in the nucleus iff the mass of the tokens ahead of it (more probable, or as
  probable with a lower id) is < top_p: one masked sum checks a drawn token. Each row draws
  _NUCLEUS_CANDIDATES tokens independently from softmax(logits) and takes the first that is in
  the nucleus: the draws follow the nucleus's renormalised softmax, as any first accepted draw
  of a rejection sampler does. The first candidate is plain sampling's draw (same key), so top_p
  changes nothing where that draw is in the nucleus. Should all miss (each lands inside with
  probability >= top_p), the row draws again, one at a time (fold_in(key, r) for r >=
  _NUCLEUS_CANDIDATES), from the tokens ahead of its most probable miss: every token not ahead
  of a miss is outside the nucleus too, so the set shrinks at each miss and still holds the
  whole nucleus. Rows are independent of each other. The bisection of `_nucleus` made 32
  masked sums over the vocabulary per step; this makes one draw and 3 checks, and a rare loop.
  """
  weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [b, v]; filtered 0
  ids = jnp.arange(weights.shape[-1])
  total = jnp.sum(weights, axis=-1, keepdims=True)
  # float32 [b, 1]: the mass a token's ahead-set may hold, in the weights' units.
  limit = jnp.reshape(jnp.asarray(top_p, jnp.float32), (-1, 1)) * total

  def ahead_of(tokens):  # tokens int [b, n] -> bool [b, n, v]: ahead in (probability, -id)
    weight = jnp.take_along_axis(weights, tokens, axis=-1)[..., None]  # [b, n, 1]
    return (weights[:, None] > weight) | ((weights[:, None] == weight) & (ids < tokens[..., None]))

  def in_nucleus(tokens):  # tokens int [b, n] -> bool [b, n]
    mass_ahead = jnp.sum(jnp.where(ahead_of(tokens), weights[:, None], 0.0), axis=-1)
    # A row whose logits hold NaN has no nucleus: it takes its first draw (no endless loop).
    return (mass_ahead < limit) | ~(limit > 0)

  candidates = _draw_weighted(keys, weights, _NUCLEUS_CANDIDATES)  # [b, n]
  inside = in_nucleus(candidates)
  first_inside = jnp.argmax(inside, axis=-1)
  token = jnp.take_along_axis(candidates, first_inside[:, None], axis=-1)[:, 0]
  accepted = jnp.any(inside, axis=-1)
  # Where all missed, the most probable miss: the tokens ahead of any miss hold the nucleus,
  # and those ahead of the most probable one are the fewest.
  most_probable = jnp.argmax(jnp.take_along_axis(weights, candidates, axis=-1), axis=-1)
  pivot = jnp.take_along_axis(candidates, most_probable[:, None], axis=-1)[:, 0]

  def draw_again(state):
    round_, token, accepted, pivot = state
    allowed = jnp.where(ahead_of(pivot[:, None])[:, 0] | accepted[:, None], weights, 0.0)
    round_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, round_)
    drawn = _draw_weighted(round_keys, allowed)[:, 0]
    now_inside = in_nucleus(drawn[:, None])[:, 0]
    token = jnp.where(accepted, token, drawn)
    pivot = jnp.where(accepted | now_inside, pivot, drawn)
    return round_ + 1, token, accepted | now_inside, pivot

  # The most probable token is always in the nucleus (nothing is ahead of it), so every miss
  # strictly shrinks the allowed set and the loop ends.
  _, token, _, _ = jax.lax.while_loop(
    lambda state: ~jnp.all(state[2]),
    draw_again,
    (jnp.asarray(_NUCLEUS_CANDIDATES, jnp.int32), token, accepted, pivot),
  )
  return token


def _row_keys(keys, batch_size: int) -> jax.Array:
  """Typed PRNG keys [b] from typed keys [b] or raw uint32 key data [b, 2]."""
  keys = jnp.asarray(keys) if not isinstance(keys, jax.Array) else keys
  if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.wrap_key_data(keys)
  if keys.shape != (batch_size,):
    raise ValueError(f'keys must hold one PRNG key per row ({batch_size}), got shape {keys.shape}')
  return keys


def sampling_choice(keys: jax.Array, *, temperature, top_k: int, top_p):
  """The token loop's choice for sampling: row i's draw at step t from its filtered softmax
  (temperature, then top_k; the top_p nucleus last, in the draw itself: `_draw_from_nucleus`
  builds no mask) with the key fold_in(keys[i], t)."""

  def choose(step, logits):
    drawn_from = filter_logits(logits, temperature=temperature, top_k=top_k)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
    if _is_one(top_p):
      return _draw(step_keys, drawn_from)  # [b]
    return _draw_from_nucleus(step_keys, drawn_from, top_p)

  return choose


def _sample_loop(
  next_logits,
  extra: Any,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int,
  keys,
  temperature,
  top_k: int,
  top_p,
  max_lengths,
  prefix,
  prefix_lengths,
) -> tuple[jax.Array, jax.Array, Any]:
  """The token loop (`token_loop`) with a draw as its choice. Returns (tokens [b, L],
  log_probs float32[b], extra)."""
  problem = sampling_option_problem(temperature, top_k, top_p)
  if problem:
    raise ValueError(problem)
  check_lengths(batch_size, max_decode_len)
  keys = _row_keys(keys, batch_size)
  # The prefix comes first: the cap applies after it (`prefix.Forcing`).
  return token_loop(
    next_logits,
    extra,
    sampling_choice(keys, temperature=temperature, top_k=top_k, top_p=top_p),
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
    max_lengths=max_lengths,
    scored=True,
  )


def sample_search(
  step_fn: StepFn,
  cache: Any,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  keys,
  temperature=1.0,
  top_k: int = 0,
  top_p=1.0,
  max_lengths: jax.Array | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Random sampling with an incremental cache (step_fn and cache as for decode.greedy_search).

  Each step draws row i's token from softmax(filter_logits(logits)) (temperature, then top_k,
  then the top_p nucleus) with the key fold_in(keys[i], step). keys: one PRNG key per row, typed
  [batch_size] or raw uint32 [batch_size, 2] (e.g. jax.random.split(seed_key, batch_size)).

  max_lengths: optional int32[batch_size], each row's maximum number of tokens including EOS: at
  step max_lengths[i] - 1 it draws EOS. prefix, prefix_lengths: forced first tokens, part of the
  output (search.prefix); the cap applies after them.

  Returns (tokens int32[batch_size, max_decode_len] in decode's convention, log_probs
  float32[batch_size]): each row's total log-probability of its tokens up to and including EOS
  (forced ones too) under the model's own distribution, i.e. temperature 1, unfiltered, over the
  vocabulary without PAD and BOS, as beam search's scores (alpha 0) count them: a score for
  reranking or filtering, not the probability of the draw.
  """
  tokens, log_probs, _ = _sample_loop(
    cached_next_logits(step_fn),
    cache,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    keys=keys,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    max_lengths=max_lengths,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )
  return tokens, log_probs


def sample_search_uncached(
  logits_fn: LogitsFn,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  keys,
  temperature=1.0,
  top_k: int = 0,
  top_p=1.0,
  max_lengths: jax.Array | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """sample_search by full recomputation of the prefix each step (logits_fn as for
  decode.greedy_search_uncached): the reference the cached path must match."""
  tokens, log_probs, _ = _sample_loop(
    uncached_next_logits(logits_fn, bos_id),
    None,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    keys=keys,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    max_lengths=max_lengths,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )
  return tokens, log_probs


def sample_search_steps(steps: Steps, **options) -> tuple[jax.Array, jax.Array]:
  """`sample_search` over a `Steps` (a model's or an ensemble's): its cache for one length."""
  return sample_search(steps.step, steps.init_cache(options['max_decode_len'], 1), **options)
