"""paths: local paths made absolute, gs:// kept remote, any other scheme refused by name."""

import hashlib
import os
import pathlib

import pytest

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.workdir.layout import Workdir


def test_local_paths_become_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.fspath(paths.resolve('runs/a', '--workdir')) == str(tmp_path / 'runs' / 'a')
  assert os.fspath(paths.resolve('~/x', '--workdir')) == os.path.expanduser('~/x')


def test_gcs_paths_stay_remote():
  path = paths.resolve('gs://bucket/run', '--workdir')
  assert os.fspath(path) == 'gs://bucket/run' and paths.is_gcs(path)
  assert os.fspath(path / 'config.json') == 'gs://bucket/run/config.json'
  workdir = Workdir('gs://bucket/run')
  assert workdir.is_remote
  assert os.fspath(workdir.checkpoints) == 'gs://bucket/run/checkpoints'
  assert not os.path.exists('gs:')  # Never a local folder named after the scheme.


@pytest.mark.parametrize(
  'value, message',
  [
    ('s3://bucket/run', r'--workdir=s3://bucket/run: s3:// paths are not supported'),
    ('http://host/run', r'--workdir=http://host/run: http:// paths are not supported'),
    ('gs://', r'--workdir=gs://: name a bucket'),
    ('', r'--workdir is empty'),
  ],
)
def test_unservable_paths_are_one_line_errors_naming_the_flag(value, message):
  with pytest.raises(UserInputError, match=message):
    Workdir(value)


def test_gcs_without_its_extra_says_how_to_install_it(monkeypatch):
  real_find_spec = paths.importlib.util.find_spec
  monkeypatch.setattr(
    paths.importlib.util,
    'find_spec',
    lambda name: None if name in ('gcsfs', 'tensorflow') else real_find_spec(name),
  )
  with pytest.raises(UserInputError, match=r"config\.data_dir=gs://b/tfds: .*'\.\[gcs\]'"):
    paths.resolve('gs://b/tfds', 'config.data_dir')


def test_write_atomically_replaces_whole_files(tmp_path):
  target = tmp_path / 'sub' / 'f.txt'
  paths.write_atomically(target, 'one')
  paths.write_atomically(target, b'two')
  assert target.read_bytes() == b'two'
  assert sorted(os.listdir(target.parent)) == ['f.txt']  # No temporary file left.


def test_default_hypotheses_files_are_named_by_every_decoding_option(tmp_path):
  workdir = Workdir(str(tmp_path))
  names = {workdir.hypotheses_file('data/test.en', None, 4, alpha).name for alpha in (0.6, 1.5)}
  assert names == {'test.en.default.beam4.alpha0.6.txt', 'test.en.default.beam4.alpha1.5.txt'}
  rules = {
    workdir.hypotheses_file('test.en', 7, 4, 0, rule).name for rule in ('exact', 'ctranslate2')
  }
  assert rules == {'test.en.7.beam4.alpha0.txt', 'test.en.7.beam4.ctranslate2.alpha0.txt'}
  # Greedy search has no beam rule: one name whatever the flag.
  assert (
    workdir.hypotheses_file('test.en', 7, 1, 0, 'ctranslate2').name == 'test.en.7.beam1.alpha0.txt'
  )


def test_a_staged_folder_replaces_the_directory_whole_or_not_at_all(tmp_path):
  target = tmp_path / 'model'
  target.mkdir()
  (target / 'old.txt').write_text('old')
  with pytest.raises(KeyboardInterrupt):
    with paths.staged_folder(str(target)) as staging:
      (tmp_path / 'never').write_text(staging)
      (pathlib.Path(staging) / 'new.txt').write_text('half')
      raise KeyboardInterrupt
  assert sorted(p.name for p in tmp_path.iterdir()) == ['model', 'never']
  assert [p.name for p in target.iterdir()] == ['old.txt']
  with paths.staged_folder(str(target)) as staging:
    (pathlib.Path(staging) / 'new.txt').write_text('new')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['model', 'never']
  assert [p.name for p in target.iterdir()] == ['new.txt']
  assert paths.file_sha256(target / 'new.txt') == hashlib.sha256(b'new').hexdigest()
