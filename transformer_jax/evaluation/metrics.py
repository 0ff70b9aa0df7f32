"""Translation quality: sacreBLEU's corpus BLEU and chrF on detokenized text, and exact match (by
category where the task defines categories). Scoring a whole test set: `evaluation.test_set`.

Which scores mean something depends on the task: on the embedded number-words task most outputs
are one word, which has no 4-grams, so BLEU is not reported; exact match per category is.

A U+FEFF at the start of the first hypothesis or reference (a file's byte order mark, read as
text) is dropped before scoring (`text_io.without_byte_order_mark`): a BOM never changes a
score."""

from __future__ import annotations

import sacrebleu

from transformer_jax.common import text_io
from transformer_jax.data import number_words


def score(hypotheses: list[str], references: list[str], language: str | None = None) -> dict:
  """sacreBLEU corpus BLEU and chrF (default settings: 13a tokenization, mixed case) and, where
  the target `language` is known, `tokenized_lowercase_bleu`'s figure as
  'bleu_tokenized_lowercase' (with its text and description)."""
  hypotheses = text_io.without_byte_order_mark(hypotheses)
  references = text_io.without_byte_order_mark(references)
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(hypotheses, [references])
  chrf_score = chrf.corpus_score(hypotheses, [references])
  result = {
    'bleu': bleu_score.score,
    'chrf': chrf_score.score,
    'bleu_text': str(bleu_score),
    'chrf_text': str(chrf_score),
    'bleu_signature': str(bleu.get_signature()),
    'chrf_signature': str(chrf.get_signature()),
  }
  if language:
    tokenized = tokenized_lowercase_bleu(hypotheses, references, language)
    result.update(
      bleu_tokenized_lowercase=tokenized.score,
      bleu_tokenized_lowercase_text=str(tokenized),
      bleu_tokenized_lowercase_signature=TOKENIZED_LOWERCASE_BLEU.format(language=language),
    )
  return result


# How the comparable figure is made, printed beside it (papers' tables give no signature).
TOKENIZED_LOWERCASE_BLEU = (
  'lowercased, Moses-normalised and Moses-tokenized ({language}) hypotheses and references, '
  'corpus BLEU-4 on the tokens (multi-bleu.perl; sacremoses + sacreBLEU tokenize=none)'
)


def tokenized_lowercase_bleu(hypotheses: list[str], references: list[str], language: str):
  """Corpus BLEU as papers on Multi30k report it (e.g. Wu et al., ACL 2021): both sides
  lowercased, punctuation-normalised and tokenized as the dataset's preprocessing does
  (`lowercase.perl | normalize-punctuation.perl -l L | tokenizer.perl -l L`, here sacremoses),
  then BLEU-4 over the tokens with no further tokenization (what multi-bleu.perl computes).
  Not comparable with sacreBLEU's detokenized figure, which `score` reports beside it."""
  # Imported here: only evaluation needs it, and it loads its data files on import.
  from sacremoses import MosesPunctNormalizer, MosesTokenizer

  normalizer, tokenizer = MosesPunctNormalizer(lang=language), MosesTokenizer(lang=language)

  def tokens(text: str) -> str:
    return tokenizer.tokenize(normalizer.normalize(text.lower()), escape=False, return_str=True)

  bleu = sacrebleu.metrics.BLEU(tokenize='none', force=True)
  return bleu.corpus_score([tokens(h) for h in hypotheses], [[tokens(r) for r in references]])


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
  references = text_io.without_byte_order_mark(references)
  hypotheses = text_io.without_byte_order_mark(hypotheses)
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
  references = text_io.without_byte_order_mark(references)
  hypotheses = text_io.without_byte_order_mark(hypotheses)
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
