"""How a `Translator` decodes (`DecodingOptions`, checked in one place before any model is read)
and what it returns per source (`Hypothesis`).

Modes, by the options:
- beam search (beam_size > 1) or greedy (beam_size 1), the paper's default (beam 4, alpha 0.6);
  `num_hypotheses` K <= beam_size returns the K best finished hypotheses (an n-best list);
- sampling (`sampling=True`): each of K hypotheses is one draw, token by token, from the
  model's softmax at `sampling_temperature`, cut to the `sampling_topk` most probable pieces
  (0: all) and then to the `sampling_topp` nucleus (1: all); beam_size is not used;
- MBR (`mbr` N > 0): N candidates (N draws with `sampling`, else the N best of beam search,
  N <= beam_size), ranked by their mean sentence chrF against the others (`inference.mbr`);
  the K best by that utility are returned.

The field names are the translate command's flags and the server's JSON fields, so one error
message serves all three.
"""

from __future__ import annotations

import dataclasses
import math

from transformer_jax.common.errors import UserInputError, is_integer, is_number
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.search import decode
from transformer_jax.search.spec import SearchSpec

# Candidates MBR may compare for one source: N (N - 1) chrF pairs each (`inference.mbr`).
MAX_MBR_CANDIDATES = 256


@dataclasses.dataclass(frozen=True)
class DecodingOptions:
  """What `Translator.translate` / `Translator.hypotheses` do with each source."""

  # Beam size; 1 = greedy (the paper: 4). Not used when sampling.
  beam_size: int = 4
  # GNMT length penalty exponent: scores are log P / ((5 + |y|) / 6)^alpha, |y| counting EOS.
  alpha: float = 0.6
  # decode.BEAM_RULES: 'exact' (ours) or 'ctranslate2' (CTranslate2's ending and stopping).
  beam_rule: str = 'exact'
  # Hypotheses returned per source, best first: <= beam_size for beam search, any number of
  # draws when sampling, <= mbr with MBR.
  num_hypotheses: int = 1
  # Draw each token from the model's (filtered) distribution instead of searching.
  sampling: bool = False
  # Softmax temperature of the draws: > 0 and finite; below 1 sharpens, above 1 flattens.
  sampling_temperature: float = 1.0
  # Draw among the k most probable pieces only; 0 = no top-k cut.
  sampling_topk: int = 0
  # Draw within the smallest set of pieces whose probability reaches p (nucleus); 1 = no cut.
  sampling_topp: float = 1.0
  # Seed of the draws: the same seed, sources and options give the same translations.
  seed: int = 0
  # Minimum-Bayes-risk decoding over this many candidates; 0 = off.
  mbr: int = 0

  def check(self) -> 'DecodingOptions':
    """Self, or a one-line UserInputError naming the field (the flag) that is impossible."""
    if self.beam_rule not in decode.BEAM_RULES:
      raise UserInputError(f'beam_rule must be one of {decode.BEAM_RULES}, got {self.beam_rule!r}')
    _positive_integer('beam_size', self.beam_size)
    if not is_number(self.alpha) or not 0 <= self.alpha < math.inf:
      raise UserInputError(f'alpha must be a finite number >= 0, got {self.alpha!r}')
    _positive_integer('num_hypotheses', self.num_hypotheses)
    if not isinstance(self.sampling, bool):
      raise UserInputError(f'sampling must be true or false, got {self.sampling!r}')
    temperature = self.sampling_temperature
    if not is_number(temperature) or not 0 < temperature < math.inf:
      raise UserInputError(f'sampling_temperature must be a finite number > 0, got {temperature!r}')
    if not is_integer(self.sampling_topk) or self.sampling_topk < 0:
      raise UserInputError(
        f'sampling_topk must be an integer >= 0 (0: no top-k cut), got {self.sampling_topk!r}'
      )
    if not is_number(self.sampling_topp) or not 0 < self.sampling_topp <= 1:
      raise UserInputError(
        f'sampling_topp must be a number in (0, 1] (1: no nucleus cut), got {self.sampling_topp!r}'
      )
    # jax.random.key keeps 32 bits of a seed without x64: larger ones would collide.
    if not is_integer(self.seed) or not 0 <= self.seed < 2**32:
      raise UserInputError(f'seed must be an integer in [0, 2^32), got {self.seed!r}')
    if not is_integer(self.mbr) or not 0 <= self.mbr <= MAX_MBR_CANDIDATES:
      raise UserInputError(
        f'mbr must be an integer in [0, {MAX_MBR_CANDIDATES}] (0: off), got {self.mbr!r}'
      )
    if self.mbr == 1:
      raise UserInputError('mbr must be at least 2 candidates to compare (0: off), got 1')
    if self.mbr:
      if self.num_hypotheses > self.mbr:
        raise UserInputError(
          f'num_hypotheses ({self.num_hypotheses}) must be <= mbr ({self.mbr}): MBR returns '
          'the best of its candidates'
        )
      if not self.sampling and self.mbr > self.beam_size:
        raise UserInputError(
          f'mbr ({self.mbr}) must be <= beam_size ({self.beam_size}): without sampling its '
          'candidates are the n-best list of beam search'
        )
    elif not self.sampling and self.num_hypotheses > self.beam_size:
      raise UserInputError(
        f'num_hypotheses ({self.num_hypotheses}) must be <= beam_size ({self.beam_size}): '
        'beam search keeps beam_size hypotheses'
      )
    return self

  @property
  def mode(self) -> str:
    """'sampling', 'greedy' or 'beam': the search that runs (MBR draws its candidates so)."""
    if self.sampling:
      return 'sampling'
    return 'greedy' if self.beam_size == 1 else 'beam'

  def spec(self, max_decode_len: int, *, scored: bool = True) -> SearchSpec:
    """The search these options run, for a batch of that decode length: the one place where
    the options become the search's (`search.SearchSpec`; temperature and top_p travel as
    traced values, the spec says only whether each applies). `scored`: greedy sums its
    outputs' log-probabilities (beam search and sampling always do)."""
    mode = self.mode
    sampling = mode == 'sampling'
    return SearchSpec(
      mode,
      max_decode_len,
      BOS_ID,
      EOS_ID,
      PAD_ID,
      beam_size=self.beam_size if mode == 'beam' else 1,
      alpha=float(self.alpha) if mode == 'beam' else 0.0,
      rule=self.beam_rule if mode == 'beam' else 'exact',
      top_k=self.sampling_topk if sampling else 0,
      tempered=sampling and self.sampling_temperature != 1,
      nucleus=sampling and self.sampling_topp < 1,
      scored=scored,
    )

  @property
  def candidates(self) -> int:
    """Hypotheses the search produces per source: mbr's N, else num_hypotheses (sampling's
    draws), else the beam's (greedy: 1)."""
    if self.mbr:
      return self.mbr
    if self.sampling:
      return self.num_hypotheses
    return self.beam_size


