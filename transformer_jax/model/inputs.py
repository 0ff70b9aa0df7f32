"""What the model derives from its input ids before any parameter: the sinusoidal positional
encodings, and the attention masks of padding, causality and the examples of a packed row
(segment ids). Masks are bool, True where attention is allowed, [b, 1, q, k] (broadcast over
heads)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

PAD_ID = 0


def padding_mask(query_ids: jax.Array, key_ids: jax.Array) -> jax.Array:
  """True where attention is allowed: key is a real token. [b, 1, q, k] (broadcast over heads)."""
  del query_ids  # Outputs at padded query positions are ignored downstream.
  return (key_ids != PAD_ID)[:, None, None, :]


def causal_padding_mask(target_ids: jax.Array) -> jax.Array:
  """Decoder self-attention mask: key is a real token at or before the query. [b, 1, t, t]."""
  length = target_ids.shape[1]
  causal = jnp.tril(jnp.ones((length, length), dtype=bool))
  return padding_mask(target_ids, target_ids) & causal[None, None]


def segment_mask(query_segment_ids: jax.Array, key_segment_ids: jax.Array) -> jax.Array:
  """Packed rows: True where query and key belong to the same example. [b, 1, q, k].

  Segment ids number the examples of a row 1..k; 0 marks padding, which attends to nothing and
  is attended by nothing (a fully masked query row gets a uniform softmax, ignored downstream).
  """
  same = query_segment_ids[:, :, None] == key_segment_ids[:, None, :]
  return (same & (key_segment_ids != PAD_ID)[:, None, :])[:, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 where each segment starts: [1,1,1,2,2,0] -> [0,1,2,0,1,0]."""
  index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
  previous = jnp.pad(segment_ids[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
  starts = jnp.where(segment_ids != previous, index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def sinusoidal_positions(
  positions: jax.Array, d_model: int, layout: str = 'interleaved'
) -> jax.Array:
  """Sinusoidal encodings of positions [b, t] -> [b, t, m].

  'interleaved' (the paper): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).
  'concatenated' (tensor2tensor's get_timing_signal_1d, Marian's): sines in the first half,
  cosines in the second, timescales 10000^(i/(d/2 - 1)) for i < d/2.
  """
  half = d_model // 2
  if layout == 'concatenated':
    increment = math.log(10000.0) / max(half - 1, 1)
    inverse_timescale = np.exp(-increment * np.arange(half))
  else:
    inverse_timescale = np.exp(-math.log(10000.0) * np.arange(half) * 2.0 / d_model)
  angles = positions[..., None].astype(jnp.float32) * inverse_timescale  # [b, t, m/2]
  if layout == 'concatenated':
    encoding = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [b, t, m]
  else:
    # Interleave so that even features are sines and odd features cosines, as in the paper.
    encoding = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [b, t, m/2, 2]
    encoding = encoding.reshape(*positions.shape, 2 * half)  # [b, t, m] (m even)
  if d_model % 2:
    encoding = jnp.pad(encoding, [(0, 0)] * positions.ndim + [(0, 1)])
  return encoding
