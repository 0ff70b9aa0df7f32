"""Imports a Marian / OPUS-MT transformer as a workdir that translate, evaluate and train.py use:

    python -m transformer_jax.import_marian --model=DIR_OR_NPZ [--vocab=X.yml --spm=source.spm
        [--target_spm=target.spm]] --workdir=OUT [--max_len=512] [--force]
    python -m transformer_jax.import_marian --model=HF_DIR_OR_REPO_ID --workdir=OUT

--model may also be the same models as transformers publishes them: a MarianMT folder (it has a
config.json; importers/hf_marian.py) or a Hub repo id (`Helsinki-NLP/opus-mt-en-de`, through
huggingface_hub: downloaded, or the cache's with HF_HUB_OFFLINE=1). One command for both since
both are OPUS-MT models and the workdir is the same; the vocabulary flags are the .npz's only.

--model: a Marian `.npz`, or an OPUS-MT folder (its decoder.yml's model and vocabulary, else its
one `*.npz` and `*vocab.yml`; `source.spm`, and `target.spm` if it is another). --vocab: Marian's
vocabulary, a `.yml` (with --spm, the SentencePiece model that segments the source, and
--target_spm if the target's is another) or a `.spm`. The imported model computes exactly what
Marian computes; see marian.py for the mapping and what is refused.
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.common.errors import UserInputError
from transformer_jax.importers import hf_marian, workdir_writer

FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string(
    'model',
    None,
    'Marian .npz, a folder holding one (OPUS-MT), a MarianMT folder or a Hub repo id.',
  )
  flags.DEFINE_string('vocab', None, "Marian's vocabulary: X.yml (with --spm) or X.spm.")
  flags.DEFINE_string('spm', None, 'SentencePiece model that segments the source (source.spm).')
  flags.DEFINE_string(
    'target_spm', None, 'SentencePiece model that segments the target (target.spm), if another.'
  )
  cli.define_workdir_flag('Folder to write (new, or an imported one with --force).')
  flags.DEFINE_integer('max_len', 512, 'Longest source or target (in pieces) the model accepts.')
  flags.DEFINE_bool('force', False, 'Replace a workdir that holds an untrained imported model.')
  flags.mark_flags_as_required(['model', 'workdir'])


def main(argv):
  del argv
  if hf_marian.is_hf_model(FLAGS.model):
    for name in ('vocab', 'spm', 'target_spm'):
      if FLAGS[name].value is not None:
        raise UserInputError(
          f'--{name} with --model={FLAGS.model}: a transformers model brings its own vocabulary'
        )
    hf_marian.import_hf_model(FLAGS.model, FLAGS.workdir, max_len=FLAGS.max_len, force=FLAGS.force)
    print(FLAGS.workdir)
    return
  workdir_writer.import_marian_model(
    FLAGS.model,
    FLAGS.workdir,
    vocab=FLAGS.vocab,
    spm=FLAGS.spm,
    target_spm=FLAGS.target_spm,
    max_len=FLAGS.max_len,
    force=FLAGS.force,
  )
  print(FLAGS.workdir)


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
