"""Marian vocabularies as ours (marian.py): a `.yml` or `.spm` read in Marian's id order, and
SentencePiece models in our id order that segment each side as Marian's training did.

Our ids: PAD 0, EOS 1, BOS 2, UNK 3, then Marian's pieces from its id 2 on (marian.our_ids).
"""

from __future__ import annotations

import os
import re

from transformer_jax.common.errors import UserInputError, one_line
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.importers import bounded_yaml


def read_vocab_yml(path: str) -> list[str]:
  """Pieces by id of a Marian vocabulary `.yml` or `.json` (`piece: id` lines,
  data/default_vocab.cpp), at most MAX_VOCABULARY_BYTES. Every scalar is text (YAML's base
  loader: a safe loader turns unquoted `yes`, `null`, `1.0` into other types, merging keys);
  repeated or missing ids are refused, never silently dropped, and so are anchors and aliases
  (bounded_yaml). Read as parse events, so that no node of a long file is held."""
  import yaml

  data = bounded_yaml.read_bounded(path, bounded_yaml.MAX_VOCABULARY_BYTES, 'vocabulary')
  stream = bounded_yaml.events(bounded_yaml.decode(data, path), path)
  start = [next(stream, None) for _ in range(3)][-1]  # After StreamStart, DocumentStart.
  if not isinstance(start, yaml.MappingStartEvent):
    raise UserInputError(f'{path}: not a Marian vocabulary (a YAML map piece: id)')
  pieces: dict[int, str] = {}
  for key in stream:
    if isinstance(key, yaml.MappingEndEvent):
      break
    value = next(stream, None)
    if not isinstance(key, yaml.ScalarEvent) or not isinstance(value, yaml.ScalarEvent):
      raise UserInputError(f'{path}: line {key.start_mark.line + 1}: expected piece: id')
    index = int(value.value) if re.fullmatch(r'\d+', value.value) else -1
    if index in pieces or index < 0:
      raise UserInputError(
        f'{path}: line {key.start_mark.line + 1}: bad or repeated id {value.value!r:.100}'
      )
    pieces[index] = key.value
  if any(isinstance(event, yaml.DocumentStartEvent) for event in stream):
    raise UserInputError(f'{path}: not a Marian vocabulary (more than one YAML document)')
  if sorted(pieces) != list(range(len(pieces))):
    missing = min(set(range(len(pieces))) - set(pieces))
    raise UserInputError(f'{path}: ids are not 0..{len(pieces) - 1}: {missing} is missing')
  return [pieces[i] for i in range(len(pieces))]


def _load_spm(path: str):
  """The parsed SentencePiece model at `path` (at most MAX_VOCABULARY_BYTES)."""
  from sentencepiece import sentencepiece_model_pb2

  try:
    limit = bounded_yaml.MAX_VOCABULARY_BYTES
    data = bounded_yaml.read_bounded(path, limit, 'SentencePiece model')
  except FileNotFoundError:
    raise FileNotFoundError(f'SentencePiece model not found: {path}') from None
  proto = sentencepiece_model_pb2.ModelProto()
  try:
    proto.ParseFromString(data)
  except Exception as error:  # protobuf's DecodeError
    raise UserInputError(f'{path}: not a SentencePiece model ({one_line(error)})') from None
  if not proto.pieces:
    raise UserInputError(f'{path}: not a SentencePiece model (no pieces)')
  for index, piece in enumerate(proto.pieces):  # protobuf gives bytes for a string not UTF-8.
    if not isinstance(piece.piece, str):
      raise UserInputError(f'{path}: not a SentencePiece model (piece {index} is not UTF-8)')
  return proto


