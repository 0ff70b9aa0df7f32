"""Target prefixes: the searches' tokens forced through given pieces, then free (as CTranslate2's
`target_prefix`: the output starts with the prefix and continues from it).

prefix int32[b, P] and prefix_lengths int32[b]: at step t < prefix_lengths[i], sentence i's
token is prefix[i, t]; later steps (and prefix[i, t] for t >= prefix_lengths[i]) are free. Every
search applies the same mask to its logits (`force_logits`); beam search also needs the forced
token's true log-probability in its scores, which a mask alone cannot give (a softmax over one
allowed token is 1), hence `forced_extensions`. Like decode, it never imports the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.search.candidates import mask_pad


def check_prefix(prefix, prefix_lengths, batch_size: int) -> tuple[jax.Array, jax.Array] | None:
  """(prefix int32[b, P], prefix_lengths int32[b]) checked for shape, or None without a prefix.

  prefix_lengths defaults to P for every sentence. Its values must lie in [0, P] and prefix
  must hold no PAD among its first prefix_lengths[i] tokens (PAD is never generated); they may
  be traced, so only the shapes are checked here.
  """
  if prefix is None:
    if prefix_lengths is not None:
      raise ValueError('prefix_lengths given without a prefix')
    return None
  prefix = jnp.asarray(prefix, jnp.int32)
  if prefix.ndim != 2 or prefix.shape[0] != batch_size or prefix.shape[1] < 1:
    raise ValueError(f'prefix must have shape ({batch_size}, P >= 1), got {prefix.shape}')
  if prefix_lengths is None:
    prefix_lengths = jnp.full((batch_size,), prefix.shape[1], jnp.int32)
  prefix_lengths = jnp.asarray(prefix_lengths, jnp.int32)
  if prefix_lengths.shape != (batch_size,):
    raise ValueError(f'prefix_lengths must have shape ({batch_size},), got {prefix_lengths.shape}')
  return prefix, prefix_lengths


def forced_tokens(step: jax.Array, prefix: jax.Array, prefix_lengths: jax.Array):
  """(forced bool[b], token int32[b]): which sentences step `step` forces, and to what."""
  last = prefix.shape[1] - 1
  token = jax.lax.dynamic_index_in_dim(prefix, jnp.minimum(step, last), axis=1, keepdims=False)
  return step < prefix_lengths, token


def force_logits(logits: jax.Array, forced: jax.Array, token: jax.Array) -> jax.Array:
  """logits [b, ..., vocab] where forced[i] allows only token[i] (logit 0, the others -inf).

  The forced token gets 0 rather than its own logit so that it is chosen even where the model
  gives it -inf; a softmax over the row is then one-hot, so a search that needs the token's
  model probability reads it from the unmasked logits.
  """
  shape = (-1,) + (1,) * (logits.ndim - 1)
  is_token = jnp.arange(logits.shape[-1]) == token.reshape(shape)
  one_hot = jnp.where(is_token, jnp.asarray(0.0, logits.dtype), -jnp.inf)
  return jnp.where(forced.reshape(shape), one_hot, logits)


def forced_extensions(
  logits: jax.Array, alive_logp: jax.Array, token: jax.Array, count: int, *, pad_id: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Beam search's `count` best extensions (candidates.best_extensions' format) when every beam
  of sentence i may only be extended by token[i].

  logits [b, k, vocab], alive_logp float32[b, k] (-inf: no beam), token int32[b]. A beam's one
  extension scores alive_logp + the token's log-softmax over the vocabulary without PAD (its
  true log-probability, as a free step would score it); the k extensions come best first
  (ties: lower beam), then count - k empty ones (-inf). Dead beams stay dead, so beam search's
  initial state (beam 0 alive, the others -inf) keeps one hypothesis through the prefix instead
  of k copies of it.
  """
  b, k, _ = logits.shape
  neg_inf = jnp.float32(-jnp.inf)
  logits = mask_pad(logits, pad_id).astype(jnp.float32)
  token_logit = jnp.take_along_axis(logits, jnp.broadcast_to(token[:, None, None], (b, k, 1)), -1)
  logp = token_logit[..., 0] - jax.nn.logsumexp(logits, axis=-1)  # [b, k]
  candidates = jnp.where(alive_logp == neg_inf, neg_inf, alive_logp + logp)
  scores, parent = jax.lax.top_k(candidates, k)
  pad = count - k
  scores = jnp.concatenate([scores, jnp.full((b, pad), neg_inf)], axis=1)
  parent = jnp.concatenate([parent, jnp.zeros((b, pad), parent.dtype)], axis=1)
  tokens = jnp.broadcast_to(token[:, None], (b, count))
  return scores, parent.astype(jnp.int32), tokens.astype(jnp.int32)


def ctranslate2_first_free_step(
  step, prefix_lengths: jax.Array, top_token: jax.Array, top_logp: jax.Array, *, eos_id, pad_id
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """CTranslate2's beam search at the first step after a prefix (its issue #277), for beam_rule
  'ctranslate2': EOS may end only the best of the 2k candidates [b, 2k]; elsewhere it leaves an
  empty one. Returns (top_token, top_logp, after_prefix bool[b, 1]) for `alive_after_prefix`."""
  position = jnp.arange(top_token.shape[1])[None, :]
  after_prefix = ((step == prefix_lengths) & (prefix_lengths > 0))[:, None]  # [b, 1]
  refused = after_prefix & (position > 0) & (top_token == eos_id)
  return (
    jnp.where(refused, pad_id, top_token),
    jnp.where(refused, -jnp.inf, top_logp),
    after_prefix,
  )


def alive_after_prefix(alive_pool: jax.Array, ended: jax.Array, after_prefix: jax.Array, k: int):
  """The candidates [b, 2k] that may stay alive at CTranslate2's first free step: only the k
  best (k + 1 where the best one ended), as its search keeps them."""
  beyond = jnp.arange(alive_pool.shape[1])[None, :] >= k + ended[:, :1]
  return jnp.where(after_prefix & beyond, -jnp.inf, alive_pool)
