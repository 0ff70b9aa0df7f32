"""Progress reports: the text of the periodic lines (fake clock), the terminal bar, and the
reports of vocabulary training, tokenizing, averaging and translating files."""

import io
import logging
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import optax
import pytest
from flax.training import train_state

from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common import progress
from transformer_jax.common.progress import Progress
from transformer_jax.data import input_pipeline, number_words
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.evaluation import test_set
from transformer_jax.inference import text_files
from transformer_jax.inference import translator as inference_translator

from conftest import random_weight_translator


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


class Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


class NotTerminal(io.StringIO):
  def isatty(self) -> bool:
    return False


def _logged(caplog) -> list[str]:
  """Lines logged through common.log.log (absl, process 0)."""
  return [r.getMessage() for r in caplog.records if r.filename == 'log.py']


@pytest.fixture
def every_update(monkeypatch):
  """Every update logs a line: the counts of each step are visible to the test."""
  monkeypatch.setattr(progress, 'INTERVAL_S', 0.0)


def test_log_lines_every_interval_with_count_rate_and_eta():
  clock, lines = FakeClock(), []
  bar = Progress(
    total=5000,
    unit='pairs',
    description='tokenizing train',
    interval=30,
    clock=clock,
    log=lines.append,
    stream=NotTerminal(),
    enabled=True,
  )
  for _ in range(100):  # 20 pairs a second for 100 s.
    clock.now += 1
    bar.update(20)
  assert lines == [
    'tokenizing train: 600/5,000 pairs (12%) | 20 pairs/s | elapsed 00:30 | ETA 03:40',
    'tokenizing train: 1,200/5,000 pairs (24%) | 20 pairs/s | elapsed 01:00 | ETA 03:10',
    'tokenizing train: 1,800/5,000 pairs (36%) | 20 pairs/s | elapsed 01:30 | ETA 02:40',
  ]
  clock.now += 150  # Slower now: the rate is the average since the start.
  bar.update(3000)
  bar.close()
  bar.close()  # Idempotent: one final line.
  assert lines[3:] == [
    'tokenizing train: 5,000/5,000 pairs (100%) | 20 pairs/s | elapsed 04:10 | ETA 00:00',
    'tokenizing train: 5,000/5,000 pairs (100%) | 20 pairs/s | done in 04:10',
  ]


def test_lines_without_total_with_bytes_and_with_initial():
  clock, lines = FakeClock(), []
  common = dict(clock=clock, log=lines.append, stream=NotTerminal(), enabled=True, interval=10)
  with Progress(unit='checkpoints', description='averaging', **common) as bar:
    clock.now += 40
    bar.update(2)
  with Progress(total=3_000_000, unit='B', unit_scale=True, description='staging', **common) as bar:
    clock.now += 10
    bar.update(1_500_000)
  with Progress(total=10, initial=4, unit='sentences', **common) as bar:
    clock.now += 3
    bar.update(3)  # 3 in 3 s: the 4 counted from the start are not part of the rate.
  assert lines == [
    'averaging: 2 checkpoints | 0.05 checkpoints/s | elapsed 00:40',
    'averaging: 2 checkpoints | 0.05 checkpoints/s | done in 00:40',
    'staging: 1.50MB/3.00MB (50%) | 150kB/s | elapsed 00:10 | ETA 00:10',
    'staging: 1.50MB/3.00MB (50%) | 150kB/s | done in 00:10',
    '7/10 sentences (70%) | 1 sentences/s | done in 00:03',
  ]


def test_an_error_ends_the_report_without_a_final_line():
  lines = []
  with pytest.raises(ValueError):
    with Progress(total=3, log=lines.append, stream=NotTerminal(), enabled=True) as bar:
      bar.update()
      raise ValueError('stop')
  assert lines == []


