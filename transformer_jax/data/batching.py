"""Training batches planned per epoch: token-budget length buckets, or packed rows.

Token budget (the paper's batching): each batch holds pairs of similar length, padded to one of
a few bucket lengths L, with `tokens_per_batch // L` rows, so every batch has about the same
number of (padded) tokens and `jit` compiles one program per bucket, not one per batch.

Packing: every row has one fixed length L on each side and holds several pairs one after the
other, with segment ids (1..k within the row, 0 = padding) and positions restarting at each
pair, so the model can keep the pairs apart. One shape for every batch, little padding.

Either way the plan for an epoch (which pairs go in which batch, and the order of batches) is
a pure function of (seed, epoch) — and of the epoch's segmentation where the pairs are
segmented afresh every epoch (`subword_sampling.SampledSplit`) — computed the same on every
process; each process then materialises only its rows of each batch. So the iterator state is
just a batch counter (grain's `{'next_index': k}`), a resumed run sees exactly the same
batches, and all processes always feed arrays of the same shape.
"""

from __future__ import annotations

import bisect
import sys
import threading
from typing import Callable

import grain
import numpy as np

# Pairs are sorted by length within pools of this many batches before being cut into batches:
# enough to find same-length neighbours, small enough that batches stay random.
_POOL_BATCHES = 64
# Packing fills rows first-fit from pools of this many shuffled pairs: large enough that only a
# pool's last few rows stay part-empty, small enough that each pair scans few open rows.
_PACKING_POOL_EXAMPLES = 4096
# Successive token-budget bucket lengths grow by about this factor (`config.bucket_growth`).
BUCKET_GROWTH = 1.5


def bucket_lengths(
  max_length: int, min_length: int = 8, growth: float = BUCKET_GROWTH
) -> list[int]:
  """Bucket lengths growing by ~`growth`x from min_length, rounded up to multiples of 4, then
  max: [8, 12, 20, 32, 48, 72, ...] at 1.5. A smaller growth pads less (Multi30k's captions:
  26% of the positions at 1.5, 18% at 1.2) for more buckets, one compiled program each."""
  lengths, length = [], min_length
  while length < max_length:
    lengths.append(length)
    grown = int(length * growth)
    grown += grown % 4 and 4 - grown % 4  # Multiples of 4: friendlier tile sizes.
    length = max(grown, length + 4)
  lengths.append(max_length)
  return lengths


