"""Running a CTranslate2 export as ours decodes (the server's CTranslate2 engine and the
agreement tests use it): translation options, GNMT re-ranking of CTranslate2's hypotheses
(`translate`), n-best lists with scores, target prefixes and sampling as
`Translator.hypotheses` returns them (`hypotheses`), scoring as `Translator.score` (`score`), and
the one import of the optional `ctranslate2` package (`import_ctranslate2`).

Text becomes CTranslate2's pieces through the export's vocabulary (`load_tokenizers`: our
`Tokenizer`, which cuts a MarianMT import's language tags and special tokens out as
MarianTokenizer does before SentencePiece sees the rest, and segments targets with the
workdir's own target model where it has one); a bare `sentencepiece.SentencePieceProcessor`
is taken too, for vocabularies without such rules.

This module runs with transformer_jax installed; the export itself is
`exporters.ctranslate2_spec`."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.inference import batches, scoring
from transformer_jax.inference.decoding import EXTRA_DECODE_LENGTH
from transformer_jax.inference.options import DecodingOptions, Hypothesis
from transformer_jax.search.decode import host_length_penalty


def import_ctranslate2(needed_by: str):
  """The ctranslate2 module (with its spec API), or a one-line UserInputError saying that
  `needed_by` (a flag, e.g. '--format=ctranslate2') needs it and how to install it."""
  try:
    import ctranslate2  # noqa: F401  (an optional dependency: the [export] extra)
    import ctranslate2.specs  # noqa: F401
  except ImportError:
    raise UserInputError(
      f"{needed_by} needs the ctranslate2 package: pip install -e '.[export]'"
    ) from None
  return ctranslate2


# The export's vocabulary, and its target side's where the workdir segments targets apart
# (`Workdir.target_vocab_file`; absent: the vocabulary does both).
SENTENCEPIECE_FILE = 'sentencepiece.model'
TARGET_SENTENCEPIECE_FILE = 'target_sentencepiece.model'


def load_tokenizers(directory: str) -> tuple[Tokenizer, Tokenizer]:
  """(sources' tokenizer, targets') of a CTranslate2 export written by this project."""
  source = Tokenizer.load(os.path.join(directory, SENTENCEPIECE_FILE))
  target_path = os.path.join(directory, TARGET_SENTENCEPIECE_FILE)
  return source, Tokenizer.load(target_path) if os.path.exists(target_path) else source


class _Pieces:
  """Text <-> CTranslate2's pieces: through our `Tokenizer` (MarianTokenizer's rules where its
  vocabulary has them; decoded text stripped as it strips it) or a bare SentencePiece
  processor."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ours = isinstance(tokenizer, Tokenizer)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text) if self.ours else self.tokenizer.encode(text, out_type=int)

  def pieces(self, ids: Sequence[int]) -> list[str]:
    if self.ours:
      return self.tokenizer.pieces(ids)
    return [self.tokenizer.id_to_piece(int(i)) for i in ids]

  def decode(self, pieces: Sequence[str]) -> str:
    if self.ours:
      return self.tokenizer.decode(self.tokenizer.piece_ids(pieces))
    return self.tokenizer.decode(list(pieces))


# --- Decoding as ours --------------------------------------------------------------------------


def translation_options(max_len: int, beam_size: int = 4) -> dict:
  """`ctranslate2.Translator.translate_batch` keyword arguments that decode as ours.

  Sources are cut to max_len tokens with their EOS kept, as ours; outputs have at most
  max_len - 1 tokens before EOS (ours: max_len with EOS) and may be empty (EOS first), as ours.
  Greedy needs nothing else. Beam search returns every finished hypothesis
  (num_hypotheses = beam_size) with its log-prob (length_penalty=0), which `translate` ranks
  by the GNMT penalty (`gnmt_best`).
  """
  options = dict(
    beam_size=beam_size,
    max_input_length=max_len,
    max_decoding_length=max_len - 1,
    min_decoding_length=0,  # CTranslate2's default 1 forbids EOS first; ours allows it.
  )
  if beam_size > 1:
    options.update(num_hypotheses=beam_size, length_penalty=0.0, return_scores=True)
  return options


