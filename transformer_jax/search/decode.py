"""Autoregressive decoding (greedy and beam search), driven by callables.

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

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.search import prefix as target_prefix
from transformer_jax.search.candidates import best_extensions, mask_pad

# step_fn(token_ids int32[b, 1], cache) -> (logits float32[b, vocab], new_cache)
StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]
# logits_fn(target_input_ids int32[b, max_len]) -> float32[b, max_len, vocab]
LogitsFn = Callable[[jax.Array], jax.Array]
# reorder_cache(cache, rows int32[B]) -> the cache whose row r goes on from row rows[r]
ReorderFn = Callable[[Any, jax.Array], Any]
# extend_cache(cache, length) -> the cache made to hold `length` positions
ExtendFn = Callable[[Any, int], Any]
# How beam search ends hypotheses and stops (see beam_search).
BEAM_RULES = ('exact', 'ctranslate2')


# --- Helpers shared by all searches ------------------------------------------


def _record_token(
  token: jax.Array, finished: jax.Array, *, eos_id: int, pad_id: int
) -> tuple[jax.Array, jax.Array]:
  """Applies the EOS convention to one step's chosen token per row.

  token: int32[...], finished: bool[...] (rows that already emitted EOS).
  Returns (token to write: pad for finished rows, new finished flags). The EOS
  itself is written because the row is only marked finished *after* it.
  """
  written = jnp.where(finished, jnp.asarray(pad_id, token.dtype), token)
  return written, finished | (written == eos_id)


def _keep_decoding(step: jax.Array, finished: jax.Array, max_decode_len: int) -> jax.Array:
  """while_loop condition: steps left and some row still unfinished."""
  return (step < max_decode_len) & ~jnp.all(finished)


def _check_lengths(batch_size: int, max_decode_len: int) -> None:
  # Python-level checks: these are static (bound with partial under jit).
  if batch_size < 1 or max_decode_len < 1:
    raise ValueError(
      f'batch_size ({batch_size}) and max_decode_len ({max_decode_len}) must both be >= 1'
    )


def _uncached_next_logits(logits_fn: LogitsFn, bos_id: int):
  """next_logits for the loops below that recomputes the whole prefix.

  out: int32[rows, max_len] holds the tokens generated so far and pad at
  positions >= step, so the target input is out shifted right behind BOS:
  [BOS, y_0..y_{step-1}, pad...]; the logits at `step` predict y_step.
  """

  def next_logits(step, token, out, extra):
    bos = jnp.full((out.shape[0], 1), bos_id, jnp.int32)
    logits = logits_fn(jnp.concatenate([bos, out[:, :-1]], axis=1))  # [r,L,V]
    return jax.lax.dynamic_index_in_dim(logits, step, axis=1, keepdims=False), extra  # [r, V]

  return next_logits


# --- Greedy search -----------------------------------------------------------


def _greedy_loop(
  next_logits: Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
  extra: Any,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
  """The greedy while_loop shared by the cached and uncached variants.

  next_logits(step, token [b,1], out [b,max_len], extra) -> (logits [b,vocab],
  new_extra) gives the logits for position `step`; `extra` is whatever state
  the variant carries (the model cache, or nothing). Returns (out, extra).
  prefix, prefix_lengths: the target prefix (search.prefix).
  """
  _check_lengths(batch_size, max_decode_len)
  forcing = target_prefix.check_prefix(prefix, prefix_lengths, batch_size)

  def body(state):
    step, token, out, finished, extra = state
    logits, extra = next_logits(step, token, out, extra)
    logits = mask_pad(logits, pad_id)
    if forcing is not None:
      logits = target_prefix.force_logits(logits, *target_prefix.forced_tokens(step, *forcing))
    chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b]
    written, finished = _record_token(chosen, finished, eos_id=eos_id, pad_id=pad_id)
    out = jax.lax.dynamic_update_slice_in_dim(out, written[:, None], step, axis=1)
    # Finished rows feed pad: their later logits are ignored anyway.
    return step + 1, written[:, None], out, finished, extra

  init = (
    jnp.asarray(0, jnp.int32),  # step
    jnp.full((batch_size, 1), bos_id, jnp.int32),  # [b, 1]
    jnp.full((batch_size, max_decode_len), pad_id, jnp.int32),  # [b, L]
    jnp.zeros((batch_size,), jnp.bool_),  # [b]
    extra,
  )
  _, _, out, _, extra = jax.lax.while_loop(
    lambda s: _keep_decoding(s[0], s[3], max_decode_len), body, init
  )
  return out, extra


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
  of the output; the search goes on from them (search.prefix).
  """
  tokens, cache = _greedy_loop(
    lambda step, token, out, cache: step_fn(token, cache),
    cache,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )
  return (tokens, cache) if return_cache else tokens


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
) -> jax.Array:
  """Greedy decoding by full recomputation of the target prefix each step.

  logits_fn(target_input_ids int32[b, max_decode_len]) -> float32[b,
  max_decode_len, vocab] must be causal (position i sees inputs[:, :i+1]).
  Quadratic in length; it exists as the reference the cached path must match
  token for token, and as the baseline that shows what the cache buys.
  prefix, prefix_lengths: as for greedy_search.
  """
  tokens, _ = _greedy_loop(
    _uncached_next_logits(logits_fn, bos_id),
    None,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )
  return tokens


