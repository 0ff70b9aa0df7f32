"""Sampling (search.sampling, inference.decoding.sample_decode): the draws follow the model's
tempered softmax (chi-square at a fixed seed), top-k and top-p never leave their sets, a
sentence's draw depends on its key only, and bad options are one-line errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import tokenizer
from transformer_jax.inference import decoding
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import decode, sampling

PAD, BOS, EOS = 0, 1, 2
VOCAB = 8
DRAWS = 24_000
# First-token logits; PAD's is the largest, so a search that let PAD through would show it.
LOGITS = np.array([5.0, 0.0, -0.5, 1.2, 0.4, -1.0, 0.9, -2.0], np.float32)


def _first_tokens(temperature=1.0, top_k=0, top_p=1.0, draws=DRAWS, seed=0) -> np.ndarray:
  """`draws` first tokens, one per row (each its own key), from the fixed LOGITS."""

  def step_fn(token, cache):
    return jnp.broadcast_to(jnp.asarray(LOGITS), (token.shape[0], VOCAB)), cache

  tokens, _ = sampling.sample_search(
    step_fn,
    None,
    batch_size=draws,
    max_decode_len=1,
    bos_id=BOS,
    eos_id=EOS,
    pad_id=PAD,
    keys=jax.random.split(jax.random.key(seed), draws),
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
  )
  return np.asarray(tokens)[:, 0]


def _softmax_of_the_choices(logits: np.ndarray) -> np.ndarray:
  """What sampling draws from: the softmax without PAD and BOS, neither ever a prediction."""
  logits = logits.astype(np.float64).copy()
  logits[[PAD, BOS]] = -np.inf
  probs = np.exp(logits - logits.max())
  return probs / probs.sum()


def _chi_square_p(tokens: np.ndarray, probs: np.ndarray) -> float:
  """p-value of the draws' counts against probs over the tokens probs allows."""
  support = np.flatnonzero(probs > 0)
  assert np.isin(tokens, support).all(), sorted(set(tokens.tolist()) - set(support.tolist()))
  observed = np.bincount(tokens, minlength=VOCAB)[support]
  expected = probs[support] * len(tokens)
  assert expected.min() >= 5  # the chi-square approximation holds
  return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize('temperature', [1.0, 0.6, 2.5])
def test_first_tokens_follow_the_tempered_softmax(temperature):
  tokens = _first_tokens(temperature=temperature)
  assert (tokens != PAD).all()
  assert _chi_square_p(tokens, _softmax_of_the_choices(LOGITS / temperature)) > 1e-3
  # The test can tell temperatures apart: the same draws against T = 1.5 T are far off.
  assert _chi_square_p(tokens, _softmax_of_the_choices(LOGITS / (1.5 * temperature))) < 1e-6


def test_top_k_never_draws_outside_the_k_most_probable():
  tokens = _first_tokens(top_k=3)
  top3 = [3, 6, 4]  # the 3 largest logits once PAD and BOS are out
  assert set(np.unique(tokens).tolist()) == set(top3)
  probs = np.zeros(VOCAB)
  probs[top3] = _softmax_of_the_choices(LOGITS)[top3]
  assert _chi_square_p(tokens, probs / probs.sum()) > 1e-3


@pytest.mark.parametrize('top_p, nucleus', [(0.5, [3, 6]), (0.9, [3, 6, 4, 2]), (0.01, [3])])
def test_top_p_draws_from_the_nucleus_renormalised(top_p, nucleus):
  full = _softmax_of_the_choices(LOGITS)
  order = np.argsort(-full)
  # The nucleus: the fewest most probable tokens whose probability reaches top_p.
  size = int(np.searchsorted(np.cumsum(full[order]), top_p) + 1)
  assert sorted(order[:size].tolist()) == sorted(nucleus)
  tokens = _first_tokens(top_p=top_p)
  probs = np.zeros(VOCAB)
  probs[nucleus] = full[nucleus]
  assert set(np.unique(tokens).tolist()) == set(nucleus)
  if len(nucleus) > 1:
    assert _chi_square_p(tokens, probs / probs.sum()) > 1e-3