def gnmt_best(hypotheses: Sequence[Sequence[str]], log_probs: Sequence[float], alpha: float):
  """The hypothesis with the best log P / ((5 + |y|) / 6)^alpha, |y| counting EOS (decode.py)."""
  scores = [lp / ((5.0 + len(h) + 1) / 6.0) ** alpha for h, lp in zip(hypotheses, log_probs)]
  return hypotheses[int(np.argmax(scores))]


def translate(
  translator,
  sentencepiece,
  sentences: Sequence[str],
  *,
  max_len: int,
  beam_size: int = 4,
  alpha: float = 0.6,
  max_batch_size: int = 64,
) -> list[str]:
  """CTranslate2 translations of `sentences` decoded as `inference.Translator.translate` does.

  translator: a `ctranslate2.Translator`; sentencepiece: the export's source `Tokenizer`
  (`load_tokenizers`), or its SentencePiece processor where the vocabulary has no
  MarianTokenizer rules. Blank sentences give empty translations, as ours.
  """
  codec = _Pieces(sentencepiece)
  outputs = [''] * len(sentences)
  rows = [i for i, sentence in enumerate(sentences) if sentence.strip()]
  if not rows:
    return outputs
  source = {i: codec.pieces(codec.encode(sentences[i])) for i in rows}
  # Ours caps each output at its source length (with EOS, after the cut to max_len) + 50
  # tokens and at max_len, EOS counted; CTranslate2 takes one cap per call: one call per cap.
  by_cap: dict[int, list[int]] = {}
  for i in rows:
    length = min(len(source[i]) + 1, max_len)
    by_cap.setdefault(min(length + EXTRA_DECODE_LENGTH, max_len), []).append(i)
  for cap, indices in sorted(by_cap.items()):
    options = translation_options(max_len, beam_size)
    options['max_decoding_length'] = cap - 1  # CTranslate2's cap does not count the EOS.
    results = translator.translate_batch(
      [source[i] for i in indices], max_batch_size=max_batch_size, **options
    )
    for index, result in zip(indices, results):
      if beam_size > 1:
        best = gnmt_best(result.hypotheses, result.scores, alpha)
      else:
        best = result.hypotheses[0]
      outputs[index] = codec.decode(best)
  return outputs


# --- n-best lists, scores, sampling and prefixes, as `Translator.hypotheses` ---------------------


