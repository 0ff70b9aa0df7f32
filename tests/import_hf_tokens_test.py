"""Special tokens of a transformers MarianMT import (issue 50), tokenized exactly as
`MarianTokenizer` tokenizes them: `</s>`, `<unk>` and `<pad>` in the middle of a text; a
language tag the .spm has as a piece but vocab.json lacks, and one vocab.json has but the .spm
lacks; the extra special tokens of tokenizer_config.json, special_tokens_map.json and
added_tokens.json, cut out wherever they stand. What MarianMTModel could not embed is refused
at import in one line naming the file and field.

Ids are compared by piece name (import_hf_test's tables), MarianTokenizer's <pad> in an
unpadded text being our BOS: a token MarianMTModel attends to, whose rows are <pad>'s (a
literal <pad> is checked to compute as MarianMTModel computes it).
"""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import hf_tiny
from import_hf_tags_test import _texts
from import_hf_test import WORDS, make_folder

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import BOS_ID, UNK_ID, Tokenizer
from transformer_jax.exporters import huggingface
from transformer_jax.importers import hf_marian, hf_vocabulary
from transformer_jax.inference.translator import Translator

torch = pytest.importorskip('torch', reason='torch is not installed (pip install -e .[test])')
transformers = pytest.importorskip(
  'transformers', reason='transformers is not installed (pip install -e .[test])'
)

TAGS = ('>>deu<<', '>>fra<<', '>>spa<<')
SPM_TAG = '>>ita<<'  # A piece of the .spm (user-defined: SentencePiece cuts it anywhere).
SIZES = {k: hf_tiny.FIELDS[k] for k in hf_tiny.FIELDS if k.endswith(('_model', 'layers', 'dim'))}
SIZES.update(encoder_attention_heads=2, decoder_attention_heads=2)


def _add_spm_piece(path: str, piece: str) -> None:
  from sentencepiece import sentencepiece_model_pb2

  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, 'rb') as f:
    proto.ParseFromString(f.read())
  proto.pieces.add(piece=piece, score=0.0, type=proto.SentencePiece.USER_DEFINED)
  with open(path, 'wb') as f:
    f.write(proto.SerializeToString())


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """{'shared': one vocabulary, target.spm the same; 'separate': hf_tiny's, separate
  vocabularies of unequal sizes}, TAGS in vocab.json, SPM_TAG in the .spm files only."""
  root = tmp_path_factory.mktemp('hf_tokens')
  made = {}
  for name, fields in (('shared', dict(SIZES)), ('separate', dict(hf_tiny.FIELDS))):
    folder = str(root / name)
    made[name] = folder, make_folder(folder, fields, 'safetensors', 4.0, 0.3, tags=TAGS)
    for spm in ('source.spm', 'target.spm'):
      _add_spm_piece(os.path.join(folder, spm), SPM_TAG)
  return made


def _variant(folders, tmp_path, name='shared', **files):
  """A copy of a folder with tokenizer files (name -> JSON) written into it."""
  folder = str(tmp_path / name)
  shutil.copytree(folders[name][0], folder)
  for file, content in files.items():
    path = os.path.join(folder, file.replace('__', '.').replace('_json', '.json'))
    settings = {}
    if os.path.exists(path):
      with open(path) as f:
        settings = json.load(f)
    with open(path, 'w') as f:
      json.dump({**settings, **content}, f)
  return folder


def _ours(folder):
  """(source Tokenizer, target Tokenizer) as the import writes them."""

  def size(name):
    path = os.path.join(folder, name)
    return len(json.load(open(path))) if os.path.exists(path) else None

  source, target = size('vocab.json'), size('target_vocab.json')
  vocab = hf_vocabulary.read_vocabulary(folder, source, target or source)
  tokenizer = Tokenizer(vocab.vocabulary)
  return tokenizer, Tokenizer(vocab.target_vocabulary) if vocab.target_vocabulary else tokenizer


def _table(vocab: dict, ours: Tokenizer, size: int) -> np.ndarray:
  """MarianTokenizer's id -> ours, by piece name; its <pad> (the last) our BOS; ids beyond
  this side's vocabulary (MarianMTModel cannot embed them) our UNK."""
  out = np.full(size + 64, UNK_ID, np.int64)
  for piece, i in vocab.items():
    out[i] = BOS_ID if i == len(vocab) - 1 else ours.piece_ids([piece])[0]
  return out


