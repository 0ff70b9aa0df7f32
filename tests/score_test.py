"""Scoring given translations (`Translator.score`, `python -m transformer_jax.score`): equal to
what beam search reports for its own hypotheses, to the training evaluation's loss, to
CTranslate2's `score_batch` on the export, whatever the batch; bad input refused before work."""

import functools
import os
import subprocess
import sys

import ctranslate2
import jax
import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import number_words
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.exporters import ctranslate2_spec
from transformer_jax.inference import scoring, text_files
from transformer_jax.inference.decoding import beam_decode, teacher_forcing_inputs
from transformer_jax.inference.translator import Translator
from transformer_jax.training.step import eval_step

from conftest import REPO_ROOT

# Lengths from 2 to ~20 pieces: several length buckets on both sides.
NUMBERS = [3, 17, 42, 99, 342, 1000, 2024, 7777, 31415, 500000, 987654, 12]
SOURCES = [number_words.english_words(n) for n in NUMBERS]
TARGETS = [number_words.german_words(n) for n in NUMBERS]


@pytest.fixture(scope='module')
def translator(tiny_workdir):
  # Batches of 8 rows: the 12 pairs take two batches of different shapes.
  return Translator.from_checkpoint(tiny_workdir, batch_size=8)


@pytest.fixture(scope='module')
def scores(translator):
  return translator.score(SOURCES, TARGETS, per_token=True)


def _padded(rows, width):
  array = np.full((len(rows), width), PAD_ID, np.int32)
  for row, ids in enumerate(rows):
    array[row, : len(ids)] = ids
  return array


def test_each_result_sums_its_tokens_with_the_eos_counted(translator, scores):
  assert len(scores) == len(SOURCES)
  for target, result in zip(TARGETS, scores):
    assert result['tokens'] == len(translator.tokenizer.encode(target)) + 1
    assert len(result['token_log_probs']) == result['tokens']
    assert result['log_prob'] == pytest.approx(sum(result['token_log_probs']), abs=1e-5)
    assert result['mean'] == pytest.approx(result['log_prob'] / result['tokens'], abs=1e-9)
    assert all(value < 0 for value in result['token_log_probs'])
  assert 'token_log_probs' not in translator.score(SOURCES[:1], TARGETS[:1])[0]


def test_beam_scores_at_alpha_0_are_the_sums_of_our_log_probs(translator):
  """At alpha 0 the length penalty is 1, so beam search's score of each hypothesis it returns
  is that hypothesis's log-probability: scoring the hypotheses gives the same numbers."""
  source_ids = [translator.tokenizer.encode(s) + [EOS_ID] for s in SOURCES[:8]]
  src = _padded(source_ids, 32)
  search = jax.jit(
    functools.partial(beam_decode, translator.model, beam_size=4, alpha=0.0, max_decode_len=32)
  )
  ids, beam_scores = (np.asarray(x) for x in search(translator.params, src))
  pairs, expected = [], []
  for row in range(len(source_ids)):
    for beam in range(4):
      tokens = list(ids[row, beam])
      if EOS_ID in tokens and np.isfinite(beam_scores[row, beam]):
        pairs.append((source_ids[row], tokens[: tokens.index(EOS_ID) + 1]))
        expected.append(beam_scores[row, beam])
  print(f'{len(pairs)} finished beam hypotheses compared')
  assert len(pairs) >= 16, 'too few finished hypotheses to compare'
  mine = [r['log_prob'] for r in scoring.score_encoded(translator, pairs)]
  np.testing.assert_allclose(mine, expected, rtol=0, atol=1e-5)
  # And the best hypothesis of each sentence scores at least as high as its other three.
  per_sentence = {}
  for (source, _), value in zip(pairs, mine):
    per_sentence.setdefault(tuple(source), []).append(value)
  assert all(values[0] >= max(values) - 1e-6 for values in per_sentence.values())


