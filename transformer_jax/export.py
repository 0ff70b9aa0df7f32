"""Exports a trained workdir for serving elsewhere:

    python -m transformer_jax.export --workdir=DIR --format=ctranslate2 --out=MODEL_DIR \\
        [--quantization=int8|int16|float16|float32] [--checkpoint=averaged|latest|STEP]
    python -m transformer_jax.export --workdir=DIR --format=stablehlo --out=MODEL_DIR \\
        [--dtype=float32|bfloat16|float16] [--checkpoint=averaged|latest|STEP]
    python -m transformer_jax.export --workdir=DIR --format=huggingface --out=MODEL_DIR \\
        [--checkpoint=averaged|latest|STEP]

--format=ctranslate2 writes a CTranslate2 model directory (CTranslate2's TransformerSpec, with
the vocabulary, the SentencePiece model and a README showing how to load it); it needs the
`[export]` extra (`pip install 'transformer_jax[export]'`). See exporters/ctranslate2_spec.py.
--format=stablehlo writes the whole greedy and beam-4 searches as `jax.export` artifacts with the
parameters, the SentencePiece model and a `translate.py` that needs only jax, numpy and
sentencepiece; --dtype is what those searches compute in and the parameters' matrices are
stored in (default: the model's own). See exporters/stablehlo.py.
--format=huggingface writes a transformers MarianMT folder (config.json, model.safetensors,
source.spm, target.spm, vocab.json, tokenizer and generation configs, a README) that
`MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load; it needs only
`safetensors` (no torch). Its weights are float32: --quantization and --dtype other than float32
are refused (transformers casts when it loads). See exporters/huggingface.py.

--dtype is refused with --format=ctranslate2: CTranslate2 stores its weights in the type
--quantization names (float16, bfloat16, int8, ...) and chooses the type it computes in when it
loads the model (`compute_type=`), so no export setting means what --dtype means elsewhere (the
products and the matrices), and two flags for the stored type would only conflict.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.common.errors import UserInputError
from transformer_jax.exporters import ctranslate2_spec, huggingface, stablehlo

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag()
  flags.DEFINE_enum(
    'format', None, ['ctranslate2', 'stablehlo', 'huggingface'], 'What to export to.'
  )
  flags.DEFINE_string('out', None, 'Directory to write (local; refused if it exists, see --force).')
  flags.DEFINE_string(
    'quantization',
    None,
    'ctranslate2: weight type, one of ' + ', '.join(ctranslate2_spec.QUANTIZATIONS) + ' '
    "(default float32; 'int8' for fast CPU inference). stablehlo: see --dtype. huggingface: "
    'float32 only.',
  )
  cli.define_checkpoint_flag()
  cli.define_dtype_flag()
  flags.DEFINE_bool('force', False, 'Replace --out if it exists.')
  flags.mark_flags_as_required(['workdir', 'format', 'out'])


def main(argv):
  del argv
  options = {}
  if FLAGS.format in ('stablehlo', 'huggingface'):
    options['dtype'] = FLAGS.dtype
  elif FLAGS.dtype is not None:
    # Every --dtype is also a CTranslate2 weight type: name the flag that stores it.
    raise UserInputError(
      f'--dtype={FLAGS.dtype} is for --format=stablehlo; with --format=ctranslate2 give '
      f'--quantization={FLAGS.dtype} (the weights are stored in it; CTranslate2 chooses the '
      'type it computes in when it loads the model, compute_type=)'
    )
  exporters = {
    'ctranslate2': ctranslate2_spec.export,
    'stablehlo': stablehlo.export,
    'huggingface': huggingface.export,
  }
  out = exporters[FLAGS.format](
    FLAGS.workdir,
    FLAGS.out,
    quantization=FLAGS.quantization or 'float32',
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    force=FLAGS.force,
    **options,
  )
  print(out)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
