"""Tests for transformer_jax.data.text_dataset (user parallel text -> tfds array_record)."""

import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest
import tensorflow_datasets as tfds

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import text_dataset as td

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI30K = os.path.join(REPO_ROOT, '..', 'shared', 'data', 'multi30k')

MAX_CHARS = 20
# (source line as written, target line as written, expected (src, tgt) or the
# reason it is dropped). Enough plain lines follow that a hash-ordered write
# would not come back in file order by chance.
TRAIN_ROWS = [
  ('Hello world', 'Hallo Welt', ('Hello world', 'Hallo Welt')),
  ('  Grüße, naïve café  ', 'Grüße aus Köln 🙂', ('Grüße, naïve café', 'Grüße aus Köln 🙂')),
  ('', 'leer', 'empty'),
  ('x' * (MAX_CHARS + 1), 'zu lang', 'too_long'),
  ('   ', 'nur Leerzeichen', 'empty'),
  ('tab\tinside', 'Tab\tdrin', ('tab\tinside', 'Tab\tdrin')),
  ('exactly twenty chars', 'y' * MAX_CHARS, ('exactly twenty chars', 'y' * MAX_CHARS)),
] + [(f'sentence {i}', f'Satz {i}', (f'sentence {i}', f'Satz {i}')) for i in range(40)]
VALID_ROWS = [('one', 'eins'), ('two', 'zwei'), ('three', 'drei')]


def _write(path: pathlib.Path, lines, *, crlf=False, final_newline=True, bom=False) -> str:
  sep = '\r\n' if crlf else '\n'
  text = sep.join(lines) + (sep if final_newline and lines else '')
  path.write_bytes(('\ufeff' if bom else '').encode() + text.encode('utf-8'))
  return str(path)


def _corpus(root: pathlib.Path):
  """train (CRLF source without final newline, BOM target) + valid; no test."""
  root.mkdir(parents=True, exist_ok=True)
  src = {
    'train': _write(root / 'train.en', [r[0] for r in TRAIN_ROWS], crlf=True, final_newline=False),
    'valid': _write(root / 'valid.en', [r[0] for r in VALID_ROWS]),
  }
  tgt = {
    'train': _write(root / 'train.de', [r[1] for r in TRAIN_ROWS], bom=True),
    'valid': _write(root / 'valid.de', [r[1] for r in VALID_ROWS], crlf=True),
  }
  return src, tgt


def _prepare(src, tgt, data_dir, **kwargs):
  return td.prepare_text_dataset(
    src_path_by_split=src,
    tgt_path_by_split=tgt,
    data_dir=str(data_dir),
    src_lang='en',
    tgt_lang='de',
    **kwargs,
  )


def _decoded(source):
  return [(ex['en'].decode(), ex['de'].decode()) for ex in source]


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp('text')
  src, tgt = _corpus(root / 'files')
  data_dir = root / 'tfds'
  name = _prepare(src, tgt, data_dir, max_chars=MAX_CHARS)
  return src, tgt, data_dir, name, dict(td.last_prepare_report)


def test_round_trip_exact_contents_in_file_order(prepared):
  _, _, data_dir, name, report = prepared
  assert name.startswith('parallel_text/en_de_') and len(name.split('_')[-1]) == 12
  sources = tfds.data_source(name, data_dir=str(data_dir), try_gcs=False)
  assert set(sources) == {'train', 'validation'}
  expected = [row[2] for row in TRAIN_ROWS if isinstance(row[2], tuple)]
  assert _decoded(sources['train']) == expected
  assert [sources['train'][i]['en'].decode() for i in (0, 1, len(expected) - 1)] == [
    expected[0][0],
    expected[1][0],
    expected[-1][0],
  ]
  assert _decoded(sources['validation']) == VALID_ROWS
  assert report == {
    'train': {'lines': len(TRAIN_ROWS), 'kept': len(expected), 'empty': 2, 'too_long': 1},
    'validation': {'lines': 3, 'kept': 3, 'empty': 0, 'too_long': 0},
  }
  info = tfds.builder(name, data_dir=str(data_dir)).info
  assert info.disable_shuffling
  assert info.supervised_keys == ('en', 'de')


def test_prepare_logs_dropped_pairs_once(tmp_path, caplog):
  src, tgt = _corpus(tmp_path / 'files')
  caplog.set_level(logging.INFO, logger='absl')
  _prepare(src, tgt, tmp_path / 'tfds', max_chars=MAX_CHARS)
  ours = [r.getMessage() for r in caplog.records if r.filename == 'text_dataset.py']
  messages = [m for m in ours if 'dropped' in m]
  assert len(messages) == 1
  assert messages[0].startswith(
    f'train: dropped 3 of {len(TRAIN_ROWS)} pairs: 2 with an empty side, '
    f'1 longer than {MAX_CHARS} characters (parallel_text/en_de_'
  )
  assert any(m.startswith('validation: kept all 3 pairs') for m in ours)
  assert 'Using custom data configuration' not in caplog.text  # Silenced: expected here.


