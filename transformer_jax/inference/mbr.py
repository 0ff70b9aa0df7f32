"""Minimum-Bayes-risk selection: among candidate translations of one source (sampled or an
n-best list), the one with the highest expected utility against the others (Freitag et al.,
2022, "High Quality Rather than High Model Probability: Minimum Bayes Risk Decoding with Neural
Metrics"). Drawing the candidates is the decoder's job; this module only chooses.

Utility: sacreBLEU's sentence chrF with default settings (`sacrebleu.metrics.CHRF()`: character
6-grams, no word n-grams, beta 2), the metric the project reports at corpus level. The expected
utility of candidate i is the mean of chrF(i, j) over every other candidate j, each weighted
equally (the candidates stand for samples of the model's distribution; duplicates count as often
as they occur). A candidate is never compared with itself: chrF(i, i) = 100 for all i would add
the same constant to every candidate. Ties go to the earliest candidate, i.e. the higher-ranked
one of an n-best list.

N candidates cost N (N - 1) chrF comparisons. Each candidate's character n-grams are extracted
once (sacreBLEU's own reference cache, `CHRF._extract_reference_info`), each unordered pair's
matches are counted once for both directions, and sacreBLEU's `CHRF._compute_f_score` turns the
statistics into the score: exactly `CHRF.sentence_score`'s value (tests/mbr_test.py checks it),
about 1/8 of its cost. These are private methods of sacrebleu 2.x (pinned by the tests).
"""

from __future__ import annotations

import numpy as np
import sacrebleu

from transformer_jax.common.errors import UserInputError

METRICS = ('chrf',)


def select(candidates: list[str], *, metric: str = 'chrf') -> tuple[int, np.ndarray]:
  """(index of the chosen candidate, each candidate's expected utility, float64 [N]).

  One candidate is chosen with utility 0 (nothing to compare it with); no candidates is an
  error."""
  if metric not in METRICS:
    raise UserInputError(f'MBR metric must be one of {METRICS}, got {metric!r}')
  if isinstance(candidates, (str, bytes)):
    raise TypeError('mbr.select takes a list of candidate strings, got a single string')
  if not candidates:
    raise UserInputError('MBR selection needs at least one candidate, got none')
  utilities = expected_utilities(pairwise_chrf(list(candidates)))
  # argmax returns the first of equal maxima: the higher-ranked candidate wins a tie.
  return int(np.argmax(utilities)), utilities


def expected_utilities(scores: np.ndarray) -> np.ndarray:
  """Each row's mean over the other columns (the diagonal, self-comparison, left out)."""
  count = scores.shape[0]
  if count < 2:
    return np.zeros(count)
  off_diagonal = scores.sum(axis=1) - np.diag(scores)
  return off_diagonal / (count - 1)


def pairwise_chrf(candidates: list[str]) -> np.ndarray:
  """[N, N] sentence chrF of candidate i (hypothesis) against candidate j (reference), equal to
  `CHRF().sentence_score(candidates[i], [candidates[j]]).score`; the diagonal is left 0."""
  chrf = sacrebleu.metrics.CHRF()
  # sentence_score's preprocessing and n-gram extraction, done once per candidate instead of
  # once per comparison: a list (one Counter per n-gram order) per candidate.
  processed = [chrf._preprocess_segment(candidate) for candidate in candidates]
  ngrams = chrf._extract_reference_info(processed)['ref_ngrams']
  totals = [[sum(counter.values()) for counter in orders] for orders in ngrams]
  count = len(candidates)
  scores = np.zeros((count, count))
  for i in range(count):
    for j in range(i + 1, count):
      # Matches are symmetric (the clipped count min(hyp, ref) of each shared n-gram), so one
      # pass gives both directions; the totals swap roles. As CHRF._get_match_statistics, an
      # order the reference lacks counts no hypothesis n-grams.
      forward, backward = [], []
      for order, (first, second) in enumerate(zip(ngrams[i], ngrams[j])):
        smaller, larger = (first, second) if len(first) <= len(second) else (second, first)
        matches = sum(min(n, larger[gram]) for gram, n in smaller.items() if gram in larger)
        total_i, total_j = totals[i][order], totals[j][order]
        forward += [total_i if total_j else 0, total_j, matches]
        backward += [total_j if total_i else 0, total_i, matches]
      scores[i, j] = chrf._compute_f_score(forward)
      scores[j, i] = chrf._compute_f_score(backward)
  return scores