TEXTS = [
  *_texts(4, WORDS),
  f'{SPM_TAG} the cat',  # A tag of the .spm vocab.json lacks: <unk> as a tag, and mid-text.
  f'the cat {SPM_TAG} sat',
  f'{SPM_TAG}the cat',
  '>>deu<< the cat',  # A tag vocab.json has and the .spm lacks.
  'the <pad> cat </s> sat <unk> on <pad><pad> the mat </s>',
  '<pad>', '</s>', '<unk>', '<pad> the',
  '>>fra<< the >>deu<< cat >>fra<<',
  'the<s>cat <eop> mat',
]  # fmt: skip


def assert_ids_equal(folder):
  """Both sides' ids of TEXTS equal MarianTokenizer's."""
  theirs = transformers.MarianTokenizer.from_pretrained(folder)
  source, target = _ours(folder)
  target_vocab = theirs.target_encoder if theirs.separate_vocabs else theirs.encoder
  for side, ours, vocab in (
    ('text', source, theirs.encoder),
    ('text_target', target, target_vocab),
  ):
    table = _table(vocab, ours, ours.vocab_size)
    rows = theirs(**{side: TEXTS}).input_ids
    assert ours.encode_batch(TEXTS) == [list(table[ids[:-1]]) for ids in rows], (folder, side)
  return theirs, source, target


@pytest.mark.parametrize('name', ['shared', 'separate'])
def test_special_tokens_and_tags_in_text_as_marian_tokenizer(folders, name):
  theirs, source, target = assert_ids_equal(folders[name][0])
  assert source.encode(f'{SPM_TAG} the')[0] == UNK_ID != source.encode('>>deu<< the')[0]
  assert source.encode('the <pad> cat')[1] == BOS_ID  # Not padding.


EXTRA = {
  'additional_special_tokens in tokenizer_config.json': dict(
    tokenizer_config_json={
      'additional_special_tokens': [
        '>>fra<<',
        {'content': '>>deu<<', '__type': 'AddedToken'},
        {'content': '>>spa<<', 'lstrip': False},  # Read by transformers 5 as its own text.
      ]
    }
  ),
  'special_tokens_map.json, named and additional': dict(
    special_tokens_map_json={
      'eos_token': {'content': '</s>', 'lstrip': False},
      'mask_token': '>>spa<<',
      'additional_special_tokens': ['>>fra<<'],
    }
  ),
  "transformers 5's extra_special_tokens": dict(
    tokenizer_config_json={'extra_special_tokens': {'lang': '>>deu<<'}}
  ),
  'added_tokens_decoder at another id': dict(
    tokenizer_config_json={
      'added_tokens_decoder': {'20': {'content': '>>deu<<', 'special': True}},
    }
  ),
  'added_tokens.json': dict(added_tokens_json={'>>fra<<': 'vocab id'}),
}


@pytest.mark.parametrize('name', ['shared', 'separate'])
@pytest.mark.parametrize('case', list(EXTRA))
def test_extra_special_tokens_are_cut_out_as_marian_tokenizer_cuts_them(
  folders, tmp_path, name, case
):
  files = json.loads(json.dumps(EXTRA[case]))
  if 'added_tokens_json' in files:
    with open(os.path.join(folders[name][0], 'vocab.json')) as f:
      files['added_tokens_json'] = {'>>fra<<': json.load(f)['>>fra<<']}
  folder = _variant(folders, tmp_path, name, **files)
  theirs, source, _ = assert_ids_equal(folder)
  extra = set(theirs.added_tokens_encoder) & set(TAGS)
  assert extra and all(len(source.encode(f'the{token}cat')) == 3 for token in extra)
  # Exported back (export --format=huggingface), MarianTokenizer cuts the same tokens out as
  # the same pieces on both sides (a separate target vocabulary's ids come in our order).
  hf_marian.import_hf_model(folder, str(tmp_path / 'workdir'))
  huggingface.export(str(tmp_path / 'workdir'), str(tmp_path / 'exported'))
  back = transformers.MarianTokenizer.from_pretrained(str(tmp_path / 'exported'))
  assert set(back.added_tokens_encoder) & set(TAGS) == extra

  def pieces(tokenizer, side):
    vocab = (
      tokenizer.target_encoder if side == 'text_target' and tokenizer.separate_vocabs else None
    )
    by_id = {i: piece for piece, i in (vocab or tokenizer.encoder).items()}
    return [[by_id[i] for i in row] for row in tokenizer(**{side: TEXTS}).input_ids]

  assert back(text=TEXTS).input_ids == theirs(text=TEXTS).input_ids
  assert pieces(back, 'text') == pieces(theirs, 'text')
  # A literal <pad> in a target text: MarianTokenizer reads vocab.json's <pad> id in a separate
  # target vocabulary, whatever piece sits there; the export keeps the import's target order.
  wanted = ['<pad>' not in text or name == 'shared' for text in TEXTS]
  kept = lambda rows: [row for row, keep in zip(rows, wanted) if keep]  # noqa: E731
  assert kept(pieces(back, 'text_target')) == kept(pieces(theirs, 'text_target'))


