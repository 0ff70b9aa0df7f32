"""Corpus BLEU and chrF with sacreBLEU on detokenized output.

    python -m transformer_jax.evaluate --workdir=DIR --src=test.en --ref=test.de \
        [--beam_size=4 --alpha=0.6 --checkpoint=averaged --out=hypotheses.txt]

Translates the source file, writes one hypothesis per line, and prints sacreBLEU's scores
with their signatures (so results are comparable with published ones).
"""

from __future__ import annotations

import os
import sys
import time

import sacrebleu
from absl import app, flags

from transformer_jax.checkpointing import CorruptCheckpointError
from transformer_jax.config import UserInputError
from transformer_jax.metric_writers import quiet_library_logs
from transformer_jax.translate import Translator, check_decoding_options, checkpoint_flag_value


def read_lines(path: str) -> list[str]:
  """Lines of a UTF-8 text file without their line endings (CRLF too)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no such file')
  if os.path.isdir(path):  # Pipes are fine: `--src=<(sacrebleu -t wmt14 ... --echo src)`.
    raise UserInputError(f'{path}: is a directory, not a text file')
  with open(path, 'rb') as f:
    data = f.read()
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    line = data[:error.start].count(b'\n') + 1
    raise UserInputError(f'{path}:{line}: not valid UTF-8') from None
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines.pop()  # The final newline ends the last line; it does not start a new one.
  return [line.rstrip('\r') for line in lines]


def score(hypotheses: list[str], references: list[str]) -> dict:
  """sacreBLEU corpus BLEU and chrF (default settings: 13a tokenization, mixed case)."""
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(hypotheses, [references])
  chrf_score = chrf.corpus_score(hypotheses, [references])
  return {'bleu': bleu_score.score, 'chrf': chrf_score.score,
          'bleu_text': str(bleu_score), 'chrf_text': str(chrf_score),
          'bleu_signature': str(bleu.get_signature()),
          'chrf_signature': str(chrf.get_signature())}


def evaluate(translator: Translator, sources: list[str], references: list[str], *,
             beam_size: int = 4, alpha: float = 0.6) -> tuple[list[str], dict]:
  if len(sources) != len(references):
    raise UserInputError(f'{len(sources)} source lines but {len(references)} reference lines')
  start = time.time()
  hypotheses = translator.translate(sources, beam_size=beam_size, alpha=alpha)
  result = score(hypotheses, references)
  result['seconds'] = time.time() - start
  return hypotheses, result


FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_string('src', None, 'Source sentences, one per line.')
  flags.DEFINE_string('ref', None, 'Reference translations, one per line.')
  flags.DEFINE_string('out', None, 'Where to write the hypotheses (default: '
                      '<workdir>/hypotheses/<src name>.<checkpoint>.beam<k>.txt).')
  flags.DEFINE_string('checkpoint', None, "Step number, 'averaged' or 'latest' (default: the "
                      'averaged checkpoint if current, else the latest).')
  flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent.')
  flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
  flags.mark_flags_as_required(['workdir', 'src', 'ref'])


def main(argv):
  del argv
  quiet_library_logs()
  try:
    check_decoding_options(FLAGS.beam_size, FLAGS.alpha, FLAGS.batch_size)
    sources, references = read_lines(FLAGS.src), read_lines(FLAGS.ref)
    if len(sources) != len(references):
      raise UserInputError(f'{FLAGS.src} has {len(sources)} lines but {FLAGS.ref} has '
                           f'{len(references)}')
    checkpoint = checkpoint_flag_value(FLAGS.checkpoint)
    translator = Translator.from_checkpoint(FLAGS.workdir, checkpoint, FLAGS.batch_size)
    hypotheses, result = evaluate(translator, sources, references, beam_size=FLAGS.beam_size,
                                  alpha=FLAGS.alpha)
  except (FileNotFoundError, UserInputError, CorruptCheckpointError) as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  out = FLAGS.out or os.path.join(
      FLAGS.workdir, 'hypotheses',
      f'{os.path.basename(FLAGS.src)}.{checkpoint or "default"}.beam{FLAGS.beam_size}.txt')
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, 'w', encoding='utf-8') as f:
    f.writelines(h + '\n' for h in hypotheses)
  print(f'{result["bleu_text"]}\n  signature: {result["bleu_signature"]}')
  print(f'{result["chrf_text"]}\n  signature: {result["chrf_signature"]}')
  print(f'{len(hypotheses)} sentences in {result["seconds"]:.1f}s '
        f'(beam {FLAGS.beam_size}, alpha {FLAGS.alpha}); hypotheses: {out}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
