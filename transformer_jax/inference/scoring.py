"""Scoring given translations (forced decoding): each (source, target) pair's log-probability
under the model, from one teacher-forced forward pass per batch, no search loop.

Conventions (those of our searches and of CTranslate2's `score_batch`):
- the target's EOS is scored and counted: a pair's `tokens` is its target pieces + 1, and its
  `log_prob` is log P(target pieces, EOS | source), the quantity beam search ranks (at alpha 0
  its scores are exactly these sums);
- PAD and BOS are no predictions: log-probs are normalised over the vocabulary without them,
  as the searches do (`search.candidates.mask_never_predicted`) and as the CTranslate2 export
  does (their logit bias). The training loss normalises over the whole vocabulary;
  `target_log_probs` with `exclude_pad_and_bos=False` gives its log-probs (its mean NLL is the
  eval loss at label smoothing 0). For a trained model their probability is negligible and the
  two agree closely.

`score_pairs` (the `Translator.score` method) sorts pairs by length into batches as
`Translator.translate` does; the `score` command's file handling is `text_files.score_files`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from absl import logging

from transformer_jax.common.errors import UserInputError
from transformer_jax.common.progress import Progress
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference.decoding import source_bucket, target_log_probs

# The model is a static argument (a flax Module is a hashable dataclass of its config): one
# compiled program per model config and batch shape.
# Batches dispatched ahead of the one read back: enough to keep the device busy, few enough
# that a large file's log-probabilities never all wait in memory at once (0: one at a time).
BATCHES_IN_FLIGHT = 4

jitted_target_log_probs = jax.jit(
  target_log_probs,
  static_argnames=('model', 'exclude_pad_and_bos', 'rows_per_chunk', 'vocabulary_block'),
)


def encode_pairs(
  sources: Sequence[str],
  targets: Sequence[str],
  tokenizer: Tokenizer,
  target_tokenizer: Tokenizer,
  max_len: int,
  *,
  source_name: Callable[[int], str] = lambda index: f'source {index}',
  target_name: Callable[[int], str] = lambda index: f'target {index}',
) -> list[tuple[list[int], list[int]]]:
  """(source ids + EOS, target ids + EOS) per pair, or a one-line UserInputError naming the
  pair (`source_name(index)`, `target_name(index)`: a list index, a file's line).

  A target longer than max_len (EOS counted) is refused: cutting it would score another
  sentence. A longer source is cut to max_len with a warning, as `Translator.translate` does
  (and as the CTranslate2 export's max_input_length does).
  """
  for name, texts in (('sources', sources), ('targets', targets)):
    if isinstance(texts, (str, bytes)):
      raise TypeError(f'scoring takes lists of sentences; {name} is a single str; pass [it]')
  if len(sources) != len(targets):
    raise UserInputError(
      f'{len(sources)} sources but {len(targets)} targets: scoring takes one target per source'
    )
  pairs = []
  for index, (source, target) in enumerate(zip(sources, targets)):
    for text, name in ((source, source_name), (target, target_name)):
      if not isinstance(text, str):
        raise UserInputError(f'{name(index)} is {type(text).__name__}, not str')
    source_ids = tokenizer.encode(source)
    if len(source_ids) + 1 > max_len:
      logging.warning(
        '%s has %d tokens; truncated to the model maximum %d',
        source_name(index),
        len(source_ids) + 1,
        max_len,
      )
      source_ids = source_ids[: max_len - 1]
    target_ids = target_tokenizer.encode(target)
    if len(target_ids) + 1 > max_len:
      raise UserInputError(
        f'{target_name(index)} has {len(target_ids) + 1} tokens (EOS counted), more than the '
        f"model's max_len {max_len}: it cannot be scored whole"
      )
    pairs.append((source_ids + [EOS_ID], target_ids + [EOS_ID]))
  return pairs


def score_encoded(
  translator,
  pairs: Sequence[tuple[list[int], list[int]]],
  *,
  per_token: bool = False,
  progress: bool = False,
) -> list[dict]:
  """Scores of (source ids + EOS, target ids + EOS) pairs (`encode_pairs`), in their order.

  Pairs are sorted by source length bucket, then target length, into batches of the
  translator's batch_size rows, each padded to power-of-two lengths (`source_bucket`) as
  `Translator.translate` pads: few shapes, few compiles, little padding. Every batch is
  dispatched before any result is read back (JAX runs them asynchronously), so that the host's
  padding and bookkeeping overlap the model's work instead of idling it between batches.
  """
  max_len = translator.model_config.max_len
  batch_size = translator.batch_size
  order = sorted(
    range(len(pairs)),
    key=lambda i: (source_bucket(len(pairs[i][0]), max_len), len(pairs[i][1]), len(pairs[i][0])),
  )
  results: list[dict | None] = [None] * len(pairs)
  bar = Progress(
    total=len(pairs), unit='pairs', description='scoring', enabled=None if progress else False
  )
  in_flight: list[tuple[list[int], jax.Array]] = []

  def collect(rows, log_probs) -> None:
    log_probs = np.asarray(jax.device_get(log_probs), np.float32)  # One explicit fetch.
    for row, index in enumerate(rows):
      count = len(pairs[index][1])
      values = log_probs[row, :count]
      total = float(np.sum(values, dtype=np.float64))
      result = {'log_prob': total, 'tokens': count, 'mean': total / count}
      if per_token:
        result['token_log_probs'] = [float(v) for v in values]
      results[index] = result
    bar.update(len(rows))

  for start in range(0, len(order), batch_size):
    rows = order[start : start + batch_size]
    source_length = source_bucket(max(len(pairs[i][0]) for i in rows), max_len)
    target_length = source_bucket(max(len(pairs[i][1]) for i in rows), max_len)
    src = np.full((batch_size, source_length), PAD_ID, np.int32)
    tgt = np.full((batch_size, target_length), PAD_ID, np.int32)
    for row, index in enumerate(rows):
      source_ids, target_ids = pairs[index]
      src[row, : len(source_ids)] = source_ids
      tgt[row, : len(target_ids)] = target_ids
    src, tgt = jax.device_put((src, tgt))  # One explicit transfer per batch.
    in_flight.append((rows, translator._token_log_probs(translator.params, src, tgt)))
    if len(in_flight) > BATCHES_IN_FLIGHT:
      collect(*in_flight.pop(0))
  for batch in in_flight:
    collect(*batch)
  bar.close()
  return results


def score_pairs(
  translator,
  sources: Sequence[str],
  targets: Sequence[str],
  *,
  per_token: bool = False,
  progress: bool = False,
) -> list[dict]:
  """Each pair's log-probability under the translator's model, in input order, as a dict:
  {'log_prob': sum over the target's tokens and its EOS, 'tokens': their count (EOS counted),
  'mean': log_prob / tokens, and with per_token 'token_log_probs': the per-token values}.

  Targets are segmented with the translator's target tokenizer. Conventions (EOS scored, PAD
  excluded): the module docstring. `progress`: a progress bar (for files).
  """
  pairs = encode_pairs(
    sources,
    targets,
    translator.tokenizer,
    translator.target_tokenizer,
    translator.model_config.max_len,
  )
  return score_encoded(translator, pairs, per_token=per_token, progress=progress)


def format_score(result: dict) -> str:
  """One output line: `sum<TAB>mean<TAB>tokens`, and the per-token values space-separated as a
  4th column when present. Tab-separated, fixed columns: `cut -f2`, `paste` beside the
  sentences, a spreadsheet or pandas read it without a parser."""
  columns = [f'{result["log_prob"]:.6f}', f'{result["mean"]:.6f}', str(result['tokens'])]
  if 'token_log_probs' in result:
    columns.append(' '.join(f'{value:.6f}' for value in result['token_log_probs']))
  return '\t'.join(columns)
