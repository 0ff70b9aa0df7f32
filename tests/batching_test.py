"""Tests of transformer_jax.data.batching: token-budget, length-bucketed batches and their iterator.

The data are synthetic but shaped like Multi30k: source lengths ~ lognormal (mean 14, sd 5
tokens, EOS included), clipped to [2, 70]; target = source +- 3. Every example's ids identify it:
inputs start with 4 + index and targets with 10_004 + index, so a batch row names its example.
"""

import json

import numpy as np
import pytest

from transformer_jax.data import batching
from transformer_jax.data.batching import (
  TokenBudgetPlan,
  bucket_lengths,
  make_token_budget_iterator,
)
from transformer_jax.data.input_pipeline import TokenizedSplit

EOS = 1
NUM_EXAMPLES = 3000
MAX_LENGTH = 64
TOKENS = 1024  # Per side; rows per bucket [128, 85, 51, 32, 21, 16] (see test_rows_per_bucket).
SEED = 7
TARGET_ID_BASE = 10_004


def _synthetic_lengths(num_examples, seed=0):
  rng = np.random.default_rng(seed)
  sigma2 = np.log(1 + (5 / 14) ** 2)  # Lognormal with mean 14, sd 5.
  source = rng.lognormal(np.log(14) - sigma2 / 2, np.sqrt(sigma2), num_examples)
  source = np.clip(np.rint(source), 2, 70).astype(np.int64)
  target = np.clip(source + rng.integers(-3, 4, num_examples), 2, 70)
  # Edge cases: exactly max_length on either side (eligible), a long pair for the top bucket,
  # then three over max_length: by one token, by the source, by the target alone.
  source = np.concatenate([source, [64, 30, 50, 65, 80, 10]])
  target = np.concatenate([target, [30, 64, 52, 20, 12, 75]])
  return source, target


def _ids(first, index, length):
  body = [(index * 7 + j) % 500 + 4 for j in range(1, length - 1)]
  return [first] + body + [EOS]


def _build_split(source_lengths, target_lengths):
  inputs = [_ids(4 + i, i, n) for i, n in enumerate(source_lengths)]
  targets = [_ids(TARGET_ID_BASE + i, i, n) for i, n in enumerate(target_lengths)]
  return TokenizedSplit.from_sequences(inputs, targets)


@pytest.fixture(scope='module')
def data():
  source, target = _synthetic_lengths(NUM_EXAMPLES)
  split = _build_split(source, target)
  got_source, got_target = split.lengths()
  np.testing.assert_array_equal(got_source, source)
  np.testing.assert_array_equal(got_target, target)
  eligible = np.flatnonzero(np.maximum(source, target) <= MAX_LENGTH)
  return {
    'split': split,
    'source': source,
    'target': target,
    'eligible': eligible,
    'long': np.flatnonzero(np.maximum(source, target) > MAX_LENGTH),
  }


def _plan(data, seed=SEED, tokens=TOKENS, row_multiple=1):
  return TokenBudgetPlan(
    data['source'],
    data['target'],
    tokens_per_batch=tokens,
    max_length=MAX_LENGTH,
    seed=seed,
    row_multiple=row_multiple,
  )


