"""A transformers MarianMT folder's vocabularies as ours, read as MarianTokenizer reads them:
vocab.json's ids (and target_vocab.json's for targets, with tokenizer_config.json's
separate_vocabs), source.spm / target.spm segmenting.

Our ids: PAD 0, EOS 1, BOS 2, UNK 3, then vocab.json's pieces from its id 2 on, then
target_vocab.json's pieces vocab.json lacks (separate vocabularies only), then the .spm pieces
neither has (MarianTokenizer: <unk>; marian_vocabulary). One id space holds both sides: each
side's HF ids map into it (`HFVocabulary.source_ids`, `target_ids`), and hf_marian gives every
id a side's vocabulary lacks that side's <unk> rows, and masks its logit. Each side's tokenizer
reads such ids as <unk> (the ids its SentencePiece model carries, data/tokenizer.py), as
MarianTokenizer does.

Special tokens, cut out of texts wherever they stand as MarianTokenizer's added-token trie cuts
them (`special_tokens`): </s>, <unk> and <pad> (a <pad> in a text is our BOS: MarianMTModel
attends to it, and BOS has <pad>'s rows), and the extra ones tokenizer_config.json,
special_tokens_map.json and added_tokens.json list, at MarianTokenizer's ids read in each side's
vocabulary. One MarianMTModel could not embed is refused in one line naming the file and field.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.data.tokenizer import BOS_ID, PAD_ID, UNK_ID, with_marian_rules
from transformer_jax.importers import hf_files
from transformer_jax.importers.marian_vocabulary import sentencepiece_vocabulary

_RESERVED = ['<pad>', '</s>', '<s>', '<unk>']  # Our ids 0-3 (data/tokenizer.py).


@dataclasses.dataclass(frozen=True)
class HFVocabulary:
  vocabulary: bytes  # Our SentencePiece model (source.spm's segmentation).
  # target.spm's over the same ids (or source.spm's with other ids lacking), None when both
  # sides read text alike.
  target_vocabulary: bytes | None
  source_ids: np.ndarray  # vocab.json's id -> ours (<pad>, the last, -> PAD).
  target_ids: np.ndarray  # target_vocab.json's (vocab.json's when shared) id -> ours.
  extra: int  # .spm pieces in neither vocabulary, appended last.
  separate: bool  # target_vocab.json apart (tokenizer_config.json separate_vocabs).
  vocab_size: int  # Ours: both sides' pieces and the extra ones.
  files: list[str]


def _read_pieces(path: str, size: int, field: str) -> list[str]:
  """Pieces by id of a vocab.json-like file of `size` ids (config.json `field`), <pad> last."""
  vocab = hf_files.read_json(path, 'vocabulary')
  if not isinstance(vocab, dict) or not all(
    isinstance(k, str) and is_integer(v) for k, v in vocab.items()
  ):
    raise UserInputError(f'{path}: not a map of pieces to ids')
  pieces = {v: k for k, v in vocab.items()}
  if sorted(pieces) != list(range(size)):
    raise UserInputError(f'{path}: ids are not 0..{size - 1} each once (config.json {field})')
  by_id = [pieces[i] for i in range(size)]
  if by_id[-1] != '<pad>':
    raise UserInputError(f'{path}: id {size - 1} is {by_id[-1]!r:.40}, not <pad>')
  if by_id[:2] != ['</s>', '<unk>']:
    raise UserInputError(f'{path}: Marian vocabularies start with </s> (0) and <unk> (1)')
  return by_id


def _check_agrees(pieces: list[str], vocab_path: str, spm_path: str) -> None:
  """Refuses a vocab.json that is not this .spm's (another model's, say). MarianTokenizer would
  read each .spm piece vocab.json lacks as <unk>; a Marian vocabulary built from the data that
  .spm segmented lacks at most its rare pieces, so half of them missing is another vocabulary."""
  import sentencepiece

  processor = sentencepiece.SentencePieceProcessor(model_file=spm_path)  # Read and checked.
  spm_pieces = [
    processor.id_to_piece(i)
    for i in range(processor.get_piece_size())
    if not (processor.is_control(i) or processor.is_unknown(i))
  ]
  known = set(pieces)
  missing = [piece for piece in spm_pieces if piece not in known]
  if 2 * len(missing) > len(spm_pieces):
    raise UserInputError(
      f'{vocab_path}: disagrees with {os.path.basename(spm_path)}: {len(missing)} of its '
      f"{len(spm_pieces)} pieces are not in it (e.g. {missing[0]!r:.40}): another model's "
      'vocabulary'
    )


# The tokenizer files whose special tokens MarianTokenizer reads (transformers 5), and the named
# special-token fields: MarianTokenizer's own three must be what its conversions have (the ids
# our model and searches assume); any other named one is cut out of texts as an added token.
_TOKENIZER_CONFIG, _SPECIAL_TOKENS_MAP, _ADDED_TOKENS = (
  'tokenizer_config.json',
  'special_tokens_map.json',
  'added_tokens.json',
)
_MARIAN_TOKENS = {'eos_token': '</s>', 'unk_token': '<unk>', 'pad_token': '<pad>'}
_OTHER_NAMED_TOKENS = ('bos_token', 'sep_token', 'cls_token', 'mask_token')


def _token_text(value, where: str) -> str:
  """A special token as the files give it: text, or an AddedToken's {'content': text, ...}."""
  if isinstance(value, dict):
    if value.get('single_word'):  # Matched only between word boundaries: no rule of ours.
      raise UserInputError(f'{where}: single_word=true is not supported')
    value = value.get('content')
  if not isinstance(value, str) or not value:
    raise UserInputError(f'{where}: expected a token (text), got {value!r:.60}')
  return value


