"""Translator.attention: every layer and head of the three attentions; plot draws them."""

import functools

import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import attention_plots
from transformer_jax.inference.translator import Translator

from conftest import random_weight_translator


@functools.lru_cache(maxsize=1)
def _translator() -> Translator:
  return random_weight_translator(2, 3)


def test_attention_maps_shapes_normalisation_and_masks():
  translator = _translator()
  maps = translator.attention('three hundred forty-two', 'dreihundertzweiundvierzig')
  s, t = len(maps.source_tokens), len(maps.target_tokens)
  assert maps.source_tokens[-1] == maps.target_tokens[-1] == '</s>'
  assert (
    ''.join(maps.source_tokens[:-1]).replace('\u2581', ' ').strip() == 'three hundred forty-two'
  )
  assert maps.encoder_self.shape == (2, 2, s, s)
  assert maps.decoder_self.shape == (3, 2, t, t)
  assert maps.cross.shape == (3, 2, t, s)
  for weights in (maps.encoder_self, maps.decoder_self, maps.cross):
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)  # Each query's row.
  # The decoder never looks ahead: position i attends to positions <= i only.
  causal = np.tril(np.ones((t, t), bool))
  assert np.all(maps.decoder_self[..., ~causal] < 1e-7)
  assert np.all(maps.decoder_self[..., causal] > 0)
  # Random weights attend everywhere: no head is accidentally masked out.
  assert np.all(maps.cross > 0) and np.all(maps.encoder_self > 0)


def test_attention_without_target_uses_the_models_translation():
  translator = _translator()
  source = 'seven hundred one'
  translation = translator.translate([source], beam_size=2)[0]
  maps = translator.attention(source, beam_size=2)
  assert maps.target_tokens == (
    translator.tokenizer.pieces(translator.tokenizer.encode(translation)) + ['</s>']
  )


def test_plot_writes_one_panel_per_layer_and_head(tmp_path):
  pytest.importorskip('matplotlib')
  from PIL import Image  # Installed with matplotlib.

  maps = _translator().attention('one hundred', 'hundert')
  sizes = {}
  for kind, layers in (('cross', None), ('encoder', None), ('decoder', [2])):
    out = attention_plots.plot(maps, kind, str(tmp_path / f'{kind}.png'), layers)
    with Image.open(out) as image:
      assert image.format == 'PNG'
      sizes[kind] = image.size
  # 3 decoder layers drawn for 'cross', 1 for 'decoder': three times the height, same width.
  assert sizes['cross'][1] > 2.5 * sizes['decoder'][1]
  with pytest.raises(UserInputError, match='layer 4 does not exist'):
    attention_plots.plot(maps, 'cross', str(tmp_path / 'x.png'), [4])