def test_the_mean_nll_is_the_eval_loss_without_label_smoothing(translator):
  pairs = scoring.encode_pairs(
    SOURCES, TARGETS, translator.tokenizer, translator.target_tokenizer, 32
  )
  src = _padded([s for s, _ in pairs], 32)
  tgt = _padded([t for _, t in pairs], 32)
  evaluate = jax.jit(functools.partial(eval_step, model=translator.model, label_smoothing=0.0))
  metrics = evaluate(translator.params, {'inputs': src, 'targets': tgt})
  eval_loss = float(metrics['loss_sum'] / metrics['token_count'])
  full_vocabulary = scoring.jitted_target_log_probs(
    translator.model, translator.params, src, tgt, exclude_pad_and_bos=False
  )
  tokens = sum(len(t) for _, t in pairs)
  assert float(metrics['token_count']) == tokens
  assert -float(np.sum(full_vocabulary)) / tokens == pytest.approx(eval_loss, abs=1e-5)
  # Without PAD and BOS in the normaliser (the searches' and CTranslate2's convention) every
  # token's log-prob is log(p / (1 - p_pad - p_bos)): higher, never lower.
  without_pad = scoring.jitted_target_log_probs(translator.model, translator.params, src, tgt)
  real = tgt != PAD_ID
  assert np.all(np.asarray(without_pad)[real] > np.asarray(full_vocabulary)[real])
  # The projection's chunks of positions and blocks of the vocabulary are a speed choice: one
  # chunk and one block (the whole logits, as on accelerators), chunks of 7 rows (the last one
  # padded), and blocks of 1 (PAD's own block wholly masked), of 5 (the vocabulary 256 is no
  # multiple: the last block overlaps the one before) and of 64 give the same values.
  vocab = translator.model_config.vocab_size
  for rows_per_chunk, block in ((tgt.size, vocab), (7, 5), (tgt.size, 1), (9, 64)):
    chunked = scoring.jitted_target_log_probs(
      translator.model,
      translator.params,
      src,
      tgt,
      rows_per_chunk=rows_per_chunk,
      vocabulary_block=block,
    )
    np.testing.assert_allclose(chunked, without_pad, rtol=0, atol=1e-5)
  # And the whole logits' log-softmax, computed here directly, agrees with all of them.
  logits = translator.model.apply(
    {'params': translator.params}, src, teacher_forcing_inputs(tgt)
  )  # [b, t, v]
  never = np.isin(np.arange(vocab), [PAD_ID, BOS_ID])
  logits = np.where(never, -np.inf, np.asarray(logits, np.float64))
  direct = (
    np.take_along_axis(logits, np.asarray(tgt)[..., None], -1)[..., 0]
    - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1))
    - logits.max(-1)
  )
  np.testing.assert_allclose(np.where(real, direct, 0.0), without_pad, rtol=0, atol=1e-5)


@pytest.fixture(scope='module')
def ctranslate2_model(tiny_workdir, tmp_path_factory):
  out = ctranslate2_spec.export(tiny_workdir, str(tmp_path_factory.mktemp('ct2') / 'float32'))
  return ctranslate2.Translator(out, intra_threads=1)


def test_per_token_log_probs_equal_ctranslate2s_score_batch(translator, scores, ctranslate2_model):
  pieces = ctranslate2_spec.vocabulary(translator.tokenizer)

  def as_pieces(text):
    return [pieces[i] for i in translator.tokenizer.encode(text)]

  theirs = ctranslate2_model.score_batch(
    [as_pieces(s) for s in SOURCES], [as_pieces(t) for t in TARGETS]
  )
  largest = 0.0
  for result, mine in zip(theirs, scores):
    # CTranslate2 scores (and counts) the EOS too.
    assert len(result.log_probs) == mine['tokens']
    largest = max(largest, np.max(np.abs(np.asarray(result.log_probs) - mine['token_log_probs'])))
  print(f'largest per-token difference from CTranslate2: {largest:.2e}')
  assert largest < 1e-4


def test_scores_do_not_depend_on_the_batch_or_the_order(translator, scores):
  alone = [translator.score([s], [t], per_token=True)[0] for s, t in zip(SOURCES, TARGETS)]
  reversed_order = translator.score(SOURCES[::-1], TARGETS[::-1], per_token=True)[::-1]
  for together, single, backwards in zip(scores, alone, reversed_order):
    for other in (single, backwards):
      assert other['tokens'] == together['tokens']
      np.testing.assert_allclose(
        other['token_log_probs'], together['token_log_probs'], rtol=0, atol=1e-5
      )