def _expected_epoch_size(plan):
  """Full batches per bucket plus one partly empty batch per bucket with leftovers."""
  counts = np.bincount(
    [plan.bucket_of(int(n)) for n in plan.lengths[plan.eligible]], minlength=len(plan.buckets)
  )
  return int(sum(-(-count // rows) for count, rows in zip(counts, plan.rows)))


def _take(iterator, count):
  return [next(iterator) for _ in range(count)]


def _expected_arrays(split, members, rows, length):
  expected = {
    'inputs': np.zeros((rows, length), np.int32),
    'targets': np.zeros((rows, length), np.int32),
  }
  for row, index in enumerate(members):
    example = split[int(index)]
    for side in ('inputs', 'targets'):
      expected[side][row, : len(example[side])] = example[side]
  return expected


def _assert_same_batches(got, want):
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(got, want)):
    for side in ('inputs', 'targets'):
      np.testing.assert_array_equal(a[side], b[side], err_msg=f'batch {k} {side}')


# 1. Bucket lengths.


@pytest.mark.parametrize(
  'max_length, expected',
  [
    (5, [5]),
    (8, [8]),
    (20, [8, 12, 20]),
    (21, [8, 12, 20, 21]),
    (64, [8, 12, 20, 32, 48, 64]),
    (100, [8, 12, 20, 32, 48, 72, 100]),
    (256, [8, 12, 20, 32, 48, 72, 108, 164, 248, 256]),
    (512, [8, 12, 20, 32, 48, 72, 108, 164, 248, 372, 512]),
  ],
)
def test_bucket_lengths_pinned(max_length, expected):
  # Note: the docstring's example [8, 12, 16, 24, 32, 48, ...] is not what the code yields.
  lengths = bucket_lengths(max_length)
  assert lengths == expected
  assert all(a < b for a, b in zip(lengths, lengths[1:]))
  assert lengths[-1] == max_length
  assert all(n % 4 == 0 for n in lengths[:-1])


def test_bucket_lengths_invariants():
  for max_length in range(1, 1025):
    lengths = bucket_lengths(max_length)
    assert all(a < b for a, b in zip(lengths, lengths[1:])), max_length
    assert lengths[-1] == max_length
    assert all(0 < n <= max_length for n in lengths)


@pytest.mark.parametrize(
  'growth, expected',
  [
    (1.2, [8, 12, 16, 20, 24, 28, 36, 44, 52, 64]),
    (1.1, [8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 60, 64]),
    # Growth too small to reach the next multiple of 4 still steps by 4.
    (1.01, list(range(8, 65, 4))),
    (4.0, [8, 32, 64]),
  ],
)
def test_bucket_growth_pinned(growth, expected):
  assert bucket_lengths(64, growth=growth) == expected
  for max_length in range(1, 300):
    lengths = bucket_lengths(max_length, growth=growth)
    assert all(a < b for a, b in zip(lengths, lengths[1:])), (growth, max_length)
    assert lengths[-1] == max_length
    assert all(n % 4 == 0 for n in lengths[:-1])


def test_finer_buckets_pad_less_and_keep_every_pair_once(data):
  # A small budget, so that the part-full leftover batches (one per bucket) weigh little.
  coarse, fine = (
    TokenBudgetPlan(
      data['source'],
      data['target'],
      tokens_per_batch=256,
      max_length=MAX_LENGTH,
      seed=SEED,
      bucket_growth=growth,
    )
    for growth in (1.5, 1.2)
  )
  assert coarse.buckets == bucket_lengths(MAX_LENGTH)
  assert fine.buckets == bucket_lengths(MAX_LENGTH, growth=1.2)
  # Measured on these lengths: 0.251 at growth 1.5, 0.171 at 1.2; 226 -> 202 batches.
  assert coarse.padding_fraction(0) > 0.24
  assert fine.padding_fraction(0) < 0.18
  assert len(fine.epoch(0)) < 0.9 * len(coarse.epoch(0))
  members = np.sort(np.concatenate([m for _, m in fine.epoch(0)]))
  np.testing.assert_array_equal(members, data['eligible'])
  # Every batch's pairs fit its bucket and none would fit the bucket below.
  for bucket, batch_members in fine.epoch(0):
    longest = np.maximum(data['source'], data['target'])[batch_members]
    assert longest.max() <= fine.buckets[bucket]
    assert bucket == 0 or longest.min() > fine.buckets[bucket - 1]


def test_rows_per_bucket(data):
  assert _plan(data).buckets == [8, 12, 20, 32, 48, 64]
  assert _plan(data).rows == [128, 85, 51, 32, 21, 16]
  assert _plan(data, row_multiple=8).rows == [128, 80, 48, 32, 16, 16]
  # A budget below one row of a bucket still gets row_multiple rows: the one case where
  # rows * bucket length exceeds tokens_per_batch.
  assert _plan(data, tokens=40, row_multiple=4).rows == [4, 4, 4, 4, 4, 4]


def test_eligibility(data):
  plan = _plan(data)
  np.testing.assert_array_equal(plan.eligible, data['eligible'])
  np.testing.assert_array_equal(data['long'], NUM_EXAMPLES + np.arange(3, 6))
  assert np.isin(NUM_EXAMPLES + np.arange(3), plan.eligible).all()
  assert not np.isin(data['long'], plan.eligible).any()
  assert len(plan.eligible) == len(data['source']) - len(data['long'])


# 2. Token budget.


@pytest.mark.parametrize('tokens, row_multiple', [(TOKENS, 1), (TOKENS, 8), (4096, 4), (40, 4)])
def test_token_budget_never_exceeded(data, tokens, row_multiple):
  plan = _plan(data, tokens=tokens, row_multiple=row_multiple)
  for rows in plan.rows:
    assert rows % row_multiple == 0
  for epoch in range(3):
    for bucket, members in plan.epoch(epoch):
      length, rows = plan.buckets[bucket], plan.rows[bucket]
      if length * row_multiple > tokens:
        assert rows == row_multiple  # Minimum rows: the budget cannot be met (documented).
      else:
        assert rows * length <= tokens
      assert 1 <= len(members) <= rows
      member_lengths = np.maximum(data['source'][members], data['target'][members])
      assert member_lengths.max() <= length
      lower = plan.buckets[bucket - 1] if bucket else 0
      assert member_lengths.min() > lower  # Each example sits in the smallest bucket it fits.


# 3. Coverage, order, determinism.


def test_every_eligible_example_once_per_epoch(data):
  plan = _plan(data)
  orders = []
  for epoch in range(3):
    batches = plan.epoch(epoch)
    members = np.concatenate([m for _, m in batches])
    np.testing.assert_array_equal(np.sort(members), data['eligible'])
    assert not np.isin(data['long'], members).any()
    assert len(batches) == _expected_epoch_size(plan)
    # At most one partly empty batch per bucket (the leftovers).
    partial = [b for b, m in batches if len(m) < plan.rows[b]]
    assert len(partial) == len(set(partial))
    orders.append(members)
  for a in range(3):
    for b in range(a + 1, 3):
      assert not np.array_equal(orders[a], orders[b])


def test_plan_deterministic_in_seed(data):
  def listing(plan, epoch):
    return [(b, m.tolist()) for b, m in plan.epoch(epoch)]

  plan = _plan(data)
  for epoch in (0, 1, 2):
    assert listing(plan, epoch) == listing(_plan(data), epoch)
    assert listing(plan, epoch) != listing(_plan(data, seed=SEED + 1), epoch)
  # The cache keeps one epoch; going back recomputes the same plan.
  first = listing(plan, 0)
  listing(plan, 1)
  assert listing(plan, 0) == first


# 4. Padding.


def test_padding_fraction_below_fixed_length(data):
  plan = _plan(data)
  source, target, eligible = data['source'], data['target'], data['eligible']
  real = int(source[eligible].sum() + target[eligible].sum())
  fixed = 1 - real / (2 * len(eligible) * MAX_LENGTH)
  # Recomputed independently of padding_fraction.
  padded = sum(2 * plan.rows[b] * plan.buckets[b] for b, _ in plan.epoch(0))
  bucketed = plan.padding_fraction(0)
  assert bucketed == pytest.approx(1 - real / padded, abs=1e-12)
  # On this data: token budget ~0.30 padding vs ~0.78 padding to max_length=64.
  assert bucketed < 0.35
  assert fixed > 0.75
  assert bucketed < fixed / 2
  for epoch in (1, 2):
    assert plan.padding_fraction(epoch) < 0.35


# 5. Iterator contents.


def test_iterator_batches_match_plan(data):
  split = data['split']
  iterator, plan = make_token_budget_iterator(
    split, tokens_per_batch=TOKENS, max_length=MAX_LENGTH, seed=SEED
  )
  size = len(plan.epoch(0))
  got = _take(iterator, size + 10)  # Crosses into epoch 1.
  want = [(b, m) for b, m in plan.epoch(0)] + [(b, m) for b, m in plan.epoch(1)[:10]]
  seen = []
  for batch, (bucket, members) in zip(got, want):
    length, rows = plan.buckets[bucket], plan.rows[bucket]
    assert set(batch) == {'inputs', 'targets'}
    for side in ('inputs', 'targets'):
      assert batch[side].dtype == np.int32
      assert batch[side].shape == (rows, length)
      assert length in plan.buckets
    expected = _expected_arrays(split, members, rows, length)
    for side in ('inputs', 'targets'):
      np.testing.assert_array_equal(batch[side], expected[side])
    assert not batch['inputs'][len(members) :].any()
    assert not batch['targets'][len(members) :].any()
    real = batch['inputs'][: len(members), 0]
    np.testing.assert_array_equal(real - 4, members)
    np.testing.assert_array_equal(batch['targets'][: len(members), 0] - TARGET_ID_BASE, members)
    seen.append(real - 4)
  np.testing.assert_array_equal(np.sort(np.concatenate(seen[:size])), data['eligible'])


# 6. Multi-process shards.


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_shards_partition_each_batch(data, process_count):
  split = data['split']
  kwargs = dict(tokens_per_batch=TOKENS, max_length=MAX_LENGTH, seed=SEED, num_threads=1)
  # One process with process_count devices has the same row_multiple, so the same plan.
  reference, plan = make_token_budget_iterator(split, devices_per_process=process_count, **kwargs)
  size = len(plan.epoch(0))
  count = size + 3
  want = _take(reference, count)
  shards = []
  for p in range(process_count):
    iterator, shard_plan = make_token_budget_iterator(
      split, process_index=p, process_count=process_count, **kwargs
    )
    assert shard_plan.rows == plan.rows
    assert all(rows % process_count == 0 for rows in plan.rows)
    shards.append(_take(iterator, count))
  for k in range(count):
    position = k % size
    bucket, members = plan.epoch(k // size)[position]
    shapes = {shards[p][k]['inputs'].shape for p in range(process_count)}
    shapes |= {shards[p][k]['targets'].shape for p in range(process_count)}
    assert shapes == {(plan.rows[bucket] // process_count, plan.buckets[bucket])}
    for side in ('inputs', 'targets'):
      np.testing.assert_array_equal(
        np.concatenate([shards[p][k][side] for p in range(process_count)]), want[k][side]
      )
    ids = [
      set((s['inputs'][:, 0][s['inputs'][:, 0] > 0] - 4).tolist())
      for s in (shards[p][k] for p in range(process_count))
    ]
    for a in range(process_count):
      for b in range(a + 1, process_count):
        assert not ids[a] & ids[b]
    assert set().union(*ids) == set(members.tolist())


# 7. Resume.


@pytest.mark.parametrize('past_boundary', [False, True])
def test_resume_from_state(data, past_boundary):
  kwargs = dict(tokens_per_batch=TOKENS, max_length=MAX_LENGTH, seed=SEED)
  iterator, plan = make_token_budget_iterator(data['split'], **kwargs)
  size = len(plan.epoch(0))
  n = size + 7 if past_boundary else 11
  m = size if past_boundary else 15  # Past boundary: the m batches cross into epoch 2 too.
  _take(iterator, n)
  state = iterator.get_state()
  state = json.loads(json.dumps(state))
  assert state == {'next_index': n}
  recorded = _take(iterator, m)
  fresh, _ = make_token_budget_iterator(data['split'], **kwargs)
  fresh.set_state(state)
  _assert_same_batches(_take(fresh, m), recorded)
  # An iterator that already ran ahead also rewinds to the state.
  iterator.set_state(state)
  _assert_same_batches(_take(iterator, m), recorded)


# 8. locate().


def test_locate_consistent_with_epoch_sizes(data):
  plan = _plan(data)
  size = _expected_epoch_size(plan)
  sizes = [len(plan.epoch(e)) for e in range(4)]
  assert sizes == [size] * 4  # Bucket counts do not change, so neither does the epoch size.
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for k in range(int(starts[-1])):
    epoch = int(np.searchsorted(starts, k, side='right')) - 1
    assert plan.locate(k) == (epoch, k - int(starts[epoch]))
  # A fresh plan jumping straight to a late counter agrees.
  assert _plan(data).locate(5 * size + 3) == (5, 3)
  assert _plan(data).locate(size - 1) == (0, size - 1)
  assert _plan(data).locate(size) == (1, 0)


def test_planned_batches_use_global_counter(data):
  plan = _plan(data, row_multiple=2)
  size = len(plan.epoch(0))
  source = batching._PlannedBatches(data['split'], plan, process_index=1, process_count=2)
  bucket, members = plan.epoch(1)[4]
  rows = plan.rows[bucket]
  batch = source[size + 4]
  expected = _expected_arrays(data['split'], members[rows // 2 :], rows // 2, plan.buckets[bucket])
  for side in ('inputs', 'targets'):
    np.testing.assert_array_equal(batch[side], expected[side])


def _reference_epoch(plan, epoch):
  """The plan's specification, one example at a time: shuffle; sort pools by length; append
  each example to its bucket's batch, emitting it when full; leftovers last; shuffle batches."""
  rng = np.random.default_rng([plan.seed, epoch])
  order = rng.permutation(plan.eligible)
  pool_size = batching._POOL_BATCHES * max(plan.rows)
  pending, batches = {}, []
  for start in range(0, len(order), pool_size):
    pool = order[start : start + pool_size]
    for index in pool[np.argsort(plan.lengths[pool], kind='stable')]:
      bucket = plan.bucket_of(int(plan.lengths[index]))
      pending.setdefault(bucket, []).append(int(index))
      if len(pending[bucket]) == plan.rows[bucket]:
        batches.append((bucket, pending.pop(bucket)))
  batches += [(bucket, members) for bucket, members in sorted(pending.items()) if members]
  return [batches[i] for i in rng.permutation(len(batches))]


@pytest.mark.parametrize('seed, epoch', [(SEED, 0), (SEED, 3), (11, 1)])
def test_plan_equals_its_per_example_specification(data, seed, epoch):
  # Small pools, so batches carry leftovers from one pool into the next.
  plan = _plan(data, seed=seed, tokens=256)
  got, want = plan.epoch(epoch), _reference_epoch(plan, epoch)
  assert len(got) == len(want)
  for (bucket, members), (want_bucket, want_members) in zip(got, want):
    assert bucket == want_bucket
    np.testing.assert_array_equal(members, want_members)
