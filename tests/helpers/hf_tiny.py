"""One tiny multilingual MarianMT model for the tests of what works on an import (fine-tuning,
serving, exports, translate's options): a random `MarianMTModel` (import_hf_test's builder,
d 32, 1+1 layers, 32 positions) with separate vocabularies of unequal sizes
(tokenizer_config.json separate_vocabs, target.spm apart), an untied output projection and
language tags in vocab.json, the variant that exercises most of the importer's mapping."""

import numpy as np
from import_hf_test import GERMAN, WORDS, make_folder

TAGS = ('>>deu<<', '>>fra<<')
MAX_POSITIONS = 32
FIELDS = dict(
  activation_function='gelu',
  tie_word_embeddings=False,
  share_encoder_decoder_embeddings=False,
  vocabs='unequal',
  d_model=32,
  encoder_layers=1,
  decoder_layers=1,
  encoder_attention_heads=2,
  decoder_attention_heads=2,
  encoder_ffn_dim=64,
  decoder_ffn_dim=64,
  max_position_embeddings=MAX_POSITIONS,
)
# </s>'s bias: most greedy outputs of such sources end within the cap, and most say something.
EOS_BIAS = 4.0


def make_model(folder: str):
  """The model saved into `folder` as transformers saves one; returns it."""
  return make_folder(folder, FIELDS, 'safetensors', EOS_BIAS, 0.3, tags=TAGS)


def sources(count: int, seed: int = 0, tagged: float = 0.75) -> list[str]:
  """English texts of 1-8 words, most of them (`tagged`) after a language tag."""
  rng = np.random.default_rng(seed)
  texts = [' '.join(rng.choice(WORDS, rng.integers(1, 9))) for _ in range(count)]
  return [f'{rng.choice(TAGS)} {t}' if rng.random() < tagged else t for t in texts]


def targets(count: int, seed: int = 1) -> list[str]:
  """Texts of 1-6 words in both languages (what target.spm segments)."""
  rng = np.random.default_rng(seed)
  return [' '.join(rng.choice(GERMAN + WORDS, rng.integers(1, 7))) for _ in range(count)]
