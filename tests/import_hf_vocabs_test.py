"""Separate source and target vocabularies (issue 50): MarianMT checkpoints whose
tokenizer_config.json has separate_vocabs=true (vocab.json for sources, target_vocab.json for
targets, share_encoder_decoder_embeddings=false), imported into our one vocabulary and checked
against transformers: logits, forced scores, greedy `generate`, MarianTokenizer's ids.

transformers' Marian conversion writes such vocabularies at equal sizes; a MarianMTModel takes
decoder_vocab_size != vocab_size too, so both are tested. With unequal sizes MarianTokenizer's
own decode is wrong (its special ids are vocab.json's, so skip_special_tokens drops the target
piece whose id is the source's <pad>): generate's ids are decoded here from target_vocab.json.
"""

import numpy as np
import pytest
from import_hf_test import (
  GERMAN,
  MAX_POSITIONS,
  SENTENCES,
  WORDS,
  _id_maps,
  _sources,
  logits_and_scores_agree,
  make_folder,
)

from transformer_jax.importers import hf_marian
from transformer_jax.inference.translator import Translator

torch = pytest.importorskip('torch', reason='torch is not installed (pip install -e .[test])')
transformers = pytest.importorskip(
  'transformers', reason='transformers is not installed (pip install -e .[test])'
)

TAGS = ('>>deu<<', '>>fra<<')
# vocabs -> (MarianConfig fields, </s> bias): biases at which most greedy outputs end and most
# say something.
VOCABS = {
  'equal': (dict(activation_function='swish', tie_word_embeddings=True), 4.5),
  'unequal': (dict(activation_function='gelu', tie_word_embeddings=False), 1.0),
}


@pytest.fixture(scope='module', params=list(VOCABS))
def imported(request, tmp_path_factory):
  """(name, HF model, MarianTokenizer, our Translator), vocab.json with TAGS."""
  root = tmp_path_factory.mktemp('vocabs')
  fields, eos_bias = VOCABS[request.param]
  fields = dict(fields, share_encoder_decoder_embeddings=False, vocabs=request.param)
  model = make_folder(str(root / 'hf'), fields, 'safetensors', eos_bias, 0.3, tags=TAGS)
  sizes = model.config.vocab_size, model.config.decoder_vocab_size
  assert (sizes[0] == sizes[1]) == (request.param == 'equal'), sizes
  hf_marian.import_hf_model(str(root / 'hf'), str(root / 'workdir'))
  tokenizer = transformers.MarianTokenizer.from_pretrained(str(root / 'hf'))
  assert tokenizer.separate_vocabs
  return request.param, model, tokenizer, Translator.from_checkpoint(str(root / 'workdir'))


def test_logits_and_forced_scores_equal_transformers(imported):
  logits_and_scores_agree(*imported)


def _generated_texts(model, tokenizer, sources):
  """Greedy `generate` (never the target's <pad>), each row's ids up to </s> as text by
  target_vocab.json and target.spm (MarianTokenizer.convert_tokens_to_string's steps)."""
  target_pad = model.config.decoder_start_token_id
  batch = tokenizer(sources, return_tensors='pt', padding=True)
  with torch.no_grad():
    rows = model.generate(
      **batch,
      do_sample=False,
      num_beams=1,
      max_new_tokens=MAX_POSITIONS - 1,
      bad_words_ids=[[target_pad]],
      pad_token_id=target_pad,
    ).numpy()
  texts, ended = [], 0
  for row in rows:
    ids = list(row[1:])
    if 0 in ids:
      ids, ended = ids[: ids.index(0)], ended + 1
    pieces = [tokenizer.decoder[int(i)] for i in ids]
    texts.append(tokenizer.spm_target.decode_pieces(pieces).replace('▁', ' ').strip())
  return texts, ended


def test_greedy_equals_generate(imported):
  name, model, tokenizer, translator = imported
  sources = _sources()[: SENTENCES // 2] + [f'{TAGS[0]} {s}' for s in _sources(seed=6)][:100]
  theirs, ended = _generated_texts(model, tokenizer, sources)
  words = np.mean([len(t.split()) for t in theirs])
  print(f'{name}: {ended}/{len(sources)} ended, {words:.1f} words')
  assert ended >= len(sources) // 2 and words >= 2, (name, ended, words)  # Real decisions.
  assert translator.translate(sources, beam_size=1) == theirs, name


def test_ids_equal_marian_tokenizer(imported):
  """Sources by vocab.json, targets by target_vocab.json; a tag only vocab.json has is <unk> in
  a target, as it is to MarianTokenizer."""
  _, _, tokenizer, translator = imported
  source_ids, target_ids = _id_maps(tokenizer, translator)
  rng = np.random.default_rng(3)
  sources = [' '.join(rng.choice(WORDS, rng.integers(1, 8))) for _ in range(60)]
  sources += [f'{rng.choice(TAGS)} {text}' for text in sources[:40]] + ['>>xx<< the cat']
  targets = [' '.join(rng.choice(WORDS + GERMAN, rng.integers(1, 8))) for _ in range(60)]
  targets += [f'{TAGS[0]} {text}' for text in targets[:10]]
  for theirs, ours, texts, table in (
    (tokenizer(sources).input_ids, translator.tokenizer, sources, source_ids),
    (tokenizer(text_target=targets).input_ids, translator.target_tokenizer, targets, target_ids),
  ):
    assert ours.encode_batch(texts) == [list(table[ids[:-1]]) for ids in theirs]
  assert translator.target_tokenizer.encode(f'{TAGS[0]} the')[0] == 3  # Our UNK.
  assert translator.tokenizer.encode(f'{TAGS[0]} the')[0] != 3
