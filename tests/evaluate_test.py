"""evaluate's inputs and scores: line splitting as references need it, pipes, sacreBLEU."""

import os
import threading

import pytest
import sacrebleu

from transformer_jax.common.text_io import read_lines
from transformer_jax.evaluation import metrics, test_set
from transformer_jax.evaluation.metrics import score


def test_read_lines_keeps_empty_lines_and_strips_crlf(tmp_path):
  path = tmp_path / 'ref.de'
  path.write_bytes(b'eins\r\n\nzwei\nletzte')  # CRLF, an empty line, no final newline.
  assert read_lines(str(path)) == ['eins', '', 'zwei', 'letzte']
  path.write_bytes(b'eins\n\n')  # The final newline ends a line; it does not start one.
  assert read_lines(str(path)) == ['eins', '']


@pytest.mark.skipif(not hasattr(os, 'mkfifo'), reason='no named pipes on this platform')
def test_read_lines_reads_a_pipe(tmp_path):
  """As bash's `--src=<(sacrebleu -t wmt14 ... --echo src)` passes one."""
  fifo = str(tmp_path / 'pipe')
  os.mkfifo(fifo)

  def write():
    with open(fifo, 'wb') as f:
      f.write('größer\nzwei\n'.encode())

  writer = threading.Thread(target=write, daemon=True)  # Never blocks the exit if unread.
  writer.start()
  try:
    assert read_lines(fifo) == ['größer', 'zwei']
  finally:
    writer.join(timeout=10)


def test_score_is_sacrebleus_corpus_score():
  hypotheses = ['ein Hund läuft im Park', 'zwei Katzen schlafen']
  references = ['ein Hund rennt im Park', 'zwei Katzen schlafen']
  result = score(hypotheses, references)
  assert result['bleu'] == pytest.approx(
    sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9
  )
  assert result['chrf'] == pytest.approx(
    sacrebleu.corpus_chrf(hypotheses, [references]).score, abs=1e-9
  )
  assert 0 < result['bleu'] < 100
  assert result['bleu_signature'].startswith('nrefs:1|case:mixed|eff:no|tok:13a')


def test_exact_match_by_category_counts_each_category_in_order():
  references = ['null', 'eins', 'zweitausend', 'zweitausend', 'x', 'elf']
  hypotheses = ['null', 'eine', 'zweitausend', 'zweitausendzwei', 'x', 'elf']
  categories = ['zero', 'units', 'round', 'round', None, 'teens']
  assert metrics.exact_match_by_category(references, hypotheses, categories) == {
    'zero': (1, 1),
    'units': (0, 1),
    'teens': (1, 1),
    'round': (1, 2),
    'none': (1, 1),
  }
  with pytest.raises(ValueError):  # One category per sentence, no fewer.
    metrics.exact_match_by_category(references, hypotheses, categories[:-1])


def test_translation_metrics_by_category_and_without_bleu():
  references, hypotheses = ['null', 'zweitausend', 'zweitausend'], ['null', 'zweitausend', 'x']
  result = metrics.translation_metrics(
    references, hypotheses, categories=['zero', 'round', 'round'], with_bleu=False
  )
  assert result == {
    'exact_match': pytest.approx(2 / 3),
    'chrf': pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score),
    'exact_match/zero': 1.0,
    'exact_match/round': 0.5,
  }
  assert 'bleu' in metrics.translation_metrics(references, hypotheses)


def test_which_tasks_report_bleu_and_categories():
  assert not metrics.bleu_is_meaningful('number_words')
  assert not metrics.bleu_is_meaningful('number_words/tiny')
  assert metrics.bleu_is_meaningful('text') and metrics.bleu_is_meaningful('wmt14_translate')
  sources = ['one thousand', 'zero', 'a cat']
  assert metrics.sentence_categories('number_words', sources) == ['round', 'zero', None]
  assert metrics.sentence_categories('text', sources) is None


class _Echo:
  """Stands in for a Translator: 'translates' by looking the source up."""

  def __init__(self, table):
    self.table = table

  def translate(self, sentences, beam_size, alpha, beam_rule, progress):
    return [self.table[s] for s in sentences]


