"""Ensembles at decode time (issue 27, item 4): the log of the weighted mean of the members'
probabilities per step (search/ensemble.py), decoded greedily and by beam search over the
members' own caches (inference/ensemble.py)."""

import functools
import json
import logging
import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference import ensemble as inference_ensemble
from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.decoding import beam_decode, greedy_decode
from transformer_jax.inference.ensemble import (
  Ensemble,
  ensemble_beam_decode,
  ensemble_greedy_decode,
)
from transformer_jax.inference.translator import Translator
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import ensemble
from transformer_jax.search.decode import strip_after_eos

from conftest import random_weight_translator

SOURCES = ['three hundred and twelve', 'forty-two', 'one thousand and seven', 'ninety-nine']
MAX_DECODE_LEN = 16


@pytest.fixture(scope='module')
def random_translator():
  return random_weight_translator()


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def test_combined_log_probs_are_the_log_of_the_weighted_mean_of_probabilities():
  a, b = np.random.default_rng(0).normal(0, 3, (2, 5, 11)).astype(np.float32)
  combined = ensemble.combine_log_probs([a, b], (1, 3))
  expected = np.log(0.25 * _softmax(a) + 0.75 * _softmax(b))
  np.testing.assert_allclose(np.asarray(combined), expected, atol=2e-6)
  # Without PAD: each member renormalised over the other tokens before the mix.
  masked = np.asarray(ensemble.combine_log_probs([a, b], None, pad_id=0))
  assert np.all(masked[..., 0] == -np.inf)
  without_pad = [_softmax(x[..., 1:]) for x in (a, b)]
  np.testing.assert_allclose(masked[..., 1:], np.log(np.mean(without_pad, axis=0)), atol=2e-6)


def test_a_member_alone_or_with_itself_gives_exactly_its_log_softmax():
  a = np.random.default_rng(1).normal(0, 5, (3, 96)).astype(np.float32)
  own = np.asarray(jax.nn.log_softmax(a))
  for logits, weights in (([a], None), ([a, a], None), ([a, a, a], (1, 2, 3)), ([a] * 3, (1,) * 3)):
    assert np.array_equal(np.asarray(ensemble.combine_log_probs(logits, weights)), own)


def test_weights_must_match_the_members_and_be_positive():
  assert ensemble.normalised_weights(None, 4) == (0.25,) * 4
  assert ensemble.normalised_weights((1, 3), 2) == (0.25, 0.75)
  for weights in ((1,), (1, 0), (1, -1), (1, float('nan'))):
    with pytest.raises(ValueError):
      ensemble.normalised_weights(weights, 2)
  with pytest.raises(UserInputError, match='^3 weights given for 2 ensemble members$'):
    inference_ensemble.check_weights((1, 2, 3), 2)


def test_step_reorder_and_extend_act_on_each_members_cache():
  # Member m's cache counts its steps, offset by 100 * m: each must advance its own part.
  def member(m):
    def step_fn(tokens, cache):
      logits = jnp.zeros((tokens.shape[0], 5)).at[:, m + 1].set(10.0)
      return logits, cache + 1

    return step_fn

  step = ensemble.ensemble_step_fn([member(0), member(1)], (3, 1))
  log_probs, caches = step(jnp.zeros((2, 1), jnp.int32), (jnp.zeros(2), jnp.full(2, 100.0)))
  assert [c.tolist() for c in caches] == [[1, 1], [101, 101]]
  p1, p2 = _softmax(np.eye(5)[1] * 10), _softmax(np.eye(5)[2] * 10)
  np.testing.assert_allclose(np.asarray(log_probs[0]), np.log(0.75 * p1 + 0.25 * p2), atol=1e-6)
  reorder = ensemble.ensemble_reorder([lambda c, rows: c[rows], lambda c, rows: -c[rows]])
  reordered = reorder((jnp.arange(3), jnp.arange(3)), jnp.array([2, 2, 0]))
  assert [c.tolist() for c in reordered] == [[2, 2, 0], [-2, -2, 0]]
  extend = ensemble.ensemble_extend([lambda c, n: c * n, lambda c, n: c + n])
  assert extend((2, 3), 10) == (20, 13)


def _source_ids(translator: Translator) -> np.ndarray:
  rows = [translator.tokenizer.encode(s) + [EOS_ID] for s in SOURCES]
  src = np.full((len(rows), 16), PAD_ID, np.int32)
  for index, ids in enumerate(rows):
    src[index, : len(ids)] = ids
  return src


