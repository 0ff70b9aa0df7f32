"""Target prefixes: the searches' tokens forced through given pieces, then free (as CTranslate2's
`target_prefix`: the output starts with the prefix and continues from it).

prefix int32[b, P] and prefix_lengths int32[b]: at step t < prefix_lengths[i], sentence i's
token is prefix[i, t]; later steps (and prefix[i, t] for t >= prefix_lengths[i]) are free. `Forcing`
holds what every search forces (the prefix, then EOS at each sentence's length cap): greedy and
sampling take its token instead of their choice; beam search scores the forced token's true
log-probability from the reductions it makes anyway (`candidates.best_extensions`). Like
decode, it never imports the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def check_max_lengths(max_lengths, batch_size: int) -> jax.Array | None:
  """max_lengths as int32[batch_size] (each row's most tokens, EOS counted), or None."""
  if max_lengths is None:
    return None
  max_lengths = jnp.asarray(max_lengths, jnp.int32)
  if max_lengths.shape != (batch_size,):
    raise ValueError(f'max_lengths must have shape ({batch_size},), got {max_lengths.shape}')
  return max_lengths


@dataclasses.dataclass(frozen=True)
class Forcing:
  """What every search forces, in one place: each sentence's target prefix (its first
  prefix_lengths[i] tokens), then EOS at its length cap (step max_lengths[i] - 1, counted after
  the prefix: a prefix is given to be kept). Greedy and sampling take the forced token instead
  of their choice (`at`); beam search scores the prefix's tokens (`prefix_at`) and lets only EOS
  end a capped sentence (`capped`). Made inside the traced search, never passed to jit."""

  batch_size: int
  eos_id: int
  prefix: jax.Array | None = None  # int32 [b, P]
  prefix_lengths: jax.Array | None = None  # int32 [b]
  max_lengths: jax.Array | None = None  # int32 [b]

  @classmethod
  def of(
    cls, batch_size: int, *, eos_id: int, prefix=None, prefix_lengths=None, max_lengths=None
  ) -> 'Forcing':
    """Checked shapes (`check_prefix`, `check_max_lengths`); values may be traced."""
    checked = check_prefix(prefix, prefix_lengths, batch_size)
    prefix, prefix_lengths = checked if checked is not None else (None, None)
    max_lengths = check_max_lengths(max_lengths, batch_size)
    return cls(batch_size, eos_id, prefix, prefix_lengths, max_lengths)

  @property
  def has_prefix(self) -> bool:
    return self.prefix is not None

  @property
  def forces_anything(self) -> bool:
    return self.prefix is not None or self.max_lengths is not None

  def prefix_at(self, step) -> tuple[jax.Array, jax.Array] | None:
    """(in_prefix bool[b], its token int32[b]) at `step`, or None without a prefix."""
    if self.prefix is None:
      return None
    return forced_tokens(step, self.prefix, self.prefix_lengths)

  def capped(self, step) -> jax.Array | None:
    """bool[b]: the sentences that may only end at `step` (their cap), or None without caps."""
    if self.max_lengths is None:
      return None
    return step >= self.max_lengths - 1

  def at(self, step) -> tuple[jax.Array, jax.Array] | None:
    """(forced bool[b], token int32[b]): the prefix's token where one is active, else EOS where
    the cap is reached; None where nothing is ever forced."""
    if not self.forces_anything:
      return None
    forced = jnp.zeros((self.batch_size,), jnp.bool_)
    token = jnp.full((self.batch_size,), self.eos_id, jnp.int32)
    if self.max_lengths is not None:
      forced = self.capped(step)
    if self.prefix is not None:
      in_prefix, prefix_token = self.prefix_at(step)
      forced, token = forced | in_prefix, jnp.where(in_prefix, prefix_token, token)
    return forced, token


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
