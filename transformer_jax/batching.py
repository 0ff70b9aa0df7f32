"""The paper's batching: sentence pairs grouped by length into token-budget batches.

Each batch holds pairs of similar length, padded to one of a few bucket lengths L, with
`tokens_per_batch // L` rows, so every batch has about the same number of (padded) tokens and
`jit` compiles one program per bucket, not one per batch.

The plan for an epoch (which pairs go in which batch, and the order of batches) is a pure
function of (seed, epoch), computed the same on every process; each process then materialises
only its rows of each batch. So the iterator state is just a batch counter (grain's
`{'next_index': k}`), a resumed run sees exactly the same batches, and all processes always
feed arrays of the same shape.
"""

from __future__ import annotations

import bisect
import sys
import threading

import grain
import numpy as np

# Pairs are sorted by length within pools of this many batches before being cut into batches:
# enough to find same-length neighbours, small enough that batches stay random.
_POOL_BATCHES = 64


def bucket_lengths(max_length: int, min_length: int = 8) -> list[int]:
  """Bucket lengths growing by ~1.5x from min_length: [8, 12, 20, 32, 48, 72, ...], then max."""
  lengths, length = [], min_length
  while length < max_length:
    lengths.append(length)
    length = length * 3 // 2 if length % 2 == 0 else length * 4 // 3
    length += length % 4 and 4 - length % 4  # Multiples of 4: friendlier tile sizes.
  lengths.append(max_length)
  return lengths


class TokenBudgetPlan:
  """Which examples make up each batch of each epoch, for a token budget."""

  def __init__(self, source_lengths: np.ndarray, target_lengths: np.ndarray, *,
               tokens_per_batch: int, max_length: int, seed: int, row_multiple: int = 1):
    self.source_lengths = np.asarray(source_lengths)
    self.target_lengths = np.asarray(target_lengths)
    self.lengths = np.maximum(self.source_lengths, self.target_lengths)
    self.eligible = np.flatnonzero(self.lengths <= max_length)
    self.buckets = bucket_lengths(max_length)
    # Rows per bucket: the token budget over the padded length, a multiple of row_multiple so
    # the rows split evenly over processes and devices.
    self.rows = [max(row_multiple, tokens_per_batch // length // row_multiple * row_multiple)
                 for length in self.buckets]
    self.seed = seed
    self._epoch_sizes: list[int] = []
    # (epoch, plan) in one field: grain reads batches from several threads.
    self._cached: tuple[int, list] | None = None
    self._lock = threading.Lock()

  def bucket_of(self, length: int) -> int:
    return bisect.bisect_left(self.buckets, length)

  def epoch(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """[(bucket index, example indices)] for one epoch, in training order."""
    cached = self._cached
    if cached is not None and cached[0] == epoch:
      return cached[1]
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(self.eligible)
    pool_size = _POOL_BATCHES * max(self.rows)
    pending: dict[int, list[int]] = {}
    batches = []
    for start in range(0, len(order), pool_size):
      pool = order[start:start + pool_size]
      pool = pool[np.argsort(self.lengths[pool], kind='stable')]
      for index in pool:
        bucket = self.bucket_of(int(self.lengths[index]))
        members = pending.setdefault(bucket, [])
        members.append(int(index))
        if len(members) == self.rows[bucket]:
          batches.append((bucket, np.asarray(members)))
          pending[bucket] = []
    # Leftovers become partly empty batches, so every example is seen once per epoch.
    for bucket, members in sorted(pending.items()):
      if members:
        batches.append((bucket, np.asarray(members)))
    batches = [batches[i] for i in rng.permutation(len(batches))]
    self._cached = (epoch, batches)
    return batches

  def locate(self, index: int) -> tuple[int, int]:
    """Global batch counter -> (epoch, batch within the epoch)."""
    epoch = 0
    while True:
      with self._lock:
        if epoch == len(self._epoch_sizes):
          self._epoch_sizes.append(len(self.epoch(epoch)))
      if index < self._epoch_sizes[epoch]:
        return epoch, index
      index -= self._epoch_sizes[epoch]
      epoch += 1

  def padding_fraction(self, epoch: int = 0) -> float:
    """Fraction of the batches' source+target positions that are padding, over one epoch."""
    real = padded = 0
    for bucket, members in self.epoch(epoch):
      padded += 2 * self.rows[bucket] * self.buckets[bucket]
      real += int(self.source_lengths[members].sum() + self.target_lengths[members].sum())
    return 1.0 - real / max(padded, 1)


class _PlannedBatches:
  """Random-access batches (grain MapDataset source): this process's rows of batch k."""

  def __init__(self, split, plan: TokenBudgetPlan, process_index: int, process_count: int):
    self._split, self._plan = split, plan
    self._process_index, self._process_count = process_index, process_count

  def __len__(self) -> int:
    return sys.maxsize  # Endless: epochs follow each other.

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    epoch, position = self._plan.locate(index)
    bucket, members = self._plan.epoch(epoch)[position]
    length, rows = self._plan.buckets[bucket], self._plan.rows[bucket]
    local_rows = rows // self._process_count
    first = self._process_index * local_rows
    inputs = np.zeros((local_rows, length), np.int32)
    targets = np.zeros((local_rows, length), np.int32)
    for row, example_index in enumerate(members[first:first + local_rows]):
      example = self._split[int(example_index)]
      inputs[row, :len(example['inputs'])] = example['inputs']
      targets[row, :len(example['targets'])] = example['targets']
    return {'inputs': inputs, 'targets': targets}


def make_token_budget_iterator(split, *, tokens_per_batch: int, max_length: int, seed: int,
                               process_index: int = 0, process_count: int = 1,
                               devices_per_process: int = 1,
                               num_threads: int = 2) -> tuple[grain.DatasetIterator,
                                                              TokenBudgetPlan]:
  """Endless length-bucketed batches of `split` (a TokenizedSplit) and the plan behind them.

  `tokens_per_batch` is the global budget of padded tokens per side (the paper: ~25,000).
  """
  source_lengths, target_lengths = split.lengths()
  plan = TokenBudgetPlan(source_lengths, target_lengths, tokens_per_batch=tokens_per_batch,
                         max_length=max_length, seed=seed,
                         row_multiple=process_count * devices_per_process)
  dataset = grain.MapDataset.source(_PlannedBatches(split, plan, process_index, process_count))
  iterator = iter(dataset.to_iter_dataset(
      grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=8)))
  return iterator, plan
