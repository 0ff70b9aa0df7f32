"""Exports a trained workdir for serving elsewhere:

    python -m transformer_jax.export --workdir=DIR --format=ctranslate2 --out=MODEL_DIR \\
        [--quantization=int8|int16|float16|float32] [--checkpoint=averaged|latest|STEP]

--format=ctranslate2 writes a CTranslate2 model directory (CTranslate2's TransformerSpec, with
the vocabulary, the SentencePiece model and a README showing how to load it); it needs the
`[export]` extra (`pip install 'transformer_jax[export]'`). See exporters/ctranslate2_spec.py.
--format=stablehlo writes the whole greedy and beam-4 searches as `jax.export` artifacts with the
parameters, the SentencePiece model and a `translate.py` that needs only jax, numpy and
sentencepiece. See exporters/stablehlo.py.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.exporters import ctranslate2_spec, stablehlo

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag()
  flags.DEFINE_enum('format', None, ['ctranslate2', 'stablehlo'], 'What to export to.')
  flags.DEFINE_string('out', None, 'Directory to write (local; refused if it exists, see --force).')
  flags.DEFINE_string(
    'quantization',
    None,
    'ctranslate2: weight type, one of ' + ', '.join(ctranslate2_spec.QUANTIZATIONS) + ' '
    "(default float32; 'int8' for fast CPU inference). stablehlo: float32 only.",
  )
  cli.define_checkpoint_flag()
  flags.DEFINE_bool('force', False, 'Replace --out if it exists.')
  flags.mark_flags_as_required(['workdir', 'format', 'out'])


def main(argv):
  del argv
  exporters = {'ctranslate2': ctranslate2_spec.export, 'stablehlo': stablehlo.export}
  out = exporters[FLAGS.format](
    FLAGS.workdir,
    FLAGS.out,
    quantization=FLAGS.quantization or 'float32',
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    force=FLAGS.force,
  )
  print(out)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
