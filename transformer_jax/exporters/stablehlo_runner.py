"""Translates with a StableHLO export of a transformer_jax model, needing only jax (with
flatbuffers, which `jax.export.deserialize` reads with), numpy and sentencepiece.

`python -m transformer_jax.export --format=stablehlo --out=DIR` copies this file into DIR as
`translate.py`, with a `__main__` entry calling `main`:

    python DIR/translate.py [--beam_size=4] [--alpha=0.6] [--batch_size=64] \\
        [--input=FILE] [--output=FILE] [--model_dir=DIR] < sentences > translations

or, from Python, `ExportedTranslator(DIR).translate(sentences, beam_size=4, alpha=0.6)`.

It must import nothing from transformer_jax, nor flax: the directory is meant for machines that
have neither. What it does on the host is what `transformer_jax.inference.Translator.translate`
does (tests/export_stablehlo_test.py checks that both translate identically): sources of at most
max_len tokens with their EOS, sorted by length, padded to the Translator's length buckets (the
exported search decodes min(bucket + 50, max_len) positions, the Translator's decode length), each
output capped at its source length + 50 tokens (EOS counted), control ids dropped before
detokenising. The search itself, encoder and cached decoder included, is the exported function,
in the dtype it was exported in (manifest.json's 'dtype'; its parameters are read back in theirs,
`load_parameters`). A vocabulary imported from a transformers MarianMT model segments text as
MarianTokenizer does (language tags, special tokens), which SentencePiece alone cannot: the
manifest's 'marian_rules' (`Tokenizer.marian_record`) says how, and `marian_encode` applies it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from typing import Sequence

import jax
import numpy as np
import sentencepiece
from jax import export

FORMAT = 'transformer_jax.stablehlo'
FORMAT_VERSION = 1
MANIFEST_FILE = 'manifest.json'


def source_bucket(length: int, limit: int, smallest: int) -> int:
  """The padded source length for a batch whose longest source has `length` tokens: the smallest
  power-of-two multiple of `smallest` >= length, at most `limit` (the Translator's buckets)."""
  bucket = smallest
  while bucket < length:
    bucket *= 2
  return min(bucket, limit)


def strip_after_eos(tokens: np.ndarray, eos_id: int, pad_id: int) -> list[list[int]]:
  """int[rows, length] -> per-row ids before the first EOS, padding removed."""
  rows = []
  for row in np.asarray(tokens).tolist():
    if eos_id in row:
      row = row[: row.index(eos_id)]
    rows.append([token for token in row if token != pad_id])
  return rows


def marian_encode(sp, text: str, rules: dict) -> list[int]:
  """The ids of `text` as transformers' MarianTokenizer cuts it (transformer_jax's
  `Tokenizer._marian_segments`, copied: this file imports nothing of transformer_jax; the
  CTranslate2 export's README shows this function too; tests/import_hf_workdir_test.py checks
  that both give the same ids): the special tokens `rules['specials']` ({token: id}) out
  wherever they stand, leftmost then longest; in each stretch of text between them a leading
  `>>code<<` out as the id of that piece (a language tag); the rest through SentencePiece
  (`sp`); ids in `rules['unknown_ids']` read as `rules['unk_id']`."""
  specials, unknown = rules['specials'], set(rules['unknown_ids'])
  tokens = sorted(specials, key=lambda token: (-len(token), token))
  split = re.compile('(' + '|'.join(map(re.escape, tokens)) + ')' if tokens else '((?!))')
  ids = []
  for index, part in enumerate(split.split(text)):
    if index % 2:  # A special token.
      ids.append(specials[part])
      continue
    if part.startswith('>>') and (end := part.find('<<')) != -1:
      ids.append(sp.piece_to_id(part[: end + 2]))  # A language tag: that piece, or <unk>.
      part = part[end + 2 :]
    if part:
      ids += sp.encode(part, out_type=int)
  return [rules['unk_id'] if i in unknown else i for i in ids]


def load_parameters(path: str, description: dict) -> dict[str, np.ndarray]:
  """parameters.npz as the search takes them: the arrays named in the manifest's
  parameters.shapes, the bfloat16 ones (stored as uint16 bit patterns: NumPy cannot name
  bfloat16 in a file) viewed back as jax's bfloat16. An export without dtypes_by_name (before
  --dtype) holds float32 only."""
  dtypes = description.get('dtypes_by_name', {})
  with np.load(path, allow_pickle=False) as stored:
    arrays = {name: stored[name] for name in description['shapes']}
  return {
    name: value.view(jax.numpy.bfloat16) if dtypes.get(name) == 'bfloat16' else value
    for name, value in arrays.items()
  }


class ExportedTranslator:
  """The exported searches of one directory: `.translate(list_of_str) -> list_of_str`."""

  def __init__(self, model_dir: str):
    self.model_dir = os.path.abspath(model_dir)
    with open(os.path.join(self.model_dir, MANIFEST_FILE), encoding='utf-8') as f:
      self.manifest = json.load(f)
    if self.manifest.get('format') != FORMAT or self.manifest.get('version') != FORMAT_VERSION:
      raise ValueError(
        f'{self.model_dir}: not a {FORMAT} export of version {FORMAT_VERSION} '
        f'(manifest says {self.manifest.get("format")!r} {self.manifest.get("version")!r})'
      )
    ids = self.manifest['special_ids']
    self.pad_id, self.eos_id, self.bos_id = ids['pad'], ids['eos'], ids['bos']
    self.max_len = self.manifest['max_len']
    self.sentencepiece = sentencepiece.SentencePieceProcessor(
      model_file=self._path(self.manifest['sentencepiece_model'])
    )
    self.marian_rules = self.manifest.get('marian_rules')  # None: SentencePiece alone.
    parameters = self.manifest['parameters']
    stored = load_parameters(self._path(parameters['file']), parameters)
    # On the device once: the searches would otherwise copy every weight at every call.
    self.parameters = {name: jax.device_put(value) for name, value in stored.items()}
    self._searches = {}

  @property
  def beam_sizes(self) -> list[int]:
    return sorted(int(size) for size in self.manifest['searches'])

  def _path(self, name: str) -> str:
    return os.path.join(self.model_dir, name)

  def _search(self, beam_size: int):
    """The exported search for `beam_size`, jitted so that each batch shape compiles once."""
    if beam_size not in self._searches:
      searches = self.manifest['searches']
      if str(beam_size) not in searches:
        raise ValueError(
          f'beam_size={beam_size} was not exported; this directory has beam sizes '
          f'{", ".join(map(str, self.beam_sizes))} (1 is greedy)'
        )
      path = self._path(searches[str(beam_size)]['file'])
      with open(path, 'rb') as f:
        serialized = bytearray(f.read())
      try:
        exported = export.deserialize(serialized)
      except Exception as error:  # jax says what is incompatible; say which files and versions.
        raise RuntimeError(
          f'{path}: jax {jax.__version__} cannot read this export (written by jax '
          f'{self.manifest["jax_version"]}): {error}'
        ) from error
      self._searches[beam_size] = jax.jit(exported.call)
    return self._searches[beam_size]

  def _detokenise(self, ids: Sequence[int]) -> str:
    # Control ids are not text (as the Tokenizer); unk stays visible as SentencePiece renders it.
    control = (self.pad_id, self.eos_id, self.bos_id)
    text = self.sentencepiece.decode([i for i in ids if i not in control])
    # MarianTokenizer's decode strips the text, as the Tokenizer does for its vocabularies.
    return text.strip() if self.marian_rules and self.marian_rules['strip'] else text

  def encode(self, sentence: str) -> list[int]:
    """The source ids of `sentence` (no EOS), as the workdir's Tokenizer gives them."""
    if self.marian_rules:
      return marian_encode(self.sentencepiece, sentence, self.marian_rules)
    return self.sentencepiece.encode(sentence, out_type=int)

  def translate(
    self,
    sentences: Sequence[str],
    beam_size: int | None = None,
    alpha: float | None = None,
    batch_size: int | None = None,
  ) -> list[str]:
    """One translation per sentence, in order; blank sentences give empty translations.

    beam_size 1 is greedy search; defaults are the manifest's (the paper's beam 4, alpha 0.6).
    Batches hold `batch_size` sentences, any number: the exported batch axis is symbolic.
    """
    defaults = self.manifest['defaults']
    beam_size = defaults['beam_size'] if beam_size is None else beam_size
    alpha = defaults['alpha'] if alpha is None else alpha
    batch_size = defaults['batch_size'] if batch_size is None else batch_size
    if isinstance(sentences, (str, bytes)):
      raise TypeError('translate takes a list of sentences; pass [sentence]')
    if batch_size < 1 or not alpha >= 0:
      raise ValueError(f'batch_size must be >= 1 and alpha >= 0, got {batch_size}, {alpha}')
    search = self._search(beam_size)
    extra_length = self.manifest['extra_decode_length']
    encoded: list[list[int] | None] = []
    for index, sentence in enumerate(sentences):
      if not sentence.strip():
        encoded.append(None)
        continue
      ids = self.encode(sentence)
      if len(ids) + 1 > self.max_len:
        print(
          f'sentence {index} has {len(ids) + 1} tokens; truncated to the model maximum '
          f'{self.max_len}',
          file=sys.stderr,
        )
        ids = ids[: self.max_len - 1]
      encoded.append(ids + [self.eos_id])
    outputs = [''] * len(sentences)
    order = sorted(
      (i for i, ids in enumerate(encoded) if ids is not None), key=lambda i: len(encoded[i])
    )
    # Full batches: one compiled shape per length bucket (fewer rows only when there are fewer).
    rows_per_batch = min(batch_size, len(order))
    for start in range(0, len(order), batch_size):
      rows = order[start : start + batch_size]
      source_length = source_bucket(
        max(len(encoded[i]) for i in rows), self.max_len, self.manifest['min_source_bucket']
      )
      source_ids = np.full((rows_per_batch, source_length), self.pad_id, np.int32)
      max_lengths = np.ones((rows_per_batch,), np.int32)
      for row, index in enumerate(rows):
        source_ids[row, : len(encoded[index])] = encoded[index]
        max_lengths[row] = len(encoded[index]) + extra_length
      max_lengths = np.minimum(max_lengths, min(self.max_len, source_length + extra_length))
      # [rows, min(source_length + 50, max_len)]: each row's best hypothesis.
      tokens = search(self.parameters, source_ids, max_lengths, np.float32(alpha))
      for row, (index, ids) in enumerate(
        zip(rows, strip_after_eos(np.asarray(tokens), self.eos_id, self.pad_id))
      ):
        # Greedy search runs to the batch's longest cap; each output keeps its own (EOS counted).
        outputs[index] = self._detokenise(ids[: max_lengths[row] - 1])
    return outputs


# The reading policy of transformer_jax.common.text_io (its home, documented there), copied
# because this file may not import transformer_jax: `decode_text` gives the same lines and the
# same one-line messages (ValueError here, UserInputError there) on the same bytes, which
# tests/text_policy_test.py checks on a table of byte strings. Change both or neither.
_BOM = '\ufeff'
_NOT_TEXT = (
  (b'\x1f\x8b', 'gzip-compressed', 'decompress it first (gunzip -c FILE | ...)'),
  (
    re.compile(b'BZh[1-9](?:1AY&SY|\x17rE8P\x90)'),
    'bzip2-compressed',
    'decompress it first (bunzip2 -c FILE | ...)',
  ),
  (b'\xfd7zXZ\x00', 'xz-compressed', 'decompress it first (xz -dc FILE | ...)'),
  (b'\x28\xb5\x2f\xfd', 'zstd-compressed', 'decompress it first (zstd -dc FILE | ...)'),
  (b'\x04\x22\x4d\x18', 'lz4-compressed', 'decompress it first (lz4 -dc FILE | ...)'),
  (
    re.compile(b'PK(?:\x03\x04|\x05\x06|\x07\x08)'),
    'a zip archive',
    'extract the text file from it first (unzip -p FILE | ...)',
  ),
  (
    b"7z\xbc\xaf'\x1c",
    'a 7z archive',
    'extract the text file from it first (7z x -so FILE | ...)',
  ),
  (
    b'\xff\xfe\x00\x00',
    'UTF-32LE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8 FILE | ...)',
  ),
  (
    b'\x00\x00\xfe\xff',
    'UTF-32BE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-32 -t UTF-8 FILE | ...)',
  ),
  (
    b'\xff\xfe',
    'UTF-16LE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE | ...)',
  ),
  (
    b'\xfe\xff',
    'UTF-16BE text (by its byte order mark)',
    'convert it to UTF-8 first (iconv -f UTF-16 -t UTF-8 FILE | ...)',
  ),
)


def decode_text(data: bytes, name: str, path: str | None = None) -> list[str]:
  """The lines of a whole input's bytes, without line endings (text_io.decode_text's copy)."""
  for magic, what, advice in _NOT_TEXT:
    if magic.match(data) if isinstance(magic, re.Pattern) else data.startswith(magic):
      advice = advice.replace('FILE', shlex.quote(path) if path else 'FILE')
      raise ValueError(f'{name}: {what}, not UTF-8 text; {advice}')
  problems = []  # (line, order within a line, message): the first line's problem is refused.
  nul = data.find(b'\x00')
  if nul >= 0:
    line = data.count(b'\n', 0, nul) + 1
    problems.append(
      (
        line,
        0,
        f'{name} line {line}: NUL byte; this looks like a binary file, expected UTF-8 text '
        'with one sentence per line',
      )
    )
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    line = data.count(b'\n', 0, error.start) + 1
    problems.append(
      (
        line,
        1,
        f'{name} line {line}: invalid UTF-8 (byte 0x{data[error.start]:02x} at offset '
        f'{error.start}); convert the file to UTF-8',
      )
    )
    text = data.decode('utf-8', errors='replace')
  text = text.removeprefix(_BOM)
  stray = text.find(_BOM)
  if stray >= 0:
    line = text.count('\n', 0, stray) + 1
    problems.append(
      (
        line,
        2,
        f'{name} line {line}: a byte order mark (U+FEFF) after the start of the text (files '
        'joined with cat keep theirs); only one, at the very start, is allowed: remove it',
      )
    )
  if '\r' in text and '\n' not in text:
    problems.append(
      (1, 3, f'{name} line 1: the file uses CR-only (old Mac) line endings; convert them to \\n')
    )
  if problems:
    raise ValueError(min(problems)[2])
  if not text:
    return []
  lines = text.split('\n')
  if lines[-1] == '':
    lines.pop()
  return [line.rstrip('\r') for line in lines] if '\r' in text else lines


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description='Translates lines (one translation per line) with an exported transformer_jax '
    'model.'
  )
  here = os.path.dirname(os.path.abspath(__file__))
  parser.add_argument('--model_dir', default=here, help='the export (default: this directory)')
  parser.add_argument('--beam_size', type=int, default=None, help='1 is greedy (default: 4)')
  parser.add_argument('--alpha', type=float, default=None, help='length penalty (default: 0.6)')
  parser.add_argument('--batch_size', type=int, default=None, help='sentences per batch')
  parser.add_argument('--input', default=None, help='UTF-8 text file (default: stdin)')
  parser.add_argument('--output', default=None, help='file to write (default: stdout)')
  args = parser.parse_args(argv)
  try:  # The input first: a file that is not text costs no loading.
    if args.input is None:
      lines = decode_text(sys.stdin.buffer.read(), 'stdin')
    else:
      with open(args.input, 'rb') as f:
        lines = decode_text(f.read(), f'--input={args.input}', args.input)
  except (OSError, ValueError) as error:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    where = f'--input={args.input}: ' if isinstance(error, OSError) else ''
    print(f'error: {where}{reason}', file=sys.stderr)
    return 2
  translator = ExportedTranslator(args.model_dir)
  try:
    translations = translator.translate(lines, args.beam_size, args.alpha, args.batch_size)
  except ValueError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  # A newline inside a translation would shift every later line: it becomes a space.
  text = ''.join(line.replace('\n', ' ') + '\n' for line in translations)
  if args.output is None:
    sys.stdout.write(text)
    sys.stdout.flush()
  else:
    with open(args.output, 'w', encoding='utf-8') as f:
      f.write(text)
  return 0
