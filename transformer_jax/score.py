"""Scores given translations with a trained workdir (forced decoding), one pair per line:

    python -m transformer_jax.score --workdir=DIR --src=source.txt --tgt=targets.txt > scores.tsv

Line N of the output scores line N of --tgt as the translation of line N of --src, as
`sum<TAB>mean<TAB>tokens`: the log-probability of the target's pieces and its EOS, that sum per
token, and the number of tokens (EOS counted, as CTranslate2's `score_batch` counts); with
`--per_token` a 4th column holds each token's log-probability, space-separated. Tab-separated
fixed columns because they are easy to cut and paste: `cut -f1` gives the sums, `paste
source.txt scores.tsv` puts them beside the sentences, spreadsheets and pandas read them as is.
`--models=DIR,DIR2 [--weights=1,2]` scores under an ensemble's mixture instead of `--workdir`.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.inference import text_files

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag('Training workdir (config.json, vocab.model, checkpoints); or --models.')
  cli.define_models_flags()
  cli.define_checkpoint_flag()
  cli.define_dtype_flag()
  flags.DEFINE_string('src', None, 'Source sentences, one per line.')
  flags.DEFINE_string('tgt', None, 'Their translations to score, one per line (as many lines).')
  flags.DEFINE_integer('batch_size', 64, 'Pairs scored together.')
  flags.DEFINE_string('output', None, 'Write the scores to this file instead of stdout.')
  flags.DEFINE_bool('per_token', False, "Add each token's log-probability as a 4th column.")
  flags.mark_flags_as_required(['src', 'tgt'])


def main(argv):
  del argv
  text_files.score_files(
    FLAGS.workdir,
    FLAGS.src,
    FLAGS.tgt,
    models=FLAGS.models,
    weights=FLAGS.weights,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    dtype=FLAGS.dtype,
    batch_size=FLAGS.batch_size,
    output_path=FLAGS.output,
    per_token=FLAGS.per_token,
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