def test_evaluate_report_on_number_words_has_categories_and_no_bleu():
  sources, references = (
    ['one thousand', 'two thousand', 'one'],
    ['eintausend', 'zweitausend', 'eins'],
  )
  translator = _Echo(dict(zip(sources, ['eintausendeins', 'zweitausend', 'eins'])))
  _, result = test_set.evaluate(translator, sources, references, dataset='number_words')
  assert result['exact_matches'] == 2 and result['sentences'] == 3
  assert result['by_category'] == {'units': (1, 1), 'round': (1, 2)}
  lines = test_set.report_lines(result)
  assert lines[0] == 'exact match 66.67% (2/3)'
  assert lines[1].split() == ['units', '100.00%', '1/1', '1-9']
  assert lines[2].split()[:3] == ['round', '50.00%', '1/2']
  assert lines[3].startswith('BLEU not reported')
  assert lines[4].startswith('chrF2 = ') and lines[5].startswith('  signature: nrefs:1')


def test_evaluate_report_elsewhere_has_bleu_and_no_categories():
  sources, references = ['a', 'b'], ['ein Hund rennt im Park', 'zwei Katzen schlafen']
  translator = _Echo({'a': 'ein Hund läuft im Park', 'b': 'zwei Katzen schlafen'})
  hypotheses, result = test_set.evaluate(translator, sources, references, dataset='text')
  assert 'by_category' not in result
  lines = test_set.report_lines(result)
  assert lines[0] == 'exact match 50.00% (1/2)'
  expected = sacrebleu.corpus_bleu(hypotheses, [references])
  assert lines[1] == str(expected) and lines[2].startswith('  signature: nrefs:1|case:mixed')
  assert lines[3].startswith('chrF2 = ')


def test_tokenized_lowercase_bleu_is_multi_bleu_on_moses_tokens():
  """Papers' Multi30k figure: case and the tokenizer's splits do not count, words do."""
  references = ['Ein Mann mit einem Hut, der etwas anstarrt.', 'Zwei Hunde spielen im Schnee.']
  # Lowercased output with punctuation glued differently: the same tokens after Moses.
  relaxed = ['ein mann mit einem hut , der etwas anstarrt .', 'zwei hunde spielen im schnee .']
  tokenized = metrics.tokenized_lowercase_bleu(relaxed, references, 'de')
  assert tokenized.score == pytest.approx(100.0)
  # sacreBLEU's cased, detokenized BLEU sees the case and gives far less.
  assert score(relaxed, references)['bleu'] < 50
  # A different word counts: the figure is BLEU over the tokens written out by hand.
  changed = ['ein mann mit einem hut , der etwas ansieht .', 'zwei hunde spielen im schnee .']
  expected = sacrebleu.metrics.BLEU(tokenize='none').corpus_score(
    changed, [['ein mann mit einem hut , der etwas anstarrt .', 'zwei hunde spielen im schnee .']]
  )
  assert metrics.tokenized_lowercase_bleu(changed, references, 'de').score == pytest.approx(
    expected.score, abs=1e-9
  )
  assert 0 < expected.score < 100


def test_evaluate_reports_the_comparable_bleu_where_the_language_is_known():
  sources, references = ['a', 'b'], ['Ein Hund rennt im Park.', 'Zwei Katzen schlafen.']
  translator = _Echo({'a': 'ein hund rennt im park .', 'b': 'Zwei Katzen schlafen.'})
  _, result = test_set.evaluate(translator, sources, references, dataset='text', language='de')
  assert result['bleu_tokenized_lowercase'] == pytest.approx(100.0)
  assert result['bleu'] < 100
  lines = test_set.report_lines(result)
  assert lines[3].startswith('comparable with papers: BLEU = 100.00')
  assert 'Moses-tokenized (de)' in lines[4]
  # Without the language (or on number words) the figure is left out.
  _, plain = test_set.evaluate(translator, sources, references, dataset='text')
  assert 'bleu_tokenized_lowercase' not in plain
  _, words = test_set.evaluate(
    translator, sources, references, dataset='number_words', language='de'
  )
  assert 'bleu_tokenized_lowercase' not in words
