"""MBR selection (evaluation/mbr.py): the candidate with the highest mean sentence chrF against
the others."""

import numpy as np
import pytest
import sacrebleu

from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import mbr

CONSENSUS = 'a man in a blue shirt rides a bike down the street'
VARIANTS = [
  'a man in a blue shirt rides a bicycle down the street',
  'a man in a blue shirt is riding a bike down the road',
  'a man in blue rides a bike down the street',
  'the man in a blue shirt rides a bike along the street',
]


def brute_force_utilities(candidates):
  chrf = sacrebleu.metrics.CHRF()
  return [
    np.mean([chrf.sentence_score(h, [r]).score for j, r in enumerate(candidates) if j != i])
    for i, h in enumerate(candidates)
  ]


def test_the_consensus_wins_wherever_it_is_ranked():
  # Each variant differs from the consensus in one place, and from the others in two.
  for position in range(len(VARIANTS) + 1):
    candidates = VARIANTS[:position] + [CONSENSUS] + VARIANTS[position:]
    index, utilities = mbr.select(candidates)
    assert index == position
    others = np.delete(utilities, position)
    assert utilities[position] > others.max() + 1.0  # chrF points, not a rounding tie.


def test_identical_candidates_pick_the_first_with_utility_100():
  index, utilities = mbr.select([CONSENSUS] * 5)
  assert index == 0
  np.testing.assert_array_equal(utilities, np.full(5, 100.0))


def test_ties_go_to_the_higher_ranked_candidate():
  # Two pairs of duplicates: candidates 1 and 3 have the same utility as 0 and 2.
  index, utilities = mbr.select(['x y z', 'x y z', 'x y w', 'x y w'])
  assert utilities[0] == utilities[1] == utilities[2] == utilities[3]
  assert index == 0


def test_an_outlier_never_wins():
  outliers = ['', '.', 'zwei hundert', 'the the the the the the the the', CONSENSUS[::-1]]
  for outlier in outliers:
    for position in range(len(VARIANTS) + 1):
      candidates = VARIANTS[:position] + [outlier] + VARIANTS[position:]
      index, utilities = mbr.select(candidates)
      assert index != position, (outlier, position)
      assert utilities[position] < 25.0 if outlier else utilities[position] == 0.0


def test_utilities_equal_sentence_score_brute_force():
  candidates = [CONSENSUS, *VARIANTS, '', 'A man.', 'a man in a blue shirt rides a bike down']
  _, utilities = mbr.select(candidates)
  np.testing.assert_allclose(utilities, brute_force_utilities(candidates), rtol=0, atol=1e-9)
  # Each pairwise score is sacreBLEU's to the last bit (the cache changes no statistic).
  chrf = sacrebleu.metrics.CHRF()
  scores = mbr.pairwise_chrf(candidates)
  for i, hypothesis in enumerate(candidates):
    for j, reference in enumerate(candidates):
      if i != j:
        assert scores[i, j] == chrf.sentence_score(hypothesis, [reference]).score, (i, j)


def test_one_candidate_is_chosen_and_none_is_an_error():
  index, utilities = mbr.select(['only'])
  assert index == 0 and utilities.tolist() == [0.0]
  with pytest.raises(UserInputError, match='at least one candidate'):
    mbr.select([])
  with pytest.raises(UserInputError, match="metric must be one of \\('chrf',\\), got 'bleu'"):
    mbr.select(['a', 'b'], metric='bleu')
  with pytest.raises(TypeError, match='single string'):
    mbr.select('a sentence')
