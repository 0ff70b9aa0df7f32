"""Shared source+target SentencePiece vocabulary: trained once, stored in the workdir.

A vocabulary imported from a transformers MarianMT model carries MarianTokenizer's rules as
well (MARIAN_MARKER): language tags and special tokens cut out before SentencePiece."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
import threading
import time
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import format_duration, log
from transformer_jax.common.progress import progress

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_TYPES = ('bpe', 'unigram', 'word', 'char')  # SentencePiece's.
# SentencePiece's sampling seed is process-wide: one seeded segmentation at a time.
_SAMPLING_LOCK = threading.Lock()
# A vocabulary imported from a transformers MarianMT model segments text as MarianTokenizer does
# (`_marian_segments`), which SentencePiece alone cannot express. The rule travels inside the
# model bytes, so every reader of the workdir's vocabulary (training, translating, serving,
# ensembles comparing hashes, token caches keyed by `fingerprint`) gets it: a length-delimited
# field of ModelProto's range for third-party extensions (200 and up), which SentencePiece parses
# as unknown, ignores and writes back last. Any other vocabulary lacks it and is read as before.
# Its payload: _MARIAN_TEXT, the special tokens (`MARIAN_SPECIALS` or the model's own: UTF-8
# JSON {token: id}, then its length as a uint32), the ids this side's MarianTokenizer vocabulary
# lacks (uint32s; they are <unk> to it), their count (a uint32): fixed text at a place the last
# bytes give, so that it is found from the end without parsing the model. (The first imports
# wrote _MARIAN_TEXT_V1 and no special tokens: they read as MARIAN_SPECIALS.)
_MARIAN_FIELD = 20050
_MARIAN_TEXT = b'transformer_jax: MarianTokenizer segmentation v2 (>>tag<< prefixes, specials)'
_MARIAN_TEXT_V1 = b'transformer_jax: MarianTokenizer segmentation (>>tag<< prefixes, specials)'
# MarianTokenizer's special tokens: its added-token trie cuts them out of the text wherever they
# stand, as these ids. A <pad> in a text is a token MarianMTModel attends to (its attention mask
# is 1 there), not padding: our BOS, whose embedding rows are <pad>'s on both sides
# (importers/hf_marian). A model's tokenizer files may add others (importers/hf_vocabulary).
MARIAN_SPECIALS = {'</s>': EOS_ID, '<unk>': UNK_ID, '<pad>': BOS_ID}


def _varint(value: int) -> bytes:
  """Protobuf's base-128 varint: 7 bits a byte, low first, the high bit saying more follow."""
  out = bytearray()
  while value > 0x7F:
    out.append(value & 0x7F | 0x80)
    value >>= 7
  return bytes(out + bytes([value]))


def _marian_field(unknown_ids: Sequence[int], specials: dict[str, int]) -> bytes:
  ids = sorted(set(int(i) for i in unknown_ids))
  tokens = json.dumps({str(k): int(v) for k, v in specials.items()}, sort_keys=True).encode()
  payload = _MARIAN_TEXT + tokens + struct.pack('<I', len(tokens))
  payload += struct.pack(f'<{len(ids)}I', *ids) + struct.pack('<I', len(ids))
  return _varint(_MARIAN_FIELD << 3 | 2) + _varint(len(payload)) + payload


def _uint32(data: bytes, end: int) -> int | None:
  """The little-endian uint32 that ends at `end`, None where there is none."""
  return struct.unpack('<I', data[end - 4 : end])[0] if 4 <= end <= len(data) else None