def test_filters_compose_temperature_then_top_k_then_top_p():
  logits = jnp.asarray(LOGITS)[None].at[0, PAD].set(-jnp.inf)
  # T = 0.5 sharpens; the top 3 (3, 6, 4) renormalised: 0.571, 0.313, 0.116; p = 0.85 keeps 2.
  kept = sampling.filter_logits(logits, temperature=0.5, top_k=3, top_p=0.85)
  np.testing.assert_array_equal(np.flatnonzero(np.isfinite(kept[0])), [3, 6])
  np.testing.assert_allclose(kept[0, [3, 6]], LOGITS[[3, 6]] / 0.5)
  # Per-row (traced) temperature and top_p.
  rows = sampling.filter_logits(
    jnp.tile(logits, (2, 1)), temperature=jnp.array([1.0, 0.5]), top_p=jnp.array([1.0, 0.5])
  )
  assert np.isfinite(rows[0]).sum() == VOCAB - 1 and np.isfinite(rows[1]).sum() == 1


class SourceToy:
  """Causal toy: logits_i = T[x_i] + U[x_{i-1}] + S[sentence] + P[i]; EOS grows likelier with
  i. A row's logits depend on its own tokens and sentence only."""

  def __init__(self, num_sentences=6, max_len=12, seed=0):
    rng = np.random.default_rng(seed)
    self.t, self.u = (rng.normal(size=(2, VOCAB, VOCAB)) * 1.5).astype(np.float32)
    self.s = rng.normal(size=(num_sentences, VOCAB)).astype(np.float32)
    self.p = rng.normal(size=(max_len, VOCAB)).astype(np.float32)
    self.p[:, EOS] += np.linspace(-3, 3, max_len)
    self.max_len = max_len

  def logits_at(self, cur, prev, src, pos):
    return jnp.asarray(self.t)[cur] + jnp.asarray(self.u)[prev] + src + jnp.asarray(self.p)[pos]

  def init_cache(self, sentences):
    b = len(sentences)
    src = jnp.asarray(self.s[np.asarray(sentences)])
    return {'pos': jnp.int32(0), 'prev': jnp.full((b,), PAD, jnp.int32), 'src': src}

  def step_fn(self, token, cache):
    logits = self.logits_at(token[:, 0], cache['prev'], cache['src'], cache['pos'])
    return logits, {**cache, 'pos': cache['pos'] + 1, 'prev': token[:, 0]}

  def logits_fn(self, sentences):
    src = jnp.asarray(self.s[np.asarray(sentences)])

    def logits_fn(inputs):
      prev = jnp.concatenate([jnp.full_like(inputs[:, :1], PAD), inputs[:, :-1]], axis=1)
      return jnp.stack(
        [self.logits_at(inputs[:, i], prev[:, i], src, i) for i in range(inputs.shape[1])], 1
      )

    return logits_fn


TOY = SourceToy()
KEYS = jax.random.split(jax.random.key(7), 6)


def _sample(sentences, keys, uncached=False, **options):
  common = dict(
    batch_size=len(sentences), max_decode_len=TOY.max_len, bos_id=BOS, eos_id=EOS, pad_id=PAD
  )
  if uncached:
    return sampling.sample_search_uncached(TOY.logits_fn(sentences), keys=keys, **common, **options)
  return sampling.sample_search(
    TOY.step_fn, TOY.init_cache(sentences), keys=keys, **common, **options
  )


def _log_prob(sentence, row) -> float:
  """The row's total log-probability under the toy (T = 1, unfiltered, PAD and BOS excluded)."""
  row = np.asarray(row).tolist()
  length = row.index(EOS) + 1 if EOS in row else len(row)
  inputs = jnp.asarray([[BOS] + row[:-1]], jnp.int32)
  logits = np.asarray(TOY.logits_fn([sentence])(inputs), np.float64)[0]
  logits[:, [PAD, BOS]] = -np.inf
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  return float(sum(logp[i, row[i]] for i in range(length)))


