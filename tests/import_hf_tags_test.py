"""Multilingual MarianMT models (issue 50): sources that start with a language tag (`>>deu<<`,
a piece of vocab.json, not of the .spm) tokenized as transformers' MarianTokenizer tokenizes
them, and translated as `MarianMTModel.generate` translates them.

The models and SentencePiece files are import_hf_test's (random tiny MarianMTModels, real
SentencePiece models trained here), with tags added to vocab.json.
"""

import numpy as np
import pytest
from import_hf_test import GERMAN, VARIANTS, WORDS, _generate, _id_maps, make_folder

from transformer_jax.data.tokenizer import BOS_ID, Tokenizer, split_marian_rules
from transformer_jax.importers import hf_marian
from transformer_jax.inference.translator import Translator

transformers = pytest.importorskip(
  'transformers', reason='transformers is not installed (pip install -e .[test])'
)

TAGS = ('>>deu<<', '>>fra<<', '>>spa<<')


# import_hf_test's variant (0: one .spm; 2: target.spm apart) -> </s>'s bias here: with the
# first's 7.0 these sources' greedy outputs are nearly all empty, with 4.0 most end and most say
# something; 24.0 does the same for the second.
EOS_BIAS = {0: 4.0, 2: 24.0}


@pytest.fixture(scope='module', params=list(EOS_BIAS))
def tagged(request, tmp_path_factory):
  """(HF model, MarianTokenizer, our Translator) of a variant, vocab.json with TAGS."""
  root = tmp_path_factory.mktemp('tags')
  fields, saved, _, std = VARIANTS[list(VARIANTS)[request.param]]
  model = make_folder(str(root / 'hf'), fields, saved, EOS_BIAS[request.param], std, tags=TAGS)
  hf_marian.import_hf_model(str(root / 'hf'), str(root / 'workdir'))
  tokenizer = transformers.MarianTokenizer.from_pretrained(str(root / 'hf'))
  return model, tokenizer, Translator.from_checkpoint(str(root / 'workdir'))


def _texts(seed, words):
  """Texts with and without tags, and the forms MarianTokenizer treats apart: a tag with no
  space after it, one not in vocab.json (<unk>), a second tag or one mid-text (SentencePiece's
  then), a space before it (no tag), `>>` with no `<<`, special tokens inside the text."""
  rng = np.random.default_rng(seed)
  plain = [' '.join(rng.choice(words, rng.integers(1, 8))) for _ in range(60)]
  tag = lambda: str(rng.choice(TAGS))  # noqa: E731
  tagged = [f'{tag()} {text}' for text in plain[:40]] + [f'{tag()}{text}' for text in plain[40:]]
  odd = [
    '>>xyz<< the cat',
    '>>deu<< >>fra<< the cat',
    'the cat >>deu<< sat',
    ' >>deu<< the cat',
    '>>deu',
    '>>deu<<',
    '>> the cat << sat',
    '>><<',
    'the </s> cat',
    '</s>>>deu<< the cat',
    '>>deu<<<unk> cat',
    'the <pad> mat',
    '',
  ]
  return plain + tagged + odd


def test_ids_equal_marian_tokenizer_with_and_without_tags(tagged):
  _, tokenizer, translator = tagged
  assert translator.tokenizer.marian_rules
  tables = _id_maps(tokenizer, translator)
  for side, words, ours, table in (
    ('source', WORDS, translator.tokenizer, tables[0]),
    ('target', WORDS + GERMAN, translator.target_tokenizer, tables[1]),
  ):
    texts = _texts(4, words)
    assert len(texts) >= 100 and sum(t.startswith(TAGS) for t in texts) >= 50
    kwargs = 'text' if side == 'source' else 'text_target'
    rows = tokenizer(**{kwargs: texts}).input_ids
    # Unpadded, so a <pad> here is one in the text: a token MarianMTModel attends to, our BOS
    # (whose embedding rows are <pad>'s), not padding.
    table = table.copy()
    table[tokenizer.pad_token_id] = BOS_ID
    theirs = [list(table[np.array(ids[:-1], int)]) for ids in rows]  # No </s>.
    assert ours.encode_batch(texts) == theirs, side
    assert [ours.encode(text) for text in texts] == theirs, side
    # Subword sampling keeps tags whole (MarianTokenizer does not sample; what fine-tuning may).
    sampled = ours.encode_sampled(texts, alpha=0.5, seed=0)
    for text, ids in zip(texts, sampled):
      if text.startswith(TAGS[0] + ' '):
        assert ids[0] == ours.encode(text)[0], text


def test_greedy_with_a_tag_equals_generate(tagged):
  model, tokenizer, translator = tagged
  rng = np.random.default_rng(5)
  texts = [' '.join(rng.choice(WORDS, rng.integers(1, 9))) for _ in range(40)]
  sources = [f'{tag} {text}' for text in texts for tag in TAGS]
  theirs, rows = _generate(model, tokenizer, sources, num_beams=1)
  assert translator.translate(sources, beam_size=1) == theirs
  ended = sum(int((row[1:] == 0).any()) for row in rows)
  spoken = sum(bool(text) for text in theirs)
  print(f'{len(sources)} sources: {ended} ended, {spoken} not empty')
  assert ended >= len(sources) // 4 and spoken >= len(sources) // 2  # Real decisions.
  by_tag = [theirs[i :: len(TAGS)] for i in range(len(TAGS))]
  assert by_tag[0] != by_tag[1] != by_tag[2]  # The tag is read, not dropped.


def test_the_rule_travels_in_the_vocabulary_and_only_there(tmp_path, tagged):
  _, _, translator = tagged
  ours = translator.tokenizer
  ours.save(tmp_path / 'v.model')
  again = Tokenizer.load(tmp_path / 'v.model')
  assert again.marian_rules and again.model_bytes == ours.model_bytes
  assert again.encode('>>deu<< the cat') == ours.encode('>>deu<< the cat')
  # Without the marker, the same pieces segment as SentencePiece alone: the tag in characters.
  plain = Tokenizer(split_marian_rules(ours.model_bytes)[0])
  assert not plain.marian_rules and plain.fingerprint != ours.fingerprint
  assert plain.encode('>>deu<< the cat')[0] != ours._processor.piece_to_id('>>deu<<')
  trained = Tokenizer.train([' '.join(WORDS)] * 20 + ['>>deu<< the cat'] * 5, vocab_size=40)
  assert not trained.marian_rules
  assert trained.encode('>>deu<< </s> cat') == trained._processor.encode('>>deu<< </s> cat')