def test_iterating_counts_each_item():
  clock, lines = FakeClock(), []
  items = progress.progress(
    ['a', 'b', 'c'], unit='files', clock=clock, log=lines.append, enabled=True, interval=0
  )
  assert items.total == 3
  seen = []
  for item in items:
    clock.now += 2
    seen.append(item)
  assert seen == ['a', 'b', 'c']
  assert [line.split(' | ')[0] for line in lines] == [
    '1/3 files (33%)',
    '2/3 files (67%)',
    '3/3 files (100%)',
    '3/3 files (100%)',
  ]
  assert lines[-1] == '3/3 files (100%) | 0.5 files/s | done in 00:06'


def test_terminal_gets_a_tqdm_bar_and_no_log_lines():
  stream, lines = Terminal(), []
  bar = Progress(total=3, unit='sentences', description='translating', stream=stream,
                 log=lines.append, enabled=True)  # fmt: skip
  assert isinstance(bar._bar, progress.tqdm)
  bar.update(2)
  bar.update(1)
  bar.close()
  assert lines == []
  assert 'translating' in stream.getvalue()
  assert '3/3' in stream.getvalue()
  # Not a terminal: no tqdm, lines instead.
  bar = Progress(total=3, stream=NotTerminal(), log=lines.append, enabled=True)
  assert bar._bar is None


def test_only_process_zero_reports(monkeypatch):
  lines, stream = [], Terminal()
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  with Progress(total=2, stream=stream, log=lines.append, interval=0) as bar:
    bar.update(2)
  assert bar.n == 2  # Counted all the same.
  assert lines == [] and stream.getvalue() == ''


def test_vocabulary_training_reports_sentences_then_training(caplog, every_update):
  caplog.set_level(logging.INFO, logger='absl')
  sentences = [number_words.english_words(n) for n in range(0, 3000, 7)]  # 429
  quiet = Tokenizer.train(sentences, vocab_size=60)
  assert _logged(caplog) == []
  reported = Tokenizer.train(sentences, vocab_size=60, report=True, total=len(sentences))
  assert reported.fingerprint == quiet.fingerprint  # Reporting changes nothing.
  lines = _logged(caplog)
  assert lines[0].startswith('vocabulary: reading sentences: 1/429 sentences (0%)')
  assert lines[-3].startswith('vocabulary: reading sentences: 429/429 sentences (100%)')
  assert 'done in' in lines[-3]
  assert lines[-2] == 'training the 60-piece vocabulary on 429 sentences'
  assert re.fullmatch(r'vocabulary trained in \dm\d\ds', lines[-1])
  # More sentences than SentencePiece keeps: reading ends at its limit, as does the total.
  caplog.clear()
  capped = Tokenizer.train(sentences, vocab_size=60, max_sentences=300, report=True, total=429)
  lines = _logged(caplog)
  assert lines[-3].startswith('vocabulary: reading sentences: 300/300 sentences (100%)')
  assert lines[-2] == 'training the 60-piece vocabulary on 300 sentences'
  first = Tokenizer.train(sentences[:300], vocab_size=60, max_sentences=300)
  assert capped.fingerprint == first.fingerprint  # SentencePiece kept the first 300.


class _Source(list):
  """A tfds-like random-access source."""

  def __getitems__(self, indices):
    return [self[i] for i in indices]


def test_tokenizing_reports_pairs_by_chunk(caplog, every_update, monkeypatch, tmp_path):
  caplog.set_level(logging.INFO, logger='absl')
  monkeypatch.setattr(input_pipeline, '_TOKENIZE_CHUNK', 40)
  source = _Source(
    {'en': number_words.english_words(n), 'de': number_words.german_words(n)} for n in range(100)
  )
  tokenizer = Tokenizer.train([e['en'] for e in source] + [e['de'] for e in source], vocab_size=60)
  config = ml_collections.ConfigDict({'data': {'src_lang': 'en', 'tgt_lang': 'de'}})
  cache = str(tmp_path / 'number_words_tiny-train.npz')
  split = input_pipeline.TokenizedSplit.build(source, tokenizer, config, cache)
  assert len(split) == 100
  assert [line.split(' | ')[0] for line in _logged(caplog)] == [
    'tokenizing number_words_tiny-train: 40/100 pairs (40%)',
    'tokenizing number_words_tiny-train: 80/100 pairs (80%)',
    'tokenizing number_words_tiny-train: 100/100 pairs (100%)',
    'tokenizing number_words_tiny-train: 100/100 pairs (100%)',
  ]
  caplog.clear()
  input_pipeline.TokenizedSplit.build(source, tokenizer, config, cache)
  assert _logged(caplog) == []  # Loaded from the cache: nothing to report.


