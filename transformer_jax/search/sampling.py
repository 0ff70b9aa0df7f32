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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.search import prefix as target_prefix
from transformer_jax.search.candidates import mask_pad, top_k_by_blocks
from transformer_jax.search.decode import (
  LogitsFn,
  StepFn,
  _check_lengths,
  _keep_decoding,
  _record_token,
  _uncached_next_logits,
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
  drawn; float rounding at the top end falls back to the last token that has weight."""
  weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [b, v]
  cumulative = jnp.cumsum(weights, axis=-1)
  uniform = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)  # [b] in [0, 1)
  target = (uniform * cumulative[:, -1])[:, None]
  index = jnp.sum(cumulative <= target, axis=-1)  # the first token whose cumulative > target
  vocab = logits.shape[-1]
  last = vocab - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
  return jnp.minimum(index, last).astype(jnp.int32)


def _row_keys(keys, batch_size: int) -> jax.Array:
  """Typed PRNG keys [b] from typed keys [b] or raw uint32 key data [b, 2]."""
  keys = jnp.asarray(keys) if not isinstance(keys, jax.Array) else keys
  if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.random.wrap_key_data(keys)
  if keys.shape != (batch_size,):
    raise ValueError(f'keys must hold one PRNG key per row ({batch_size}), got shape {keys.shape}')
  return keys


def _sample_loop(
  next_logits: Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
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
  """The sampling while_loop (decode._greedy_loop's, drawing instead of taking the argmax).
  Returns (tokens [b, L], log_probs float32[b], extra)."""
  _check_lengths(batch_size, max_decode_len)
  problem = sampling_option_problem(temperature, top_k, top_p)
  if problem:
    raise ValueError(problem)
  keys = _row_keys(keys, batch_size)
  forcing = target_prefix.check_prefix(prefix, prefix_lengths, batch_size)
  if max_lengths is not None:
    max_lengths = jnp.asarray(max_lengths, jnp.int32)
    if max_lengths.shape != (batch_size,):
      raise ValueError(f'max_lengths must have shape ({batch_size},), got {max_lengths.shape}')

  def body(state):
    step, token, out, finished, log_probs, extra = state
    logits, extra = next_logits(step, token, out, extra)
    logits = mask_pad(logits, pad_id).astype(jnp.float32)
    drawn_from = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    forced = jnp.zeros((batch_size,), jnp.bool_)
    forced_token = jnp.full((batch_size,), eos_id, jnp.int32)
    if max_lengths is not None:
      forced = step >= max_lengths - 1  # at its cap a row may only end
    if forcing is not None:
      # The prefix comes first: the cap applies after it.
      in_prefix, prefix_token = target_prefix.forced_tokens(step, *forcing)
      forced, forced_token = forced | in_prefix, jnp.where(in_prefix, prefix_token, forced_token)
    if max_lengths is not None or forcing is not None:
      drawn_from = target_prefix.force_logits(drawn_from, forced, forced_token)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
    chosen = _draw(step_keys, drawn_from)  # [b]
    # The model's own log-probability (temperature 1, unfiltered, PAD excluded).
    token_logp = jnp.take_along_axis(jax.nn.log_softmax(logits), chosen[:, None], axis=-1)[:, 0]
    log_probs = log_probs + jnp.where(finished, 0.0, token_logp)
    written, finished = _record_token(chosen, finished, eos_id=eos_id, pad_id=pad_id)
    out = jax.lax.dynamic_update_slice_in_dim(out, written[:, None], step, axis=1)
    return step + 1, written[:, None], out, finished, log_probs, extra

  init = (
    jnp.asarray(0, jnp.int32),  # step
    jnp.full((batch_size, 1), bos_id, jnp.int32),  # [b, 1]
    jnp.full((batch_size, max_decode_len), pad_id, jnp.int32),  # [b, L]
    jnp.zeros((batch_size,), jnp.bool_),  # finished [b]
    jnp.zeros((batch_size,), jnp.float32),  # log_probs [b]
    extra,
  )
  _, _, out, _, log_probs, extra = jax.lax.while_loop(
    lambda s: _keep_decoding(s[0], s[3], max_decode_len), body, init
  )
  return out, log_probs, extra


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
  vocabulary without PAD, as beam search's scores (alpha 0) count them: a score for reranking
  or filtering, not the probability of the draw.
  """
  tokens, log_probs, _ = _sample_loop(
    lambda step, token, out, cache: step_fn(token, cache),
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
    _uncached_next_logits(logits_fn, bos_id),
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