def special_tokens(folder: str, pieces: list[str]) -> tuple[dict[str, int], list[str]]:
  """({token: MarianTokenizer's id} of every token its added-token trie cuts out of texts,
  the files read): its three (</s>, <unk>, <pad>), and any other that tokenizer_config.json,
  special_tokens_map.json (named fields, additional_special_tokens, extra_special_tokens) or
  added tokens (tokenizer_config.json added_tokens_decoder, added_tokens.json) list, at its
  vocab.json id (`pieces` by id) or the id given. One a MarianMTModel cannot embed (no
  vocab.json id), or that would change the ids of its three, is refused in one line."""
  ids = {piece: i for i, piece in enumerate(pieces)}
  tokens = {token: ids[token] for token in _MARIAN_TOKENS.values()}
  named: list[tuple[str, str]] = []  # (token, where): at its vocab.json id.
  given: dict[str, tuple[int, str]] = {}  # token -> (id, where): added tokens' own ids.
  files = []
  for name in (_TOKENIZER_CONFIG, _SPECIAL_TOKENS_MAP, _ADDED_TOKENS):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
      continue
    settings = hf_files.read_json(path, 'tokenizer file')
    if not isinstance(settings, dict):
      raise UserInputError(f'{path}: not a map of tokenizer settings')
    files.append(name)
    if name == _ADDED_TOKENS:
      given.update((token, (index, f'{path}: {token!r:.40}')) for token, index in settings.items())
      continue
    for field, want in _MARIAN_TOKENS.items():
      if settings.get(field) is not None:
        value = _token_text(settings[field], f'{path}: {field}')
        if value != want:
          raise UserInputError(
            f'{path}: {field}={value!r:.40} is not supported: MarianMT models have {want!r}'
          )
    fields = [(field, settings.get(field)) for field in _OTHER_NAMED_TOKENS]
    for field in ('additional_special_tokens', 'extra_special_tokens'):
      listed = settings.get(field) or []
      if isinstance(listed, dict):
        listed = list(listed.values())
      if not isinstance(listed, list):
        raise UserInputError(f'{path}: {field} must be a list of tokens')
      # transformers 5 reads a listed {'content': ...} as an AddedToken only when it says so
      # ('__type'); any other it takes as the text of the dict itself, a token no text holds
      # (and MarianMTModel could not embed): left out here.
      listed = [
        value
        for value in listed
        if not isinstance(value, dict) or value.get('__type') == 'AddedToken'
      ]
      fields += [(f'{field}[{i}]', value) for i, value in enumerate(listed)]
    named += [
      (_token_text(value, f'{path}: {field}'), f'{path}: {field}')
      for field, value in fields
      if value is not None
    ]
    decoder = settings.get('added_tokens_decoder') or {}
    if not isinstance(decoder, dict):
      raise UserInputError(f'{path}: added_tokens_decoder must be a map of ids to tokens')
    for index, value in decoder.items():
      where = f'{path}: added_tokens_decoder[{index!r:.20}]'
      number = int(index) if isinstance(index, str) and index.isdigit() else index
      given[_token_text(value, where)] = (number, where)
  for token, where in named:
    if token not in ids and token not in given:
      raise UserInputError(
        f'{where} {token!r:.40} is not in vocab.json: MarianTokenizer would give it a new id, '
        'which MarianMTModel has no embedding for'
      )
    tokens.setdefault(token, ids.get(token))
  for token, (index, where) in given.items():
    if not is_integer(index) or not 0 <= index < len(pieces):
      raise UserInputError(
        f"{where}: id {index!r:.20} is not among vocab.json's 0..{len(pieces) - 1}: "
        'MarianMTModel has no embedding for it'
      )
    if token in _MARIAN_TOKENS.values() and index != tokens[token]:
      raise UserInputError(f"{where}: {token} must have vocab.json's id {tokens[token]}")
    clash = [t for t in _MARIAN_TOKENS.values() if tokens[t] == index and t != token]
    if clash:
      raise UserInputError(f"{where}: id {index} is {clash[0]}'s")
    tokens[token] = int(index)
  return tokens, files


