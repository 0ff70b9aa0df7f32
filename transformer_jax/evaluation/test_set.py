"""Scoring a test set: the `evaluate` command's work (translate sources with a workdir's model,
score the hypotheses against references with `evaluation.metrics`, keep the hypotheses)."""

from __future__ import annotations

import time

from transformer_jax.common import paths, text_io
from transformer_jax.common.errors import UserInputError
from transformer_jax.evaluation.metrics import (
  bleu_is_meaningful,
  exact_match_by_category,
  format_categories,
  score,
  sentence_categories,
)
from transformer_jax.inference.translator import Translator, check_decoding_options
from transformer_jax.workdir.layout import Workdir


def evaluate(
  translator: Translator,
  sources: list[str],
  references: list[str],
  *,
  beam_size: int = 4,
  alpha: float = 0.6,
  progress: bool = False,
  dataset: str | None = None,
  beam_rule: str = 'exact',
) -> tuple[list[str], dict]:
  """(hypotheses, `score` of them plus 'seconds', 'sentences', 'exact_match', 'exact_matches',
  'bleu_reported' and, where the task defines categories, 'by_category' (see
  `exact_match_by_category`)) for aligned sources and references.

  dataset: the config.dataset the model was trained on, which says which scores mean something.
  progress: reports the sentences translated with rate and ETA (`Translator.translate`).
  """
  if isinstance(sources, str) or isinstance(references, str):
    # A str is a sequence too: it would be scored letter by letter.
    raise UserInputError('metrics.evaluate takes lists of sentences, got a single str')
  if len(sources) != len(references):
    raise UserInputError(f'{len(sources)} source lines but {len(references)} reference lines')
  if not sources:
    raise UserInputError('no sentences: nothing to evaluate')
  # A file's byte order mark read as text (open(FILE, encoding='utf-8')) changes no score.
  sources = text_io.without_byte_order_mark(sources)
  references = text_io.without_byte_order_mark(references)
  start = time.time()
  hypotheses = translator.translate(
    sources, beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, progress=progress
  )
  result = score(hypotheses, references)
  result['seconds'] = time.time() - start
  result['sentences'] = len(hypotheses)
  result['exact_matches'] = sum(h == r for h, r in zip(hypotheses, references))
  result['exact_match'] = result['exact_matches'] / max(len(references), 1)
  result['bleu_reported'] = dataset is None or bleu_is_meaningful(dataset)
  categories = sentence_categories(dataset, sources) if dataset else None
  if categories is not None:
    result['by_category'] = exact_match_by_category(references, hypotheses, categories)
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
  beam_rule: str = 'exact',
) -> dict:
  """The `evaluate` command: translates `src`, scores it against `ref`, writes the hypotheses
  (to `out`, default in the workdir); returns `evaluate`'s dict plus 'hypotheses_file' (the
  file written)."""
  check_decoding_options(beam_size, alpha, batch_size, beam_rule)
  sources, references = text_io.read_lines(src, '--src'), text_io.read_lines(ref, '--ref')
  for flag, path, lines in (('--src', src, sources), ('--ref', ref, references)):
    if not lines:
      raise UserInputError(f'{flag}={path} is empty: nothing to evaluate')
  if len(sources) != len(references):
    raise UserInputError(f'{src} has {len(sources)} lines but {ref} has {len(references)}')
  # Before the test set is translated: the hypotheses must have somewhere to go.
  if out:
    text_io.check_writable_output(out, '--out')
  else:
    out = Workdir(workdir).hypotheses_file(src, checkpoint, beam_size, alpha, beam_rule)
    text_io.check_writable_output(out, '--out', make_folders=True)
  paths.check_outputs_apart(
    {'--out': out},
    {'--src': src, '--ref': ref},
    {'--workdir': workdir},
    run_outputs=(Workdir(workdir).hypotheses_folder,),
  )
  translator = Translator.from_checkpoint(workdir, checkpoint, batch_size)
  saved = Workdir(workdir).read_run_config_if_present() or {}
  dataset = saved.get('config', {}).get('dataset')
  hypotheses, result = evaluate(
    translator,
    sources,
    references,
    beam_size=beam_size,
    alpha=alpha,
    progress=True,
    dataset=dataset if isinstance(dataset, str) else None,
    beam_rule=beam_rule,
  )
  text_io.write_lines(hypotheses, out, flag='--out')
  return dict(result, hypotheses_file=out)


def report_lines(result: dict) -> list[str]:
  """What `evaluate` prints: exact match (by category where defined), BLEU where it means
  something, chrF, with sacreBLEU's signatures."""
  lines = [
    f'exact match {100 * result["exact_match"]:.2f}% '
    f'({result["exact_matches"]:,}/{result["sentences"]:,})'
  ]
  if 'by_category' in result:
    lines += format_categories(result['by_category'])
  if result['bleu_reported']:
    lines += [result['bleu_text'], f'  signature: {result["bleu_signature"]}']
  else:
    lines.append('BLEU not reported: most outputs of this task are one word, with no 4-grams')
  lines += [result['chrf_text'], f'  signature: {result["chrf_signature"]}']
  return lines