def _assert_self_ensemble_decodes_as_the_model(translator, count, weights, *, greedy=True):
  """`count` copies of the translator's model, weighted so, search as the model alone: the same
  token ids (greedy, if asked, and beam 4) and beam scores within 1e-6 of their size (the two
  programs fuse differently: on an AVX-512 Xeon the scores of -12 differed by 2e-6, 2 ulp).
  Returns the model's greedy tokens (or None) and beam ids."""
  model, params, src = translator.model, translator.params, _source_ids(translator)
  models, members = (model,) * count, (params,) * count
  own_tokens = None
  if greedy:
    own_tokens = np.asarray(
      jax.jit(functools.partial(greedy_decode, model, max_decode_len=MAX_DECODE_LEN))(params, src)
    )
    tokens = jax.jit(
      functools.partial(
        ensemble_greedy_decode, models, max_decode_len=MAX_DECODE_LEN, weights=weights
      )
    )(members, src)
    np.testing.assert_array_equal(np.asarray(tokens), own_tokens)
  beam = dict(beam_size=4, alpha=0.6, max_decode_len=MAX_DECODE_LEN)
  own_ids, own_scores = jax.jit(functools.partial(beam_decode, model, **beam))(params, src)
  ids, scores = jax.jit(functools.partial(ensemble_beam_decode, models, weights=weights, **beam))(
    members, src
  )
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(own_ids))
  np.testing.assert_allclose(np.asarray(scores), np.asarray(own_scores), rtol=1e-6, atol=1e-6)
  return own_tokens, np.asarray(own_ids)


def test_a_random_weight_model_ensembled_with_itself_decodes_exactly_as_itself(random_translator):
  tokens, ids = _assert_self_ensemble_decodes_as_the_model(random_translator, 2, None)
  # Not trivial: the outputs differ between sentences, and the beams within each sentence.
  assert len({tuple(row) for row in tokens.tolist()}) > 2
  assert all(len({tuple(beam) for beam in beams}) == 4 for beams in ids.tolist())


def test_a_trained_model_ensembled_with_itself_decodes_and_translates_exactly_as_itself(
  tiny_workdir,
):
  single = Translator.from_checkpoint(tiny_workdir, 8, batch_size=4)
  # After 8 steps it says little (the same for every source: see the random-weight test); its
  # greedy search is compared through translate below.
  _assert_self_ensemble_decodes_as_the_model(single, 2, None, greedy=False)
  thrice = Ensemble.from_checkpoints([(tiny_workdir, 8)] * 3, weights=(1, 2, 3), batch_size=4)
  for beam_size in (1, 4):
    assert thrice.translate(SOURCES, beam_size) == single.translate(SOURCES, beam_size)


def test_two_checkpoints_decode_greedily_the_argmax_of_their_mean_probabilities(tiny_workdir):
  members = [Translator.from_checkpoint(tiny_workdir, step, batch_size=4) for step in (4, 8)]
  models, params = tuple(t.model for t in members), tuple(t.params for t in members)
  src = _source_ids(members[0])
  decode = functools.partial(ensemble_greedy_decode, models, max_decode_len=MAX_DECODE_LEN)
  tokens = np.asarray(jax.jit(decode)(params, src))
  # Each model's own probabilities along the ensemble's output (teacher forcing), PAD and BOS
  # excluded as the searches exclude them: at every step the ensemble took the argmax of their
  # mean.
  target_in = np.concatenate([np.full((len(src), 1), BOS_ID), tokens[:, :-1]], axis=1)
  probs = []
  for model, p in zip(models, params):
    logits = np.asarray(model.apply({'params': p}, src, target_in), np.float64)
    logits[..., [PAD_ID, BOS_ID]] = -np.inf
    probs.append(_softmax(logits))
  mean = (probs[0] + probs[1]) / 2
  lengths = [len(ids) + 1 for ids in strip_after_eos(tokens, EOS_ID, pad_id=PAD_ID)]
  for row, length in enumerate(lengths):
    np.testing.assert_array_equal(tokens[row, :length], mean[row, :length].argmax(-1))
  # The two models disagree: their mean is not either one's distribution.
  assert np.abs(probs[0] - probs[1]).max() > 0.05

  # One step by hand: the ensemble's first step is log((p4 + p8) / 2) of the models' logits.
  @jax.jit
  def first_step(params, src):
    steps = inference_ensemble.members_steps(models, params, src)  # Uniform weights.
    step, caches = steps.step, steps.init_cache(MAX_DECODE_LEN, 1)
    return step(jnp.full((len(src), 1), BOS_ID, jnp.int32), caches)[0]

  np.testing.assert_allclose(np.exp(np.asarray(first_step(params, src))), mean[:, 0], atol=1e-5)


def test_ensembles_share_programs_only_with_equal_members_and_weights(tiny_workdir):
  """Ensembles share their jitted searches as Translators do (`translator._SharedPrograms`),
  keyed on the members' models and weights, which the searches close over: each ensemble's
  scores are the log of its own weighted mean."""
  members = [Translator.from_checkpoint(tiny_workdir, step, batch_size=4) for step in (4, 8)]
  pairs = (SOURCES, ['dreihundertzwölf', 'zweiundvierzig', 'tausendsieben', 'neunundneunzig'])
  per_token = [
    [np.array(s['token_log_probs']) for s in m.score(*pairs, per_token=True)] for m in members
  ]
  own = [np.array([p.sum() for p in member]) for member in per_token]
  mixed = {}
  for weights in ((1, 3), (3, 1), (1, 3)):
    ensemble = Ensemble(members, weights=weights, batch_size=4)
    scores = np.array([s['log_prob'] for s in ensemble.score(*pairs)])
    w = np.array(weights) / sum(weights)
    # The mixture is per token: log(w1 p1 + w2 p2) at each token, summed.
    expected = [
      np.log(w[0] * np.exp(p) + w[1] * np.exp(q)).sum() for p, q in zip(*per_token, strict=True)
    ]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    mixed.setdefault(weights, []).append(ensemble._batches)
  assert not np.allclose(own[0], own[1], atol=0.05)  # The members differ: weights matter.
  (a, c), (b,) = mixed[(1, 3)], mixed[(3, 1)]
  assert a._token_log_probs is c._token_log_probs and a._search is c._search
  assert b._token_log_probs is not a._token_log_probs and b._search is not a._search