def read_marian_rules(
  model_proto: bytes,
) -> tuple[bytes, frozenset[int] | None, dict[str, int] | None]:
  """(the model without MarianTokenizer's rules, the ids its vocabulary lacks, its special
  tokens {token: id}), the last two None where the model has no such rules."""
  none = model_proto, None, None
  count = _uint32(model_proto, len(model_proto))
  if count is None:
    return none
  end = len(model_proto) - 4 - 4 * count  # Where the ids start.
  layouts = []  # (where the fixed text starts, it, the special tokens' JSON or None)
  size = _uint32(model_proto, end)
  if size is not None and end - 4 - size >= 0:
    layouts.append((end - 4 - size - len(_MARIAN_TEXT), _MARIAN_TEXT, (end - 4 - size, end - 4)))
  layouts.append((end - len(_MARIAN_TEXT_V1), _MARIAN_TEXT_V1, None))
  for start, text, tokens in layouts:
    field = _varint(_MARIAN_FIELD << 3 | 2) + _varint(len(model_proto) - start)
    if start < len(field) or model_proto[start - len(field) : start + len(text)] != field + text:
      continue
    specials = dict(MARIAN_SPECIALS)
    if tokens is not None:
      specials = json.loads(model_proto[tokens[0] : tokens[1]].decode())
    ids = struct.unpack(f'<{count}I', model_proto[end:-4])
    return model_proto[: start - len(field)], frozenset(ids), specials
  return none


def split_marian_rules(model_proto: bytes) -> tuple[bytes, frozenset[int] | None]:
  """(the model without MarianTokenizer's rules, the ids its vocabulary lacks, or None where
  the model has no such rules)."""
  return read_marian_rules(model_proto)[:2]


def with_marian_rules(
  model_proto: bytes, unknown_ids: Sequence[int] = (), specials: dict[str, int] | None = None
) -> bytes:
  """`model_proto` marked to segment text as transformers' MarianTokenizer (`Tokenizer`), its
  `unknown_ids` (pieces of ours that side's vocabulary lacks) read as <unk>, as it reads them,
  and its `specials` ({token: our id}; None: MARIAN_SPECIALS) cut out wherever they stand."""
  specials = MARIAN_SPECIALS if specials is None else specials
  return split_marian_rules(model_proto)[0] + _marian_field(unknown_ids, specials)


def _specials_pattern(specials: dict[str, int]) -> re.Pattern:
  """The special tokens as the added-token trie finds them: leftmost, then longest."""
  tokens = sorted(specials, key=lambda token: (-len(token), token))
  return re.compile('(' + '|'.join(map(re.escape, tokens)) + ')' if tokens else '((?!))')