def test_bad_pairs_are_one_line_errors(translator):
  with pytest.raises(UserInputError, match=r'^2 sources but 1 targets'):
    translator.score(SOURCES[:2], TARGETS[:1])
  with pytest.raises(UserInputError, match=r'^target 1 has \d+ tokens .*max_len 32'):
    translator.score(SOURCES[:2], [TARGETS[0], ' '.join(TARGETS * 3)])
  with pytest.raises(TypeError, match='single str'):
    translator.score(SOURCES[0], TARGETS[0])
  assert translator.score([], []) == []


def _write(path, lines):
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path)


def _refuses_before_loading(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError('the checkpoint was restored before the input was checked')

  monkeypatch.setattr(Translator, 'from_checkpoint', fail)


def test_bad_files_are_refused_before_the_model_is_loaded(tiny_workdir, tmp_path, monkeypatch):
  _refuses_before_loading(monkeypatch)
  src = _write(tmp_path / 'src.txt', SOURCES[:2])
  tgt = _write(tmp_path / 'tgt.txt', TARGETS[:2])
  empty = _write(tmp_path / 'empty.txt', [])
  too_long = _write(tmp_path / 'long.txt', [TARGETS[0], ' '.join(TARGETS * 3)])
  out = str(tmp_path / 'scores.tsv')
  cases = [
    ((empty, tgt), rf'^--src={empty}: the file is empty'),
    ((src, empty), rf'^--tgt={empty}: the file is empty'),
    ((src, too_long), rf'^--tgt={too_long} line 2 has \d+ tokens .*max_len 32'),
    ((src, _write(tmp_path / 'one.txt', TARGETS[:1])), r'has 2 lines but --tgt=.* has 1'),
  ]
  for (source, target), message in cases:
    with pytest.raises(UserInputError, match=message):
      text_files.score_files(tiny_workdir, source, target, output_path=out)
  with pytest.raises(UserInputError, match=r'^--output=.*--src='):
    text_files.score_files(tiny_workdir, src, tgt, output_path=src)
  assert not os.path.exists(out)


def _score_command(*flags):
  return subprocess.run(
    [sys.executable, '-m', 'transformer_jax.score', *flags],
    capture_output=True,
    text=True,
    cwd=REPO_ROOT,
    timeout=300,
  )


def test_the_command_writes_one_line_per_pair(tiny_workdir, tmp_path, scores):
  src = _write(tmp_path / 'src.txt', SOURCES)
  tgt = _write(tmp_path / 'tgt.txt', TARGETS)
  out = tmp_path / 'scores.tsv'
  result = _score_command(
    f'--workdir={tiny_workdir}', f'--src={src}', f'--tgt={tgt}', f'--output={out}', '--per_token'
  )
  assert result.returncode == 0, result.stderr[-2000:]
  lines = out.read_text().splitlines()
  assert len(lines) == len(SOURCES)
  for line, expected in zip(lines, scores):
    total, mean, tokens, per_token = line.split('\t')
    assert int(tokens) == expected['tokens']
    assert float(total) == pytest.approx(expected['log_prob'], abs=2e-6)
    assert float(mean) == pytest.approx(expected['mean'], abs=2e-6)
    values = [float(v) for v in per_token.split(' ')]
    np.testing.assert_allclose(values, expected['token_log_probs'], rtol=0, atol=2e-6)


def test_the_command_refuses_files_of_different_lengths_in_one_line(tiny_workdir, tmp_path):
  src = _write(tmp_path / 'src.txt', SOURCES[:3])
  tgt = _write(tmp_path / 'tgt.txt', TARGETS[:2])
  out = tmp_path / 'scores.tsv'
  result = _score_command(
    f'--workdir={tiny_workdir}', f'--src={src}', f'--tgt={tgt}', f'--output={out}'
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
    f'error: --src={src} has 3 lines but --tgt={tgt} has 2: line N of each is one pair'
  ]
  assert not out.exists()
