"""`Translator.hypotheses` (issue 27): n-best lists with their log-probabilities, sampling keyed
by sentence, target prefixes, MBR re-ranking and ensembles, all through the one batch loop of
`Translator._decode_batch`; and `DecodingOptions.check`'s one-line errors."""

import math

import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import mbr
from transformer_jax.inference.ensemble import Ensemble
from transformer_jax.inference.options import DecodingOptions
from transformer_jax.inference.translator import Translator
from transformer_jax.search.decode import length_penalty

from conftest import copied_workdir

SOURCES = [
  'three hundred twelve',
  'forty-two',
  '',
  'one thousand seven',
  'ninety-nine',
  'seven',
  'six hundred fifty-one thousand',
]


@pytest.fixture(scope='module')
def translator(number_words_workdir, tmp_path_factory) -> Translator:
  """conftest's 150-step model: outputs are number words, n-best lists differ."""
  workdir = copied_workdir(number_words_workdir, tmp_path_factory, 'hypotheses_workdir')
  return Translator.from_checkpoint(workdir, batch_size=8)


def _texts(found):
  return [[h.text for h in candidates] for candidates in found]


def _flat(sources, found):
  pairs = [(source, h) for source, candidates in zip(sources, found) for h in candidates]
  return [source for source, _ in pairs], [h for _, h in pairs]


def test_n_best_lists_are_the_beams_best_first_with_their_log_probabilities(translator):
  found = translator.hypotheses(SOURCES, beam_size=4, alpha=0.6, num_hypotheses=4)
  assert found[2] == []  # A blank source has no hypothesis.
  assert [len(c) for i, c in enumerate(found) if i != 2] == [4] * (len(SOURCES) - 1)
  assert [c[0].text if c else '' for c in found] == translator.translate(SOURCES)
  for candidates in found:
    scores = [h.score for h in candidates]
    assert scores == sorted(scores, reverse=True)
    assert len({h.text for h in candidates}) == len(candidates)  # Distinct hypotheses.
    for h in candidates:
      assert h.score == pytest.approx(h.log_prob / float(length_penalty(h.tokens, 0.6)), rel=1e-6)
  # log_prob is the model's log P(pieces, EOS | source), as forced decoding computes it.
  sources, flat = _flat(SOURCES, found)
  scored = translator.score(sources, [h.text for h in flat])
  assert [r['tokens'] for r in scored] == [h.tokens for h in flat]
  np.testing.assert_allclose(
    [h.log_prob for h in flat], [r['log_prob'] for r in scored], atol=1e-5, rtol=0
  )
  # The first K of a beam's list are that beam's: K = 2 is a prefix of K = 4.
  two = translator.hypotheses(SOURCES, beam_size=4, alpha=0.6, num_hypotheses=2)
  assert _texts(two) == [t[:2] for t in _texts(found)]


def test_greedy_has_one_hypothesis_whose_log_prob_is_forced_scorings(translator):
  found = translator.hypotheses(SOURCES, beam_size=1)
  assert [c[0].text if c else '' for c in found] == translator.translate(SOURCES, beam_size=1)
  sources, flat = _flat(SOURCES, found)
  scored = translator.score(sources, [h.text for h in flat])
  # Two programs (a step's log-softmax accumulated over the steps, one pass over the whole
  # target) round differently: ~2e-6 apart on a sum of -3.3 under the suite's compiler flags. A
  # wrong token or a missing EOS moves a sum by far more than 1e-5.
  np.testing.assert_allclose(
    [h.log_prob for h in flat], [r['log_prob'] for r in scored], atol=1e-5, rtol=0
  )


def test_draws_depend_on_seed_and_position_not_on_the_batch(translator):
  options = dict(sampling=True, num_hypotheses=3, seed=11)
  drawn = translator.hypotheses(SOURCES, **options)
  assert all(len(c) == 3 for i, c in enumerate(drawn) if i != 2)
  again = translator.hypotheses(SOURCES, **options)
  assert _texts(again) == _texts(drawn)
  # Another batch size (one sentence per batch here) and the same draws.
  small = Translator(translator.model_config, translator.params, translator.tokenizer, batch_size=2)
  assert _texts(small.hypotheses(SOURCES, **options)) == _texts(drawn)
  # A sentence alone, keyed by its position in the list, draws what it drew among the others.
  alone = translator.hypotheses([SOURCES[4]], draw_positions=[4], **options)
  assert _texts(alone) == [_texts(drawn)[4]]
  other_seed = translator.hypotheses(SOURCES, **{**options, 'seed': 12})
  assert _texts(other_seed) != _texts(drawn)
  # Draws are sorted by score, each with the model's log-probability of the draw.
  for candidates in drawn:
    scores = [h.score for h in candidates]
    assert scores == sorted(scores, reverse=True)
    assert all(h.log_prob < 0 and math.isfinite(h.log_prob) for h in candidates)


