"""Reduced-precision inference against float32 (issue 49 item 4) on the default task's test set:
top-1 agreement of `Translator(dtype=...)` with float32 (beam 4 and greedy), exact match, and
how far the log-probs move.

    python bench/dtype_agreement.py --workdir=DIR [--checkpoint=latest] [--count=2000]

DIR is a workdir trained on the default task (`python train.py --workdir=DIR`). The test set is
number_words' test split as the workdir's data holds it (`sample_numbers('test', 2000, 0)`, the
builder's own draw). Per dtype and search it prints the share of sources whose translation is
float32's, and its exact match against the references. The log-probs are forced decoding
(`Translator.score`, per token) of float32's beam-4 translations under each dtype: the mean and
the largest |difference| per token, and per sentence of the mean per-token log-prob (what
tests/inference_dtype_test.py bounds).
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from transformer_jax.data import number_words
from transformer_jax.inference.translator import Translator

_WORKDIR = flags.DEFINE_string('workdir', None, 'A workdir trained on the default task.')
_CHECKPOINT = flags.DEFINE_string('checkpoint', None, "As translate's (default: its default).")
_COUNT = flags.DEFINE_integer('count', 2000, 'Test sentences (the split has 2,000).')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
_DTYPES = flags.DEFINE_list('dtypes', ['bfloat16', 'float16'], 'Reduced dtypes to compare.')
flags.mark_flags_as_required(['workdir'])

SEARCHES = {'beam 4': dict(beam_size=4, alpha=0.6), 'greedy': dict(beam_size=1)}


def compare(name, translator, sources, references, expected, targets, reference_scores):
  """One row per search: agreement with float32 and exact match; then the log-probs."""
  for search, options in SEARCHES.items():
    start = time.time()
    found = translator.translate(sources, **options)
    seconds = time.time() - start
    agree = sum(a == b for a, b in zip(found, expected[search]))
    exact = sum(a == b for a, b in zip(found, references))
    print(
      f'{name:24} {search:7} top-1 = float32 {agree:,}/{len(sources):,} '
      f'({100 * agree / len(sources):.2f}%)  exact match {100 * exact / len(sources):.2f}%  '
      f'{seconds:.1f}s'
    )
  scores = translator.score(sources, targets, per_token=True)
  per_token = np.concatenate(
    [
      np.abs(np.asarray(a['token_log_probs']) - np.asarray(b['token_log_probs']))
      for a, b in zip(scores, reference_scores)
    ]
  )
  per_sentence = np.array([abs(a['mean'] - b['mean']) for a, b in zip(scores, reference_scores)])
  print(
    f'{name:24} log-probs of float32 beam-4 output: per token |diff| mean {per_token.mean():.4f} '
    f'max {per_token.max():.4f}; per sentence |diff of mean| mean {per_sentence.mean():.4f} '
    f'max {per_sentence.max():.4f}'
  )


def main(argv):
  del argv
  numbers = number_words.sample_numbers('test', _COUNT.value, 0)
  sources = [number_words.english_words(n) for n in numbers]
  references = [number_words.german_words(n) for n in numbers]
  checkpoint = _CHECKPOINT.value
  if checkpoint is not None and checkpoint.isdigit():
    checkpoint = int(checkpoint)
  load = dict(checkpoint=checkpoint, batch_size=_BATCH_SIZE.value)
  print(f'{_WORKDIR.value}: {len(sources):,} test sentences, batch {_BATCH_SIZE.value}')
  reference = Translator.from_checkpoint(_WORKDIR.value, **load)
  expected = {search: reference.translate(sources, **o) for search, o in SEARCHES.items()}
  for search in SEARCHES:
    exact = sum(a == b for a, b in zip(expected[search], references))
    print(f'{"float32":24} {search:7} exact match {100 * exact / len(sources):.2f}%')
  targets = expected['beam 4']
  reference_scores = reference.score(sources, targets, per_token=True)
  for dtype in _DTYPES.value:
    translator = Translator.from_checkpoint(_WORKDIR.value, dtype=dtype, **load)
    compare(dtype, translator, sources, references, expected, targets, reference_scores)


if __name__ == '__main__':
  app.run(main)
