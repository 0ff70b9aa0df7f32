"""Translation quality: sacreBLEU's corpus BLEU and chrF on detokenized text, exact match (by
category where the task defines categories), and the `evaluate` command's work (translate a
test set, score it, keep the hypotheses).

Which scores mean something depends on the task: on the embedded number-words task most outputs
are one word, which has no 4-grams, so BLEU is not reported; exact match per category is.
"""

from __future__ import annotations

import time

import sacrebleu

from transformer_jax import text_io
from transformer_jax.data import number_words
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


def is_number_words(dataset: str) -> bool:
  """Whether `dataset` (a config.dataset value) is the embedded number-words task."""
  return dataset.split('/')[0] == 'number_words'


def bleu_is_meaningful(dataset: str) -> bool:
  """BLEU is reported except on number words: one-word outputs have no 4-grams (BLEU 0.00)."""
  return not is_number_words(dataset)


def sentence_categories(dataset: str, sources: list[str]) -> list[str | None] | None:
  """Each source sentence's category where the task defines them, else None.

  Number words: `number_words.category_of_sentence` (None for a line that is no number).
  """
  if not is_number_words(dataset):
    return None
  return [number_words.category_of_sentence(source) for source in sources]


def exact_match_by_category(
  references: list[str], hypotheses: list[str], categories: list[str | None]
) -> dict[str, tuple[int, int]]:
  """{category: (exact matches, sentences)} in number_words.CATEGORIES order, only those seen;
  sentences of no category are counted under 'none'."""
  counts: dict[str, list[int]] = {}
  for reference, hypothesis, category in zip(references, hypotheses, categories, strict=True):
    hits_total = counts.setdefault(category or 'none', [0, 0])
    hits_total[0] += reference == hypothesis
    hits_total[1] += 1
  order = [*number_words.CATEGORIES, 'none']
  return {name: tuple(counts[name]) for name in order if name in counts}


def format_categories(by_category: dict[str, tuple[int, int]]) -> list[str]:
  """One aligned line per category: name, exact match %, hits/sentences, what it holds."""
  lines = []
  for name, (hits, total) in by_category.items():
    meaning = number_words.CATEGORIES.get(name, 'not a number written in words')
    lines.append(f'  {name:<12} {100 * hits / total:7.2f}%  {hits:>5,}/{total:<5,}  {meaning}')
  return lines


def translation_metrics(
  references: list[str],
  hypotheses: list[str],
  *,
  categories: list[str | None] | None = None,
  with_bleu: bool = True,
) -> dict[str, float]:
  """Exact match, sacreBLEU corpus chrF and (with_bleu) BLEU of detokenized hypotheses; with
  `categories` (one per sentence) also 'exact_match/<category>' for each category present."""
  scores = score(hypotheses, references)
  hits = sum(h == r for h, r in zip(hypotheses, references))
  result = {'exact_match': hits / max(len(references), 1)}
  if with_bleu:
    result['bleu'] = scores['bleu']
  result['chrf'] = scores['chrf']
  if categories is not None:
    by_category = exact_match_by_category(references, hypotheses, categories)
    for name, (category_hits, sentences) in by_category.items():
      result[f'exact_match/{name}'] = category_hits / sentences
  return result


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
  if len(sources) != len(references):
    raise UserInputError(f'{src} has {len(sources)} lines but {ref} has {len(references)}')
  # Before the test set is translated: the hypotheses must have somewhere to go.
  if out:
    text_io.check_writable_output(out, '--out')
  else:
    out = Workdir(workdir).hypotheses_file(src, checkpoint, beam_size, alpha, beam_rule)
    text_io.check_writable_output(out, '--out', make_folders=True)
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