def test_top_k_one_sampling_is_greedy(translator):
  greedy = translator.translate(SOURCES, beam_size=1)
  assert translator.translate(SOURCES, sampling=True, sampling_topk=1, seed=3) == greedy
  # A very low temperature concentrates every draw on the argmax too.
  cold = translator.translate(SOURCES, sampling=True, sampling_temperature=1e-3, seed=4)
  assert cold == greedy


def test_prefixes_are_forced_and_counted_in_the_scores(translator):
  prefixes = ['dreihundert', None, 'zwei', 'sieben', '', 'sieben', 'sechshundert']
  for options in (
    dict(beam_size=4, num_hypotheses=2),
    dict(beam_size=1),
    dict(sampling=True, num_hypotheses=2, seed=5),
  ):
    found = translator.hypotheses(SOURCES, target_prefix=prefixes, **options)
    assert found[2] == []
    for prefix, candidates in zip(prefixes, found):
      for h in candidates:
        assert h.text.startswith(prefix or ''), (prefix, h.text, options)
  # 'forty-two' with no prefix decodes as without prefixes; 'seven' forced to 'sieben' too.
  free = translator.hypotheses(SOURCES, beam_size=4, num_hypotheses=2)
  forced = translator.hypotheses(SOURCES, target_prefix=prefixes, beam_size=4, num_hypotheses=2)
  assert _texts(forced)[1] == _texts(free)[1]
  # A forced start that the model would not choose: log_prob still is log P(whole target).
  sources, flat = _flat(SOURCES, forced)
  scored = translator.score(sources, [h.text for h in flat])
  np.testing.assert_allclose(
    [h.log_prob for h in flat], [r['log_prob'] for r in scored], atol=1e-5, rtol=0
  )
  assert _texts(forced)[0][0] != _texts(free)[0][0] or _texts(free)[0][0].startswith('dreihundert')


def test_prefix_errors_name_the_entry(translator):
  with pytest.raises(UserInputError, match='target_prefix has 1 entries for 2 sentences'):
    translator.translate(['one', 'two'], target_prefix=['eins'])
  too_long = ' '.join(['sieben'] * 60)  # More pieces than 'one' + 50 allows.
  with pytest.raises(UserInputError, match=r'target_prefix 1 has \d+ pieces; its source allows'):
    translator.translate(['two', 'one'], target_prefix=[None, too_long])
  with pytest.raises(UserInputError, match='target_prefix 0 is int'):
    translator.translate(['two'], target_prefix=[3])


def test_mbr_reranks_the_candidates_by_their_mean_chrf(translator):
  found = translator.hypotheses(SOURCES, beam_size=4, mbr=4, num_hypotheses=4)
  beams = translator.hypotheses(SOURCES, beam_size=4, num_hypotheses=4)
  for candidates, beam in zip(found, beams):
    if not beam:
      assert candidates == []
      continue
    chosen, utilities = mbr.select([h.text for h in beam])
    assert candidates[0].text == beam[chosen].text
    assert candidates[0].utility == pytest.approx(utilities[chosen])
    assert sorted(h.text for h in candidates) == sorted(h.text for h in beam)
    assert [h.utility for h in candidates] == sorted(utilities.tolist(), reverse=True)
  # With sampling, the chosen one is among the seed's draws.
  drawn = translator.hypotheses(SOURCES, sampling=True, num_hypotheses=8, seed=2)
  picked = translator.translate(SOURCES, sampling=True, mbr=8, seed=2)
  for index, candidates in enumerate(drawn):
    if candidates:
      assert picked[index] in {h.text for h in candidates}
      chosen, _ = mbr.select([h.text for h in candidates])
      assert picked[index] == candidates[chosen].text


