"""Prepares tfds catalog datasets (WMT14, ...) as `array_record`, once, for training without
TensorFlow (the `prepare_data` command's work). Stock builders' download and extraction code
needs TensorFlow (`pip install -e '.[prepare]'`); training afterwards reads the prepared files
through `tfds.data_source` without it. The datasets this package builds itself ('number_words',
'text') are prepared by `train.py` on first use ('number_words' is accepted here too).
"""

from __future__ import annotations

import importlib.util
import os

import tensorflow_datasets as tfds

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.data import number_words


def is_prepared(name: str, data_dir: str) -> bool:
  return builder(name, data_dir).is_prepared()


def builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
  """The builder of `name` writing array_record into `data_dir`; one-line errors for a name
  or folder that cannot be prepared."""
  if not isinstance(name, str) or not name.strip():
    raise UserInputError("--dataset must name a tfds dataset, e.g. 'wmt14_translate/de-en'")
  if name == 'text':
    raise UserInputError(
      "--dataset='text': your parallel files are prepared by train.py itself "
      '(--config.dataset=text --config.data.dir=DIR); nothing to prepare here'
    )
  data_dir = os.fspath(paths.resolve(data_dir, '--data_dir'))  # '' would be the current folder.
  if name.split('/')[0] == 'number_words':
    variant = name.split('/', 1)[1] if '/' in name else 'default'
    variants = [config.name for config in number_words.NumberWords.BUILDER_CONFIGS]
    if variant not in variants:
      raise UserInputError(
        f'--dataset={name!r}: number_words has no variant {variant!r} (it has '
        f'{", ".join(f"number_words/{v}" for v in variants)})'
      )
    return number_words.NumberWords(config=variant, data_dir=data_dir, file_format='array_record')
  # Without TensorFlow, `import tensorflow_datasets` registers only some builders; the
  # translation ones (wmt*, ted_*, opus, para_crawl) register when their package is imported.
  import tensorflow_datasets.translate  # noqa: F401

  try:
    return tfds.builder(name, data_dir=data_dir, file_format='array_record', try_gcs=False)
  except tfds.core.registered.DatasetNotFoundError as error:
    raise UserInputError(f'--dataset={name!r}: {str(error).splitlines()[0]}') from None
  except ValueError:  # e.g. an unknown builder config after the '/'
    configs = [
      config.name for config in getattr(tfds.builder_cls(name.split('/')[0]), 'BUILDER_CONFIGS', [])
    ]
    known = f' (it has: {", ".join(configs)})' if configs else ''
    raise UserInputError(f'--dataset={name!r}: no such dataset config{known}') from None


def prepare(
  name: str,
  data_dir: str,
  *,
  manual_dir: str | None = None,
  max_examples_per_split: int | None = None,
) -> tfds.core.DatasetInfo:
  """Downloads (if needed) and writes dataset `name` as array_record under data_dir.

  Returns its DatasetInfo. An already prepared dataset is not touched. Raises UserInputError
  for an unknown name, and for a stock builder when TensorFlow, which its download and
  extraction code needs, is not installed.
  """
  if max_examples_per_split is not None and (
    not is_integer(max_examples_per_split) or max_examples_per_split < 1
  ):
    raise UserInputError(
      f'--max_examples_per_split must be a positive integer, got {max_examples_per_split!r}'
    )
  dataset_builder = builder(name, data_dir)
  if dataset_builder.is_prepared():
    return dataset_builder.info
  if (
    not isinstance(dataset_builder, number_words.NumberWords)
    and importlib.util.find_spec('tensorflow') is None
  ):
    raise UserInputError(
      f'--dataset={name!r}: preparing a stock tfds dataset needs TensorFlow; '
      "install it with `pip install -e '.[prepare]'` (training afterwards "
      'does not)'
    )
  download_config = tfds.download.DownloadConfig(
    manual_dir=manual_dir, max_examples_per_split=max_examples_per_split, try_download_gcs=False
  )
  dataset_builder.download_and_prepare(file_format='array_record', download_config=download_config)
  return dataset_builder.info
