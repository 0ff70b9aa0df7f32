"""evaluate's inputs and scores: line splitting as references need it, pipes, sacreBLEU."""

import os
import threading

import pytest
import sacrebleu

from transformer_jax.metrics import score
from transformer_jax.text_io import read_lines


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