def sentencepiece_vocabulary(
  marian_pieces: list[str],
  spm_path: str,
  yml_path: str | None = None,
  target_spm_path: str | None = None,
) -> tuple[bytes, bytes | None, int]:
  """(SentencePiece model bytes, the target side's or None, number of pieces appended as <unk>
  copies).

  Our ids: [<pad>, </s>, <s>, <unk>] + marian_pieces[2:] + the .spm's pieces that Marian's
  vocabulary lacks (`_rows`), the target .spm's after the source's. Each model takes its .spm's
  normaliser, model type, scores and piece types; pieces its .spm lacks are UNUSED with a score
  below every other, so its segmentation never produces them (they still decode). With
  target_spm_path (OPUS-MT's target.spm) the second model segments target text into the same
  ids, as Marian's training did.
  """
  source = yml_path or spm_path
  if marian_pieces[:2] != ['</s>', '<unk>']:
    raise UserInputError(f'{source}: Marian vocabularies start with </s> (0) and <unk> (1)')
  clash = sorted(set(marian_pieces) & {'<pad>', '<s>'})
  if clash or len(set(marian_pieces)) != len(marian_pieces):
    why = f'{clash[0]!r} is one of our reserved pieces' if clash else 'a piece is listed twice'
    raise UserInputError(f'{source}: {why}')
  spms = [_load_spm(spm_path)] + ([_load_spm(target_spm_path)] if target_spm_path else [])
  known = set(marian_pieces) | {'<pad>', '<s>'}
  extra = [p.piece for spm in spms for p in spm.pieces if p.piece not in known]
  extra = list(dict.fromkeys(extra))
  models = [
    _our_sentencepiece_model(spm, marian_pieces[2:] + extra, path)
    for spm, path in zip(spms, [spm_path, target_spm_path])
  ]
  return models[0], models[1] if target_spm_path else None, len(extra)


def _our_sentencepiece_model(spm, pieces: list[str], spm_path: str) -> bytes:
  """`spm` (a parsed .spm) rebuilt over our reserved pieces + `pieces`, in that id order."""
  import sentencepiece
  from sentencepiece import sentencepiece_model_pb2

  Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
  scores = {p.piece: (p.score, p.type) for p in spm.pieces}
  lowest = min(p.score for p in spm.pieces) - 1.0
  proto = sentencepiece_model_pb2.ModelProto()  # Without the .spm's self-test samples, if any.
  for field in ('trainer_spec', 'normalizer_spec', 'denormalizer_spec'):
    if spm.HasField(field):
      getattr(proto, field).CopyFrom(getattr(spm, field))
  for index, piece in enumerate(['<pad>', '</s>', '<s>', '<unk>']):
    proto.pieces.add(piece=piece, type=Piece.UNKNOWN if index == UNK_ID else Piece.CONTROL)
  for piece in pieces:
    score, kind = scores.get(piece, (lowest, Piece.UNUSED))
    if kind not in (Piece.NORMAL, Piece.USER_DEFINED, Piece.BYTE):
      kind = Piece.UNUSED  # Another control piece of the .spm: no id of ours means it.
    proto.pieces.add(piece=piece, score=score, type=kind)
  spec = proto.trainer_spec
  spec.vocab_size = len(proto.pieces)
  spec.pad_id, spec.eos_id, spec.bos_id, spec.unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID
  spec.pad_piece, spec.eos_piece, spec.bos_piece, spec.unk_piece = '<pad>', '</s>', '<s>', '<unk>'
  vocabulary = proto.SerializeToString()
  try:
    sentencepiece.SentencePieceProcessor().LoadFromSerializedProto(vocabulary)
  except Exception as error:  # sentencepiece raises bare RuntimeErrors
    raise UserInputError(f'{spm_path}: our copy does not load: {one_line(error)}') from None
  return vocabulary


def read_vocabulary(vocab: str, spm: str | None = None) -> tuple[list[str], str, str | None]:
  """(Marian's pieces by id, the .spm that segments, the .yml or None) for --vocab [--spm]."""
  if vocab.endswith('.spm') or vocab.endswith('.model'):
    if spm is not None and os.path.abspath(spm) != os.path.abspath(vocab):
      raise UserInputError(f'--spm={spm} with --vocab={vocab}: a .spm vocabulary segments itself')
    return [p.piece for p in _load_spm(vocab).pieces], vocab, None
  if spm is None:
    raise UserInputError(f'--vocab={vocab} needs --spm=source.spm (the model that segments text)')
  try:
    return read_vocab_yml(vocab), spm, vocab
  except FileNotFoundError:
    raise FileNotFoundError(f'vocabulary not found: {vocab}') from None
