"""The one token loop of greedy decoding and sampling: a jax.lax.while_loop that asks for the
next logits, lets a `choose` function pick each row's token (greedy: the argmax; sampling: a
draw), takes the forced token instead where `prefix.Forcing` says so (a target prefix, then EOS
at a row's length cap), writes it in the output convention of `decode`, and stops once every
row has ended. With `scored`, each row's log-probability of its tokens (the model's own,
temperature 1, unfiltered, PAD and BOS excluded) is summed in the same loop.

Beam search (`beam`) keeps its own loop: its state is beams, not rows. Like the rest of
`search`, this never imports the model.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from transformer_jax.search.candidates import mask_never_predicted
from transformer_jax.search.prefix import Forcing
from transformer_jax.search.steps import LogitsFn

# next_logits(step, token int32[b, 1], out int32[b, L], extra) -> (logits [b, vocab], extra)
NextLogits = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# choose(step, logits float32[b, vocab] with PAD masked) -> the chosen token int32[b]
Choose = Callable[[jax.Array, jax.Array], jax.Array]


def record_token(
  token: jax.Array, finished: jax.Array, *, eos_id: int, pad_id: int
) -> tuple[jax.Array, jax.Array]:
  """Applies the EOS convention to one step's chosen token per row.

  token: int32[...], finished: bool[...] (rows that already emitted EOS).
  Returns (token to write: pad for finished rows, new finished flags). The EOS
  itself is written because the row is only marked finished *after* it.
  """
  written = jnp.where(finished, jnp.asarray(pad_id, token.dtype), token)
  return written, finished | (written == eos_id)


def keep_decoding(step: jax.Array, finished: jax.Array, max_decode_len: int) -> jax.Array:
  """while_loop condition: steps left and some row still unfinished."""
  return (step < max_decode_len) & ~jnp.all(finished)


def check_lengths(batch_size: int, max_decode_len: int) -> None:
  # Python-level checks: these are static (bound with partial under jit).
  if batch_size < 1 or max_decode_len < 1:
    raise ValueError(
      f'batch_size ({batch_size}) and max_decode_len ({max_decode_len}) must both be >= 1'
    )


def uncached_next_logits(logits_fn: LogitsFn, bos_id: int) -> NextLogits:
  """next_logits for the loops that recompute the whole prefix.

  out: int32[rows, max_len] holds the tokens generated so far and pad at
  positions >= step, so the target input is out shifted right behind BOS:
  [BOS, y_0..y_{step-1}, pad...]; the logits at `step` predict y_step.
  """

  def next_logits(step, token, out, extra):
    bos = jnp.full((out.shape[0], 1), bos_id, jnp.int32)
    logits = logits_fn(jnp.concatenate([bos, out[:, :-1]], axis=1))  # [r,L,V]
    return jax.lax.dynamic_index_in_dim(logits, step, axis=1, keepdims=False), extra  # [r, V]

  return next_logits


def cached_next_logits(step_fn) -> NextLogits:
  """next_logits over a step function and its cache (the loop's `extra`)."""
  return lambda step, token, out, cache: step_fn(token, cache)


def argmax_choice(step: jax.Array, logits: jax.Array) -> jax.Array:
  """Greedy's choice: the most probable token (ties: the lower id)."""
  del step
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def token_loop(
  next_logits: NextLogits,
  extra: Any,
  choose: Choose,
  *,
  batch_size: int,
  max_decode_len: int,
  bos_id: int,
  eos_id: int,
  pad_id: int,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
  max_lengths: jax.Array | None = None,
  scored: bool = False,
) -> tuple[jax.Array, jax.Array | None, Any]:
  """Decodes token by token until every row has ended (or max_decode_len steps).

  Returns (tokens int32[b, max_decode_len] in decode's convention, log_probs float32[b] with
  `scored` (else None), the final `extra`). A row's log-prob counts every token it wrote up to
  and including its EOS, forced ones too, each under the model's own softmax without PAD and BOS
  (`candidates.mask_never_predicted`), which is also what the choice draws from.
  prefix, prefix_lengths, max_lengths: what `Forcing` forces (the prefix, then each row's cap).
  """
  check_lengths(batch_size, max_decode_len)
  forcing = Forcing.of(
    batch_size, eos_id=eos_id, prefix=prefix, prefix_lengths=prefix_lengths, max_lengths=max_lengths
  )

  def body(state):
    step, token, out, finished, log_probs, extra = state
    logits, extra = next_logits(step, token, out, extra)
    logits = mask_never_predicted(logits, pad_id, bos_id).astype(jnp.float32)
    chosen = choose(step, logits)  # [b]
    forced = forcing.at(step)
    if forced is not None:
      # The forced token instead of the choice: the same token a choice from logits that
      # allow only it would give, without a pass over the vocabulary to mask them.
      chosen = jnp.where(forced[0], forced[1], chosen)
    if scored:
      # jax.nn.log_softmax's arithmetic at the chosen token only: no [b, vocab] written out.
      row_max = jnp.max(logits, axis=-1)  # [b]
      log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
      token_logit = jnp.take_along_axis(logits, chosen[:, None], axis=-1)[:, 0]
      log_probs = log_probs + jnp.where(finished, 0.0, (token_logit - row_max) - log_norm)
    written, finished = record_token(chosen, finished, eos_id=eos_id, pad_id=pad_id)
    out = jax.lax.dynamic_update_slice_in_dim(out, written[:, None], step, axis=1)
    # Finished rows feed pad: their later logits are ignored anyway.
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
    lambda s: keep_decoding(s[0], s[3], max_decode_len), body, init
  )
  return out, log_probs if scored else None, extra
