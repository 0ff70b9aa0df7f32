"""Cached decoding on random models (`model.cache`): cross-attention keys/values kept once
per sentence and never gathered, self-attention keys/values never moved, a beam table that
follows the parents, a cache grown through beam search's lengths. It must decode exactly what
recomputing every prefix decodes."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.inference import decoding
from transformer_jax.model import cache as model_cache
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

CONFIGS = {
  'post_norm_shared': dict(),
  'pre_norm_untied': dict(pre_norm=True, share_embeddings=False),
  'head_sizes_learned_positions': dict(qk_dim=24, v_dim=8, learned_positions=True),
  # Marian's variant; its biases (zero at init) are drawn at random in `_model`.
  'marian_variant': dict(
    attention_bias=True, logits_bias=True, ffn_activation='swish', sinusoid_layout='concatenated'
  ),
}


def _model(name: str, seed: int = 0):
  config = TransformerConfig(
    vocab_size=61,
    d_model=32,
    d_ff=64,
    num_heads=4,
    num_encoder_layers=2,
    num_decoder_layers=3,
    max_len=40,
    **CONFIGS[name],
  )
  model = Transformer(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(seed), dummy, dummy)['params'])
  if config.attention_bias or config.logits_bias:
    rng = np.random.default_rng(seed)

    def randomise_bias(path, leaf):
      is_bias = jax.tree_util.keystr(path).endswith(("['bias']", "['logits_bias']"))
      return leaf + 0.3 * rng.standard_normal(leaf.shape).astype(np.float32) if is_bias else leaf

    params = jax.tree_util.tree_map_with_path(randomise_bias, params)
  return model, params


def _sources(batch: int, seed: int = 0) -> np.ndarray:
  """Random ids ending in EOS, then padding of varied length."""
  rng = np.random.default_rng(seed)
  src = rng.integers(4, 61, size=(batch, 9)).astype(np.int32)
  for row, length in enumerate(rng.integers(3, 9, size=batch)):
    src[row, length - 1], src[row, length:] = EOS_ID, PAD_ID
  return src


@pytest.mark.parametrize(
  'name, batch, beam_size, max_decode_len',
  [
    ('post_norm_shared', 1, 4, 20),  # cache lengths 8, 16, 20
    ('post_norm_shared', 3, 2, 7),  # one length
    ('pre_norm_untied', 3, 4, 20),
    ('head_sizes_learned_positions', 2, 4, 12),  # 8, 12
    ('head_sizes_learned_positions', 2, 1, 12),
    ('marian_variant', 2, 4, 12),
  ],
)
def test_cached_beam_search_equals_recomputing_every_prefix(name, batch, beam_size, max_decode_len):
  model, params = _model(name, seed=batch)
  src = _sources(batch, seed=beam_size)
  search = functools.partial(
    decoding.beam_decode, model, beam_size=beam_size, alpha=0.6, max_decode_len=max_decode_len
  )
  max_lengths = np.minimum(np.arange(batch) + max_decode_len - 2, max_decode_len)
  cached = jax.jit(search)(params, src, max_lengths=max_lengths)
  uncached = jax.jit(functools.partial(search, use_cache=False))(
    params, src, max_lengths=max_lengths
  )
  np.testing.assert_array_equal(cached[0], uncached[0])
  np.testing.assert_allclose(cached[1], uncached[1], rtol=1e-6, atol=1e-6)
  # Non-trivial: beams that differ, and hypotheses that run past the first cache length.
  tokens = np.asarray(cached[0])
  assert len({tuple(beam) for beam in tokens[0]}) == beam_size
  assert (tokens[:, 0, 8:] != PAD_ID).any() or max_decode_len <= 8


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_cached_greedy_equals_recomputing_every_prefix(name):
  model, params = _model(name, seed=7)
  src = _sources(3)
  decoded = [
    jax.jit(
      functools.partial(decoding.greedy_decode, model, max_decode_len=14, use_cache=use_cache)
    )(params, src)
    for use_cache in (True, False)
  ]
  np.testing.assert_array_equal(decoded[0], decoded[1])


def _cache_shapes(beam_size: int, batch: int = 3, max_decode_len: int = 5):
  model, params = _model('head_sizes_learned_positions')
  src = jnp.asarray(_sources(batch))

  def create(params, src):
    encoded = model.apply({'params': params}, src, method=Transformer.encode)
    return decoding.init_cache(model, params, encoded, src, max_decode_len, beam_size)

  return model.config, jax.eval_shape(create, params, src)


def test_the_cache_holds_cross_attention_once_per_sentence():
  config, cache = _cache_shapes(beam_size=4)
  layers = config.num_decoder_layers
  assert len(cache['cross_attention']) == len(cache['self_attention']) == layers
  for cross, own in zip(cache['cross_attention'], cache['self_attention']):
    # [b, h, s, d]: 3 sentences, not 3 x 4 rows.
    assert cross['key'].shape == (3, 4, 9, 24) and cross['value'].shape == (3, 4, 9, 8)
    # [b, h, max_t * beam, d]
    assert own['key'].shape == (3, 4, 5 * 4, 24) and own['value'].shape == (3, 4, 5 * 4, 8)
  assert cache['beam_of_position'].shape == (12, 5)
  _, greedy = _cache_shapes(beam_size=1)
  assert 'beam_of_position' not in greedy
  assert greedy['self_attention'][0]['key'].shape == (3, 4, 5, 24)


def test_reordering_moves_only_the_beam_table_and_extending_keeps_every_entry():
  entries = jnp.arange(2 * 1 * 3 * 2 * 1, dtype=jnp.float32).reshape(2, 1, 3 * 2, 1)
  cache = {
    'self_attention': ({'key': entries, 'value': entries + 100},),
    'cross_attention': ({'key': jnp.ones((2, 1, 4, 1)), 'value': jnp.ones((2, 1, 4, 1))},),
    'beam_of_position': jnp.array([[0, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 0]], jnp.int32),
  }
  rows = jnp.array([1, 1, 3, 2])  # Both beams of sentence 0 go on from its beam 1.
  reordered = model_cache.reorder_beams(cache, rows)
  np.testing.assert_array_equal(reordered['beam_of_position'], cache['beam_of_position'][rows])
  assert reordered['self_attention'] is cache['self_attention']
  assert reordered['cross_attention'] is cache['cross_attention']

  extended = model_cache.extend_cache(cache, 5)  # 3 -> 5 positions of 2 beams
  key = extended['self_attention'][0]['key']
  assert key.shape == (2, 1, 5 * 2, 1)
  np.testing.assert_array_equal(key[:, :, :6], entries)  # entry t * beam + j stays put
  assert not np.asarray(key[:, :, 6:]).any()
  np.testing.assert_array_equal(extended['beam_of_position'][:, :3], cache['beam_of_position'])
  assert extended['beam_of_position'].shape == (4, 5)


def test_cached_decoding_without_a_cache_is_an_error():
  model, params = _model('post_norm_shared')
  src = _sources(2)
  with pytest.raises(ValueError, match='create_cache'):
    model.apply(
      {'params': params},
      None,
      src,
      jnp.ones((2, 1), jnp.int32),
      use_cache=True,
      mutable=['cache'],
      method=Transformer.decode,
    )
