"""prepare_data: catalog datasets prepared as array_record, then read without TensorFlow."""

import importlib.util
import os
import subprocess
import sys

import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.configs import default
from transformer_jax.data import input_pipeline, tfds_prepare
from transformer_jax.training import run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prepare_then_read_through_data_source(tmp_path):
  info = tfds_prepare.prepare('number_words/tiny', str(tmp_path))
  assert {name: split.num_examples for name, split in info.splits.items()} == {
    'train': 2000,
    'validation': 200,
    'test': 200,
  }
  record_files = sorted(
    p for p in os.listdir(tmp_path / 'number_words/tiny/2.0.0') if 'array_record' in p
  )
  assert record_files
  mtimes = [os.path.getmtime(tmp_path / 'number_words/tiny/2.0.0' / p) for p in record_files]
  # A second call finds the dataset prepared and writes nothing.
  tfds_prepare.prepare('number_words/tiny', str(tmp_path))
  assert mtimes == [
    os.path.getmtime(tmp_path / 'number_words/tiny/2.0.0' / p) for p in record_files
  ]
  # Training reads it by name, as any catalog dataset prepared this way.
  config = default.get_config()
  config.dataset = 'number_words/tiny'
  sources = input_pipeline.load_data_sources(config, str(tmp_path))
  assert len(sources['train']) == 2000 and set(sources['test'][0]) == {'en', 'de'}


def test_unknown_dataset_and_config_are_named(tmp_path):
  with pytest.raises(UserInputError, match=r"--dataset='nosuch_dataset': Dataset nosuch"):
    tfds_prepare.prepare('nosuch_dataset', str(tmp_path))
  with pytest.raises(UserInputError, match=r'no such dataset config \(it has: cs-en, de-en, '):
    tfds_prepare.prepare('wmt14_translate/xx-yy', str(tmp_path))
  assert not any('.array_record' in name for _, _, names in os.walk(tmp_path) for name in names)


@pytest.mark.skipif(
  importlib.util.find_spec('tensorflow') is not None,
  reason='TensorFlow is installed (the [prepare] extra)',
)
def test_stock_builder_without_tensorflow_says_which_extra(tmp_path):
  # The WMT14 builder is found (its features are the config's language names) ...
  builder = tfds_prepare.builder('wmt14_translate/de-en', str(tmp_path))
  assert set(builder.info.features.keys()) == {'de', 'en'}
  # ... but downloading it needs TensorFlow: a one-line error and exit 2, nothing written.
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'transformer_jax.prepare_data',
      '--dataset=wmt14_translate/de-en',
      f'--data_dir={tmp_path}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
    "error: --dataset='wmt14_translate/de-en': preparing a stock tfds dataset needs "
    "TensorFlow; install it with `pip install -e '.[prepare]'` (training afterwards does not)"
  )
  assert not any('.array_record' in name for _, _, names in os.walk(tmp_path) for name in names)


def test_a_data_dir_of_another_scheme_is_a_clear_error():
  # gs:// is staged to a local cache (tests/gcs_test.py); other object stores are refused.
  config = default.get_config()
  config.dataset = 'wmt14_translate/de-en'
  config.data_dir = 's3://b/tfds'
  with pytest.raises(UserInputError, match=r'config.data_dir=s3://b/tfds: s3:// paths are not '):
    run_config.validate_run_config(config)