def rows_for_budget(tokens_per_batch: int, length: int, row_multiple: int) -> int:
  """Rows of `length` tokens within the budget, a multiple of row_multiple (at least one
  multiple) so that the rows split evenly over processes and devices."""
  return max(row_multiple, tokens_per_batch // length // row_multiple * row_multiple)


class _Lengths:
  """One epoch's pair lengths (EOS included): each side, their maximum, and the pairs that fit."""

  def __init__(self, source: np.ndarray, target: np.ndarray, max_length: int):
    self.source, self.target = np.asarray(source), np.asarray(target)
    self.both = np.maximum(self.source, self.target)
    self.eligible = np.flatnonzero(self.both <= max_length)


class _EpochPlan:
  """Shared machinery of a per-epoch plan: pairs that fit, the epoch cache, counter lookup.

  Subclasses define `_plan_epoch(epoch, rng, lengths)` (the epoch's batches, in training order)
  and `local_batch(split, batch, process_index, process_count)` (this process's arrays).
  `epoch_lengths(epoch) -> (source lengths, target lengths)`, where given, are each epoch's own
  (pairs segmented afresh every epoch); the arrays given are then epoch 0's.
  """

  def __init__(
    self,
    source_lengths: np.ndarray,
    target_lengths: np.ndarray,
    *,
    max_length: int,
    seed: int,
    epoch_lengths: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
  ):
    first = _Lengths(source_lengths, target_lengths, max_length)
    self._first, self._max_length, self._epoch_lengths = first, max_length, epoch_lengths
    self.source_lengths, self.target_lengths = first.source, first.target
    self.lengths, self.eligible = first.both, first.eligible
    self.num_excluded = len(self.lengths) - len(self.eligible)  # Pairs longer than max_length.
    self.seed = seed
    self._epoch_sizes: list[int] = []
    # {epoch: plan} for the epoch and its neighbours, replaced whole: grain reads batches from
    # several threads, which may straddle an epoch's end.
    self._cached: dict[int, list] = {}
    self._lock = threading.Lock()

  def lengths_of(self, epoch: int) -> _Lengths:
    """The pair lengths the plan of `epoch` is made from."""
    if self._epoch_lengths is None or epoch == 0:
      return self._first
    return _Lengths(*self._epoch_lengths(epoch), self._max_length)

  def epoch(self, epoch: int) -> list:
    """The batches of one epoch, in training order (a pure function of (seed, epoch))."""
    cached = self._cached
    if epoch in cached:
      return cached[epoch]
    rng = np.random.default_rng([self.seed, epoch])
    batches = self._plan_epoch(epoch, rng, self.lengths_of(epoch))
    kept = {e: plan for e, plan in cached.items() if abs(e - epoch) == 1}
    self._cached = {**kept, epoch: batches}
    return batches

  def _plan_epoch(self, epoch: int, rng: np.random.Generator, lengths: _Lengths) -> list:
    raise NotImplementedError

  def local_batch(
    self, split, batch, process_index: int, process_count: int
  ) -> dict[str, np.ndarray]:
    raise NotImplementedError

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


def _local_slice(rows: int, process_index: int, process_count: int) -> slice:
  local_rows = rows // process_count
  return slice(process_index * local_rows, (process_index + 1) * local_rows)


class TokenBudgetPlan(_EpochPlan):
  """Which examples make up each batch of each epoch, for a token budget."""

  def __init__(
    self,
    source_lengths: np.ndarray,
    target_lengths: np.ndarray,
    *,
    tokens_per_batch: int,
    max_length: int,
    seed: int,
    row_multiple: int = 1,
    epoch_lengths: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
    bucket_growth: float = BUCKET_GROWTH,
  ):
    super().__init__(
      source_lengths,
      target_lengths,
      max_length=max_length,
      seed=seed,
      epoch_lengths=epoch_lengths,
    )
    self.buckets = bucket_lengths(max_length, growth=bucket_growth)
    # Rows per bucket: the token budget over the padded length.
    self.rows = [rows_for_budget(tokens_per_batch, length, row_multiple) for length in self.buckets]

  def bucket_of(self, length: int) -> int:
    return bisect.bisect_left(self.buckets, length)

  def epoch(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """[(bucket index, example indices)] for one epoch, in training order."""
    return super().epoch(epoch)

  def _plan_epoch(
    self, epoch: int, rng: np.random.Generator, lengths: _Lengths
  ) -> list[tuple[int, np.ndarray]]:
    order = rng.permutation(lengths.eligible)
    pool_size = _POOL_BATCHES * max(self.rows)
    pending: dict[int, list[int]] = {}
    batches = []
    for start in range(0, len(order), pool_size):
      pool = order[start : start + pool_size]
      pool = pool[np.argsort(lengths.both[pool], kind='stable')]
      # Sorted by length, the pool is a run of examples per bucket, in bucket order. Each run
      # tops up that bucket's pending examples and is cut into full batches of its rows; the
      # rest waits for the next pool. (Array slicing, not a loop per example: at WMT14 size,
      # 4.5M pairs, an epoch plans in well under a second.)
      pool_buckets = np.searchsorted(self.buckets, lengths.both[pool], side='left')
      for run in np.split(pool, np.flatnonzero(np.diff(pool_buckets)) + 1):
        bucket = self.bucket_of(int(lengths.both[run[0]]))
        members = np.concatenate([pending.get(bucket, run[:0]), run])
        rows = self.rows[bucket]
        full = len(members) // rows * rows
        batches.extend((bucket, members[i : i + rows]) for i in range(0, full, rows))
        pending[bucket] = members[full:]
    # Leftovers become partly empty batches, so every example is seen once per epoch.
    for bucket, members in sorted(pending.items()):
      if len(members):
        batches.append((bucket, members))
    return [batches[i] for i in rng.permutation(len(batches))]

  def local_batch(
    self, split, batch: tuple[int, np.ndarray], process_index: int, process_count: int
  ) -> dict[str, np.ndarray]:
    bucket, members = batch
    length, rows = self.buckets[bucket], self.rows[bucket]
    local = _local_slice(rows, process_index, process_count)
    inputs = np.zeros((rows // process_count, length), np.int32)
    targets = np.zeros((rows // process_count, length), np.int32)
    for row, example_index in enumerate(members[local]):
      example = split[int(example_index)]
      inputs[row, : len(example['inputs'])] = example['inputs']
      targets[row, : len(example['targets'])] = example['targets']
    return {'inputs': inputs, 'targets': targets}

  def padding_fraction(self, epoch: int = 0) -> float:
    """Fraction of the batches' source+target positions that are padding, over one epoch."""
    real = padded = 0
    lengths = self.lengths_of(epoch)
    for bucket, members in self.epoch(epoch):
      padded += 2 * self.rows[bucket] * self.buckets[bucket]
      real += int(lengths.source[members].sum() + lengths.target[members].sum())
    return 1.0 - real / max(padded, 1)


class PackedPlan(_EpochPlan):
  """Which examples share each row, and which rows make each batch, for packed batches.

  Every row is `length` tokens on each side. An epoch shuffles the pairs that fit (both sides
  at most `length`), fills rows first-fit within pools of shuffled pairs (a pair goes to the
  first open row with room for both of its sides, else opens a new row), shuffles the rows
  and cuts them into batches of `rows` rows; the last batch is filled up with empty rows, so
  every pair is seen exactly once per epoch and every batch has one shape. A batch is a list
  of rows, each an array of example indices in their order within the row.
  """

  def __init__(
    self,
    source_lengths: np.ndarray,
    target_lengths: np.ndarray,
    *,
    rows: int,
    length: int,
    seed: int,
    pool_size: int = _PACKING_POOL_EXAMPLES,
    epoch_lengths: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
  ):
    super().__init__(
      source_lengths, target_lengths, max_length=length, seed=seed, epoch_lengths=epoch_lengths
    )
    if rows < 1 or length < 1 or pool_size < 1:
      raise ValueError(f'rows={rows}, length={length}, pool_size={pool_size} must be positive')
    self.rows, self.length, self.pool_size = rows, length, pool_size

  def epoch(self, epoch: int) -> list[list[np.ndarray]]:
    """[[example indices of each row] per batch] for one epoch, in training order."""
    return super().epoch(epoch)

  def _plan_epoch(
    self, epoch: int, rng: np.random.Generator, lengths: _Lengths
  ) -> list[list[np.ndarray]]:
    order = rng.permutation(lengths.eligible)
    rows: list[np.ndarray] = []
    for start in range(0, len(order), self.pool_size):
      rows.extend(self._pack(order[start : start + self.pool_size], lengths))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    return [rows[start : start + self.rows] for start in range(0, len(rows), self.rows)]

  def _pack(self, pool: np.ndarray, lengths: _Lengths) -> list[np.ndarray]:
    """First-fit of the pool's pairs (in the pool's order) into rows of self.length."""
    # Room left per open row on each side; a pair opens at most one row.
    source_room = np.empty(len(pool), np.int64)
    target_room = np.empty(len(pool), np.int64)
    members: list[list[int]] = []
    for index in pool.tolist():
      source, target = lengths.source[index], lengths.target[index]
      fits = (source_room[: len(members)] >= source) & (target_room[: len(members)] >= target)
      row = int(fits.argmax()) if len(members) else 0
      if not len(members) or not fits[row]:
        row = len(members)
        members.append([])
        source_room[row], target_room[row] = self.length, self.length
      members[row].append(index)
      source_room[row] -= source
      target_room[row] -= target
    return [np.asarray(m, np.int64) for m in members]

  def local_batch(
    self, split, batch: list[np.ndarray], process_index: int, process_count: int
  ) -> dict[str, np.ndarray]:
    """This process's rows of a batch: ids, segment ids and positions per side, [rows, L]."""
    local_rows = self.rows // process_count
    arrays = {
      f'{side}{suffix}': np.zeros((local_rows, self.length), np.int32)
      for side in ('inputs', 'targets')
      for suffix in ('', '_segment_ids', '_positions')
    }
    for row, members in enumerate(batch[_local_slice(self.rows, process_index, process_count)]):
      for side in ('inputs', 'targets'):
        offset = 0
        for segment, example_index in enumerate(members.tolist(), start=1):
          ids = split[example_index][side]
          end = offset + len(ids)
          arrays[side][row, offset:end] = ids
          arrays[f'{side}_segment_ids'][row, offset:end] = segment
          arrays[f'{side}_positions'][row, offset:end] = np.arange(len(ids))
          offset = end
    return arrays

  def padding_fraction(self, epoch: int = 0) -> float:
    """Fraction of the batches' source+target positions that are padding, over one epoch."""
    batches = self.epoch(epoch)
    lengths = self.lengths_of(epoch)
    real = sum(
      int(lengths.source[m].sum() + lengths.target[m].sum()) for batch in batches for m in batch
    )
    return 1.0 - real / max(2 * len(batches) * self.rows * self.length, 1)

  def examples_per_row(self, epoch: int = 0) -> float:
    """Mean number of pairs in a non-empty row over one epoch."""
    rows = [m for batch in self.epoch(epoch) for m in batch]
    return sum(len(m) for m in rows) / max(len(rows), 1)


class _PlannedBatches:
  """Random-access batches (grain MapDataset source): this process's rows of batch k."""

  def __init__(self, split, plan: _EpochPlan, process_index: int, process_count: int):
    self._split, self._plan = split, plan
    self._process_index, self._process_count = process_index, process_count

  def __len__(self) -> int:
    return sys.maxsize  # Endless: epochs follow each other.

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    epoch, position = self._plan.locate(index)
    # A split segmented afresh every epoch (`subword_sampling.SampledSplit`) gives its epoch's.
    for_epoch = getattr(self._split, 'for_epoch', None)
    split = for_epoch(epoch) if for_epoch else self._split
    return self._plan.local_batch(
      split, self._plan.epoch(epoch)[position], self._process_index, self._process_count
    )


def _planned_iterator(
  split, plan: _EpochPlan, process_index: int, process_count: int, num_threads: int
) -> grain.DatasetIterator:
  dataset = grain.MapDataset.source(_PlannedBatches(split, plan, process_index, process_count))
  return iter(
    dataset.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=8))
  )


def make_token_budget_iterator(
  split,
  *,
  tokens_per_batch: int,
  max_length: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
  devices_per_process: int = 1,
  micro_batches: int = 1,
  num_threads: int = 2,
  bucket_growth: float = BUCKET_GROWTH,
) -> tuple[grain.DatasetIterator, TokenBudgetPlan]:
  """Endless length-bucketed batches of `split` (a TokenizedSplit) and the plan behind them.

  `tokens_per_batch` is the global budget of padded tokens per side (the paper: ~25,000).
  Rows are a multiple of process_count * devices_per_process * micro_batches, so a batch cuts
  into `micro_batches` gradient-accumulation micro-batches that split evenly over devices.
  """
  source_lengths, target_lengths = split.lengths()
  plan = TokenBudgetPlan(
    source_lengths,
    target_lengths,
    tokens_per_batch=tokens_per_batch,
    max_length=max_length,
    seed=seed,
    row_multiple=process_count * devices_per_process * micro_batches,
    epoch_lengths=getattr(split, 'epoch_lengths', None),
    bucket_growth=bucket_growth,
  )
  return _planned_iterator(split, plan, process_index, process_count, num_threads), plan


def make_packed_iterator(
  split,
  *,
  length: int,
  seed: int,
  rows_per_batch: int | None = None,
  tokens_per_batch: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
  devices_per_process: int = 1,
  micro_batches: int = 1,
  num_threads: int = 2,
  pool_size: int = _PACKING_POOL_EXAMPLES,
) -> tuple[grain.DatasetIterator, PackedPlan]:
  """Endless packed batches of `split` (a TokenizedSplit) and the plan behind them.

  Every batch is {'inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids',
  'inputs_positions', 'targets_positions'}, int32 [this process's rows, length]. Give the
  global batch either as `rows_per_batch` or as `tokens_per_batch` (tokens per side; rows =
  tokens // length, rounded down to a multiple of process_count * devices_per_process *
  micro_batches). Pairs longer than `length` on either side are left out (`plan.num_excluded`).
  """
  if (rows_per_batch is None) == (tokens_per_batch is None):
    raise ValueError('give exactly one of rows_per_batch and tokens_per_batch')
  row_multiple = process_count * devices_per_process * micro_batches
  if rows_per_batch is None:
    rows_per_batch = rows_for_budget(tokens_per_batch, length, row_multiple)
  elif rows_per_batch < 1 or rows_per_batch % row_multiple:
    raise ValueError(
      f'rows_per_batch={rows_per_batch} must be a positive multiple of '
      'process_count * devices_per_process * micro_batches = '
      f'{row_multiple}'
    )
  source_lengths, target_lengths = split.lengths()
  plan = PackedPlan(
    source_lengths,
    target_lengths,
    rows=rows_per_batch,
    length=length,
    seed=seed,
    pool_size=pool_size,
    epoch_lengths=getattr(split, 'epoch_lengths', None),
  )
  return _planned_iterator(split, plan, process_index, process_count, num_threads), plan


def packing_model_args(batch: dict) -> dict:
  """Transformer keyword arguments for a packed batch (segment ids, positions); {} otherwise."""
  if 'inputs_segment_ids' not in batch:
    return {}
  return {
    'src_segment_ids': batch['inputs_segment_ids'],
    'tgt_segment_ids': batch['targets_segment_ids'],
    'src_positions': batch.get('inputs_positions'),
    'tgt_positions': batch.get('targets_positions'),
  }
