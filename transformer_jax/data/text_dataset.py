"""The user's own sentence-aligned parallel text as a tfds `array_record` dataset.

A corpus is a directory of plain UTF-8 files, one sentence per line, where line N
of the source file translates line N of the target file:

    DIR/train.en  DIR/train.de        (required)
    DIR/valid.en  DIR/valid.de        (optional; `validation.*` is accepted too)
    DIR/test.en   DIR/test.de         (optional)

`prepare_text_dataset` validates the files, then writes them once as the tfds
dataset `parallel_text/<src>_<tgt>_<fingerprint>` under `data_dir`; training
reads it like any other dataset, without TensorFlow:

    src, tgt = text_paths('/data/multi30k', 'en', 'de')
    name = prepare_text_dataset(src_path_by_split=src, tgt_path_by_split=tgt,
                                data_dir='/tmp/tfds', src_lang='en', tgt_lang='de')
    sources = tfds.data_source(name, data_dir='/tmp/tfds', try_gcs=False)
    sources['test'][0]  # {'en': b'A man in an orange hat ...', 'de': b'Ein Mann ...'}

Facts this module relies on (tensorflow-datasets 4.9.10):

* Loading needs no import of this module: `tfds.data_source(name, data_dir=...)`
  finds no registered `parallel_text` builder (the class is deliberately not
  registered) and reads the prepared directory from its `dataset_info.json` and
  `features.json` (a read-only builder). A name that was never prepared raises
  `tfds.core.registered.DatasetNotFoundError`.
* tfds normally writes examples in the order of a hash of their keys, and
  `data_source[split][i]` returns the i-th *written* example. The builder sets
  `disable_shuffling=True` (stored in dataset_info.json), so examples are written
  sorted by key, the 0-based line number: `data_source[split][i]` is the i-th
  kept pair in file order, and reading 0..len-1 visits every pair once, in order.

The config name carries a fingerprint: sha256 over the bytes of every file, the
split each belongs to, the languages, `max_chars` and `_FORMAT_VERSION`. Same
files -> same name, and an already prepared dataset is reused after hashing the
files (nothing else is read or written). Changed files -> a new name, prepared
next to the old one (old ones are never deleted).

All validation happens before anything is written, so a bad input raises
`UserInputError` (one line naming the file, and the line where there is one) and
leaves `data_dir` untouched. tfds itself writes into a temporary directory and
renames it at the end, so an interrupted prepare leaves no half-written dataset.

Line handling: a line ends at '\\n'; a trailing '\\r' (CRLF files), a UTF-8 byte
order mark and a missing final newline are fine. Each side is stripped of
leading and trailing whitespace. A pair with an empty side, or with a side longer
than `max_chars` characters, is dropped and counted; the counts are logged once
(absl logging.info) and kept in `last_prepare_report` and in the dataset's
metadata.json. A split left with no pair at all is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging as python_logging
import os
import re
import sys
from typing import Callable, Iterator

import tensorflow_datasets as tfds
from absl import logging
from etils import epath
from tensorflow_datasets.core import shuffle as tfds_shuffle

from transformer_jax.common import text_io
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.common.paths import file_sha256

DATASET_NAME = 'parallel_text'
# Part of the fingerprint: bump it when the way files become examples changes,
# so old prepared datasets are not reused under the new rules.
_FORMAT_VERSION = 1
_VERSION = '1.0.0'

# File stem(s) -> tfds split name, in the order splits are reported.
_SPLIT_STEMS = {'train': ('train',), 'validation': ('valid', 'validation'), 'test': ('test',)}
_SPLIT_ALIASES = {
  'train': 'train',
  'valid': 'validation',
  'validation': 'validation',
  'test': 'test',
}
# A language code: becomes a feature name, part of the dataset config name and
# (in text_paths) a file extension.
_LANG_RE = re.compile(r'^[A-Za-z][A-Za-z0-9_-]{0,31}$')

# Per split: {'lines': n, 'kept': n, 'empty': n, 'too_long': n}, from the
# latest successful `prepare_text_dataset` call (also when it reused a dataset).
last_prepare_report: dict[str, dict[str, int]] = {}


# ------------------------------------------------------------------ paths --


def text_paths(
  data_dir_of_files: str, src_lang: str, tgt_lang: str
) -> tuple[dict[str, str], dict[str, str]]:
  """(src_path_by_split, tgt_path_by_split) from the DIR/{split}.{lang} layout.

  train.{src,tgt} must exist. valid.* (or validation.*) and test.* are optional:
  a split whose two files are both absent is left out of the result; a split
  with only one of its two files is an error (the other is probably misnamed).
  """
  check_langs(src_lang, tgt_lang)
  if not os.path.isdir(data_dir_of_files):
    raise UserInputError(
      f'parallel text directory {data_dir_of_files} does not exist or is not a directory'
    )
  src_paths, tgt_paths = {}, {}
  for split, stems in _SPLIT_STEMS.items():
    found = [
      stem
      for stem in stems
      if any(
        os.path.exists(os.path.join(data_dir_of_files, f'{stem}.{lang}'))
        for lang in (src_lang, tgt_lang)
      )
    ]
    if len(found) > 1:
      names = ' and '.join(f'{stem}.{{{src_lang},{tgt_lang}}}' for stem in found)
      raise UserInputError(
        f'{data_dir_of_files} has both {names}; keep only one of them for the {split} split'
      )
    stem = found[0] if found else stems[0]
    src = os.path.join(data_dir_of_files, f'{stem}.{src_lang}')
    tgt = os.path.join(data_dir_of_files, f'{stem}.{tgt_lang}')
    if not found and split != 'train':
      continue  # Optional split, absent.
    for path in (src, tgt):
      if not os.path.exists(path):
        raise UserInputError(f'missing {split} file {path}')
    src_paths[split], tgt_paths[split] = src, tgt
  return src_paths, tgt_paths


# ------------------------------------------------------------- validation --


def check_langs(src_lang: str, tgt_lang: str, prefix: str = '') -> None:
  """Two different language codes (file suffixes, feature names); `prefix` says where they
  were set ('config.data.' for the run config)."""
  for field, lang in (('src_lang', src_lang), ('tgt_lang', tgt_lang)):
    if not isinstance(lang, str) or not _LANG_RE.match(lang):
      raise UserInputError(
        f'{prefix}{field}={lang!r} is not a language code: use a letter '
        'followed by letters, digits, "_" or "-" (e.g. "en")'
      )
  if src_lang == tgt_lang:
    raise UserInputError(
      f'{prefix}src_lang and {prefix}tgt_lang are both {src_lang!r}; they must differ'
    )


def _normalise_splits(
  src_path_by_split: dict[str, str], tgt_path_by_split: dict[str, str]
) -> dict[str, tuple[str, str]]:
  """{tfds split: (src path, tgt path)} in train/validation/test order."""
  for field, paths in (
    ('src_path_by_split', src_path_by_split),
    ('tgt_path_by_split', tgt_path_by_split),
  ):
    if not isinstance(paths, dict):
      raise UserInputError(f'{field} must be a dict {{split: path}}, got {type(paths).__name__}')
    unknown = sorted(str(s) for s in paths if s not in _SPLIT_ALIASES)
    if unknown:
      raise UserInputError(
        f'{field} has unknown split(s) {", ".join(unknown)}; expected {", ".join(_SPLIT_ALIASES)}'
      )
    if 'valid' in paths and 'validation' in paths:
      raise UserInputError(f'{field} has both "valid" and "validation"; give only one')
  src = {_SPLIT_ALIASES[s]: p for s, p in src_path_by_split.items()}
  tgt = {_SPLIT_ALIASES[s]: p for s, p in tgt_path_by_split.items()}
  if set(src) != set(tgt):
    raise UserInputError(
      'src_path_by_split and tgt_path_by_split name different splits: '
      f'{sorted(src)} vs {sorted(tgt)}'
    )
  if 'train' not in src:
    raise UserInputError('no train split: src_path_by_split/tgt_path_by_split need a "train" entry')
  pairs = {}
  for split in _SPLIT_STEMS:
    if split in src:
      for path in (src[split], tgt[split]):
        if not isinstance(path, (str, os.PathLike)):
          raise UserInputError(f'{split} path {path!r} is not a path')
        if not os.path.exists(path):
          raise UserInputError(f'missing {split} file {os.fspath(path)}')
        if not os.path.isfile(path):
          raise UserInputError(f'{split} file {os.fspath(path)} is not a regular file')
      pairs[split] = (os.fspath(src[split]), os.fspath(tgt[split]))
  return pairs


def _read_lines(path: str, data: bytes) -> list[str]:
  """The lines of a text file's bytes, without line terminators, under the reading policy of
  `common.text_io` (the same for translate and evaluate): a UserInputError naming the file and
  line for anything that is not UTF-8 text."""
  return text_io.decode_text(data, path, path)


def _fingerprint(
  digests: dict[str, tuple[str, str]], src_lang: str, tgt_lang: str, max_chars: int
) -> str:
  """12 hex digits over the file contents (by split), languages and options."""
  record = {
    'format_version': _FORMAT_VERSION,
    'src_lang': src_lang,
    'tgt_lang': tgt_lang,
    'max_chars': max_chars,
    'sha256': {split: list(pair) for split, pair in digests.items()},
  }
  blob = json.dumps(record, sort_keys=True).encode('utf-8')
  return hashlib.sha256(blob).hexdigest()[:12]


def _select_pairs(
  src_lines: list[str], tgt_lines: list[str], max_chars: int
) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
  """Kept (line index, src, tgt) in file order, and the drop counts."""
  kept, empty, too_long = [], 0, 0
  for index, (src, tgt) in enumerate(zip(src_lines, tgt_lines)):
    src, tgt = src.strip(), tgt.strip()
    if not src or not tgt:
      empty += 1
    elif len(src) > max_chars or len(tgt) > max_chars:
      too_long += 1
    else:
      kept.append((index, src, tgt))
  counts = {'lines': len(src_lines), 'kept': len(kept), 'empty': empty, 'too_long': too_long}
  return kept, counts


def _summary(counts: dict[str, int], max_chars: int) -> str:
  dropped = counts['empty'] + counts['too_long']
  if not dropped:
    return f'kept all {counts["lines"]:,} pairs'
  return (
    f'dropped {dropped:,} of {counts["lines"]:,} pairs: '
    f'{counts["empty"]:,} with an empty side, {counts["too_long"]:,} longer than '
    f'{max_chars:,} characters'
  )


# ----------------------------------------------------------- tfds builder --


class ParallelText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Sentence pairs read from the user's files; one config per fingerprint.

  Not registered with tfds: a prepared dataset is loaded from its directory
  (`tfds.data_source('parallel_text/<config>', data_dir=...)`), and an
  unprepared name then fails with DatasetNotFoundError rather than with an
  attempt to build an unknown config from code.
  """

  VERSION = tfds.core.Version(_VERSION)
  RELEASE_NOTES = {_VERSION: 'Initial release.'}
  # See number_words.NumberWords.code_path: tfds's own lookup needs a module
  # that is not installed, and the path is only used to look for checksums.
  code_path = tfds.core.Path(__file__)

  def __init__(
    self,
    *,
    src_lang: str,
    tgt_lang: str,
    pairs_by_split: dict[str, list[tuple[int, str, str]]],
    report: dict[str, dict[str, int]],
    **kwargs,
  ):
    self._src_lang = src_lang
    self._tgt_lang = tgt_lang
    self._pairs_by_split = pairs_by_split
    self._report = report
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      description=(
        f'Sentence-aligned {self._src_lang}-{self._tgt_lang} text from '
        'user files (transformer_jax.data.text_dataset).'
      ),
      features=tfds.features.FeaturesDict(
        {
          self._src_lang: tfds.features.Text(),
          self._tgt_lang: tfds.features.Text(),
        }
      ),
      supervised_keys=(self._src_lang, self._tgt_lang),
      # Write examples sorted by key (the line index), not by key hash, so that
      # data_source[split][i] is the i-th kept pair in file order.
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(report=self._report),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(pairs) for split, pairs in self._pairs_by_split.items()}

  def _generate_examples(self, pairs) -> Iterator[tuple[int, dict[str, str]]]:
    for index, src, tgt in pairs:
      yield index, {self._src_lang: src, self._tgt_lang: tgt}


