"""Each beam-search step's best one-token extensions of the beams (decode.beam_search).

A step scores every alive beam's extension by every token; this finds the few best without
writing the [beams, vocab] log-probs out: a top-k per beam from block maxima, then a top-k over
the beams. Like decode, it never imports the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_never_predicted(logits: jax.Array, pad_id: int, bos_id: int | None = None) -> jax.Array:
  """PAD and BOS are never predictions: every search and score leaves them out of the softmax.
  PAD: an emitted pad would be masked as padding by a model that recomputes the prefix but
  attended to by one with a cache, and they would diverge. BOS only starts a target. A model
  trained here learns its logit down, but counting it made the export to MarianMT, imported
  back, another model: MarianMT's one <pad> is the decoder's start and an output class, and an
  import masks the BOS it becomes (exporters/huggingface.py). Marian has no <pad> either, and
  CTranslate2's converter removes it. logits: [..., vocab].

  A `where` against the vocabulary's ids rather than a scatter into a copy of the logits: the
  same values, and it fuses with what reads them (on an H200 the scatter cost scoring's
  program 1.17-1.58x; bench/README.md, issue 27)."""
  ids = jnp.arange(logits.shape[-1])
  never = ids == pad_id if bos_id is None else (ids == pad_id) | (ids == bos_id)
  return jnp.where(never, -jnp.inf, logits)


def top_k_block(n: int) -> int | None:
  """The block size `top_k_by_blocks` splits n values into: a divisor of n near 128 (a
  ragged last block would make XLA copy the rest into a slice), or None if n has none."""
  divisors = [size for size in range(64, 257) if n % size == 0]
  return min(divisors, key=lambda size: abs(size - 128)) if divisors else None


def top_k_by_blocks(x: jax.Array, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """lax.top_k over the last axis of x [..., n], exactly (ties: lower index first), for
  count << n; also returns the maximum of each block ([..., blocks], or [..., 1]).

  The count largest values lie in the count blocks with the largest maxima (a value outside
  them has count larger block maxima above it). So one reduction finds those blocks and
  top_k sorts only their count * block values, in index order, instead of all n: XLA:CPU's
  top_k sorts each row, where the reduction is vectorised and spread over the cores.
  """
  n = x.shape[-1]
  block = top_k_block(n)
  if block is None or n // block <= count:
    values, index = jax.lax.top_k(x, count)
    return values, index, jnp.max(x, axis=-1, keepdims=True)
  lead = x.shape[:-1]
  block_max = jnp.max(x.reshape(*lead, n // block, block), axis=-1)  # [..., blocks]
  _, best = jax.lax.top_k(block_max, count)  # [..., count] block numbers
  # [..., count, block] -> [..., count * block]: indices into x, in index order.
  index = (jnp.sort(best, axis=-1)[..., None] * block + jnp.arange(block)).reshape(
    *lead, count * block
  )
  values, where = jax.lax.top_k(jnp.take_along_axis(x, index, axis=-1), count)
  return values, jnp.take_along_axis(index, where, axis=-1), block_max


def best_extensions(
  logits: jax.Array,
  alive_logp: jax.Array,
  only_eos: jax.Array,
  count: int,
  *,
  eos_id: int,
  pad_id: int,
  bos_id: int,
  forced: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each sentence's `count` best one-token extensions of its beams.

  logits [b, k, vocab], alive_logp float32[b, k] (-inf: no
  beam), only_eos bool[b] (at its max length a sentence may only end; EOS keeps
  its model log-prob). An extension scores alive_logp + log-softmax of the
  logits over the vocabulary without PAD and BOS (`mask_never_predicted`). Returns
  (scores float32[b, count], parent beam int32[b, count], token int32[b, count]), best first,
  in the order of one top_k over all k * vocab extensions (ties: lower beam, then token).

  A beam's best `count` tokens include all of its extensions among its
  sentence's best `count`, so a top_k per beam comes first (`top_k_by_blocks`)
  and only k * count candidates meet in the second: the vocabulary is read by
  two reductions (block maxima, then the log-sum-exp), never written out as
  log-probs.

  forced: (in_prefix bool[b], token int32[b]) where a target prefix is active
  (`prefix.Forcing.prefix_at`): those sentences' beams may only be extended by
  their token, which scores its true log-probability from the same two
  reductions (no third pass over the vocabulary); their k extensions come best
  first (ties: lower beam), then count - k empty ones (-inf). Dead beams stay
  dead, so beam search's first state (beam 0 alive) keeps one hypothesis
  through the prefix instead of k copies of it.
  """
  b, k, vocab = logits.shape
  neg_inf = jnp.float32(-jnp.inf)
  # In place (a where would be written out, once per consumer), then read in float32.
  logits = mask_never_predicted(logits, pad_id, bos_id).astype(jnp.float32)
  per_beam = min(count, vocab)
  top_logits, tokens, block_max = top_k_by_blocks(logits, per_beam)  # [b, k, per_beam]
  row_max = jnp.max(block_max, axis=-1, keepdims=True)  # [b, k, 1]
  log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
  # (x - max) - log(sum(exp(x - max))): jax.nn.log_softmax's arithmetic.
  logp = (top_logits - row_max) - log_norm
  eos_logp = (logits[:, :, eos_id, None] - row_max) - log_norm  # [b, k, 1]
  only_eos = only_eos[:, None, None]
  logp = jnp.where(only_eos, jnp.where(jnp.arange(per_beam) == 0, eos_logp, neg_inf), logp)
  tokens = jnp.where(only_eos, eos_id, tokens)
  # Dead beams (-inf) stay dead even if their logits are not finite.
  alive = alive_logp[:, :, None]
  candidates = jnp.where(alive == neg_inf, neg_inf, alive + logp)
  scores, index = jax.lax.top_k(candidates.reshape(b, k * per_beam), count)
  token = jnp.take_along_axis(tokens.reshape(b, k * per_beam), index, axis=1)
  parent = (index // per_beam).astype(jnp.int32)
  token = token.astype(jnp.int32)
  if forced is None:
    return scores, parent, token
  in_prefix, forced_token = forced
  # [b, k, 1]: the forced token's logit of every beam, then its log-softmax as above.
  forced_logit = jnp.take_along_axis(
    logits, jnp.broadcast_to(forced_token[:, None, None], (b, k, 1)), axis=-1
  )
  forced_logp = ((forced_logit - row_max) - log_norm)[..., 0]  # [b, k]
  forced_scores = jnp.where(alive_logp == neg_inf, neg_inf, alive_logp + forced_logp)
  forced_scores, forced_parent = jax.lax.top_k(forced_scores, min(k, count))
  pad = count - forced_scores.shape[1]
  forced_scores = jnp.concatenate([forced_scores, jnp.full((b, pad), neg_inf)], axis=1)
  forced_parent = jnp.concatenate(
    [forced_parent.astype(jnp.int32), jnp.zeros((b, pad), jnp.int32)], axis=1
  )
  forced_tokens = jnp.broadcast_to(forced_token[:, None], (b, count)).astype(jnp.int32)
  use = in_prefix[:, None]
  return (
    jnp.where(use, forced_scores, scores),
    jnp.where(use, forced_parent, parent),
    jnp.where(use, forced_tokens, token),
  )
