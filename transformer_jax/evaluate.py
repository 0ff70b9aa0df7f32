"""Scores a test set: exact match (per category on the number-words task) and sacreBLEU's BLEU
(where it means something) and chrF on detokenized output, with signatures:

    python -m transformer_jax.evaluate --workdir=DIR --src=test.en --ref=test.de \
        [--beam_size=4 --alpha=0.6 --beam_rule=exact --checkpoint=averaged --dtype=bfloat16
         --out=hypotheses.txt]

Translates the source file, writes one hypothesis per line, and prints the scores with their
signatures, so results are comparable with published ones. `--models=DIR,DIR2 --out=FILE`
evaluates an ensemble; `--sampling`, `--mbr=N` decode otherwise (the first hypothesis is
scored). `--dtype` decodes in another inference dtype (`Translator`), named in the default
hypotheses file and the summary line where it is not the model's own.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.evaluation import test_set

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag('Training workdir (or --models).')
  cli.define_models_flags()
  flags.DEFINE_string('src', None, 'Source sentences, one per line.')
  flags.DEFINE_string('ref', None, 'Reference translations, one per line.')
  flags.DEFINE_string(
    'out',
    None,
    'Where to write the hypotheses (default: a file named '
    'after --src, --checkpoint, the decoding flags and --dtype in the workdir; needed with '
    '--models).',
  )
  cli.define_checkpoint_flag()
  cli.define_dtype_flag()
  flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent.')
  cli.define_beam_rule_flag()
  cli.define_sampling_flags()
  flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
  flags.mark_flags_as_required(['src', 'ref'])


def main(argv):
  del argv
  result = test_set.evaluate_files(
    FLAGS.workdir,
    FLAGS.src,
    FLAGS.ref,
    models=FLAGS.models,
    weights=FLAGS.weights,
    out=FLAGS.out,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    beam_size=FLAGS.beam_size,
    alpha=FLAGS.alpha,
    batch_size=FLAGS.batch_size,
    beam_rule=FLAGS.beam_rule,
    dtype=FLAGS.dtype,
    **cli.sampling_flag_values(FLAGS),
  )
  print('\n'.join(test_set.report_lines(result)))
  print(
    f'{result["sentences"]} sentences in {result["seconds"]:.1f}s '
    f'({result["decoding"]}); hypotheses: {result["hypotheses_file"]}'
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
