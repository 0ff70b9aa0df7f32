"""Draws a trained model's attention as heatmaps, like the paper's Figures 3-5:

    pip install -e '.[plot]'   # matplotlib
    python -m transformer_jax.plot_attention --workdir=DIR --text="A man rides a bike." \
        --out=attention.png [--target="..."] [--kind=cross|encoder|decoder] [--layers=5,6]

One panel per layer and head; without --target the model's own translation is used.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import attention_plots

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag('Training workdir (config, vocabulary, checkpoints).')
  flags.DEFINE_string('text', None, 'The source sentence.')
  flags.DEFINE_string('target', None, "Its translation; default: the model's own (beam).")
  flags.DEFINE_string('out', 'attention.png', 'Image file to write (.png, .pdf, .svg).')
  flags.DEFINE_enum('kind', 'cross', list(attention_plots.KINDS), 'Which attention to draw.')
  flags.DEFINE_list('layers', None, 'Layers to draw, numbered from 1 (default: all).')
  cli.define_checkpoint_flag()
  flags.DEFINE_integer('beam_size', 4, 'Beam size for the translation when --target is unset.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty for the translation when --target is unset.')
  flags.mark_flags_as_required(['workdir', 'text'])


def main(argv):
  del argv
  try:
    layers = [int(layer) for layer in FLAGS.layers] if FLAGS.layers else None
  except ValueError:
    raise UserInputError(
      f'--layers={",".join(FLAGS.layers)}: expected layer numbers like 1,6'
    ) from None
  maps, target = attention_plots.plot_translation(
    FLAGS.workdir,
    FLAGS.text,
    FLAGS.out,
    target=FLAGS.target,
    kind=FLAGS.kind,
    layers=layers,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    beam_size=FLAGS.beam_size,
    alpha=FLAGS.alpha,
  )
  print(
    f'{FLAGS.kind} attention, {len(maps.source_tokens)} source x '
    f'{len(maps.target_tokens)} target pieces -> {FLAGS.out}'
  )
  print(f'target{"" if FLAGS.target else " (the model translation)"}: {target}')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