def test_reprepare_reuses_and_changes_make_new_names(prepared):
  src, tgt, data_dir, name, report = prepared
  files = sorted(p for p in pathlib.Path(data_dir).rglob('*') if p.is_file())
  mtimes = [p.stat().st_mtime_ns for p in files]
  start = time.perf_counter()
  assert _prepare(src, tgt, data_dir, max_chars=MAX_CHARS) == name
  assert time.perf_counter() - start < 2.0
  assert td.last_prepare_report == report  # Restored from the dataset's metadata.
  assert sorted(p for p in pathlib.Path(data_dir).rglob('*') if p.is_file()) == files
  assert [p.stat().st_mtime_ns for p in files] == mtimes
  # Another option -> another fingerprint, prepared next to the first.
  assert _prepare(src, tgt, data_dir, max_chars=MAX_CHARS + 1) != name


def test_changed_content_gives_new_name(tmp_path):
  src, tgt = _corpus(tmp_path / 'files')
  data_dir = tmp_path / 'tfds'
  first = _prepare(src, tgt, data_dir)
  with open(src['valid'], 'a', encoding='utf-8') as f:
    f.write('four\n')
  with open(tgt['valid'], 'a', encoding='utf-8') as f:
    f.write('vier\n')
  second = _prepare(src, tgt, data_dir)
  assert second != first
  sources = tfds.data_source(second, data_dir=str(data_dir), try_gcs=False)
  assert _decoded(sources['validation'])[-1] == ('four', 'vier')
  assert len(tfds.data_source(first, data_dir=str(data_dir), try_gcs=False)['validation']) == 3


def test_text_paths(tmp_path):
  _corpus(tmp_path)
  src, tgt = td.text_paths(str(tmp_path), 'en', 'de')
  assert src == {'train': str(tmp_path / 'train.en'), 'validation': str(tmp_path / 'valid.en')}
  assert tgt == {'train': str(tmp_path / 'train.de'), 'validation': str(tmp_path / 'valid.de')}
  for lang in ('en', 'de'):
    os.rename(tmp_path / f'valid.{lang}', tmp_path / f'validation.{lang}')
    _write(tmp_path / f'test.{lang}', ['a'])
  src, tgt = td.text_paths(str(tmp_path), 'en', 'de')
  assert src['validation'] == str(tmp_path / 'validation.en')
  assert tgt['test'] == str(tmp_path / 'test.de')

  _write(tmp_path / 'valid.en', ['x'])
  with pytest.raises(UserInputError, match='both valid'):
    td.text_paths(str(tmp_path), 'en', 'de')
  os.remove(tmp_path / 'valid.en')
  os.remove(tmp_path / 'test.de')
  with pytest.raises(UserInputError, match=f'missing test file {tmp_path / "test.de"}'):
    td.text_paths(str(tmp_path), 'en', 'de')
  os.remove(tmp_path / 'train.de')
  with pytest.raises(UserInputError, match=f'missing train file {tmp_path / "train.de"}'):
    td.text_paths(str(tmp_path), 'en', 'de')
  with pytest.raises(UserInputError, match='does not exist'):
    td.text_paths(str(tmp_path / 'nope'), 'en', 'de')


# Each case: {file name: bytes} (train.en/train.de default to two good lines),
# and the fragments the one-line message must contain ({d} = the files' dir).
GOOD = b'one\ntwo\n'
BAD_CASES = {
  'unequal_counts': (
    {'train.de': b'eins\nzwei\ndrei\n'},
    ['{d}/train.en has 2 lines', '{d}/train.de has 3'],
  ),
  'invalid_utf8': (
    {'train.de': b'eins\nzwei\n\xff drei\n', 'train.en': b'a\nb\nc\n'},
    ['{d}/train.de line 3', 'invalid UTF-8'],
  ),
  'latin1_in_test_split': (
    {'test.en': b'ok\ncaf\xe9\n', 'test.de': b'ok\nok\n'},
    ['{d}/test.en line 2', 'invalid UTF-8'],
  ),
  'binary_nul': ({'train.en': b'one\n\x00\x01\x02\n'}, ['{d}/train.en line 2', 'NUL']),
  'missing_file': ({'train.de': None}, ['missing train file {d}/train.de']),
  'all_pairs_empty': (
    {'train.en': b' \n\n'},
    ['no usable train pairs', '{d}/train.en', '2 with an empty side'],
  ),
  'empty_files': (
    {'train.en': b'', 'train.de': b''},
    ['no usable train pairs', 'the files are empty'],
  ),
  'cr_only': ({'train.en': b'one\rtwo\r'}, ['{d}/train.en line 1', 'CR-only']),
}