def test_members_of_other_sizes_and_max_len_translate_together_within_the_smallest(
  random_translator, caplog
):
  small = random_translator
  config = small.model_config.replace(d_model=32, d_ff=64, num_decoder_layers=2, max_len=12)
  model = Transformer(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), dummy, dummy)['params'])
  large = Translator(config, params, small.tokenizer, batch_size=8)
  # Another architecture is refused unless asked for; max_len alone may differ.
  with pytest.raises(UserInputError, match='^ensemble members must share their architecture: '):
    Ensemble([small, large])
  short = Translator(small.model_config.replace(max_len=12), small.params, small.tokenizer)
  assert Ensemble([small, short]).max_len == 12
  pair = Ensemble([small, large], weights=(1, 1), batch_size=8, mixed_architectures=True)
  assert pair.max_len == 12
  long_source = ' and '.join(SOURCES)  # 34 pieces with EOS.
  with caplog.at_level(logging.WARNING):
    outputs = pair.translate([long_source, SOURCES[0], ''], beam_size=1)
  assert 'sentence 0 has 34 tokens; truncated to the model maximum 12' in caplog.text
  assert outputs[2] == ''
  # At most 11 pieces and EOS each (the text does not say how it was segmented: in characters).
  longest_piece = max(len(p.lstrip('\u2581')) for p in small.tokenizer.pieces(range(96)))
  assert all(0 < len(text.replace(' ', '')) <= 11 * longest_piece for text in outputs[:2])
  other = Tokenizer.train([f'{word} {n}' for n in range(300) for word in ('x', 'y')], vocab_size=40)
  with pytest.raises(UserInputError, match='must share their vocabulary: .* differs from'):
    Ensemble([small, Translator(small.model_config, small.params, other)])


def test_another_architecture_is_one_line_naming_both_and_the_field_before_any_parameters(
  tiny_workdir, tmp_path, monkeypatch
):
  other = tmp_path / 'other'
  shutil.copytree(tiny_workdir, other)
  config_file = other / 'config.json'
  config = json.loads(config_file.read_text())
  config['model']['num_decoder_layers'] += 1
  config_file.write_text(json.dumps(config))

  def restore(*args, **kwargs):
    raise AssertionError('parameters restored before the architectures were compared')

  monkeypatch.setattr(translator_module, 'restore_served_params', restore)
  layers = config['model']['num_decoder_layers']
  with pytest.raises(UserInputError) as raised:
    Ensemble.from_checkpoints([(tiny_workdir, 8), (str(other), 8)])
  assert str(raised.value) == (
    f'ensemble members must share their architecture: {tiny_workdir} has num_decoder_layers='
    f'{layers - 1}, {other} has num_decoder_layers={layers} (Python: '
    'Ensemble(..., mixed_architectures=True) mixes them on purpose)'
  )
  # Training-only fields may differ (a member fine-tuned with other dropout is the same model).
  config['model']['num_decoder_layers'] -= 1
  config['model']['dropout_rate'] = 0.3
  config_file.write_text(json.dumps(config))
  with pytest.raises(AssertionError, match='parameters restored before'):
    Ensemble.from_checkpoints([(tiny_workdir, 8), (str(other), 8)])


def test_different_vocabularies_are_one_line_naming_both_before_any_parameters(
  tiny_workdir, tmp_path, monkeypatch
):
  other = tmp_path / 'other'
  shutil.copytree(tiny_workdir, other)
  vocab = other / 'vocab.model'
  vocab.write_bytes(vocab.read_bytes() + b'\0')

  def restore(*args, **kwargs):
    raise AssertionError('parameters restored before the vocabularies were compared')

  monkeypatch.setattr(translator_module, 'restore_served_params', restore)
  with pytest.raises(UserInputError) as raised:
    Ensemble.from_checkpoints([(tiny_workdir, 8), (str(other), 8)])
  message = str(raised.value)
  assert '\n' not in message
  assert str(pathlib.Path(tiny_workdir, 'vocab.model')) in message and str(vocab) in message
  with pytest.raises(UserInputError, match='^3 weights given for 2 ensemble members$'):
    Ensemble.from_checkpoints([(tiny_workdir, 4), (tiny_workdir, 8)], weights=(1, 2, 3))
