"""Prepares a tfds catalog dataset as `array_record`, once, for training without TensorFlow.

    pip install -e '.[prepare]'          # TensorFlow, for the stock builders' download/extract
    python -m transformer_jax.prepare_data --dataset=wmt14_translate/de-en --data_dir=DIR

Training then reads DIR through `tfds.data_source` (no TensorFlow):

    python train.py --config=configs/base.py --workdir=W --config.data_dir=DIR

array_record cannot yet be read from gs:// (google/array_record#120): prepare into a gs://
data dir if you like (TensorFlow writes it), then copy it to local disk (or mount it with
gcsfuse) on each training host.
"""

import time

from absl import flags

from transformer_jax import cli
from transformer_jax.data import tfds_prepare

FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string('dataset', None, "tfds name, e.g. 'wmt14_translate/de-en' (name/config).")
  flags.DEFINE_string('data_dir', None, 'Directory (local or gs://) to write the dataset into.')
  flags.DEFINE_string(
    'manual_dir',
    None,
    'Directory of files a builder asks to be downloaded by hand (rarely needed).',
  )
  flags.DEFINE_integer(
    'max_examples_per_split',
    None,
    'Prepare only the first N examples of each split (a quick trial).',
  )
  flags.mark_flags_as_required(['dataset', 'data_dir'])


def main(argv):
  del argv
  if tfds_prepare.is_prepared(FLAGS.dataset, FLAGS.data_dir):
    print(f'{FLAGS.dataset} is already prepared in {FLAGS.data_dir}; nothing to do')
    return
  started = time.perf_counter()
  info = tfds_prepare.prepare(
    FLAGS.dataset,
    FLAGS.data_dir,
    manual_dir=FLAGS.manual_dir,
    max_examples_per_split=FLAGS.max_examples_per_split,
  )
  seconds = time.perf_counter() - started
  total = sum(split.num_examples for split in info.splits.values())
  print(
    f'{info.full_name} in {info.data_dir}: '
    + ', '.join(f'{name} {split.num_examples:,}' for name, split in info.splits.items())
    + f' examples ({total / max(seconds, 1e-9):,.0f} examples/s over {seconds:.1f} s)'
  )
  # The feature names are what config.data.src_lang / tgt_lang must name.
  print('features: ' + ', '.join(info.features.keys()))


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
