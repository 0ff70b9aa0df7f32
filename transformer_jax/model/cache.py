"""The cache of cached decoding (`Transformer.create_cache`): its layout, and what the
searches of search/decode.py do to it (`reorder_beams`, `extend_cache`).

For b sentences and `beam` rows each (batch-major: row i * beam + j is beam j of sentence i;
greedy decoding is beam = 1), the 'cache' collection holds:

  self_attention    per decoder layer, {'key': [b, h, max_t * beam, d_k], 'value': [b, h,
                    max_t * beam, d_v]}: entry t * beam + j holds position t of beam slot j,
                    written once, at step t, by the row then in slot j, and never moved.
  beam_of_position  (beam > 1) int32 [b * beam, max_t]: the slot holding each position of a
                    row's prefix. When beam search picks a row's parent, this table is what
                    follows it: one int per position instead of every layer's keys/values.
  cross_attention   per decoder layer, {'key': [b, h, s, d_k], 'value': [b, h, s, d_v]}: the
                    encoder output projected once per sentence; all beams query it together.
  decode_position   {'index': int32 []}: the step counter.

Keys and values are head-major: the attention products then need no transpose of the cache
(XLA:CPU would copy it whole to make its batch axes lead). Per-layer arrays (not stacked on a
'layers' axis) are separate buffers that each step updates in place.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model.config import TransformerConfig


def by_sentence(rows: jax.Array, beam_size: int) -> jax.Array:
  """[b * beam, 1, h, d] (one position per row, rows batch-major) -> [b, h, beam, d]: the beams
  of a sentence together, head-major."""
  _, _, heads, depth = rows.shape
  return rows.reshape(-1, beam_size, heads, depth).transpose(0, 2, 1, 3)


def by_row(heads: jax.Array) -> jax.Array:
  """The inverse of `by_sentence`: [b, h, beam, d] -> [b * beam, 1, h, d]."""
  _, num_heads, _, depth = heads.shape
  return heads.transpose(0, 2, 1, 3).reshape(-1, 1, num_heads, depth)


def write_step(entries: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
  """A layer's self-attention keys (or values) [b, h, max_t * beam, d] with this step's
  new [b * beam, 1, h, d] written at entries index * beam .. index * beam + beam - 1.

  The attention reads the array this returns as it is: a reshape between the write and the
  read would make XLA copy the cache (the update and its reshaped view get fused apart, and
  both want the buffer)."""
  beam_size = new.shape[0] // entries.shape[0]
  zero = jnp.zeros((), jnp.int32)
  start = (zero, zero, index.astype(jnp.int32) * beam_size, zero)
  return jax.lax.dynamic_update_slice(
    entries, by_sentence(new, beam_size).astype(entries.dtype), start
  )


def create(
  config: TransformerConfig,
  layer_params: Sequence,
  encoded: jax.Array,
  project: Callable[[Any, jax.Array], jax.Array],
  *,
  max_decode_len: int,
  beam_size: int,
) -> dict:
  """The cache's arrays (all but the step counter) for b sentences, encoded [b, s, m].

  project(projection_params, encoded) -> [b, s, h, d]: one cross-attention projection of
  the encoder output, applied here once per layer, key and value."""
  batch, heads = encoded.shape[0], config.num_heads
  depths = (('key', config.head_qk_dim), ('value', config.head_v_dim))
  cache = {
    'self_attention': tuple(
      {
        name: jnp.zeros((batch, heads, max_decode_len * beam_size, depth), config.compute_dtype)
        for name, depth in depths
      }
      for _ in layer_params
    ),
    'cross_attention': tuple(
      {
        name: project(layer['cross_attention'][name], encoded).transpose(0, 2, 1, 3)
        for name, _ in depths
      }  # [b, s, h, d] -> [b, h, s, d]
      for layer in layer_params
    ),
  }
  if beam_size > 1:
    cache['beam_of_position'] = jnp.zeros((batch * beam_size, max_decode_len), jnp.int32)
  return cache


def self_attention_mask(cache, rows: int, index: jax.Array) -> tuple[jax.Array, dict]:
  """This step's self-attention mask, [b, 1, beam, max_t * beam] (beam > 1) or [1, 1, 1,
  max_t], and the cache with row r's slot recorded for position `index` (slot r % beam).

  Query beam q of a sentence reads entry t * beam + p iff t <= index and its prefix's
  position t is in slot p."""
  batch, _, entries, _ = cache['self_attention'][0]['key'].shape
  beam_size = rows // batch
  max_length = entries // beam_size
  visible = jnp.arange(max_length) <= index  # [max_t]
  if beam_size == 1:
    return visible[None, None, None, :], cache
  slots = (jnp.arange(rows, dtype=jnp.int32) % beam_size)[:, None]  # [b * beam, 1]
  beams = jax.lax.dynamic_update_slice(
    cache['beam_of_position'], slots, (jnp.zeros((), jnp.int32), index)
  )
  # [b * beam, max_t] -> [b, q, max_t, p] -> [b, 1, q, max_t * p], the order of the entries.
  mask = visible[:, None] & (
    beams.reshape(-1, beam_size, max_length)[..., None] == jnp.arange(beam_size)
  )
  mask = mask.reshape(-1, 1, beam_size, max_length * beam_size)
  return mask, {**cache, 'beam_of_position': beams}


def reorder_beams(cache, rows: jax.Array):
  """Beam search's `reorder_cache`: row r goes on from the prefix of row rows[r] (int32
  [b * beam]). Keys and values stay where they were written; only the beam table follows."""
  if 'beam_of_position' not in cache:
    return cache  # One beam: its parent is itself.
  return {**cache, 'beam_of_position': jnp.take(cache['beam_of_position'], rows, axis=0)}


def extend_cache(cache, max_decode_len: int):
  """The cache made to hold max_decode_len positions (beam search's `extend_cache`): the
  self-attention entries and the beam table grow at their end, where the positions to come
  go; what was written stays where it is."""
  self_caches = cache['self_attention']
  batch, _, entries, _ = self_caches[0]['key'].shape
  beams = cache.get('beam_of_position')
  beam_size = 1 if beams is None else beams.shape[0] // batch
  added = max_decode_len - entries // beam_size
  grow = ((0, 0), (0, 0), (0, added * beam_size), (0, 0))  # [b, h, max_t * beam, d]
  extended = {
    **cache,
    'self_attention': tuple(
      {name: jnp.pad(entry, grow) for name, entry in layer.items()} for layer in self_caches
    ),
  }
  if beams is not None:
    extended['beam_of_position'] = jnp.pad(beams, ((0, 0), (0, added)))  # [b * beam, max_t]
  return extended


def layer_params(decoder_layers) -> list:
  """Each decoder layer's own parameters, for cached decoding, which runs the layers one by
  one: as given by `unstack_decoder_layers`, or else sliced from the scanned stack here (at
  every step, which copies every layer's weights)."""
  decoder_layers = nn.meta.unbox(decoder_layers)
  if isinstance(decoder_layers, (tuple, list)):
    return list(decoder_layers)
  count = jax.tree.leaves(decoder_layers)[0].shape[0]
  return [jax.tree.map(lambda p, i=i: p[i], decoder_layers) for i in range(count)]


def unstack_decoder_layers(params):
  """`params` for cached decoding: the scanned decoder stack (leading 'layers' axis) as a tuple
  of per-layer trees. Cached decoding runs the layers one by one; made once before a search,
  the per-layer weights spare every step the copies that slicing the stack would make (XLA
  does not hoist those slices out of the search loop)."""
  params = nn.meta.unbox(params)
  return {**params, 'decoder_layers': tuple(layer_params(params['decoder_layers']))}
