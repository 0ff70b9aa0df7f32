"""Target prefixes (search.prefix): greedy, beam and sampling searches forced through given
first tokens, which start the output, then continuing as the model would from them."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import tokenizer
from transformer_jax.inference import decoding
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import decode, sampling

PAD, BOS, EOS = 0, 1, 2
VOCAB = 9
SENTENCES = 6
MAX_LEN = 10


class Toy:
  """Causal toy: logits_i = T[x_i] + U[x_{i-1}] + S[sentence] + P[i]; EOS grows likelier with
  i. With beam_size > 1 the uncached logits take batch * beam_size batch-major rows."""

  def __init__(self, seed=0):
    rng = np.random.default_rng(seed)
    self.t, self.u = (rng.normal(size=(2, VOCAB, VOCAB)) * 1.5).astype(np.float32)
    self.s = rng.normal(size=(SENTENCES, VOCAB)).astype(np.float32)
    self.p = rng.normal(size=(MAX_LEN, VOCAB)).astype(np.float32)
    self.p[:, EOS] += np.linspace(-3, 3, MAX_LEN)

  def logits_at(self, cur, prev, src, pos):
    return jnp.asarray(self.t)[cur] + jnp.asarray(self.u)[prev] + src + jnp.asarray(self.p)[pos]

  def init_cache(self):
    return {
      'pos': jnp.int32(0),
      'prev': jnp.full((SENTENCES,), PAD, jnp.int32),
      'src': jnp.asarray(self.s),
    }

  def step_fn(self, token, cache):
    logits = self.logits_at(token[:, 0], cache['prev'], cache['src'], cache['pos'])
    return logits, {**cache, 'pos': cache['pos'] + 1, 'prev': token[:, 0]}

  def logits_fn(self, beam_size=1):
    src = jnp.asarray(np.repeat(self.s, beam_size, axis=0))

    def logits_fn(inputs):
      prev = jnp.concatenate([jnp.full_like(inputs[:, :1], PAD), inputs[:, :-1]], axis=1)
      return jnp.stack(
        [self.logits_at(inputs[:, i], prev[:, i], src, i) for i in range(inputs.shape[1])], 1
      )

    return logits_fn

  def log_probs(self, tokens):
    """float64 log-softmax (PAD and BOS excluded) [rows, L, V] of every position of tokens
    [rows, L], recomputed by one uncached pass of [BOS, tokens[:-1]] (rows: batch-major beams)."""
    tokens = np.asarray(tokens)
    beam_size = tokens.shape[0] // SENTENCES
    inputs = np.concatenate([np.full((len(tokens), 1), BOS), tokens[:, :-1]], axis=1)
    logits = np.asarray(self.logits_fn(beam_size)(jnp.asarray(inputs, jnp.int32)), np.float64)
    logits[..., [PAD, BOS]] = -np.inf
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


TOY = Toy()
COMMON = dict(max_decode_len=MAX_LEN, bos_id=BOS, eos_id=EOS, pad_id=PAD)
LENGTHS = np.array([0, 1, 2, 3, 3, 2], np.int32)  # one sentence without a prefix


def _greedy(uncached=False, **prefix):
  if uncached:
    return decode.greedy_search_uncached(TOY.logits_fn(), batch_size=SENTENCES, **COMMON, **prefix)
  return decode.greedy_search(
    TOY.step_fn, TOY.init_cache(), batch_size=SENTENCES, **COMMON, **prefix
  )


def _beam(beam_size, rule, uncached=False, **prefix):
  options = dict(batch_size=SENTENCES, beam_size=beam_size, alpha=0.6, rule=rule, **COMMON)
  if uncached:
    return decode.beam_search_uncached(TOY.logits_fn(beam_size), **options, **prefix)
  return decode.beam_search(TOY.step_fn, TOY.init_cache(), **options, **prefix)


def _ended_length(row) -> int:
  row = list(row)
  return row.index(EOS) + 1 if EOS in row else len(row)


def test_greedy_forced_through_its_own_first_tokens_is_unchanged():
  free = np.asarray(_greedy())
  assert (free[:, :3] != EOS).all()  # the prefixes below are real tokens, not ends
  prefix = dict(prefix=jnp.asarray(free[:, :3]), prefix_lengths=jnp.asarray(LENGTHS))
  np.testing.assert_array_equal(_greedy(**prefix), free)
  np.testing.assert_array_equal(_greedy(uncached=True, **prefix), free)


def test_greedy_forced_elsewhere_continues_with_the_argmax_recomputed_from_the_prefix():
  free = np.asarray(_greedy())
  # A first token greedy would not choose (never PAD or EOS): 3..8, shifted off its choice.
  first = np.where(free[:, 0] == 3, 4, 3).astype(np.int32)
  prefix = dict(prefix=jnp.asarray(first[:, None]))
  forced = np.asarray(_greedy(**prefix))
  np.testing.assert_array_equal(_greedy(uncached=True, **prefix), forced)
  np.testing.assert_array_equal(forced[:, 0], first)
  log_probs = TOY.log_probs(forced)
  for row, row_log_probs in zip(forced, log_probs):
    end = _ended_length(row)
    # Every later token is the argmax given the forced start (ties have measure zero).
    np.testing.assert_array_equal(row[1:end], row_log_probs[1:end].argmax(-1))
    assert (row[end:] == PAD).all()
  assert (forced[:, 1:] != free[:, 1:]).any(axis=1).sum() >= 3  # the prefix changed what follows


@pytest.mark.parametrize('rule', decode.BEAM_RULES)
def test_beam_hypotheses_start_with_the_prefix_and_score_its_log_probability(rule):
  beam_size, alpha = 3, 0.6
  prefix = np.random.default_rng(1).integers(3, VOCAB, size=(SENTENCES, 3)).astype(np.int32)
  forcing = dict(prefix=jnp.asarray(prefix), prefix_lengths=jnp.asarray(LENGTHS))
  tokens, scores = (np.asarray(x) for x in _beam(beam_size, rule, **forcing))
  uncached_tokens, uncached_scores = _beam(beam_size, rule, uncached=True, **forcing)
  np.testing.assert_array_equal(uncached_tokens, tokens)
  np.testing.assert_allclose(uncached_scores, scores, rtol=1e-5)
  assert np.isfinite(scores).all()  # k hypotheses for every sentence
  rows = tokens.reshape(SENTENCES * beam_size, MAX_LEN)
  log_probs = TOY.log_probs(rows)
  for sentence in range(SENTENCES):
    hypotheses = tokens[sentence].tolist()
    assert len({tuple(h) for h in hypotheses}) == beam_size  # no copies of the forced start
    for beam, hypothesis in enumerate(hypotheses):
      assert hypothesis[: LENGTHS[sentence]] == prefix[sentence, : LENGTHS[sentence]].tolist()
      length = _ended_length(hypothesis)
      row_log_probs = log_probs[sentence * beam_size + beam]
      total = sum(row_log_probs[i, hypothesis[i]] for i in range(length))
      np.testing.assert_allclose(scores[sentence, beam], total / ((5 + length) / 6) ** alpha, 1e-5)
  # A sentence without a prefix is searched as without any (sentences do not interact).
  free_tokens, free_scores = _beam(beam_size, rule)
  np.testing.assert_array_equal(tokens[0], free_tokens[0])
  np.testing.assert_allclose(scores[0], free_scores[0], rtol=1e-6)
  # Forcing changed the hypotheses of every sentence whose free ones do not all start with its
  # prefix (at least 3 of them).
  free_tokens = np.asarray(free_tokens)
  changed = [
    s
    for s in range(1, SENTENCES)
    if (free_tokens[s, :, : LENGTHS[s]] != prefix[s, : LENGTHS[s]]).any()
  ]
  assert len(changed) >= 3
  assert all((tokens[s] != free_tokens[s]).any() for s in changed)


def test_sampling_starts_with_the_prefix_and_counts_its_log_probability():
  prefix = np.random.default_rng(2).integers(3, VOCAB, size=(SENTENCES, 3)).astype(np.int32)
  tokens, log_probs = sampling.sample_search(
    TOY.step_fn,
    TOY.init_cache(),
    batch_size=SENTENCES,
    **COMMON,
    keys=jax.random.split(jax.random.key(3), SENTENCES),
    top_k=2,  # forced tokens outside the top 2 are still forced
    prefix=jnp.asarray(prefix),
    prefix_lengths=jnp.asarray(LENGTHS),
  )
  tokens = np.asarray(tokens)
  recomputed = TOY.log_probs(tokens)
  for sentence, row in enumerate(tokens):
    assert row[: LENGTHS[sentence]].tolist() == prefix[sentence, : LENGTHS[sentence]].tolist()
    total = sum(recomputed[sentence, i, row[i]] for i in range(_ended_length(row)))
    np.testing.assert_allclose(log_probs[sentence], total, rtol=1e-5)


def test_prefix_shapes_are_checked():
  with pytest.raises(ValueError, match=r'prefix must have shape \(6, P >= 1\), got \(6,\)'):
    _greedy(prefix=jnp.ones((SENTENCES,), jnp.int32))
  with pytest.raises(ValueError, match=r'prefix_lengths must have shape \(6,\), got \(5,\)'):
    _greedy(prefix=jnp.ones((SENTENCES, 2), jnp.int32), prefix_lengths=jnp.ones(5, jnp.int32))
  with pytest.raises(ValueError, match='prefix_lengths given without a prefix'):
    _greedy(prefix_lengths=jnp.ones(SENTENCES, jnp.int32))


def test_model_decoding_with_a_prefix_cached_equals_uncached():
  config = TransformerConfig(
    vocab_size=61, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1
  )
  model = Transformer(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), dummy, dummy)['params'])
  rng = np.random.default_rng(0)
  src = rng.integers(4, 61, size=(3, 7)).astype(np.int32)
  src[:, -1] = tokenizer.EOS_ID
  prefix = rng.integers(4, 61, size=(3, 2)).astype(np.int32)
  forcing = dict(prefix=prefix, prefix_lengths=np.array([2, 0, 1], np.int32))
  beam = dict(beam_size=3, alpha=0.6, max_decode_len=10, **forcing)
  tokens, scores = decoding.beam_decode(model, params, src, **beam)
  uncached_tokens, uncached_scores = decoding.beam_decode(
    model, params, src, use_cache=False, **beam
  )
  np.testing.assert_array_equal(tokens, uncached_tokens)
  np.testing.assert_allclose(scores, uncached_scores, rtol=1e-4)
  tokens = np.asarray(tokens)
  assert (tokens[0, :, :2] == prefix[0]).all() and (tokens[2, :, 0] == prefix[2, 0]).all()
  greedy = decoding.greedy_decode(model, params, src, max_decode_len=10, **forcing)
  np.testing.assert_array_equal(greedy[:, :2][0], prefix[0])
