"""Shared source+target SentencePiece vocabulary: trained once, stored in the workdir."""

from __future__ import annotations

import hashlib
import io
import os
from typing import Iterable, Sequence

import sentencepiece as spm

from transformer_jax.errors import UserInputError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3


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

  @classmethod
  def load(cls, path: str) -> 'Tokenizer':
    if not os.path.exists(path):
      raise FileNotFoundError(f'vocabulary not found: {path}')
    with open(path, 'rb') as f:
      return cls(f.read(), path)

  @classmethod
  def train(
    cls,
    sentences: Iterable[str],
    *,
    vocab_size: int,
    model_type: str = 'bpe',
    character_coverage: float = 1.0,
    max_sentences: int = 1_000_000,
  ) -> 'Tokenizer':
    """Trains a shared vocabulary on `sentences` (both languages, in a fixed order)."""
    model = io.BytesIO()
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
    return cls(model.getvalue())

  def save(self, path: str) -> None:
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
      f.write(self._processor.serialized_model_proto())
    os.replace(tmp, path)  # Atomic: a crash never leaves half a vocabulary.
    self.path = path

  @property
  def fingerprint(self) -> str:
    """Content hash of the vocabulary: caches of token ids are valid only for the same one."""
    return hashlib.sha256(self._processor.serialized_model_proto()).hexdigest()

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._processor.encode(list(texts), out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    # Control ids (pad, eos, bos) are not text; unk stays visible as SentencePiece renders it.
    return self._processor.decode([int(i) for i in ids if int(i) not in (PAD_ID, EOS_ID, BOS_ID)])

  def pieces(self, ids: Sequence[int]) -> list[str]:
    return [self._processor.id_to_piece(int(i)) for i in ids]
