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
detokenising. The search itself, encoder and cached decoder included, is the exported function.
"""

from __future__ import annotations

import argparse
import json
import os
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
    parameters = self.manifest['parameters']
    with np.load(self._path(parameters['file']), allow_pickle=False) as stored:
      # On the device once: the searches would otherwise copy every weight at every call.
      self.parameters = {name: jax.device_put(stored[name]) for name in parameters['shapes']}
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
    return self.sentencepiece.decode([i for i in ids if i not in control])

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
      ids = self.sentencepiece.encode(sentence, out_type=int)
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


def _read_lines(stream) -> list[str]:
  # Bytes that are not UTF-8 become U+FFFD instead of ending the run (as `translate`).
  return [raw.decode('utf-8', errors='replace').rstrip('\r\n') for raw in stream]


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
  translator = ExportedTranslator(args.model_dir)
  if args.input is None:
    lines = _read_lines(sys.stdin.buffer)
  else:
    with open(args.input, 'rb') as f:
      lines = _read_lines(f)
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