def hypotheses(
  translator,
  sentencepiece,
  sentences: Sequence[str],
  *,
  max_len: int,
  beam_size: int = 4,
  alpha: float = 0.6,
  num_hypotheses: int = 1,
  target_prefix: Sequence[str | None] | None = None,
  sampling: bool = False,
  sampling_temperature: float = 1.0,
  sampling_topk: int = 0,
  sampling_topp: float = 1.0,
  seed: int | None = None,
  max_batch_size: int = 64,
  target_sentencepiece=None,
) -> list[list[Hypothesis]]:
  """CTranslate2's num_hypotheses `Hypothesis`es per sentence, best first, as
  `inference.Translator.hypotheses` returns them (blank sentence: []; same option checks,
  caps, prefix segmentation and errors). sentencepiece as `translate`'s; target_sentencepiece
  segments the prefixes (None: sentencepiece).

  Beam search asks CTranslate2 for all beam_size hypotheses by log-prob (length_penalty=0: its
  search is ours with beam_rule='ctranslate2') and ranks them by the GNMT penalty at `alpha`
  (`gnmt_best`); greedy returns its one; sampling num_hypotheses draws (beam_size unused).
  Where beam search still differs from ours (tests/export_options_test.py): at the cap, where
  ours forces EOS and CTranslate2 ends its k best candidates, EOS or not; at alpha > 0 with more
  than beam_size hypotheses ended, where CTranslate2 keeps the beam_size best by log-prob, ours
  by score. (Right after a prefix CTranslate2 lets EOS end only the best candidate, its issue
  #277: ours with beam_rule='ctranslate2' does too.)
  log_prob is log P(pieces, EOS | source) with the prefix counted, as ours. CTranslate2's own
  scores leave out what it did not predict: the forced prefix (added here from one score_batch
  pass over the prefixes) and, for a hypothesis cut at the cap, the EOS ours forces there
  (rescored whole, with score_batch). Sampled scores are the model's own log-probs (temperature
  1, unfiltered), as ours.

  seed: `ctranslate2.set_random_seed(seed)` first (None: left as it is). In CTranslate2 4.8 that
  seeds the generators of Translators created afterwards, not of this one (measured: two calls
  after the same seed draw differently; a Translator created after it repeats its draws): its
  draws are reproducible only from a fresh Translator, depend on the batch and on earlier calls,
  and never equal ours (another random stream); only their distribution does.
  """
  options = DecodingOptions(
    beam_size=beam_size,
    alpha=alpha,
    num_hypotheses=num_hypotheses,
    sampling=sampling,
    sampling_temperature=sampling_temperature,
    sampling_topk=sampling_topk,
    sampling_topp=sampling_topp,
    seed=0 if seed is None else seed,
  ).check()
  codec = _Pieces(sentencepiece)
  jobs = batches.encode_sources(sentences, codec, max_len)
  if target_prefix is not None:
    targets = codec if target_sentencepiece is None else _Pieces(target_sentencepiece)
    batches.add_prefixes(jobs, target_prefix, targets, len(sentences))
  if seed is not None and sampling:
    import_ctranslate2('sampling').set_random_seed(seed)
  pieces = codec.pieces
  found: list[list[Hypothesis]] = [[] for _ in sentences]
  for cap, group in _calls(jobs):
    sources = [pieces(job.ids[:-1]) for job in group]  # CTranslate2 adds the source EOS.
    prefixes = [pieces(job.prefix) if job.prefix else None for job in group]
    results = translator.translate_batch(
      sources,
      target_prefix=prefixes if any(prefixes) else None,
      max_batch_size=max_batch_size,
      **search_options(options, max_len, cap),
    )
    prefix_log_probs = _prefix_log_probs(translator, sources, prefixes, max_batch_size)
    rescored = []  # (job row, hypothesis index, pieces): cut at the cap, scored whole below
    candidates = []
    for row, result in enumerate(results):
      rows = []
      for number, (hypothesis, score) in enumerate(zip(result.hypotheses, result.scores)):
        ended = bool(hypothesis) and hypothesis[-1] == END_PIECE
        hypothesis = hypothesis[:-1] if ended else hypothesis
        if not ended:
          rescored.append((row, number, hypothesis))
        rows.append([hypothesis, float(score) + prefix_log_probs[row]])
      candidates.append(rows)
    if rescored:
      whole = translator.score_batch(
        [sources[row] for row, _, _ in rescored],
        [hypothesis for _, _, hypothesis in rescored],
        max_batch_size=max_batch_size,
        max_input_length=0,
      )
      for (row, number, _), result in zip(rescored, whole):
        candidates[row][number][1] = float(np.sum(result.log_probs, dtype=np.float64))
    for job, rows in zip(group, candidates):
      if options.sampling and options.sampling_topk == 1:
        rows = rows * options.candidates  # Asked once (see search_options): every draw is it.
      found[job.index] = _ranked(codec, rows, options)
  return found


# The end token CTranslate2 returns with return_end_token=True: a hypothesis without it was cut
# at max_decoding_length (ours ends it with a forced EOS there).
END_PIECE = '</s>'


def _calls(jobs: list[batches.Job]) -> list[tuple[int, list[batches.Job]]]:
  """Jobs by (output cap, EOS counted; whether they have a prefix), smallest cap first.
  CTranslate2 takes one cap per call; and given any prefix, its beam search treats a sentence
  without one as having an empty one (EOS first only as the best candidate, its issue #277):
  sentences without a prefix are decoded apart, as without prefixes."""
  calls: dict[tuple[int, bool], list[batches.Job]] = {}
  for job in jobs:
    calls.setdefault((job.cap, job.prefix is not None), []).append(job)
  return [(cap, calls[cap, prefixed]) for cap, prefixed in sorted(calls)]


