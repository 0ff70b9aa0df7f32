"""Beam search with the GNMT length penalty, driven by a `Steps` (a model's or an ensemble's)
or, as the reference the cached search must match, by a `tokens -> logits` function that
recomputes every prefix (`beam_search_uncached`). Output convention: `decode`'s. Like the rest of
`search`, this never imports the model.

Shapes: b = batch_size sentences, k = beam_size, B = b * k model rows (batch-major: row i * k +
j is beam j of sentence i), L = max_decode_len.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from transformer_jax.search import prefix as target_prefix
from transformer_jax.search.candidates import best_extensions
from transformer_jax.search.prefix import Forcing
from transformer_jax.search.steps import ExtendFn, LogitsFn, ReorderFn, StepFn, Steps
from transformer_jax.search.token_loop import (
  NextLogits,
  cached_next_logits,
  check_lengths,
  keep_decoding,
  uncached_next_logits,
)

# How beam search ends hypotheses and stops (see beam_search).
BEAM_RULES = ('exact', 'ctranslate2')


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty ((5 + |y|) / 6) ** alpha; |y| counts EOS too."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


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
  next_logits: NextLogits,
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
  check_lengths(batch_size, max_decode_len)
  if beam_size < 1:
    raise ValueError(f'beam_size ({beam_size}) must be >= 1')
  if rule not in BEAM_RULES:
    raise ValueError(f'rule must be one of {BEAM_RULES}, got {rule!r}')
  forcing = Forcing.of(
    batch_size, eos_id=eos_id, prefix=prefix, prefix_lengths=prefix_lengths, max_lengths=max_lengths
  )
  b, k, seq_len = batch_size, beam_size, max_decode_len
  neg_inf = jnp.float32(-jnp.inf)
  if forcing.max_lengths is None:
    last_step = jnp.full((b,), seq_len, jnp.int32)  # never reached: no forcing
  else:
    last_step = forcing.max_lengths - 1  # the step at which only EOS is allowed
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
    # A sentence in its prefix extends every beam by the prefix's token (the cap waits for it).
    top_logp, parent, top_token = best_extensions(
      logits,
      alive_logp,
      step >= last_step,
      2 * k,
      eos_id=eos_id,
      pad_id=pad_id,
      bos_id=bos_id,
      forced=forcing.prefix_at(step),
    )
    after_prefix = None
    if rule == 'ctranslate2' and forcing.has_prefix:
      top_token, top_logp, after_prefix = target_prefix.ctranslate2_first_free_step(
        step, forcing.prefix_lengths, top_token, top_logp, eos_id=eos_id, pad_id=pad_id
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
    lambda state: keep_decoding(state[0], decided(state), seq_len),
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
  generated tokens including EOS (log-probs over the vocabulary without PAD and BOS;
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
  lengths = _check_cache_lengths(cache_lengths, extend_cache, max_decode_len)
  if reorder_cache is None:
    steps = Steps.of_cache(step_fn, cache, batch_size)
  else:
    steps = Steps.of_beam_cache(step_fn, cache, reorder_cache, extend_cache, lengths)
  return beam_search_steps(
    steps,
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


def beam_search_steps(
  steps: Steps,
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
  """`beam_search` over a `Steps` (a model's or an ensemble's): its cache made for the batch *
  beam rows at the first of its cache lengths, reordered and grown by its own functions."""
  lengths = steps.lengths_for(max_decode_len)
  return _beam_loop(
    cached_next_logits(steps.step),
    steps.init_cache(lengths[0] if lengths else max_decode_len, beam_size),
    steps.reorder,
    batch_size=batch_size,
    beam_size=beam_size,
    max_decode_len=max_decode_len,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    alpha=alpha,
    max_lengths=max_lengths,
    rule=rule,
    cache_lengths=lengths,
    extend_cache=steps.extend,
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
    uncached_next_logits(logits_fn, bos_id),
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