# --- Beam search -------------------------------------------------------------
#
# Shapes: b = batch_size sentences, k = beam_size, B = b * k model rows
# (batch-major: row i * k + j is beam j of sentence i), L = max_decode_len.


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty ((5 + |y|) / 6) ** alpha; |y| counts EOS too."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def expand_to_beams(tree: Any, beam_size: int, batch_size: int | None = None) -> Any:
  """Repeats every sentence's rows beam_size times (batch-major rows).

  Leaves with a leading batch axis are repeated along axis 0; 0-d leaves
  (e.g. a decode position counter) are shared by all rows and pass through.
  beam_search applies this to the cache itself; callers use it for anything
  else their step_fn closes over per sentence (encoder output, source ids).
  If batch_size is given, a leaf whose leading axis differs raises ValueError.
  """

  def expand(x):
    x = jnp.asarray(x)
    if x.ndim == 0:
      return x
    if batch_size is not None and x.shape[0] != batch_size:
      raise ValueError(
        f'leaf of shape {x.shape} has no leading batch axis of size {batch_size} (and is not 0-d)'
      )
    return jnp.repeat(x, beam_size, axis=0)

  return jax.tree.map(expand, tree)


def _reorder_rows(tree: Any, rows: jax.Array) -> Any:
  """Gathers rows (int32[B]) of every batched leaf; 0-d leaves pass through."""
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows, axis=0), tree)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, n, ...], idx int[b, m] -> out[b, m, ...]: x[i, idx[i, j]]."""
  return x[jnp.arange(x.shape[0])[:, None], idx]


def _check_cache_lengths(cache_lengths, extend_cache, max_decode_len) -> tuple[int, ...]:
  lengths = tuple(cache_lengths)
  if not lengths:
    return lengths
  if extend_cache is None or list(lengths) != sorted(set(lengths)) or lengths[0] < 1:
    raise ValueError(f'cache_lengths {lengths} must increase from >= 1, with extend_cache')
  if lengths[-1] != max_decode_len:
    raise ValueError(f'cache_lengths {lengths} must end at max_decode_len ({max_decode_len})')
  return lengths


def _while_by_cache_length(keep_going, body, state, cache_lengths, extend_cache):
  """jax.lax.while_loop(keep_going, body, state) for states (step, ..., cache), run as one loop
  per cache length: loop i takes the steps below cache_lengths[i] on a cache extended to hold
  that many positions, so early steps attend over the positions decoded so far instead of
  all. Each loop compiles its own body. No lengths: one loop."""
  state = tuple(state)
  if not cache_lengths:
    return jax.lax.while_loop(keep_going, body, state)
  for index, length in enumerate(cache_lengths):
    if index:
      state = (*state[:-1], extend_cache(state[-1], length))
    state = jax.lax.while_loop(
      lambda s, length=length: keep_going(s) & (s[0] < length), body, state
    )
  return state


def _beam_loop(
  next_logits,
  extra: Any,
  reorder: ReorderFn,
  *,
  batch_size: int,
  beam_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int,
  alpha: float,
  max_lengths: jax.Array | None,
  rule: str = 'exact',
  cache_lengths: tuple[int, ...] = (),
  extend_cache: ExtendFn | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
):
  """The beam while_loop shared by the cached and uncached variants.

  next_logits(step, token int32[B, 1], seqs int32[B, L], extra) -> (logits
  [B, vocab], new_extra) as in _greedy_loop; `extra` (the cache, or None) is
  reordered after each step, reorder(extra, rows), so that its rows follow the
  surviving beams. Returns (tokens [b, k, L], scores [b, k]).
  """
  _check_lengths(batch_size, max_decode_len)
  if beam_size < 1:
    raise ValueError(f'beam_size ({beam_size}) must be >= 1')
  if rule not in BEAM_RULES:
    raise ValueError(f'rule must be one of {BEAM_RULES}, got {rule!r}')
  forcing = target_prefix.check_prefix(prefix, prefix_lengths, batch_size)
  b, k, seq_len = batch_size, beam_size, max_decode_len
  neg_inf = jnp.float32(-jnp.inf)
  if max_lengths is None:
    last_step = jnp.full((b,), seq_len, jnp.int32)  # never reached: no forcing
  else:
    max_lengths = jnp.asarray(max_lengths, jnp.int32)
    if max_lengths.shape != (b,):
      raise ValueError(f'max_lengths must have shape ({b},), got {max_lengths.shape}')
    last_step = max_lengths - 1  # the step at which only EOS is allowed
  # Log-probs only decrease, and the penalty grows with length, so an alive
  # beam scores at most its log-prob over the penalty of its longest length.
  best_penalty = length_penalty(jnp.clip(last_step + 1, 1, seq_len), alpha)

  def decided(state) -> jax.Array:
    """bool[b]: the sentences whose hypotheses can no longer change."""
    _, _, _, alive_logp, _, fin_score, best_ended, num_ended, _ = state
    if rule == 'ctranslate2':
      return best_ended & (num_ended >= k)
    best_alive = jnp.max(alive_logp, axis=1) / best_penalty  # [b]
    # Decided: beam_size finished hypotheses that no alive beam can beat
    # (with fewer, worst is -inf: only decided once nothing is alive).
    return jnp.min(fin_score, axis=1) >= best_alive

  def body(state):
    step, token, alive_seq, alive_logp, fin_seq, fin_score, best_ended, num_ended, extra = state
    done = decided(state)  # [b]
    logits, extra = next_logits(step, token, alive_seq.reshape(b * k, seq_len), extra)
    # 2k candidates hold at least k non-EOS ones: each parent ends once at most.
    logits = logits.reshape(b, k, -1)
    top_logp, parent, top_token = best_extensions(
      logits, alive_logp, step >= last_step, 2 * k, eos_id=eos_id, pad_id=pad_id
    )
    if forcing is not None:
      # A forced sentence's beams each take the prefix's token (the cap waits for the prefix).
      forced, forced_token = target_prefix.forced_tokens(step, *forcing)
      forced_top = target_prefix.forced_extensions(
        logits, alive_logp, forced_token, 2 * k, pad_id=pad_id
      )
      top_logp, parent, top_token = (
        jnp.where(forced[:, None], f, x) for f, x in zip(forced_top, (top_logp, parent, top_token))
      )
    after_prefix = None
    if rule == 'ctranslate2' and forcing is not None:
      top_token, top_logp, after_prefix = target_prefix.ctranslate2_first_free_step(
        step, forcing[1], top_token, top_logp, eos_id=eos_id, pad_id=pad_id
      )
    top_seq = jax.lax.dynamic_update_slice_in_dim(
      _gather(alive_seq, parent), top_token[:, :, None], step, axis=2
    )
    ended = top_token == eos_id  # [b, 2k]
    if rule == 'ctranslate2':
      # Only the k best candidates may end; at the last step they all do, EOS or not.
      in_top_k = jnp.arange(2 * k) < k
      ends = in_top_k & (ended | (step == seq_len - 1))
      # A decided sentence's hypotheses are final: later steps add none.
      ends = ends & ~done[:, None]
      best_ended = best_ended | ends[:, 0]
      num_ended = num_ended + jnp.sum(ends, axis=1, dtype=jnp.int32)
    else:
      # Once decided, no later hypothesis can enter the k best: nothing to mask.
      ends = ended

    alive_pool = jnp.where(ended, neg_inf, top_logp)
    if after_prefix is not None:
      alive_pool = target_prefix.alive_after_prefix(alive_pool, ended, after_prefix, k)
    alive_logp, idx = jax.lax.top_k(alive_pool, k)
    alive_seq = _gather(top_seq, idx)
    rows = jnp.arange(b)[:, None] * k + _gather(parent, idx)  # [b, k]
    extra = reorder(extra, rows.reshape(b * k))

    new_score = jnp.where(ends, top_logp / length_penalty(step + 1, alpha), neg_inf)
    # Old finished first: top_k keeps the lower index on ties.
    fin_score, idx = jax.lax.top_k(jnp.concatenate([fin_score, new_score], axis=1), k)
    fin_seq = _gather(jnp.concatenate([fin_seq, top_seq], axis=1), idx)
    token = jax.lax.dynamic_index_in_dim(alive_seq, step, axis=2)  # [b,k,1]
    return (
      step + 1,
      token.reshape(b * k, 1),
      alive_seq,
      alive_logp,
      fin_seq,
      fin_score,
      best_ended,
      num_ended,
      extra,
    )

  init = (
    jnp.asarray(0, jnp.int32),
    jnp.full((b * k, 1), bos_id, jnp.int32),
    jnp.full((b, k, seq_len), pad_id, jnp.int32),  # alive
    # Only beam 0 starts alive, so the first step does not pick k copies.
    jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, neg_inf), (b, 1)),
    jnp.full((b, k, seq_len), pad_id, jnp.int32),  # finished
    jnp.full((b, k), neg_inf),
    jnp.zeros((b,), jnp.bool_),  # best_ended: a step's best candidate was EOS (ctranslate2)
    jnp.zeros((b,), jnp.int32),  # num_ended: hypotheses ended so far (ctranslate2)
    extra,
  )
  step, _, alive_seq, alive_logp, fin_seq, fin_score, _, _, _ = _while_by_cache_length(
    lambda state: _keep_decoding(state[0], decided(state), seq_len),
    body,
    init,
    cache_lengths,
    extend_cache,
  )

  # Finished hypotheses first; where fewer than k finished (e.g. none by
  # max_decode_len), alive ones fill the rest, scored as if they ended now;
  # slots still empty (fewer than k hypotheses exist) get -inf and pad. Both
  # sets are sorted best first (top_k), empty (-inf) slots last.
  scores = jnp.concatenate([fin_score, alive_logp / length_penalty(step, alpha)], axis=1)  # [b, 2k]
  seqs = jnp.concatenate([fin_seq, alive_seq], axis=1)
  num_finished = jnp.sum(fin_score > neg_inf, axis=1, keepdims=True)  # [b, 1]
  slot = jnp.arange(k)[None, :]
  order = jnp.where(slot < num_finished, slot, k + slot - num_finished)
  scores, seqs = _gather(scores, order), _gather(seqs, order)
  seqs = jnp.where((scores == neg_inf)[:, :, None], pad_id, seqs)
  return seqs, scores


def beam_search(
  step_fn: StepFn,
  cache: Any,
  *,
  batch_size: int,
  beam_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  alpha: float = 0.6,
  max_lengths: jax.Array | None = None,
  rule: str = 'exact',
  reorder_cache: ReorderFn | None = None,
  cache_lengths: Sequence[int] = (),
  extend_cache: ExtendFn | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Beam search with an incremental cache and the GNMT length penalty.

  Scores are log P(y) / ((5 + |y|) / 6) ** alpha with |y| the number of
  generated tokens including EOS (log-probs over the vocabulary without PAD;
  alpha >= 0, 0 meaning plain log-probs).
  Each step extends every alive beam by every token, takes the top 2k of those
  candidates, moves the ones ending in EOS to a sentence's finished set (its k
  best scores) and keeps the best k others alive.

  step_fn(token_ids int32[B, 1], cache) -> (logits float32[B, vocab],
  new_cache) works on B = batch_size * beam_size rows, batch-major (row
  i * beam_size + j is beam j of sentence i): whatever it closes over per
  sentence must be expanded likewise (see expand_to_beams). `cache` is given
  for batch_size rows; beam_search expands it, and after each step gathers
  the rows of the beams that survive from their parents. Every cache leaf must
  be either an array with a leading batch axis (repeated / gathered along
  axis 0) or a 0-d array shared by all rows, e.g. a position counter (passed
  through as step_fn returns it). Shapes and dtypes must not change.

  reorder_cache(cache, rows int32[B]) -> cache replaces both: `cache` is then
  given as step_fn wants it for the B rows, and after each step reorder_cache
  returns the cache in which row r goes on from the prefix of row rows[r]
  (rows[r] is in r's sentence). A model can so keep what does not depend on the
  beam once per sentence, and keys/values where they were written, moving only
  a table of which row holds which position instead of every cached array.

  cache_lengths, extend_cache: optional increasing cache lengths ending at
  max_decode_len. `cache` then holds cache_lengths[0] positions (after its
  expansion to beams), and before step cache_lengths[i - 1] it becomes
  extend_cache(cache, cache_lengths[i]): steps attend over a cache not much
  longer than what they decoded, at the price of one compiled loop per length.

  max_lengths: optional int32[batch_size], each sentence's maximum number of
  generated tokens including EOS: at step max_lengths[i] - 1 its beams can
  only emit EOS. Without it, hypotheses are cut at max_decode_len.

  rule 'exact' (the default) stops after max_decode_len steps, or once every
  sentence has beam_size finished hypotheses and no alive beam could beat the
  worst of them even at its longest length: the k best hypotheses among all
  that ended among a step's 2k best candidates. Sentences with fewer than
  beam_size finished ones fill the remaining slots from the alive beams
  (scored at their current length).
  rule 'ctranslate2' searches as CTranslate2's BeamSearch with
  num_hypotheses = beam_size and no length penalty during the search (and as
  OpenNMT-py): a hypothesis ends only where EOS is among a step's k best
  candidates (ranked by log-prob; the alive beams are the k best others, as in
  'exact'), and a sentence is decided once a step's best candidate was EOS and
  at least beam_size hypotheses ended; at step max_decode_len - 1 the k best
  candidates end, EOS or not. It stops earlier and may miss hypotheses 'exact'
  finds; with alpha = 0 it returns what CTranslate2 returns with
  length_penalty=0, and with alpha > 0 the best of those hypotheses under the
  GNMT penalty (CTranslate2 keeps the beam_size best by log-prob first).

  prefix int32[batch_size, P], prefix_lengths int32[batch_size] (default P):
  every beam of sentence i is extended by prefix[i, t] at the steps t <
  prefix_lengths[i], so its hypotheses start with the prefix and their scores
  include its log-probability (search.prefix). Keep prefix_lengths below
  max_lengths: the cap only applies after the prefix.

  Returns (tokens int32[batch_size, beam_size, max_decode_len] in the module's
  convention, scores float32[batch_size, beam_size]), sorted best first; slots
  with no hypothesis at all (fewer than beam_size exist) have score -inf.
  """
  if reorder_cache is None:
    cache = expand_to_beams(cache, beam_size, batch_size)
    reorder_cache = _reorder_rows
  return _beam_loop(
    lambda step, token, seqs, cache: step_fn(token, cache),
    cache,
    reorder_cache,
    batch_size=batch_size,
    beam_size=beam_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    alpha=alpha,
    max_lengths=max_lengths,
    rule=rule,
    cache_lengths=_check_cache_lengths(cache_lengths, extend_cache, max_decode_len),
    extend_cache=extend_cache,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )


def beam_search_uncached(
  logits_fn: LogitsFn,
  *,
  batch_size: int,
  beam_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  alpha: float = 0.6,
  max_lengths: jax.Array | None = None,
  rule: str = 'exact',
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """beam_search by full recomputation of each beam's prefix every step.

  logits_fn(target_input_ids int32[B, max_decode_len]) -> float32[B,
  max_decode_len, vocab] must be causal, as for greedy_search_uncached, and
  sees B = batch_size * beam_size batch-major rows. The reference the cached
  path must match. prefix, prefix_lengths: as for beam_search.
  """
  return _beam_loop(
    _uncached_next_logits(logits_fn, bos_id),
    None,
    lambda extra, rows: extra,
    batch_size=batch_size,
    beam_size=beam_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    alpha=alpha,
    max_lengths=max_lengths,
    rule=rule,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )


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