def search_options(options: DecodingOptions, max_len: int, cap: int) -> dict:
  """`translate_batch` keywords that search as `options` (checked) for outputs of at most `cap`
  tokens, EOS counted: log-prob scores (length_penalty=0, greedy too: it would divide by the
  length), the end token kept, the cap without the EOS (CTranslate2's counts the prefix, as
  ours); sampling's top-k (0: the whole vocabulary in both), nucleus and temperature as ours."""
  search = translation_options(max_len, 1 if options.sampling else options.beam_size)
  search.update(
    max_decoding_length=cap - 1,
    return_scores=True,
    length_penalty=0.0,
    return_end_token=True,
    # CTranslate2 refuses num_hypotheses > 1 at sampling_topk=1 (greedy): one, repeated.
    num_hypotheses=1 if options.sampling and options.sampling_topk == 1 else options.candidates,
  )
  if options.sampling:
    search.update(
      sampling_topk=options.sampling_topk,  # 0: the whole vocabulary, as ours.
      sampling_topp=float(options.sampling_topp),
      sampling_temperature=float(options.sampling_temperature),
    )
  return search


def _prefix_log_probs(translator, sources, prefixes, max_batch_size: int) -> list[float]:
  """log P(prefix pieces | source) per row (0 without a prefix): the part of a hypothesis'
  log-prob CTranslate2's scores leave out. score_batch also scores an EOS after the prefix:
  dropped."""
  totals = [0.0] * len(sources)
  rows = [row for row, prefix in enumerate(prefixes) if prefix]
  if rows:
    results = translator.score_batch(
      [sources[row] for row in rows],
      [prefixes[row] for row in rows],
      max_batch_size=max_batch_size,
      max_input_length=0,
    )
    for row, result in zip(rows, results):
      totals[row] = float(np.sum(result.log_probs[: len(prefixes[row])], dtype=np.float64))
  return totals


def _ranked(codec: _Pieces, rows: list, options: DecodingOptions) -> list[Hypothesis]:
  """Hypotheses ranked by score (log_prob over the GNMT penalty, EOS counted), best first (a
  stable sort: CTranslate2's order in ties), cut to num_hypotheses."""
  candidates = []
  for pieces, log_prob in rows:
    tokens = len(pieces) + 1
    candidates.append(
      Hypothesis(
        text=codec.decode(pieces),
        log_prob=log_prob,
        score=log_prob / host_length_penalty(tokens, options.alpha),
        tokens=tokens,
      )
    )
  candidates.sort(key=lambda h: -h.score)
  return candidates[: options.num_hypotheses]


def score(
  translator,
  sentencepiece,
  sources: Sequence[str],
  targets: Sequence[str],
  *,
  max_len: int,
  per_token: bool = False,
  max_batch_size: int = 64,
  target_sentencepiece=None,
) -> list[dict]:
  """CTranslate2's `score_batch` of each (source, target) pair as `inference.Translator.score`
  returns it: {'log_prob', 'tokens' (EOS counted), 'mean', 'token_log_probs' with per_token};
  the same checks (a target over max_len tokens refused, a longer source cut). sentencepiece
  as `translate`'s; target_sentencepiece segments the targets (None: sentencepiece)."""
  codec = _Pieces(sentencepiece)
  targets_codec = codec if target_sentencepiece is None else _Pieces(target_sentencepiece)
  pairs = scoring.encode_pairs(sources, targets, codec, targets_codec, max_len)
  pieces = lambda ids: codec.pieces(ids[:-1])  # noqa: E731
  results = translator.score_batch(
    [pieces(source) for source, _ in pairs],
    [pieces(target) for _, target in pairs],
    max_batch_size=max_batch_size,
    max_input_length=0,
  )
  scored = []
  for result in results:
    total = float(np.sum(result.log_probs, dtype=np.float64))
    count = len(result.log_probs)
    entry = {'log_prob': total, 'tokens': count, 'mean': total / count}
    if per_token:
      entry['token_log_probs'] = [float(value) for value in result.log_probs]
    scored.append(entry)
  return scored
