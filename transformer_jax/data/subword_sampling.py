"""Subword regularisation at training time: the training pairs segmented afresh every epoch.

With `config.subword_sampling = alpha > 0`, each epoch sees every training sentence in one
random segmentation of the shared vocabulary instead of its single best one: BPE-dropout
(Provilkov et al., 2020: each merge skipped with probability alpha; they use 0.1) for a BPE
vocabulary, Kudo's (2018) sampling with smoothing alpha for a unigram one. The model sees the
same words spelled in several ways, which regularises small-data training; evaluation, decoding
and every other split keep the deterministic segmentation.

Deterministic: epoch e of a run with seed s is segmented with seeds drawn from (s, e, side), so
a resumed run sees exactly the batches of an uninterrupted one, and the batch plan of each
epoch (`batching`) is made from that epoch's lengths. Sampled pieces are more numerous (at
alpha 0.1 on Multi30k's 8k BPE: 19.9 against 14.3 pieces per English caption), so an epoch
costs more tokens, and pairs a segmentation makes longer than the maximum length sit that
epoch out. The texts are held in memory and each epoch is segmented on one thread (Multi30k's
29,000 pairs: ~1 s an epoch): a lever for small and medium corpora, not for WMT's millions.
"""

from __future__ import annotations

import threading

import ml_collections
import numpy as np

from transformer_jax.common.log import log
from transformer_jax.data import input_pipeline
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer

# Epoch segmentations kept: the current one and a neighbour (grain reads ahead over an epoch's
# end, and a restored run plans its way to the epoch it resumes in).
_KEPT_EPOCHS = 2


class SampledSplit:
  """The training split as a `TokenizedSplit` per epoch (`for_epoch`): what the batch plans and
  `_PlannedBatches` read. `len`, `lengths()` and indexing are epoch 0's."""

  def __init__(
    self,
    sources: list[str],
    targets: list[str],
    tokenizer: Tokenizer,
    target_tokenizer: Tokenizer | None = None,
    *,
    alpha: float,
    seed: int,
  ):
    if len(sources) != len(targets):
      raise ValueError(f'{len(sources)} sources but {len(targets)} targets')
    if not 0.0 < alpha < 1.0:
      raise ValueError(f'alpha must be in (0, 1), got {alpha!r}')
    self._texts = (list(sources), list(targets))
    self._segmenters = (tokenizer, target_tokenizer or tokenizer)
    self.alpha, self.seed = alpha, seed
    self._splits: dict[int, input_pipeline.TokenizedSplit] = {}
    self._lock = threading.Lock()

  @classmethod
  def from_source(
    cls,
    source,
    tokenizer: Tokenizer,
    config: ml_collections.ConfigDict,
    target_tokenizer: Tokenizer | None = None,
  ) -> 'SampledSplit':
    """The training pairs of a data source (as `TokenizedSplit.build` reads them), sampled at
    `config.subword_sampling` with `config.seed`."""
    sources, targets = input_pipeline.eval_texts(source, config)
    log(
      f'subword sampling: {len(sources):,} training pairs segmented afresh every epoch '
      f'(alpha {config.subword_sampling})'
    )
    return cls(
      sources,
      targets,
      tokenizer,
      target_tokenizer,
      alpha=config.subword_sampling,
      seed=config.seed,
    )

  def __len__(self) -> int:
    return len(self._texts[0])

  def segment_seed(self, epoch: int, side: int) -> int:
    """The SentencePiece seed of one side (0 source, 1 target) of one epoch."""
    return int(np.random.SeedSequence([self.seed, epoch, side]).generate_state(1)[0])

  def for_epoch(self, epoch: int) -> input_pipeline.TokenizedSplit:
    """Epoch `epoch`'s segmentation of every pair (EOS appended), the same on every call."""
    with self._lock:
      split = self._splits.get(epoch)
      if split is None:
        sides = [
          [ids + [EOS_ID] for ids in segmenter.encode_sampled(texts, self.alpha, seed)]
          for side, (texts, segmenter) in enumerate(zip(self._texts, self._segmenters))
          for seed in [self.segment_seed(epoch, side)]
        ]
        split = input_pipeline.TokenizedSplit.from_sequences(*sides)
        kept = sorted(self._splits, key=lambda e: abs(e - epoch))[: _KEPT_EPOCHS - 1]
        self._splits = {**{e: self._splits[e] for e in kept}, epoch: split}
      return split

  def epoch_lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(source lengths, target lengths) of epoch `epoch`'s segmentation, EOS included."""
    return self.for_epoch(epoch).lengths()

  def lengths(self) -> tuple[np.ndarray, np.ndarray]:
    return self.epoch_lengths(0)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.for_epoch(0)[index]
