"""Prepares a tfds catalog dataset as `array_record`, once, for training without TensorFlow.

    pip install -e '.[prepare]'          # TensorFlow, for the stock builders' download/extract
    python -m transformer_jax.prepare_data --dataset=wmt14_translate/de-en --data_dir=DIR

Training then reads DIR through `tfds.data_source` (no TensorFlow):

    python train.py --config=configs/base.py --workdir=W --config.data_dir=DIR

array_record cannot yet be read from gs:// (google/array_record#120): prepare into a gs://
data dir if you like (TensorFlow writes it), then copy it to local disk (or mount it with
gcsfuse) on each training host. The datasets this package builds itself ('number_words', 'text')
need none of this: `train.py` prepares them on first use ('number_words' is accepted here too).
"""

from __future__ import annotations

import importlib.util
import sys
import time

from absl import app, flags
import tensorflow_datasets as tfds

from transformer_jax import number_words
from transformer_jax.config import UserInputError
from transformer_jax.metric_writers import quiet_library_logs

FLAGS = flags.FLAGS
flags.DEFINE_string('dataset', None, "tfds name, e.g. 'wmt14_translate/de-en' (name/config).")
flags.DEFINE_string('data_dir', None, 'Directory (local or gs://) to write the dataset into.')
flags.DEFINE_string('manual_dir', None,
                    'Directory of files a builder asks to be downloaded by hand (rarely needed).')
flags.DEFINE_integer('max_examples_per_split', None,
                     'Prepare only the first N examples of each split (a quick trial).')
flags.mark_flags_as_required(['dataset', 'data_dir'])


def _builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
  if name.split('/')[0] == 'number_words':
    return number_words.NumberWords(config=name.split('/')[1] if '/' in name else 'default',
                                    data_dir=data_dir, file_format='array_record')
  # Without TensorFlow, `import tensorflow_datasets` registers only some builders; the
  # translation ones (wmt*, ted_*, opus, para_crawl) register when their package is imported.
  import tensorflow_datasets.translate  # pylint: disable=g-import-not-at-top,unused-import
  try:
    return tfds.builder(name, data_dir=data_dir, file_format='array_record', try_gcs=False)
  except tfds.core.registered.DatasetNotFoundError as error:
    raise UserInputError(f'--dataset={name!r}: {str(error).splitlines()[0]}') from None
  except ValueError:  # e.g. an unknown builder config after the '/'
    configs = [config.name for config in
               getattr(tfds.builder_cls(name.split('/')[0]), 'BUILDER_CONFIGS', [])]
    known = f' (it has: {", ".join(configs)})' if configs else ''
    raise UserInputError(f'--dataset={name!r}: no such dataset config{known}') from None


def prepare(name: str, data_dir: str, *, manual_dir: str | None = None,
            max_examples_per_split: int | None = None) -> tfds.core.DatasetInfo:
  """Downloads (if needed) and writes dataset `name` as array_record under data_dir.

  Returns its DatasetInfo. An already prepared dataset is not touched. Raises UserInputError
  for an unknown name, and for a stock builder when TensorFlow, which its download and
  extraction code needs, is not installed.
  """
  builder = _builder(name, data_dir)
  if builder.is_prepared():
    return builder.info
  if (not isinstance(builder, number_words.NumberWords)
      and importlib.util.find_spec('tensorflow') is None):
    raise UserInputError(f'--dataset={name!r}: preparing a stock tfds dataset needs TensorFlow; '
                         "install it with `pip install -e '.[prepare]'` (training afterwards "
                         'does not)')
  download_config = tfds.download.DownloadConfig(
      manual_dir=manual_dir, max_examples_per_split=max_examples_per_split,
      try_download_gcs=False)
  builder.download_and_prepare(file_format='array_record', download_config=download_config)
  return builder.info


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  started = time.perf_counter()
  try:
    if _builder(FLAGS.dataset, FLAGS.data_dir).is_prepared():
      print(f'{FLAGS.dataset} is already prepared in {FLAGS.data_dir}; nothing to do')
      return
    info = prepare(FLAGS.dataset, FLAGS.data_dir, manual_dir=FLAGS.manual_dir,
                   max_examples_per_split=FLAGS.max_examples_per_split)
  except UserInputError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  seconds = time.perf_counter() - started
  total = sum(split.num_examples for split in info.splits.values())
  print(f'{info.full_name} in {info.data_dir}: '
        + ', '.join(f'{name} {split.num_examples:,}' for name, split in info.splits.items())
        + f' examples ({total / max(seconds, 1e-9):,.0f} examples/s over {seconds:.1f} s)')
  # The feature names are what config.data.src_lang / tgt_lang must name.
  print('features: ' + ', '.join(info.features.keys()))


if __name__ == '__main__':
  app.run(main)