def test_same_keys_same_output_and_a_sentence_alone_equals_it_in_a_batch():
  options = dict(temperature=1.3, top_k=5, top_p=0.95)
  tokens, log_probs = _sample(range(6), KEYS, **options)
  again, _ = _sample(range(6), KEYS, **options)
  np.testing.assert_array_equal(tokens, again)
  # Different keys draw different sentences (the draws are random at all).
  other, _ = _sample(range(6), jax.random.split(jax.random.key(8), 6), **options)
  assert (np.asarray(other) != np.asarray(tokens)).any(axis=1).sum() >= 3
  for sentence in (0, 3, 5):
    alone, alone_log_prob = _sample([sentence], KEYS[sentence : sentence + 1], **options)
    np.testing.assert_array_equal(alone[0], tokens[sentence])
    np.testing.assert_allclose(alone_log_prob[0], log_probs[sentence], rtol=1e-6)
  # In another batch, at another row, with raw uint32 key data.
  batch = [4, 1, 3]
  mixed, _ = _sample(batch, jax.random.key_data(KEYS[np.asarray(batch)]), **options)
  np.testing.assert_array_equal(mixed, np.asarray(tokens)[batch])


def test_log_probs_are_the_models_and_cached_equals_uncached():
  tokens, log_probs = _sample(range(6), KEYS, temperature=0.7, top_p=0.9)
  uncached, uncached_log_probs = _sample(range(6), KEYS, uncached=True, temperature=0.7, top_p=0.9)
  np.testing.assert_array_equal(tokens, uncached)
  np.testing.assert_allclose(log_probs, uncached_log_probs, rtol=1e-5)
  for sentence, row in enumerate(np.asarray(tokens)):
    np.testing.assert_allclose(log_probs[sentence], _log_prob(sentence, row), rtol=1e-5)
  ended = [row for row in np.asarray(tokens) if EOS in row]
  assert len(ended) >= 4  # the EOS convention holds (a row without EOS fills the length)
  for row in ended:
    end = row.tolist().index(EOS)
    assert (row[:end] != PAD).all() and (row[end + 1 :] == PAD).all()


def test_top_k_one_is_greedy_and_max_lengths_cap_the_rows():
  tokens, _ = _sample(range(6), KEYS, top_k=1)
  greedy = decode.greedy_search(
    TOY.step_fn,
    TOY.init_cache(range(6)),
    batch_size=6,
    max_decode_len=TOY.max_len,
    bos_id=BOS,
    eos_id=EOS,
    pad_id=PAD,
  )
  np.testing.assert_array_equal(tokens, greedy)
  caps = np.array([1, 2, 3, 4, 5, 6], np.int32)
  capped, _ = _sample(range(6), KEYS, temperature=3.0, max_lengths=jnp.asarray(caps))
  for row, cap in zip(np.asarray(capped), caps):
    assert EOS in row[:cap].tolist() and (row[cap:] == PAD).all()


@pytest.mark.parametrize(
  'options, message',
  [
    (dict(temperature=0.0), 'temperature must be a finite number > 0, got 0.0'),
    (dict(temperature=-1), 'temperature must be a finite number > 0, got -1'),
    (dict(temperature=float('inf')), 'temperature must be a finite number > 0, got inf'),
    (dict(temperature='hot'), "temperature must be a finite number > 0, got 'hot'"),
    (dict(top_k=-1), 'top_k must be an integer >= 0 (0: no top-k filter), got -1'),
    (dict(top_k=2.5), 'top_k must be an integer >= 0 (0: no top-k filter), got 2.5'),
    (dict(top_p=0.0), 'top_p must be a number in (0, 1] (1: no nucleus filter), got 0.0'),
    (dict(top_p=1.5), 'top_p must be a number in (0, 1] (1: no nucleus filter), got 1.5'),
    (dict(top_p=float('nan')), 'top_p must be a number in (0, 1] (1: no nucleus filter), got nan'),
  ],
)
def test_bad_sampling_options_are_one_line_errors(options, message):
  full = dict(temperature=1.0, top_k=0, top_p=1.0) | options
  with pytest.raises(UserInputError) as error:
    decoding.check_sampling_options(**full)
  assert str(error.value) == message and '\n' not in message
  with pytest.raises(ValueError, match='^' + message.replace('(', r'\(').replace(')', r'\)')):
    _sample(range(6), KEYS, **full)