def test_a_model_ensembled_with_itself_is_itself_in_every_mode(translator):
  ensemble = Ensemble([translator, translator], weights=[1, 3], batch_size=8)
  for options in (
    # Beam n-best with some sentences' starts forced, greedy, filtered sampling.
    dict(
      beam_size=4, num_hypotheses=3, target_prefix=['drei', None, None, None, 'neun', None, None]
    ),
    dict(beam_size=1),
    dict(sampling=True, num_hypotheses=2, seed=9, sampling_topp=0.9, sampling_temperature=0.8),
  ):
    ours = translator.hypotheses(SOURCES, **options)
    theirs = ensemble.hypotheses(SOURCES, **options)
    assert _texts(theirs) == _texts(ours), options
    np.testing.assert_allclose(
      [h.log_prob for c in theirs for h in c], [h.log_prob for c in ours for h in c], atol=1e-5
    )
  targets = translator.translate(SOURCES[:2])
  np.testing.assert_allclose(
    [r['log_prob'] for r in ensemble.score(SOURCES[:2], targets)],
    [r['log_prob'] for r in translator.score(SOURCES[:2], targets)],
    atol=1e-6,
  )


def test_a_two_model_ensemble_scores_the_mixture(translator, random_weights):
  """Scores of two different models: log of the weighted mean of their token probabilities."""
  other = Translator(translator.model_config, random_weights, translator.tokenizer, batch_size=8)
  ensemble = Ensemble([translator, other], weights=[3, 1], batch_size=8)
  targets = translator.translate(SOURCES[:2])
  per_member = [m.score(SOURCES[:2], targets, per_token=True) for m in (translator, other)]
  mixed = ensemble.score(SOURCES[:2], targets, per_token=True)
  for row, result in enumerate(mixed):
    a, b = (np.exp(m[row]['token_log_probs']) for m in per_member)
    np.testing.assert_allclose(result['token_log_probs'], np.log(0.75 * a + 0.25 * b), atol=1e-5)


@pytest.fixture(scope='module')
def random_weights(translator):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  dummy = jnp.ones((1, 1), jnp.int32)
  return nn.meta.unbox(translator.model.init(jax.random.PRNGKey(7), dummy, dummy)['params'])


@pytest.mark.parametrize(
  'options, message',
  [
    (dict(num_hypotheses=5), r'num_hypotheses \(5\) must be <= beam_size \(4\)'),
    (dict(num_hypotheses=0), 'num_hypotheses must be a positive integer, got 0'),
    (dict(sampling=True, sampling_topp=0), r'sampling_topp must be a number in \(0, 1\]'),
    (dict(sampling=True, sampling_topp=1.5), r'sampling_topp must be a number in \(0, 1\]'),
    (dict(sampling=True, sampling_topk=-1), 'sampling_topk must be an integer >= 0'),
    (dict(sampling=True, sampling_topk=2.5), 'sampling_topk must be an integer >= 0'),
    (dict(sampling=True, sampling_temperature=0), 'sampling_temperature must be a finite number'),
    (dict(sampling_temperature=float('nan')), 'sampling_temperature must be a finite number'),
    (dict(sampling_temperature=float('inf')), 'sampling_temperature must be a finite number'),
    (dict(seed=-1), r'seed must be an integer in \[0, 2\^32\)'),
    (dict(seed=2**32), r'seed must be an integer in \[0, 2\^32\)'),
    (dict(mbr=1), 'mbr must be at least 2'),
    (dict(mbr=5), r'mbr \(5\) must be <= beam_size \(4\)'),
    (dict(mbr=300, sampling=True), r'mbr must be an integer in \[0, 256\]'),
    (dict(mbr=4, num_hypotheses=5, beam_size=8), r'num_hypotheses \(5\) must be <= mbr \(4\)'),
    (dict(sampling='yes'), 'sampling must be true or false'),
    (dict(beam_rule='fast'), 'beam_rule must be one of'),
    (dict(alpha=-1), 'alpha must be a finite number >= 0'),
  ],
)
def test_impossible_options_are_one_line_errors_naming_the_field(options, message):
  with pytest.raises(UserInputError, match=message) as error:
    DecodingOptions(**options).check()
  assert '\n' not in str(error.value)


def test_allowed_combinations_pass():
  DecodingOptions(sampling=True, num_hypotheses=32).check()  # Draws are not bounded by the beam.
  DecodingOptions(sampling=True, mbr=64, num_hypotheses=4, beam_size=1).check()
  DecodingOptions(beam_size=8, mbr=8, num_hypotheses=8).check()
  assert DecodingOptions(sampling=True, beam_size=8).mode == 'sampling'
  assert DecodingOptions(beam_size=1).candidates == 1


def test_translate_refuses_several_hypotheses(translator):
  with pytest.raises(UserInputError, match=r'needs Translator.hypotheses\(\)'):
    translator.translate(['one'], num_hypotheses=2)
