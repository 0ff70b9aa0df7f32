"""Translates with a trained workdir, one sentence per line:

    python -m transformer_jax.translate --workdir=DIR < source.txt > translations.txt

Exactly one translation per input line, in order (an empty line gives an empty line); typed
lines are translated as they come when stdin is a terminal. Beam search, beam 4 and α = 0.6
as in the paper, by default; `--beam_size=1` is greedy.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.inference import text_files

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag()
  cli.define_checkpoint_flag()
  flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
  flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy (the paper: 4).')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent ((5+len)/6)^alpha (the paper: 0.6).')
  cli.define_beam_rule_flag()
  flags.DEFINE_string('input', None, 'Read sentences from this file instead of stdin.')
  flags.DEFINE_string('output', None, 'Write translations to this file instead of stdout.')
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  del argv
  text_files.translate_text(
    FLAGS.workdir,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    batch_size=FLAGS.batch_size,
    beam_size=FLAGS.beam_size,
    alpha=FLAGS.alpha,
    beam_rule=FLAGS.beam_rule,
    input_path=FLAGS.input,
    output_path=FLAGS.output,
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