def test_good_sampling_options_pass_and_keys_must_be_one_per_row():
  decoding.check_sampling_options(temperature=0.3, top_k=40, top_p=1)
  decoding.check_sampling_options(temperature=np.float32(2), top_k=np.int64(0), top_p=0.9)
  with pytest.raises(ValueError, match=r'keys must hold one PRNG key per row \(6\)'):
    _sample(range(6), KEYS[:5])


def test_sample_decode_on_a_random_model_top_k_one_is_greedy_and_scores_its_output():
  config = TransformerConfig(
    vocab_size=61, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1
  )
  model = Transformer(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), dummy, dummy)['params'])
  src = np.random.default_rng(0).integers(4, 61, size=(3, 7)).astype(np.int32)
  src[:, -1] = tokenizer.EOS_ID
  keys = jax.random.split(jax.random.key(1), 3)
  sample = jax.jit(functools.partial(decoding.sample_decode, model, max_decode_len=10, top_k=1))
  tokens, log_probs = sample(params, src, keys=keys)
  greedy = decoding.greedy_decode(model, params, src, max_decode_len=10)
  np.testing.assert_array_equal(tokens, greedy)
  # The log-probability a teacher-forced pass gives the output.
  tokens = np.asarray(tokens)
  inputs = np.concatenate([np.full((3, 1), tokenizer.BOS_ID, np.int32), tokens[:, :-1]], axis=1)
  logits = model.apply({'params': params}, src, inputs)
  never = [tokenizer.PAD_ID, tokenizer.BOS_ID]
  logp = jax.nn.log_softmax(logits.at[..., never].set(-jnp.inf), axis=-1)
  token_logp = np.take_along_axis(np.asarray(logp), tokens[..., None], axis=-1)[..., 0]
  written = tokens != tokenizer.PAD_ID
  np.testing.assert_allclose(log_probs, np.where(written, token_logp, 0).sum(1), rtol=1e-4)


def _sorted_nucleus(logits, top_p):
  """The nucleus by its definition: sort (ties: lower id first), keep while the mass before < p."""
  keep = np.zeros(logits.shape, bool)
  for row, values in enumerate(np.asarray(logits, np.float64)):
    probs = np.exp(values - values.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind='stable')
    before = np.cumsum(probs[order]) - probs[order]
    keep[row, order] = before < top_p
  return keep