def _positive_integer(name: str, value) -> None:
  if not is_integer(value) or value < 1:
    raise UserInputError(f'{name} must be a positive integer, got {value!r}')


# Inference dtypes: the compute dtype of every product, and of the parameters' matrices.
DTYPES = ('float32', 'bfloat16', 'float16')


def check_decoding_options(
  beam_size: int = 4,
  alpha: float = 0.6,
  batch_size: int = 64,
  beam_rule: str = 'exact',
  dtype: str | None = None,
) -> None:
  """One-line errors for impossible decoding settings, raised before any checkpoint is read."""
  DecodingOptions(beam_size=beam_size, alpha=alpha, beam_rule=beam_rule).check()
  _positive_integer('batch_size', batch_size)
  check_dtype(dtype)


def check_dtype(dtype: str | None) -> None:
  """A one-line error unless dtype is None (the model's own) or one of DTYPES."""
  if dtype is not None and dtype not in DTYPES:
    raise UserInputError(f'dtype must be one of {", ".join(DTYPES)}, got {dtype!r}')


@dataclasses.dataclass(frozen=True)
class Hypothesis:
  """One translation of a source with its scores under the model (the ensemble's mixture for
  an ensemble)."""

  # The detokenized translation.
  text: str
  # log P(pieces, EOS | source): the prefix's pieces and the EOS counted, PAD and BOS excluded
  # from the softmax (as `Translator.score` and CTranslate2's score_batch count).
  log_prob: float
  # log_prob / ((5 + tokens) / 6)^alpha: what beam search ranks by (at alpha 0, log_prob).
  score: float
  # Target tokens scored: the pieces and the EOS.
  tokens: int
  # MBR only: the mean sentence chrF against the other candidates.
  utility: float | None = None

  def as_dict(self) -> dict:
    fields = dataclasses.asdict(self)
    if self.utility is None:
      del fields['utility']
    return fields
