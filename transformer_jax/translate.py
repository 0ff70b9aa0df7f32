"""Translates with a trained workdir, one sentence per line:

    python -m transformer_jax.translate --workdir=DIR < source.txt > translations.txt

Exactly one output line per input line, in order (an empty line gives an empty line); typed
lines are translated as they come when stdin is a terminal. Beam search, beam 4 and α = 0.6
as in the paper, by default; `--beam_size=1` is greedy; `--sampling` draws; `--mbr=N` picks by
expected chrF. `--output_format=jsonl` writes each line's n-best list (`--num_hypotheses`) with
scores and, with `--alignments`, word alignments (`inference.text_files`). `--models` decodes
with an ensemble instead of `--workdir`.
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
  flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
  flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy (the paper: 4).')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent ((5+len)/6)^alpha (the paper: 0.6).')
  cli.define_beam_rule_flag()
  flags.DEFINE_integer(
    'num_hypotheses', 1, 'Hypotheses per source, best first (<= --beam_size; needs jsonl).'
  )
  cli.define_sampling_flags()
  flags.DEFINE_string('input', None, 'Read sentences from this file instead of stdin.')
  flags.DEFINE_string('output', None, 'Write translations to this file instead of stdout.')
  flags.DEFINE_string(
    'target_prefix_file',
    None,
    'Line N: the text translation N must start with (continued by the search); empty: none.',
  )
  flags.DEFINE_enum(
    'output_format',
    'text',
    list(text_files.OUTPUT_FORMATS),
    "'text': one translation per line; 'jsonl': one JSON object per line, "
    '{"hypotheses": [{"text", "log_prob", "score", "tokens"}, ...]}.',
  )
  flags.DEFINE_bool(
    'alignments',
    False,
    "With jsonl: each hypothesis's Pharaoh word alignment from the last decoder layer's cross "
    "attention (an ensemble's: its first member's).",
  )


def main(argv):
  del argv
  text_files.translate_text(
    FLAGS.workdir,
    models=FLAGS.models,
    weights=FLAGS.weights,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    dtype=FLAGS.dtype,
    batch_size=FLAGS.batch_size,
    beam_size=FLAGS.beam_size,
    alpha=FLAGS.alpha,
    beam_rule=FLAGS.beam_rule,
    num_hypotheses=FLAGS.num_hypotheses,
    input_path=FLAGS.input,
    output_path=FLAGS.output,
    target_prefix_path=FLAGS.target_prefix_file,
    output_format=FLAGS.output_format,
    alignments=FLAGS.alignments,
    **cli.sampling_flag_values(FLAGS),
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
