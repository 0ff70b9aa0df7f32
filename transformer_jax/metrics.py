"""Translation quality: sacreBLEU's corpus BLEU and chrF on detokenized text, exact match, and
the `evaluate` command's work (translate a test set, score it, keep the hypotheses).
"""

from __future__ import annotations

import time

import sacrebleu

from transformer_jax import text_io
from transformer_jax.errors import UserInputError
from transformer_jax.inference import Translator, check_decoding_options
from transformer_jax.workdir import Workdir


def score(hypotheses: list[str], references: list[str]) -> dict:
  """sacreBLEU corpus BLEU and chrF (default settings: 13a tokenization, mixed case)."""
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(hypotheses, [references])
  chrf_score = chrf.corpus_score(hypotheses, [references])
  return {
    'bleu': bleu_score.score,
    'chrf': chrf_score.score,
    'bleu_text': str(bleu_score),
    'chrf_text': str(chrf_score),
    'bleu_signature': str(bleu.get_signature()),
    'chrf_signature': str(chrf.get_signature()),
  }


def translation_metrics(references: list[str], hypotheses: list[str]) -> dict[str, float]:
  """Exact match and sacreBLEU corpus BLEU / chrF of detokenized hypotheses."""
  scores = score(hypotheses, references)
  hits = sum(h == r for h, r in zip(hypotheses, references))
  return {
    'exact_match': hits / max(len(references), 1),
    'bleu': scores['bleu'],
    'chrf': scores['chrf'],
  }


def evaluate(
  translator: Translator,
  sources: list[str],
  references: list[str],
  *,
  beam_size: int = 4,
  alpha: float = 0.6,
  progress: bool = False,
) -> tuple[list[str], dict]:
  """(hypotheses, `score` of them plus 'seconds') for aligned sources and references.

  progress: reports the sentences translated with rate and ETA (`Translator.translate`).
  """
  if len(sources) != len(references):
    raise UserInputError(f'{len(sources)} source lines but {len(references)} reference lines')
  start = time.time()
  hypotheses = translator.translate(sources, beam_size=beam_size, alpha=alpha, progress=progress)
  result = score(hypotheses, references)
  result['seconds'] = time.time() - start
  return hypotheses, result


def evaluate_files(
  workdir: str,
  src: str,
  ref: str,
  *,
  out: str | None = None,
  checkpoint: int | str | None = None,
  beam_size: int = 4,
  alpha: float = 0.6,
  batch_size: int = 64,
) -> dict:
  """The `evaluate` command: translates `src`, scores it against `ref`, writes the hypotheses
  (to `out`, default in the workdir); returns `score`'s dict plus 'seconds', 'sentences' and
  'hypotheses_file' (the file written)."""
  check_decoding_options(beam_size, alpha, batch_size)
  sources, references = text_io.read_lines(src, '--src'), text_io.read_lines(ref, '--ref')
  if len(sources) != len(references):
    raise UserInputError(f'{src} has {len(sources)} lines but {ref} has {len(references)}')
  # Before the test set is translated: the hypotheses must have somewhere to go.
  if out:
    text_io.check_writable_output(out, '--out')
  else:
    out = Workdir(workdir).hypotheses_file(src, checkpoint, beam_size, alpha)
    text_io.check_writable_output(out, '--out', make_folders=True)
  translator = Translator.from_checkpoint(workdir, checkpoint, batch_size)
  hypotheses, result = evaluate(
    translator, sources, references, beam_size=beam_size, alpha=alpha, progress=True
  )
  text_io.write_lines(hypotheses, out, flag='--out')
  return dict(result, sentences=len(hypotheses), hypotheses_file=out)