class _TrainState(train_state.TrainState):
  dropout_rng: jax.Array


def test_averaging_reports_each_checkpoint_read(tmp_path, caplog, every_update):
  caplog.set_level(logging.INFO, logger='absl')
  with Checkpointer(os.path.join(tmp_path, 'checkpoints'), keep=None) as checkpointer:
    for step in (1, 2, 3):
      state = _TrainState.create(
        apply_fn=None,
        params={'w': jnp.full((2,), float(step))},
        tx=optax.sgd(0.1),
        dropout_rng=jax.random.PRNGKey(step),
      )
      checkpointer.save(step, state.replace(step=jnp.asarray(step)), {'position': step})
  assert average_checkpoints(str(tmp_path), last=2)['averaged_steps'] == [2, 3]
  lines = [line for line in _logged(caplog) if line.startswith('averaging')]
  directory = os.path.join(tmp_path, 'checkpoints')
  assert [line.split(' | ')[0] for line in lines] == [
    f'averaging {directory}: 1/2 steps (50%)',
    f'averaging {directory}: 2/2 steps (100%)',
    f'averaging {directory}: 2/2 steps (100%)',
  ]
  assert 'done in' in lines[-1]


@pytest.fixture(scope='module')
def translator():
  return random_weight_translator()  # batch_size 8


# 18 sentences and 2 blank lines: batches of 8, 8 and 2 after the blank lines.
LINES = [number_words.english_words(n) for n in range(100, 118)]
LINES[3:3] = ['']
LINES.append('  ')


def test_translate_reports_sentences_by_batch_only_when_asked(translator, caplog, every_update):
  caplog.set_level(logging.INFO, logger='absl')
  quiet = translator.translate(LINES, beam_size=1)
  assert _logged(caplog) == []  # The default (and so training's periodic evaluation): quiet.
  assert translator.translate(LINES, beam_size=1, progress=True) == quiet
  lines = _logged(caplog)
  assert [line.split(' | ')[0] for line in lines] == [
    'translating: 10/20 sentences (50%)',
    'translating: 18/20 sentences (90%)',
    'translating: 20/20 sentences (100%)',
    'translating: 20/20 sentences (100%)',
  ]
  assert re.fullmatch(r'translating: 20/20 sentences \(100%\) \| [\d.,]+ sentences/s \| done in '
                      r'\d\d:\d\d', lines[-1])  # fmt: skip


def test_translate_and_evaluate_files_report(translator, caplog, monkeypatch, tmp_path):
  caplog.set_level(logging.INFO, logger='absl')
  monkeypatch.setattr(inference_translator.Translator, 'from_checkpoint', lambda *args: translator)
  source = tmp_path / 'source.txt'
  source.write_text('\n'.join(LINES) + '\n')
  output = tmp_path / 'output.txt'
  text_files.translate_text('unused', beam_size=1, input_path=str(source), output_path=str(output))
  assert len(output.read_text().splitlines()) == 20
  (line,) = _logged(caplog)
  assert line.startswith('translating: 20/20 sentences (100%)')
  # Typed at a terminal: one line at a time, no report.
  caplog.clear()
  stdin = _TypedLines([b'one\n', b'two\n'])
  out = io.StringIO()
  text_files.translate_text('unused', beam_size=1, stdin=stdin, stdout=out)
  assert len(out.getvalue().splitlines()) == 2
  assert _logged(caplog) == []
  # evaluate: the test set's sentences.
  caplog.clear()
  result = test_set.evaluate_files(
    'unused', str(source), str(source), out=str(tmp_path / 'hyp.txt'), beam_size=1
  )
  assert result['sentences'] == 20
  (line,) = _logged(caplog)
  assert line.startswith('translating: 20/20 sentences (100%)')


class _TypedLines(list):
  def isatty(self) -> bool:
    return True