class Tokenizer:
  """Text <-> ids with pad=0, eos=1, bos=2, unk=3 (the ids the model and decoder assume)."""

  def __init__(self, model_proto: bytes, path: str = '<memory>'):
    self.path = path
    self._processor = spm.SentencePieceProcessor()
    try:
      self._processor.LoadFromSerializedProto(model_proto)
    except Exception as error:  # sentencepiece raises a bare RuntimeError/OSError.
      raise UserInputError(f'{path}: not a valid SentencePiece model ({error})') from None
    ids = (
      self._processor.pad_id(),
      self._processor.eos_id(),
      self._processor.bos_id(),
      self._processor.unk_id(),
    )
    if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
      raise UserInputError(
        f'{path}: vocabulary has special ids pad/eos/bos/unk={ids}, '
        f'expected {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}'
      )
    # Read from what SentencePiece keeps (it writes unknown fields back last).
    _, self._marian_unknown, self._marian_specials = read_marian_rules(
      self._processor.serialized_model_proto()
    )
    self.marian_rules = self._marian_unknown is not None
    if self.marian_rules:
      self._marian_split = _specials_pattern(self._marian_specials)

  @classmethod
  def load(cls, path: str | os.PathLike) -> 'Tokenizer':
    path = paths.local_or_remote(path)
    if not path.exists():
      raise FileNotFoundError(f'vocabulary not found: {path}')
    if path.is_dir():
      raise UserInputError(f'{path}: is a directory, not a SentencePiece model')
    return cls(path.read_bytes(), str(path))

  @classmethod
  def train(
    cls,
    sentences: Iterable[str],
    *,
    vocab_size: int,
    model_type: str = 'bpe',
    character_coverage: float = 1.0,
    max_sentences: int = 1_000_000,
    report: bool = False,
    total: int | None = None,
  ) -> 'Tokenizer':
    """Trains a shared vocabulary on `sentences` (both languages, in a fixed order).

    report: shows the sentences read (of `total`, if given) with rate and ETA, then that
    SentencePiece trains, then how long it took (see `progress.py`; process 0 only).
    """
    if model_type not in MODEL_TYPES:  # SentencePiece: a ValueError deep in its trainer.
      raise UserInputError(
        f'vocabulary model_type must be one of {", ".join(MODEL_TYPES)}, got {model_type!r}'
      )
    model = io.BytesIO()
    if report:
      sentences = _reported(sentences, total, max_sentences, vocab_size)
    start = time.monotonic()
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      bos_id=BOS_ID,
      unk_id=UNK_ID,
      input_sentence_size=max_sentences,
      # Deterministic: same sentences in, same vocabulary out.
      shuffle_input_sentence=False,
      num_threads=1,
      # A vocabulary too large for a tiny corpus is a config error, reported by SentencePiece.
      hard_vocab_limit=True,
      minloglevel=2,
    )
    if report:
      log(f'vocabulary trained in {format_duration(time.monotonic() - start)}')
    return cls(model.getvalue())

  def save(self, path: str | os.PathLike) -> None:
    # Whole or not at all: a crash never leaves half a vocabulary.
    paths.write_atomically(path, self._processor.serialized_model_proto())
    self.path = str(path)

  @property
  def fingerprint(self) -> str:
    """Content hash of the vocabulary: caches of token ids are valid only for the same one."""
    return hashlib.sha256(self._processor.serialized_model_proto()).hexdigest()

  @property
  def model_bytes(self) -> bytes:
    """The serialized SentencePiece model (what `save` writes)."""
    return self._processor.serialized_model_proto()

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  def encode(self, text: str) -> list[int]:
    if self.marian_rules:
      return self._marian_encode([text], self._processor.encode)[0]
    return self._processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if self.marian_rules:
      return self._marian_encode(texts, self._processor.encode)
    return self._processor.encode(list(texts), out_type=int)

  def _marian_segments(self, text: str) -> list[str | int]:
    """`text` cut as transformers' MarianTokenizer cuts it before SentencePiece sees it (its
    `tokenize` and `_tokenize`, transformers 5): special tokens out wherever they stand, then in
    each piece of text between them a leading `>>code<<` (from `>>` to the first `<<`, whatever
    lies between) out as the id of that piece (a language tag), <unk> when the vocabulary lacks
    it. Ids as ints, the rest as strings for SentencePiece, each encoded apart."""
    out: list[str | int] = []
    for index, part in enumerate(self._marian_split.split(text)):
      if index % 2:  # A special token (split's odd parts are what the pattern matched).
        out.append(self._marian_specials[part])
        continue
      if part.startswith('>>') and (end := part.find('<<')) != -1:
        tag = self._processor.piece_to_id(part[: end + 2])  # unk_id when absent.
        out.append(UNK_ID if tag in self._marian_unknown else tag)
        part = part[end + 2 :]
      if part:
        out.append(part)
    return out

  def _marian_encode(self, texts: Sequence[str], encode) -> list[list[int]]:
    """`encode` (a list of strings -> their ids) over `texts`' SentencePiece parts, in one call,
    with their tags' and special tokens' ids between."""
    segments = [self._marian_segments(text) for text in texts]
    parts = [part for row in segments for part in row if isinstance(part, str)]
    encoded = encode(parts, out_type=int) if parts else []
    unknown = self._marian_unknown
    if unknown:  # Pieces MarianTokenizer's vocabulary lacks: it reads them as <unk>.
      encoded = [[UNK_ID if i in unknown else i for i in ids] for ids in encoded]
    encoded = iter(encoded)
    return [
      [i for part in row for i in (next(encoded) if isinstance(part, str) else [part])]
      for row in segments
    ]

  def encode_sampled(self, texts: Sequence[str], alpha: float, seed: int) -> list[list[int]]:
    """One random segmentation of each text (SentencePiece's sampling: BPE-dropout with merge
    dropout `alpha` for a BPE vocabulary, Kudo's subword regularisation with smoothing `alpha`
    for a unigram one), the same for the same (texts, alpha, seed).

    SentencePiece draws from a generator per thread, seeded from its global seed when the thread
    first samples; so each call seeds it and samples in a thread of its own, one at a time.
    """
    result: list[list[list[int]]] = []

    def sampled(parts: list[str], out_type=int) -> list[list[int]]:
      return self._processor.encode(
        parts, out_type=out_type, enable_sampling=True, alpha=alpha, nbest_size=-1, num_threads=1
      )

    def segment() -> None:
      # A MarianTokenizer vocabulary samples only the text between tags and special tokens.
      marian = self.marian_rules
      result.append(self._marian_encode(texts, sampled) if marian else sampled(list(texts)))

    with _SAMPLING_LOCK:
      spm.set_random_generator_seed(int(seed))
      thread = threading.Thread(target=segment, name='subword-sampling')
      thread.start()
      thread.join()
    if not result:
      raise RuntimeError('subword sampling failed (its thread raised; see the log above)')
    return result[0]

  def decode(self, ids: Sequence[int]) -> str:
    # Control ids (pad, eos, bos) are not text; unk stays visible as SentencePiece renders it.
    text = self._processor.decode([int(i) for i in ids if int(i) not in (PAD_ID, EOS_ID, BOS_ID)])
    # MarianTokenizer's decode strips the text (its convert_tokens_to_string): a run of '▁'
    # pieces at an end is no text there.
    return text.strip() if self.marian_rules else text

  def pieces(self, ids: Sequence[int]) -> list[str]:
    return [self._processor.id_to_piece(int(i)) for i in ids]

  def piece_ids(self, pieces: Sequence[str]) -> list[int]:
    """The ids of `pieces` (UNK for a piece the vocabulary lacks): `pieces`' inverse."""
    return [self._processor.piece_to_id(piece) for piece in pieces]

  def marian_record(self) -> dict | None:
    """MarianTokenizer's rules of this vocabulary as data, for readers without transformer_jax
    (the CTranslate2 and StableHLO exports write it; stablehlo_runner applies it): None for a
    plain SentencePiece vocabulary, else {'specials': {token: id}, cut out of the text wherever
    they stand; 'unknown_ids': ids read as UNK, whether SentencePiece or a leading `>>tag<<`
    (looked up by piece) gives them; 'unk_id'; 'strip': the decoded text is stripped}."""
    if not self.marian_rules:
      return None
    return {
      'rule': 'MarianTokenizer',
      'specials': dict(sorted(self._marian_specials.items())),
      'unknown_ids': sorted(self._marian_unknown),
      'unk_id': UNK_ID,
      'strip': True,
    }


def _reported(
  sentences: Iterable[str], total: int | None, max_sentences: int, vocab_size: int
) -> Iterator[str]:
  """`sentences` unchanged, counted as SentencePiece reads them; says when it starts training.

  With shuffle_input_sentence off SentencePiece keeps the first `max_sentences` and asks for
  one more before it stops reading: that request (or the end of the sentences) is the moment
  reading ends and training begins.
  """
  bar = progress(
    total=None if total is None else min(total, max_sentences),
    unit='sentences',
    description='vocabulary: reading sentences',
  )
  count = 0

  def training_begins():
    if not bar.closed:
      bar.close()
      log(f'training the {vocab_size}-piece vocabulary on {count:,} sentences')

  try:
    for sentence in sentences:
      if count == max_sentences:
        training_begins()  # SentencePiece reads this one, discards it and stops.
      else:
        count += 1
        bar.update()
      yield sentence
    training_begins()
  finally:
    bar.close(final_line=False)  # A failure while reading: the bar ends, no 'done' line.
