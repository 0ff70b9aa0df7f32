"""Word alignments read off a model's encoder-decoder attention (`Translator.align`).

For each target piece, the source piece it attends most: the cross attention of one decoder
layer, averaged over its heads, then the argmax over the source (fairseq's --print-alignment,
Marian's --alignment hard, OpenNMT's -report_align work the same way).

Which layer: by default the LAST decoder layer, as measured on the project's default model
(configs/default.py, 3 decoder layers, 1,600 steps on number_words): its attention crosses the
German reordering of units and tens (forty-two -> zwei|und|vierzig) on 72/72 two-digit numbers
and 31/50 held-out test-split numbers, layer 2 (the penultimate) on 8/72 and 0/50, layer 1 on
4/72 and 0/50. Garg et al. (2019), "Jointly Learning to Align and Translate with Transformer
Models", found the penultimate layer best in 6-layer models; `layer` (numbered from 1, like
plot_attention's --layers) picks it, or any other.

End-of-sentence pieces align to nothing: the target's '</s>' row is dropped (it is predicted,
not translated), and so is the source's '</s>' column, where decoders park attention that has no
source word to go to; each row is renormalised over the real source pieces (which leaves the
argmax unchanged but makes `alignment_weights` a distribution over source pieces).

Output is the Pharaoh format of fast_align and Moses, `i-j` with i the SOURCE index and j the
TARGET index, both from 0, pairs ordered by target then source (fast_align's order). Piece-level
pairs index SentencePiece pieces; `merge_to_words` maps them to whitespace words, using the
pieces' '▁' word-start marks: a source word and a target word are aligned when any piece of the
one is aligned to any piece of the other.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer_jax.common.errors import UserInputError, is_integer

EOS_PIECE = '</s>'
WORD_START = '\u2581'  # SentencePiece's '▁', which marks a piece that begins a word.


@dataclasses.dataclass(frozen=True)
class AttentionMaps:
  """Attention weights of one sentence pair, per layer and head (rows: queries, sum to 1)
  (`Translator.attention`).

  Tokens are SentencePiece pieces; each side ends with '</s>'. The decoder's query at target
  position i reads target pieces 0..i-1 (and BOS) and predicts target piece i.
  """

  source_tokens: list[str]
  target_tokens: list[str]
  encoder_self: np.ndarray  # [layers, heads, source, source]
  decoder_self: np.ndarray  # [layers, heads, target, target]
  cross: np.ndarray  # [layers, heads, target, source]


def default_layer(num_layers: int) -> int:
  """The last decoder layer (numbered from 1): the one that aligns best where measured (above)."""
  return num_layers


def check_layer(layer: int, num_layers: int) -> None:
  """A one-line error unless `layer` is one of the model's decoder layers (numbered from 1)."""
  if not is_integer(layer) or not 1 <= layer <= num_layers:
    raise UserInputError(
      f'alignment layer {layer!r} does not exist (the decoder has {num_layers} layers, '
      'numbered from 1)'
    )


def alignment_weights(maps: AttentionMaps, layer: int | None = None) -> np.ndarray:
  """[target pieces, source pieces] without either '</s>': `layer`'s cross attention averaged
  over heads, each row renormalised to sum to 1 over the real source pieces."""
  num_layers = maps.cross.shape[0]
  layer = default_layer(num_layers) if layer is None else layer
  check_layer(layer, num_layers)
  weights = maps.cross[layer - 1].mean(axis=0)[:-1, :-1].astype(np.float64)  # [t, s]
  totals = weights.sum(axis=1, keepdims=True)
  # A row that gave all its weight to '</s>' stays all zeros (its argmax is then piece 0).
  return weights / np.where(totals > 0, totals, 1.0)


def align(maps: AttentionMaps, layer: int | None = None) -> list[tuple[int, int]]:
  """Piece-level (source index, target index) pairs: one per target piece but '</s>', none when
  either side has no piece but '</s>'."""
  weights = alignment_weights(maps, layer)
  if weights.size == 0:
    return []
  return [(int(source), target) for target, source in enumerate(weights.argmax(axis=1))]


def word_indices(pieces: list[str]) -> list[int]:
  """Each piece's word (from 0): a piece starting with '▁' opens a new word, except the first
  piece, which always opens word 0; '</s>' belongs to no word (-1)."""
  indices, word = [], -1
  for position, piece in enumerate(pieces):
    if piece == EOS_PIECE:
      indices.append(-1)
      continue
    if position == 0 or word < 0 or piece.startswith(WORD_START):
      word += 1
    indices.append(word)
  return indices


def merge_to_words(
  pairs: list[tuple[int, int]], source_pieces: list[str], target_pieces: list[str]
) -> list[tuple[int, int]]:
  """Piece-level pairs as whitespace-word pairs (source word, target word), each once, ordered
  by target word then source word."""
  source_words, target_words = word_indices(source_pieces), word_indices(target_pieces)
  merged = {(source_words[source], target_words[target]) for source, target in pairs}
  return sorted(
    ((s, t) for s, t in merged if s >= 0 and t >= 0), key=lambda pair: (pair[1], pair[0])
  )


def pharaoh(pairs: list[tuple[int, int]]) -> str:
  """'i-j i-j ...' with i the source index, j the target index (fast_align, Moses)."""
  return ' '.join(f'{source}-{target}' for source, target in pairs)
