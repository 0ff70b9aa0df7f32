"""Input-pipeline part of the benchmark: examples/s and padding of each batching mode.

Run through `python -m transformer_jax.benchmark` (which see); kept apart so each module stays
one concern.
"""

from __future__ import annotations

import time

import ml_collections
import numpy as np

from transformer_jax.data import batching, input_pipeline
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

BATCHING_MODES = ('fixed', 'tokens', 'packed')
# Token ids the synthetic data draws from: everything above the special ids.
_FIRST_TOKEN_ID = max(PAD_ID, EOS_ID, BOS_ID, UNK_ID) + 1

# Untimed batches before timing an input pipeline: more than its prefetch buffer (8), so the
# timed batches come at the rate they are produced, not from a buffer filled while planning.
_PIPELINE_WARMUP_BATCHES = 16


def synthetic_split(
  num_examples: int, vocab_size: int, max_length: int, seed: int = 0
) -> input_pipeline.TokenizedSplit:
  """Multi30k-like pairs: source ~15 +- 5 tokens (EOS included), target ~1.05x the source."""
  rng = np.random.default_rng(seed)
  source = np.clip(np.rint(rng.normal(15.0, 5.0, num_examples)), 3, max_length).astype(np.int64)
  ratio = rng.normal(1.05, 0.15, num_examples)
  target = np.clip(np.rint(source * ratio), 3, max_length).astype(np.int64)
  arrays = {}
  for side, lengths in (('inputs', source), ('targets', target)):
    flat = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat[offsets[1:] - 1] = EOS_ID
    arrays[f'{side}_flat'], arrays[f'{side}_offsets'] = flat, offsets
  return input_pipeline.TokenizedSplit(arrays)


def _count_examples(batch: dict[str, np.ndarray]) -> int:
  if 'inputs_segment_ids' in batch:
    return int(batch['inputs_segment_ids'].max(axis=1).sum())
  return int((batch['inputs'] != PAD_ID).any(axis=1).sum())


def _time_iterator(iterator, num_batches: int) -> dict:
  start = time.perf_counter()
  next(iterator)  # Includes planning the epoch and starting the reader threads.
  first_seconds = time.perf_counter() - start
  for _ in range(_PIPELINE_WARMUP_BATCHES):
    next(iterator)
  examples = real = padded = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(iterator)
    examples += _count_examples(batch)
    for side in ('inputs', 'targets'):
      real += int((batch[side] != PAD_ID).sum())
      padded += batch[side].size
  elapsed = time.perf_counter() - start
  return {
    'examples_per_second': examples / elapsed,
    'batches_per_second': num_batches / elapsed,
    'examples_per_batch': examples / num_batches,
    'padding_fraction': 1.0 - real / padded,
    'first_batch_seconds': first_seconds,
    'timed_batches': num_batches,
  }


def benchmark_pipeline(
  *,
  num_examples: int,
  max_length: int,
  tokens_per_batch: int,
  num_batches: int,
  train_steps_per_second: float | None,
  vocab_size: int,
  size: str,
  seed: int = 0,
) -> dict:
  """Examples/s and padding of each batching mode at the same padded-token budget per batch.

  fixed: tokens_per_batch // max_length pairs padded to max_length; tokens: length buckets of
  at most tokens_per_batch padded tokens per side; packed: rows of max_length holding several
  pairs. The training step consumes examples_per_batch x the size's steps/s (a step over the
  same padded-token budget costs about the same whatever the mode).
  """
  split = synthetic_split(num_examples, vocab_size, max_length, seed)
  config = ml_collections.ConfigDict(
    {'max_source_length': max_length, 'max_target_length': max_length}
  )
  fixed_rows = max(1, tokens_per_batch // max_length)
  iterators = {
    'fixed': lambda: (
      input_pipeline.make_fixed_iterator(split, config, batch_size=fixed_rows, seed=seed),
      None,
    ),
    'tokens': lambda: batching.make_token_budget_iterator(
      split, tokens_per_batch=tokens_per_batch, max_length=max_length, seed=seed
    ),
    'packed': lambda: batching.make_packed_iterator(
      split, tokens_per_batch=tokens_per_batch, length=max_length, seed=seed
    ),
  }
  modes = {}
  for mode in BATCHING_MODES:
    iterator, plan = iterators[mode]()
    result = _time_iterator(iterator, num_batches)
    if plan is not None:
      result['epoch_padding_fraction'] = plan.padding_fraction(0)
    if train_steps_per_second:
      required = result['examples_per_batch'] * train_steps_per_second
      result['training_examples_per_second'] = required
      result['ratio_to_training'] = result['examples_per_second'] / required
    modes[mode] = result
    del iterator
  return {
    'size': size,
    'examples': num_examples,
    'max_length': max_length,
    'tokens_per_batch': tokens_per_batch,
    'fixed_rows': fixed_rows,
    'mean_source_tokens': float(split.lengths()[0].mean()),
    'mean_target_tokens': float(split.lengths()[1].mean()),
    'train_steps_per_second': train_steps_per_second,
    'modes': modes,
  }