@pytest.mark.parametrize('top_p', [0.05, 0.5, 0.9, 0.999])
def test_the_bisected_nucleus_is_the_sorted_one(top_p):
  """filter_logits finds the nucleus without sorting (a bisection on probabilities): the same set
  as the sort, ties at the boundary included in id order (rows of repeated values)."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 3, (64, 500)).astype(np.float32)
  logits[:8] = np.round(logits[:8])  # many exact ties
  logits[8:12] = 0.0  # all equal: the first ceil(p * v) tokens
  filtered = np.asarray(sampling.filter_logits(jnp.asarray(logits), top_p=top_p))
  expected = _sorted_nucleus(logits, top_p)
  found = np.isfinite(filtered)
  # float32 sums in another order may move a token sitting exactly on the boundary.
  differing = np.argwhere(found != expected)
  assert len(differing) <= 1, differing
  np.testing.assert_array_equal(filtered[found], logits[found])


def test_draws_by_the_inverse_cdf_never_pick_a_filtered_token_and_fit_the_softmax():
  logits = jnp.asarray([[0.0, -jnp.inf, 1.0, -jnp.inf, 2.0], [-jnp.inf] * 4 + [0.0]], jnp.float32)
  keys = jax.random.split(jax.random.key(0), 20_000)
  draws = np.asarray(
    jax.vmap(lambda key: sampling._draw(jnp.stack([key, key]), logits))(keys)
  )  # [draws, 2]
  assert set(draws[:, 0]) == {0, 2, 4} and set(draws[:, 1]) == {4}
  counts = np.bincount(draws[:, 0], minlength=5)[[0, 2, 4]]
  expected = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum() * len(draws)
  assert stats.chisquare(counts, expected).pvalue > 1e-3


def _nucleus_draws(logits, top_p, draws, seed=0):
  """`draws` rejection draws from each row of logits [b, v]: int [draws, b]."""
  keys = jax.random.split(jax.random.key(seed), draws)
  draw = jax.jit(
    jax.vmap(
      lambda key: sampling._draw_from_nucleus(
        jax.random.split(key, logits.shape[0]), jnp.asarray(logits), top_p
      )
    )
  )
  return np.asarray(draw(keys))


@pytest.mark.parametrize('top_p', [0.05, 0.5, 0.9, 0.999])
def test_nucleus_draws_by_rejection_stay_in_the_sorted_nucleus(top_p):
  """The sampling loop draws from the nucleus by rejection (no mask is built): every draw lies
  in the nucleus by its sorted definition, ties and all-equal rows included, and the rows that
  needed rejections are many (the check is exercised, not only the first draw)."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 3, (24, 300)).astype(np.float32)
  logits[:4] = np.round(logits[:4])  # many exact ties
  logits[4] = 0.0  # all equal: the first ceil(p * v) tokens by id
  expected = _sorted_nucleus(logits, top_p)
  draws = _nucleus_draws(logits, top_p, 400)  # [400, 24]
  outside = np.argwhere(~expected[np.arange(24)[None, :], draws])  # [n, (draw, row)]
  # A token sitting exactly on the boundary may fall either way in float32 (as for the mask).
  assert len({(row, draws[draw, row]) for draw, row in outside}) <= 1, outside
  plain = np.asarray(
    jax.vmap(lambda key: sampling._draw(jax.random.split(key, 24), jnp.asarray(logits)))(
      jax.random.split(jax.random.key(0), 400)
    )
  )
  # Where the plain draw (the same first key) lands in the nucleus, it is the draw; elsewhere
  # the row drew again.
  first_inside = expected[np.arange(24)[None, :], plain]
  changed = np.argwhere(first_inside & (draws != plain))  # [n, (draw, row)]
  # Again up to one (row, token) on the boundary, which float32 may put outside.
  assert len({(row, plain[draw, row]) for draw, row in changed}) <= 1, changed
  if top_p < 0.999:
    assert (~first_inside).sum() > 100


def test_nucleus_draws_follow_the_renormalised_softmax_after_rejections():
  """top_p 0.3 over 6 tokens: the first draw leaves the nucleus ~60% of the time; the accepted
  draws still fit the nucleus's renormalised softmax (chi-square), and not the softmax over a
  token more (so the test can fail)."""
  logits = np.log(np.array([[0.2, 0.15, 0.25, 0.1, 0.18, 0.12]], np.float32))
  draws = _nucleus_draws(logits, 0.3, 20_000)[:, 0]
  probs = np.exp(logits[0].astype(np.float64))
  nucleus = [2, 0]  # 0.25, then 0.2 (mass ahead 0.25 < 0.3); then 0.45 >= 0.3
  assert set(np.unique(draws).tolist()) == set(nucleus)
  observed = np.bincount(draws, minlength=6)[nucleus]
  expected = probs[nucleus] / probs[nucleus].sum() * len(draws)
  assert stats.chisquare(observed, expected).pvalue > 1e-3
  assert stats.chisquare(observed, np.full(2, len(draws) / 2)).pvalue < 1e-6


def test_a_nan_row_ends_the_nucleus_draw():
  logits = jnp.asarray([[0.0, 1.0, 2.0], [jnp.nan, 0.0, 1.0]], jnp.float32)
  drawn = sampling._draw_from_nucleus(jax.random.split(jax.random.key(0), 2), logits, 0.5)
  assert int(drawn[0]) == 2  # the only token of the 0.5 nucleus (0.67 alone)
