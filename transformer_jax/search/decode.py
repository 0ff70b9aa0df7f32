"""Autoregressive decoding (greedy and beam search), driven by callables: greedy is the one
token loop (`token_loop`) with an argmax choice, beam search lives in `beam` and is re-exported
here, and both take a model's or an ensemble's `Steps` (`greedy_search_steps`,
`beam_search_steps`) or the step function and cache themselves.

This module never imports the model: the caller passes a function that maps
tokens to logits, so decoding can be tested with toy functions and reused by
any model that follows the contract below.

Output convention, shared by every search here: int32 [batch, max_decode_len]
(beam search: [batch, beam_size, max_decode_len]) of generated tokens (BOS not
included). Each row ends with its first EOS (kept in the output) and holds
pad_id after it; a row that never emits EOS is cut at max_decode_len. PAD is
never generated.

The loops use jax.lax.while_loop, so they compile once for every length, stop
as soon as every row is decided (greedy: emitted EOS; beam: see beam_search),
and can be jitted or called inside jit (the keyword arguments must then be
static, e.g. bound with functools.partial; beam search's max_lengths may be
traced).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from transformer_jax.search.beam import (
  BEAM_RULES,
  beam_search,
  beam_search_steps,
  beam_search_uncached,
  length_penalty,
)
from transformer_jax.search.steps import (
  ExtendFn,
  LogitsFn,
  ReorderFn,
  StepFn,
  Steps,
  expand_to_beams,
  reorder_rows,
)
from transformer_jax.search.token_loop import (
  argmax_choice,
  cached_next_logits,
  token_loop,
  uncached_next_logits,
)

__all__ = [
  'BEAM_RULES',
  'ExtendFn',
  'LogitsFn',
  'ReorderFn',
  'StepFn',
  'Steps',
  'beam_search',
  'beam_search_steps',
  'beam_search_uncached',
  'expand_to_beams',
  'greedy_search',
  'greedy_search_steps',
  'greedy_search_uncached',
  'host_length_penalty',
  'length_penalty',
  'reorder_rows',
  'strip_after_eos',
]


# --- Greedy search: the token loop with an argmax choice ---------------------


def greedy_search(
  step_fn: StepFn,
  cache: Any,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  return_cache: bool = False,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
  max_lengths: jax.Array | None = None,
):
  """Greedy decoding with an incremental (key/value) cache.

  step_fn(token_ids int32[b, 1], cache) -> (logits float32[b, vocab],
  new_cache) consumes one token per row and advances `cache` (any pytree of
  arrays; its shapes and dtypes must not change) by one position. Decoding
  starts from BOS and feeds back the argmax each step.

  Returns int32[batch_size, max_decode_len] (see module docstring), or
  (tokens, final_cache) if return_cache, e.g. to continue decoding or to read
  how far the cache advanced (step_fn runs once per step until all rows end).

  prefix int32[batch_size, P], prefix_lengths int32[batch_size] (default P):
  row i's first prefix_lengths[i] tokens are forced to prefix[i] and are part
  of the output; the search goes on from them (search.prefix). max_lengths:
  optional int32[batch_size], each row's most tokens (EOS counted): at step
  max_lengths[i] - 1 it ends (padding rows of cap 1 end at once).
  """
  tokens, _, cache = token_loop(
    cached_next_logits(step_fn),
    cache,
    argmax_choice,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
    max_lengths=max_lengths,
  )
  return (tokens, cache) if return_cache else tokens


def greedy_search_steps(
  steps: Steps,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  scored: bool = False,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
  max_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """`greedy_search` over a `Steps` (a model's or an ensemble's), one cache length:
  (tokens int32[b, max_decode_len], log_probs float32[b] with `scored`, else None), each
  row's log-prob its tokens' (EOS and forced ones counted) under the model, PAD and BOS excluded."""
  tokens, log_probs, _ = token_loop(
    cached_next_logits(steps.step),
    steps.init_cache(max_decode_len, 1),
    argmax_choice,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
    max_lengths=max_lengths,
    scored=scored,
  )
  return tokens, log_probs


def greedy_search_uncached(
  logits_fn: LogitsFn,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
  max_lengths: jax.Array | None = None,
) -> jax.Array:
  """Greedy decoding by full recomputation of the target prefix each step.

  logits_fn(target_input_ids int32[b, max_decode_len]) -> float32[b,
  max_decode_len, vocab] must be causal (position i sees inputs[:, :i+1]).
  Quadratic in length; it exists as the reference the cached path must match
  token for token, and as the baseline that shows what the cache buys.
  prefix, prefix_lengths, max_lengths: as for greedy_search.
  """
  tokens, _, _ = token_loop(
    uncached_next_logits(logits_fn, bos_id),
    None,
    argmax_choice,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
    max_lengths=max_lengths,
  )
  return tokens


def host_length_penalty(length: int, alpha: float) -> float:
  """`length_penalty` on the host, in float32 as the search computes it: ((5 + |y|) / 6) **
  alpha, |y| counting EOS. For ranking hypotheses after a search's one fetch (no device work
  per hypothesis)."""
  base = np.float32(5.0 + length) / np.float32(6.0)
  return float(base ** np.float32(alpha))


# --- Post-processing -----------------------------------------------------------


def strip_after_eos(tokens: np.ndarray, eos_id: int, *, pad_id: int = 0) -> list[list[int]]:
  """Per-row python lists of ids before the first EOS, pads removed.

  tokens: int[batch, length] (e.g. a search's output). Used before
  detokenization, which must see neither EOS nor padding.
  """
  rows = []
  for row in np.asarray(tokens).tolist():
    if eos_id in row:
      row = row[: row.index(eos_id)]
    rows.append([t for t in row if t != pad_id])
  return rows