REFUSED = {
  'a token vocab.json lacks': (
    dict(tokenizer_config_json={'additional_special_tokens': ['<eop>']}),
    r"tokenizer_config.json: additional_special_tokens\[0\] '<eop>' is not in vocab.json",
  ),
  'an id beyond vocab.json': (
    dict(added_tokens_json={'<eop>': 999}),
    r"added_tokens.json: '<eop>': id 999 is not among vocab.json's",
  ),
  'another eos_token': (
    dict(special_tokens_map_json={'eos_token': '<unk>'}),
    r"special_tokens_map.json: eos_token='<unk>' is not supported",
  ),
  'single_word': (
    dict(
      tokenizer_config_json={
        'added_tokens_decoder': {'20': {'content': '>>deu<<', 'single_word': True}}
      }
    ),
    r"tokenizer_config.json: added_tokens_decoder\['20'\]: single_word=true is not supported",
  ),
  "</s>'s id": (
    dict(tokenizer_config_json={'added_tokens_decoder': {'0': {'content': '>>deu<<'}}}),
    r"added_tokens_decoder\['0'\]: id 0 is </s>'s",
  ),
}


@pytest.mark.parametrize('case', list(REFUSED))
def test_what_marian_mt_cannot_embed_is_refused_in_one_line(folders, tmp_path, case):
  files, message = REFUSED[case]
  folder = _variant(folders, tmp_path, **files)
  with pytest.raises(UserInputError, match=message) as error:
    hf_marian.read_model(folder)
  assert '\n' not in str(error.value)


def test_a_literal_pad_computes_as_marian_mt_model_computes_it(folders):
  """MarianMTModel attends to a <pad> in a text (its attention mask is 1 there): so does our
  model, given our BOS for it, whose rows are <pad>'s. Logits within 1e-4."""
  folder, model = folders['shared']
  theirs = transformers.MarianTokenizer.from_pretrained(folder)
  config, params, vocabulary, _, _ = hf_marian.read_model(folder)
  translator = Translator(config, params, Tokenizer(vocabulary), batch_size=2)
  texts = ['the <pad> cat sat', '>>deu<< <pad><pad> the mat']
  batch = theirs(texts, return_tensors='pt', padding=True)
  assert (batch.input_ids == theirs.pad_token_id).sum() > (batch.attention_mask == 0).sum()
  start = model.config.decoder_start_token_id
  with torch.no_grad():
    logits = model(**batch, decoder_input_ids=torch.full((2, 1), start)).logits.numpy()
  ours = [translator.tokenizer.encode(t) + [1] for t in texts]
  src = np.zeros((2, max(map(len, ours))), np.int32)
  for i, ids in enumerate(ours):
    src[i, : len(ids)] = ids
  out = np.asarray(translator.model.apply({'params': translator.params}, src, np.full((2, 1), 2)))
  table = _table(theirs.encoder, translator.tokenizer, translator.tokenizer.vocab_size)
  np.testing.assert_allclose(
    out[..., table[: len(theirs.encoder) - 1]], logits[..., :-1], atol=1e-4
  )


def test_a_vocabulary_marked_by_the_first_imports_reads_as_before(folders):
  """The marker without special tokens (the first imports': _MARIAN_TEXT_V1) reads as the
  default three, </s>, <unk>, <pad>, and keeps its ids read as <unk>."""
  import struct

  from transformer_jax.data import tokenizer as tokenizer_module

  ours, _ = _ours(folders['shared'][0])
  plain, unknown = tokenizer_module.split_marian_rules(ours.model_bytes)
  ids = sorted(unknown)
  payload = tokenizer_module._MARIAN_TEXT_V1 + struct.pack(f'<{len(ids)}I', *ids)
  payload += struct.pack('<I', len(ids))
  field = tokenizer_module._varint(tokenizer_module._MARIAN_FIELD << 3 | 2)
  old = Tokenizer(plain + field + tokenizer_module._varint(len(payload)) + payload)
  assert old.marian_rules and old.marian_record()['unknown_ids'] == ids
  assert old.marian_record()['specials'] == {'</s>': 1, '<pad>': BOS_ID, '<unk>': UNK_ID}
  assert old.encode_batch(TEXTS) == ours.encode_batch(TEXTS)
