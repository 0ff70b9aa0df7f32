"""Binds the model to the model-agnostic search in `decode.py`: source ids -> output ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax import decode
from transformer_jax.models import Transformer
from transformer_jax.tokenizer import BOS_ID, EOS_ID, PAD_ID


def init_cache(model: Transformer, params, encoded: jax.Array, src_ids: jax.Array,
               max_decode_len: int):
  """Creates the decoding cache: empty self-attention keys/values for `max_decode_len`
  positions and the cross-attention keys/values projected once from the encoder output.

  The dummy target only fixes the cache's length; under jit XLA drops the unused decoder
  computation, so only the cross-attention projections actually run.
  """
  dummy_targets = jnp.zeros((src_ids.shape[0], max_decode_len), jnp.int32)
  _, variables = model.apply({'params': params}, encoded, src_ids, dummy_targets,
                             use_cache=True, mutable=['cache'], method=Transformer.decode)
  return variables['cache']


def greedy_decode(model: Transformer, params, src_ids: jax.Array, *, max_decode_len: int,
                  use_cache: bool = True) -> jax.Array:
  """Greedy translation of a batch of source ids [b, s] -> output ids [b, max_decode_len].

  Rows end with EOS followed by padding. Call under jit (`max_decode_len`, `use_cache` static).
  """
  batch_size = src_ids.shape[0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  if use_cache:
    cache = init_cache(model, params, encoded, src_ids, max_decode_len)

    def step_fn(token_ids, cache):
      logits, variables = model.apply({'params': params, 'cache': cache}, encoded, src_ids,
                                      token_ids, use_cache=True, mutable=['cache'],
                                      method=Transformer.decode)
      return logits[:, -1], variables['cache']  # [b, v]

    return decode.greedy_search(step_fn, cache, batch_size=batch_size,
                                max_decode_len=max_decode_len, bos_id=BOS_ID, eos_id=EOS_ID,
                                pad_id=PAD_ID)

  def logits_fn(target_input_ids):
    return model.apply({'params': params}, encoded, src_ids, target_input_ids,
                       method=Transformer.decode)

  return decode.greedy_search_uncached(logits_fn, batch_size=batch_size,
                                       max_decode_len=max_decode_len, bos_id=BOS_ID,
                                       eos_id=EOS_ID, pad_id=PAD_ID)


def beam_decode(model: Transformer, params, src_ids: jax.Array, *, beam_size: int,
                alpha: float, max_decode_len: int, max_lengths: jax.Array | None = None,
                use_cache: bool = True) -> tuple[jax.Array, jax.Array]:
  """Beam search: source ids [b, s] -> (ids [b, beam, max_decode_len], scores [b, beam]).

  Best hypothesis first; scores are log-probabilities divided by the GNMT length penalty.
  `max_lengths` [b] caps each sentence's output (e.g. its source length + 50).
  """
  batch_size = src_ids.shape[0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  # The decoder runs on batch * beam rows; the source side is the same for every beam.
  beam_encoded, beam_src = decode.expand_to_beams((encoded, src_ids), beam_size, batch_size)
  common = dict(batch_size=batch_size, beam_size=beam_size, max_decode_len=max_decode_len,
                bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID, alpha=alpha,
                max_lengths=max_lengths)
  if use_cache:
    cache = init_cache(model, params, encoded, src_ids, max_decode_len)  # beam_search expands.

    def step_fn(token_ids, cache):
      logits, variables = model.apply({'params': params, 'cache': cache}, beam_encoded,
                                      beam_src, token_ids, use_cache=True, mutable=['cache'],
                                      method=Transformer.decode)
      return logits[:, -1], variables['cache']

    return decode.beam_search(step_fn, cache, **common)

  def logits_fn(target_input_ids):
    return model.apply({'params': params}, beam_encoded, beam_src, target_input_ids,
                       method=Transformer.decode)

  return decode.beam_search_uncached(logits_fn, **common)
