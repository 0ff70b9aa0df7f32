"""Inference: the model bound to the search (`decoding`), `Translator` (a workdir's model
translating sentences, and its attention maps), scoring given translations (`scoring`, also
`Translator.score`), the translate command's file handling (`text_files`) and attention plots
(`attention_plots`)."""

from transformer_jax.inference.decoding import beam_decode, greedy_decode
from transformer_jax.inference.scoring import score_pairs
from transformer_jax.inference.translator import AttentionMaps, Translator

__all__ = ['AttentionMaps', 'Translator', 'beam_decode', 'greedy_decode', 'score_pairs']
