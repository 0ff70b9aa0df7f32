"""Running a CTranslate2 export as ours decodes (the server's CTranslate2 engine and the
agreement tests use it): translation options, GNMT re-ranking of CTranslate2's hypotheses, and
the one import of the optional `ctranslate2` package (`import_ctranslate2`).

This module runs with transformer_jax installed; the export itself is
`exporters.ctranslate2_spec`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from transformer_jax.common.errors import UserInputError
from transformer_jax.inference.decoding import EXTRA_DECODE_LENGTH


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

  translator: a `ctranslate2.Translator`; sentencepiece: the exported SentencePiece processor.
  Blank sentences give empty translations, as ours.
  """
  outputs = [''] * len(sentences)
  rows = [i for i, sentence in enumerate(sentences) if sentence.strip()]
  if not rows:
    return outputs
  source = {i: sentencepiece.encode(sentences[i], out_type=str) for i in rows}
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
      outputs[index] = sentencepiece.decode(best)
  return outputs
