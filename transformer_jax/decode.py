"""Autoregressive decoding (greedy search), driven by callables.

This module never imports the model: the caller passes a function that maps
tokens to logits, so decoding can be tested with toy functions and reused by
any model that follows the contract below.

Output convention, shared by every search here: int32 [batch, max_decode_len]
of generated tokens (BOS not included). Each row ends with its first EOS (kept
in the output) and holds pad_id after it; a row that never emits EOS is cut at
max_decode_len.

The loops use jax.lax.while_loop, so they compile once for every length, stop
as soon as every row has emitted EOS, and can be jitted or called inside jit
(the keyword arguments must then be static, e.g. bound with functools.partial).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# step_fn(token_ids int32[b, 1], cache) -> (logits float32[b, vocab], new_cache)
StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]
# logits_fn(target_input_ids int32[b, max_len]) -> float32[b, max_len, vocab]
LogitsFn = Callable[[jax.Array], jax.Array]


# --- EOS handling, shared by all searches ----------------------------------

def _record_token(token: jax.Array, finished: jax.Array, *, eos_id: int,
                  pad_id: int) -> tuple[jax.Array, jax.Array]:
  """Applies the EOS convention to one step's chosen token per row.

  token: int32[...], finished: bool[...] (rows that already emitted EOS).
  Returns (token to write: pad for finished rows, new finished flags). The EOS
  itself is written because the row is only marked finished *after* it.
  """
  written = jnp.where(finished, jnp.asarray(pad_id, token.dtype), token)
  return written, finished | (written == eos_id)


def _keep_decoding(step: jax.Array, finished: jax.Array,
                   max_decode_len: int) -> jax.Array:
  """while_loop condition: steps left and some row still unfinished."""
  return (step < max_decode_len) & ~jnp.all(finished)


def _check_lengths(batch_size: int, max_decode_len: int) -> None:
  # Python-level checks: these are static (bound with partial under jit).
  if batch_size < 1 or max_decode_len < 1:
    raise ValueError(f'batch_size ({batch_size}) and max_decode_len '
                     f'({max_decode_len}) must both be >= 1')


# --- Greedy search -----------------------------------------------------------

def _greedy_loop(next_logits: Callable[[jax.Array, jax.Array, jax.Array, Any],
                                       tuple[jax.Array, Any]],
                 extra: Any, *, batch_size: int, max_decode_len: int,
                 bos_id: int, eos_id: int, pad_id: int) -> tuple[jax.Array, Any]:
  """The greedy while_loop shared by the cached and uncached variants.

  next_logits(step, token [b,1], out [b,max_len], extra) -> (logits [b,vocab],
  new_extra) gives the logits for position `step`; `extra` is whatever state
  the variant carries (the model cache, or nothing). Returns (out, extra).
  """
  _check_lengths(batch_size, max_decode_len)

  def body(state):
    step, token, out, finished, extra = state
    logits, extra = next_logits(step, token, out, extra)
    # Padding is never a prediction: an emitted pad would be masked as padding by a model
    # that recomputes the prefix but attended to by one with a cache, and they would diverge.
    logits = logits.at[:, pad_id].set(-jnp.inf)
    chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32)            # [b]
    written, finished = _record_token(chosen, finished, eos_id=eos_id,
                                      pad_id=pad_id)
    out = jax.lax.dynamic_update_slice_in_dim(out, written[:, None], step,
                                              axis=1)
    # Finished rows feed pad: their later logits are ignored anyway.
    return step + 1, written[:, None], out, finished, extra

  init = (
      jnp.asarray(0, jnp.int32),                                      # step
      jnp.full((batch_size, 1), bos_id, jnp.int32),                   # [b, 1]
      jnp.full((batch_size, max_decode_len), pad_id, jnp.int32),      # [b, L]
      jnp.zeros((batch_size,), jnp.bool_),                            # [b]
      extra,
  )
  _, _, out, _, extra = jax.lax.while_loop(
      lambda s: _keep_decoding(s[0], s[3], max_decode_len), body, init)
  return out, extra


def greedy_search(step_fn: StepFn, cache: Any, *, batch_size: int,
                  max_decode_len: int, bos_id: int, eos_id: int,
                  pad_id: int = 0, return_cache: bool = False):
  """Greedy decoding with an incremental (key/value) cache.

  step_fn(token_ids int32[b, 1], cache) -> (logits float32[b, vocab],
  new_cache) consumes one token per row and advances `cache` (any pytree of
  arrays; its shapes and dtypes must not change) by one position. Decoding
  starts from BOS and feeds back the argmax each step.

  Returns int32[batch_size, max_decode_len] (see module docstring), or
  (tokens, final_cache) if return_cache, e.g. to continue decoding or to read
  how far the cache advanced (step_fn runs once per step until all rows end).
  """
  tokens, cache = _greedy_loop(
      lambda step, token, out, cache: step_fn(token, cache), cache,
      batch_size=batch_size, max_decode_len=max_decode_len, bos_id=bos_id,
      eos_id=eos_id, pad_id=pad_id)
  return (tokens, cache) if return_cache else tokens


def greedy_search_uncached(logits_fn: LogitsFn, *, batch_size: int,
                           max_decode_len: int, bos_id: int, eos_id: int,
                           pad_id: int = 0) -> jax.Array:
  """Greedy decoding by full recomputation of the target prefix each step.

  logits_fn(target_input_ids int32[b, max_decode_len]) -> float32[b,
  max_decode_len, vocab] must be causal (position i sees inputs[:, :i+1]).
  Quadratic in length; it exists as the reference the cached path must match
  token for token, and as the baseline that shows what the cache buys.
  """
  def next_logits(step, token, out, extra):
    # Target input = outputs shifted right behind BOS: [BOS, y_0..y_{i-1},
    # pad...]. out holds pad at positions >= step, so no extra buffer needed.
    bos = jnp.full((batch_size, 1), bos_id, jnp.int32)
    inputs = jnp.concatenate([bos, out[:, :-1]], axis=1)               # [b, L]
    logits = logits_fn(inputs)                                         # [b,L,V]
    return jax.lax.dynamic_index_in_dim(logits, step, axis=1,
                                        keepdims=False), extra         # [b, V]

  tokens, _ = _greedy_loop(
      next_logits, None, batch_size=batch_size, max_decode_len=max_decode_len,
      bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
  return tokens


# --- Post-processing -----------------------------------------------------------

def strip_after_eos(tokens: np.ndarray, eos_id: int, *,
                    pad_id: int = 0) -> list[list[int]]:
  """Per-row python lists of ids before the first EOS, pads removed.

  tokens: int[batch, length] (e.g. a search's output). Used before
  detokenization, which must see neither EOS nor padding.
  """
  rows = []
  for row in np.asarray(tokens).tolist():
    if eos_id in row:
      row = row[:row.index(eos_id)]
    rows.append([t for t in row if t != pad_id])
  return rows