def _side_specials(tokens: dict[str, int], hf_ids: np.ndarray) -> dict[str, int]:
  """MarianTokenizer's special tokens as one side's ids of ours: its id read in that side's
  vocabulary (MarianTokenizer's ids are vocab.json's, which a target_vocab.json reads as its own
  pieces), that side's <pad> our BOS (a token MarianMTModel attends to, whose rows are <pad>'s;
  our PAD is padding), an id beyond a smaller target vocabulary UNK (MarianMTModel cannot embed
  it: there is no answer to match)."""
  pad = len(hf_ids) - 1
  return {
    token: BOS_ID if index == pad else int(hf_ids[index]) if index < pad else UNK_ID
    for token, index in tokens.items()
  }


def read_vocabulary(folder: str, vocab_size: int, target_vocab_size: int) -> HFVocabulary:
  """The vocabularies of a MarianMT folder whose config.json has these sizes (the module
  docstring)."""
  inside = lambda name: os.path.join(folder, name)  # noqa: E731
  for name in ('vocab.json', 'source.spm', 'target.spm'):
    if not os.path.exists(inside(name)):
      raise UserInputError(f'--model={folder}: {name} is missing (MarianTokenizer needs it)')
  tokenizer_config = inside(_TOKENIZER_CONFIG)
  separate = False
  if os.path.exists(tokenizer_config):
    settings = hf_files.read_json(tokenizer_config, 'tokenizer config')
    separate = isinstance(settings, dict) and settings.get('separate_vocabs', False)
    if not isinstance(separate, bool):
      raise UserInputError(f'{tokenizer_config}: separate_vocabs must be true or false')
  vocab_path, target_path = inside('vocab.json'), inside('target_vocab.json')
  source = _read_pieces(vocab_path, vocab_size, 'vocab_size')
  files = ['vocab.json']
  if separate:
    if not os.path.exists(target_path):
      raise UserInputError(
        f'--model={folder}: target_vocab.json is missing (tokenizer_config.json has '
        'separate_vocabs=true)'
      )
    target = _read_pieces(target_path, target_vocab_size, 'decoder_vocab_size')
    files.append('target_vocab.json')
  elif target_vocab_size != vocab_size:
    raise UserInputError(
      f'--model={folder}: decoder_vocab_size={target_vocab_size} is not vocab_size={vocab_size}, '
      'which needs a target_vocab.json (tokenizer_config.json separate_vocabs=true)'
    )
  else:
    target = source
  source_spm, target_spm = inside('source.spm'), inside('target.spm')
  with open(source_spm, 'rb') as a, open(target_spm, 'rb') as b:
    same = a.read() == b.read()
  # One id space: vocab.json's order (Marian's), then the target's pieces it lacks.
  in_source = set(source)
  joint = source[:-1] + [p for p in target[2:-1] if p not in in_source]
  vocabulary, target_vocabulary, extra = sentencepiece_vocabulary(
    joint, source_spm, vocab_path, None if same else target_spm
  )
  _check_agrees(source, vocab_path, source_spm)
  if separate or not same:
    _check_agrees(target, target_path if separate else vocab_path, target_spm)
  ours = {piece: i for i, piece in enumerate(_RESERVED + joint[2:])}
  ours['<pad>'] = PAD_ID

  def ids(pieces: list[str]) -> np.ndarray:
    return np.array([ours[piece] for piece in pieces], np.int64)

  vocab_size = len(_RESERVED) + len(joint) - 2 + extra
  source_ids, target_ids = ids(source), ids(target)
  tokens, tokenizer_files = special_tokens(folder, source)

  def lacking(side: np.ndarray) -> list[int]:  # Our ids this side's vocabulary has no piece for.
    return sorted(set(range(len(_RESERVED), vocab_size)) - set(side.tolist()))

  # Language tags (>>deu<<) and special tokens are cut out before SentencePiece, and pieces a
  # side's vocabulary lacks read as <unk>, as MarianTokenizer does: the rule rides in the
  # vocabulary's bytes (data/tokenizer.py). A target model apart gets the target's.
  if target_vocabulary is None and separate:
    target_vocabulary = vocabulary  # The same .spm, other ids to lack.
  source_rules = lacking(source_ids), _side_specials(tokens, source_ids)
  target_rules = lacking(target_ids), _side_specials(tokens, target_ids)
  if target_vocabulary is None and target_rules != source_rules:
    target_vocabulary = vocabulary  # The same .spm, other rules.
  return HFVocabulary(
    vocabulary=with_marian_rules(vocabulary, *source_rules),
    target_vocabulary=target_vocabulary and with_marian_rules(target_vocabulary, *target_rules),
    source_ids=source_ids,
    target_ids=target_ids,
    extra=extra,
    separate=separate,
    vocab_size=vocab_size,
    files=files + ['source.spm', 'target.spm'] + [f for f in tokenizer_files if f not in files],
  )