@pytest.mark.parametrize('case', sorted(BAD_CASES))
def test_bad_input_raises_and_writes_nothing(tmp_path, case):
  overrides, fragments = BAD_CASES[case]
  files = tmp_path / 'files'
  files.mkdir()
  contents = {'train.en': GOOD, 'train.de': GOOD, **overrides}
  for file_name, data in contents.items():
    if data is not None:
      (files / file_name).write_bytes(data)
  splits = {'train'} | ({'test'} if 'test.en' in contents else set())
  src = {s: str(files / f'{s}.en') for s in splits}
  tgt = {s: str(files / f'{s}.de') for s in splits}
  data_dir = tmp_path / 'tfds'
  with pytest.raises(UserInputError) as raised:
    _prepare(src, tgt, data_dir)
  message = str(raised.value)
  assert '\n' not in message
  for fragment in fragments:
    assert fragment.format(d=files) in message
  assert not data_dir.exists()


@pytest.mark.parametrize(
  'kwargs, fragment',
  [
    ({'src_lang': 'en', 'tgt_lang': 'en'}, 'must differ'),
    ({'src_lang': 'e n'}, "src_lang='e n'"),
    ({'max_chars': 0}, 'max_chars'),
    ({'src': {'dev': 'x'}}, 'unknown split(s) dev'),
    ({'src': {'valid': 'x'}, 'tgt': {'valid': 'y'}}, 'no train split'),
  ],
)
def test_bad_arguments(tmp_path, kwargs, fragment):
  src, tgt = _corpus(tmp_path / 'files')
  src, tgt = kwargs.pop('src', src), kwargs.pop('tgt', tgt)
  args = dict(
    src_path_by_split=src,
    tgt_path_by_split=tgt,
    data_dir=str(tmp_path / 'tfds'),
    src_lang='en',
    tgt_lang='de',
  )
  args.update(kwargs)
  with pytest.raises(UserInputError, match=fragment.replace('(', r'\(').replace(')', r'\)')):
    td.prepare_text_dataset(**args)
  assert not (tmp_path / 'tfds').exists()


def test_unprepared_name_is_not_found(prepared):
  with pytest.raises(tfds.core.registered.DatasetNotFoundError):
    tfds.data_source('parallel_text/en_de_000000000000', data_dir=str(prepared[2]), try_gcs=False)


def test_loads_in_fresh_process_without_this_module(prepared):
  _, _, data_dir, name, _ = prepared
  code = (
    'import sys, tensorflow_datasets as tfds\n'
    f'ds = tfds.data_source({name!r}, data_dir={str(data_dir)!r}, try_gcs=False)\n'
    "print(len(ds['train']), ds['train'][0]['en'].decode(),\n"
    "      'transformer_jax.data.text_dataset' in sys.modules, 'tensorflow' in sys.modules)\n"
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True, cwd=str(data_dir)
  ).stdout.split()
  kept = sum(isinstance(row[2], tuple) for row in TRAIN_ROWS)
  assert out == [str(kept), 'Hello', 'world', 'False', 'False']


def test_multi30k(tmp_path):
  if not os.path.isdir(MULTI30K):
    pytest.skip(f'Multi30k not found at {MULTI30K}')
  src, tgt = td.text_paths(MULTI30K, 'en', 'de')
  start = time.perf_counter()
  name = td.prepare_text_dataset(
    src_path_by_split=src,
    tgt_path_by_split=tgt,
    data_dir=str(tmp_path),
    src_lang='en',
    tgt_lang='de',
  )
  print(f'preparing Multi30k took {time.perf_counter() - start:.1f} s')
  sources = tfds.data_source(name, data_dir=str(tmp_path), try_gcs=False)
  assert {split: len(source) for split, source in sources.items()} == {
    'train': 29_000,
    'validation': 1_014,
    'test': 1_000,
  }
  with open(src['test'], encoding='utf-8') as f_en, open(tgt['test'], encoding='utf-8') as f_de:
    first = (f_en.readline().strip(), f_de.readline().strip())
  assert (sources['test'][0]['en'].decode(), sources['test'][0]['de'].decode()) == first
  assert all(counts['kept'] == counts['lines'] for counts in td.last_prepare_report.values())


def test_tensorflow_not_imported(prepared):
  del prepared
  assert 'tensorflow' not in sys.modules


def test_split_over_tfds_memory_buffer_prepares_without_tensorflow(tmp_path, monkeypatch):
  # tfds spills a split of over 1 GB (WMT14's training set is ~1.5 GB) to temporary files
  # through tf.io.gfile, which needs TensorFlow. Shrink that bound to 100 bytes so this small
  # corpus crosses it: the dataset must still prepare, in file order, without TensorFlow.
  from tensorflow_datasets.core import shuffle

  monkeypatch.setattr(shuffle, 'MAX_MEM_BUFFER_SIZE', 100)
  src, tgt = _corpus(tmp_path / 'files')
  name = _prepare(src, tgt, tmp_path / 'tfds', max_chars=MAX_CHARS)
  sources = tfds.data_source(name, data_dir=str(tmp_path / 'tfds'), try_gcs=False)
  assert _decoded(sources['train']) == [r[2] for r in TRAIN_ROWS if isinstance(r[2], tuple)]
  assert shuffle.MAX_MEM_BUFFER_SIZE == 100  # Restored afterwards.
  assert 'tensorflow' not in sys.modules