# ---------------------------------------------------------------- prepare --


class _DropCustomConfigWarning(python_logging.Filter):
  """Hides tfds's 'Using custom data configuration' warning: custom is the design."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Using custom data configuration')


@contextlib.contextmanager
def _quiet_custom_config_warning():
  absl_logger = python_logging.getLogger('absl')
  log_filter = _DropCustomConfigWarning()
  absl_logger.addFilter(log_filter)
  try:
    yield
  finally:
    absl_logger.removeFilter(log_filter)


def dataset_path(name: str, data_dir: str) -> epath.Path:
  """Directory holding the prepared dataset `name` (as returned by prepare)."""
  return epath.Path(data_dir).expanduser() / name / _VERSION


def prepare_text_dataset(
  *,
  src_path_by_split: dict[str, str],
  tgt_path_by_split: dict[str, str],
  data_dir: str,
  src_lang: str,
  tgt_lang: str,
  max_chars: int = 10_000,
  check_name: Callable[[str], None] | None = None,
) -> str:
  """Prepares the parallel files as array_record once; returns the tfds name.

  Args:
    src_path_by_split: {'train'|'valid'|'validation'|'test': path} of source
      files; 'train' is required ('valid' is stored as split 'validation').
    tgt_path_by_split: the target files, with the same splits.
    data_dir: the tfds data directory to prepare into (and to load from).
    src_lang, tgt_lang: language codes; they are the feature names.
    max_chars: pairs with a side longer than this (after stripping) are dropped.
    check_name: called with the name once the files are hashed, before anything else is read
      or written: the name identifies the content, so a resumed run refuses other data there
      (`training.run_config.check_resume`) without preparing it.

  Returns:
    'parallel_text/<src>_<tgt>_<12 hex digits>', for
    `tfds.data_source(name, data_dir=data_dir, try_gcs=False)`.

  Raises:
    UserInputError: for any problem with the arguments or the files; nothing
      has been written then.
  """
  global last_prepare_report
  check_langs(src_lang, tgt_lang)
  if not is_integer(max_chars) or max_chars <= 0:
    raise UserInputError(f'max_chars must be a positive integer, got {max_chars!r}')
  paths = _normalise_splits(src_path_by_split, tgt_path_by_split)

  # Reuse: hashing the files is all it takes to find an existing dataset.
  digests = {split: (file_sha256(src), file_sha256(tgt)) for split, (src, tgt) in paths.items()}
  config_name = f'{src_lang}_{tgt_lang}_{_fingerprint(digests, src_lang, tgt_lang, max_chars)}'
  name = f'{DATASET_NAME}/{config_name}'
  if check_name is not None:
    check_name(name)
  path = dataset_path(name, data_dir)
  if (path / 'dataset_info.json').exists():
    report = {}
    metadata = path / 'metadata.json'
    if metadata.exists():
      report = json.loads(metadata.read_text()).get('report', {})
    last_prepare_report = report
    logging.info('Reusing %s prepared in %s', name, path)
    return name

  # Read and validate every file before writing anything.
  pairs_by_split, report = {}, {}
  for split, (src, tgt) in paths.items():
    src_data, tgt_data = (epath.Path(p).read_bytes() for p in (src, tgt))
    if (hashlib.sha256(src_data).hexdigest(), hashlib.sha256(tgt_data).hexdigest()) != digests[
      split
    ]:
      raise UserInputError(f'{split} files {src} / {tgt} changed while being prepared; run again')
    src_lines, tgt_lines = _read_lines(src, src_data), _read_lines(tgt, tgt_data)
    if len(src_lines) != len(tgt_lines):
      raise UserInputError(
        f'{split} files have different line counts: {src} has {len(src_lines):,} lines, '
        f'{tgt} has {len(tgt_lines):,}; line N of one must translate line N of the other'
      )
    pairs_by_split[split], report[split] = _select_pairs(src_lines, tgt_lines, max_chars)
    if not pairs_by_split[split]:
      raise UserInputError(
        f'no usable {split} pairs in {src} / {tgt}: '
        + (_summary(report[split], max_chars) if src_lines else 'the files are empty')
      )
    del src_data, tgt_data, src_lines, tgt_lines  # Only the kept pairs stay in memory.

  for split, counts in report.items():
    logging.info('%s: %s (%s)', split, _summary(counts, max_chars), name)

  tfds.disable_progress_bar()
  with _quiet_custom_config_warning():
    builder = ParallelText(
      config=tfds.core.BuilderConfig(
        name=config_name,
        description=f'{src_lang}->{tgt_lang}, max_chars={max_chars}, files: '
        + ', '.join(
          f'{split}={os.path.basename(s)}/{os.path.basename(t)}' for split, (s, t) in paths.items()
        ),
      ),
      data_dir=data_dir,
      file_format='array_record',
      src_lang=src_lang,
      tgt_lang=tgt_lang,
      pairs_by_split=pairs_by_split,
      report=report,
    )
  with _examples_buffered_in_memory():
    builder.download_and_prepare(
      file_format='array_record',
      download_config=tfds.download.DownloadConfig(try_download_gcs=False),
    )
  last_prepare_report = report
  return name


@contextlib.contextmanager
def _examples_buffered_in_memory():
  """Keeps tfds's writer from spilling a split's examples to temporary files.

  tfds buffers up to 1 GB of serialized examples per split in memory and writes the rest to
  temporary bucket files through `tf.io.gfile`, which needs TensorFlow: without this, a split
  over 1 GB (WMT14's training set: ~1.5 GB) fails to prepare. The examples are already all in
  memory as strings here, so buffering their serialized form costs about as much again.
  """
  saved = tfds_shuffle.MAX_MEM_BUFFER_SIZE
  tfds_shuffle.MAX_MEM_BUFFER_SIZE = sys.maxsize
  try:
    yield
  finally:
    tfds_shuffle.MAX_MEM_BUFFER_SIZE = saved
