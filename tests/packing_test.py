"""Sequence packing: the packer (batching.PackedPlan), the segment-aware model and train step.

The central check: a packed batch gives the same logits and the same per-example loss as the
same examples each in its own padded row. Models are tiny with random parameters (NumPy noise
into `jax.eval_shape` shapes: compiling the real initialiser costs seconds on CPU).
"""

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax.linen import meta

from transformer_jax.data import batching, input_pipeline
from transformer_jax.data.batching import PackedPlan, TokenBudgetPlan, make_packed_iterator
from transformer_jax.data.input_pipeline import TokenizedSplit
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.inputs import segment_positions, sinusoidal_positions
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import step as training_step
from transformer_jax.training.losses import label_smoothed_cross_entropy

VOCAB = 40
CFG = TransformerConfig(
  vocab_size=VOCAB,
  d_model=16,
  d_ff=32,
  num_heads=2,
  num_encoder_layers=1,
  num_decoder_layers=1,
  max_len=16,
  dropout_rate=0.0,
  attention_dropout_rate=0.0,
)
SMOOTHING = 0.1
LENGTH = 12  # Packed row length of the model tests.
# (source length, target length) of the model tests' examples, EOS included.
EXAMPLE_LENGTHS = [(5, 4), (3, 6), (4, 3), (6, 5), (2, 2)]
# Rows of the packed model batch: examples 0, 1, 4 share row 0 (source 10, target 12 = L).
PACKED_ROWS = [np.array([0, 1, 4]), np.array([2, 3])]

# Packer tests: Multi30k-like lengths (lognormal, mean 14, sd 5, EOS included).
NUM_EXAMPLES = 2000
PACK_LENGTH = 64
PACK_TOKENS = 1024  # Per side: 16 rows of 64.
SEED = 3
TARGET_ID_BASE = 10_004
# The tests' jitted functions compile without LLVM optimisation: half the compile time on CPU
# (what is under test is which tokens see which, not speed; results are the same).
FAST_COMPILE = {'xla_backend_optimization_level': 0}


# --- helpers -----------------------------------------------------------------------------------


def _split_from(inputs, targets):
  return TokenizedSplit.from_sequences(inputs, targets)


def _model_split():
  """Random token ids (3..VOCAB-1) ending with EOS, for EXAMPLE_LENGTHS."""
  rng = np.random.default_rng(0)

  def ids(n):
    return list(rng.integers(3, VOCAB, n - 1)) + [EOS_ID]

  return _split_from([ids(s) for s, _ in EXAMPLE_LENGTHS], [ids(t) for _, t in EXAMPLE_LENGTHS])


def _multi30k_like_split(num_examples=NUM_EXAMPLES, seed=0):
  """Lengths as Multi30k's; plus pairs too long by the source, the target, both. Example i's
  inputs start with 4 + i and its targets with TARGET_ID_BASE + i, so a row names its pairs."""
  rng = np.random.default_rng(seed)
  sigma2 = np.log(1 + (5 / 14) ** 2)
  source = np.clip(
    np.rint(rng.lognormal(np.log(14) - sigma2 / 2, np.sqrt(sigma2), num_examples)), 2, 70
  ).astype(np.int64)
  target = np.clip(source + rng.integers(-3, 4, num_examples), 2, 70)
  source = np.concatenate([source, [64, 65, 10, 80]])
  target = np.concatenate([target, [64, 10, 65, 80]])

  def body(i, n):
    return [(i * 7 + j) % 500 + 4 for j in range(1, n - 1)]

  inputs = [[4 + i] + body(i, n) + [EOS_ID] for i, n in enumerate(source)]
  targets = [[TARGET_ID_BASE + i] + body(i, n) + [EOS_ID] for i, n in enumerate(target)]
  return _split_from(inputs, targets)


@pytest.fixture(scope='module')
def split():
  return _multi30k_like_split()


def _random_params(cfg, seed=0):
  shapes = meta.unbox(
    jax.eval_shape(
      Transformer(cfg).init,
      jax.random.key(0),
      jnp.ones((1, 1), jnp.int32),
      jnp.ones((1, 1), jnp.int32),
    )['params']
  )
  rng = np.random.default_rng(seed)

  def one(path, leaf):
    noise = rng.normal(size=leaf.shape)
    name = path[-1].key
    value = 1.0 + 0.1 * noise if name == 'scale' else (0.1 if name == 'bias' else 0.3) * noise
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(one, shapes)


@functools.lru_cache(maxsize=None)
def _forward():
  model = Transformer(CFG)
  return jax.jit(
    lambda params, src, tgt_in, packing: model.apply({'params': params}, src, tgt_in, **packing),
    compiler_options=FAST_COMPILE,
  )


def _logits(params, batch):
  """Logits of a (packed or plain) batch, decoder inputs shifted per segment if packed."""
  packing = batching.packing_model_args(batch)
  tgt_in = training_step.shift_right(batch['targets'], packing.get('tgt_segment_ids'))
  return np.asarray(_forward()(params, batch['inputs'], tgt_in, packing))


def _packed_model_batch(with_positions=False):
  """The packer's rows PACKED_ROWS of the model examples. Without positions (the model derives
  them from the segment ids; the train step test feeds the packer's explicit positions)."""
  split = _model_split()
  source, target = split.lengths()
  plan = PackedPlan(source, target, rows=len(PACKED_ROWS), length=LENGTH, seed=0)
  batch = plan.local_batch(split, PACKED_ROWS, 0, 1)
  if not with_positions:
    batch = {k: v for k, v in batch.items() if not k.endswith('_positions')}
  return split, batch


def _unpacked_model_batch(split):
  batch = {side: np.zeros((len(split), LENGTH), np.int32) for side in ('inputs', 'targets')}
  for i in range(len(split)):
    for side in ('inputs', 'targets'):
      batch[side][i, : len(split[i][side])] = split[i][side]
  return batch


def _where_packed(batch):
  """{example index: (row, target start, target length)} from the packed batch's rows."""
  places = {}
  for row, members in enumerate(PACKED_ROWS):
    for segment, example in enumerate(members, start=1):
      columns = np.flatnonzero(batch['targets_segment_ids'][row] == segment)
      places[int(example)] = (row, int(columns[0]), len(columns))
  return places


@functools.lru_cache(maxsize=None)
def _masked_losses():
  """(logits [b, t, v], targets [b, t], masks [n, b, t]) -> the n masked label-smoothed loss
  sums: one jitted call of the project's loss per batch shape."""

  def loss(logits, targets, mask):
    return label_smoothed_cross_entropy(logits, targets, mask, SMOOTHING)[0]

  return jax.jit(jax.vmap(loss, in_axes=(None, None, 0)), compiler_options=FAST_COMPILE)


def _per_token_losses(logits, targets):
  """[b, t] label-smoothed loss of every token (padding included; callers pick positions)."""
  b, t = targets.shape
  masks = np.eye(b * t, dtype=np.float32).reshape(b * t, b, t)
  return np.asarray(_masked_losses()(logits, targets, masks)).reshape(b, t)


# --- shift_right and positions -----------------------------------------------------------------


def test_shift_right_restarts_per_segment():
  targets = np.array([[5, 6, 1, 7, 1, 8, 9, 1, 0, 0], [3, 4, 5, 1, 6, 1, 0, 0, 0, 0]], np.int32)
  segments = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0], [1, 1, 1, 1, 2, 2, 0, 0, 0, 0]], np.int32)
  B = BOS_ID
  expected = [[B, 5, 6, B, 7, B, 8, 9, 0, 0], [B, 3, 4, 5, B, 6, 0, 0, 0, 0]]
  np.testing.assert_array_equal(training_step.shift_right(targets, segments), expected)
  # Without segment ids: unchanged (the previous example's EOS runs into the next position).
  np.testing.assert_array_equal(
    training_step.shift_right(targets[:1]), [[B, 5, 6, 1, 7, 1, 8, 9, 1, 0]]
  )
  # One example per row: the same as the plain shift at every real position.
  single = (targets[:, :4] != 0).astype(np.int32)
  np.testing.assert_array_equal(
    training_step.shift_right(targets[:, :4], single), training_step.shift_right(targets[:, :4])
  )


def test_positions_restart_per_segment(split):
  iterator, plan = make_packed_iterator(
    split, rows_per_batch=16, length=PACK_LENGTH, seed=SEED, num_threads=1
  )
  batch = next(iterator)
  for side in ('inputs', 'targets'):
    segments, positions = batch[f'{side}_segment_ids'], batch[f'{side}_positions']
    np.testing.assert_array_equal(
      np.asarray(segment_positions(jnp.asarray(segments))) * (segments > 0), positions
    )
    starts = (segments > 0) & (np.diff(segments, prepend=-1, axis=1) != 0)
    assert (positions[starts] == 0).all()
    assert starts.sum() > len(segments)  # Several examples per row.
    # The sinusoidal encoding at every segment start is position 0's.
    encoding = np.asarray(sinusoidal_positions(jnp.asarray(positions), 16))
    np.testing.assert_array_equal(
      encoding[starts], np.broadcast_to(encoding[0, 0], encoding[starts].shape)
    )
  assert segment_positions(jnp.array([[1, 1, 1, 2, 2, 0, 0]])).tolist() == [[0, 1, 2, 0, 1, 0, 1]]


# --- the model honours segments ----------------------------------------------------------------


def test_packed_equals_unpacked_logits_and_loss():
  params = _random_params(CFG)
  split, packed = _packed_model_batch()
  unpacked = _unpacked_model_batch(split)
  packed_logits, plain_logits = _logits(params, packed), _logits(params, unpacked)
  packed_losses = _per_token_losses(packed_logits, packed['targets'])
  plain_losses = _per_token_losses(plain_logits, unpacked['targets'])
  for example, (row, start, length) in _where_packed(packed).items():
    targets = split[example]['targets']
    assert length == len(targets)
    np.testing.assert_array_equal(packed['targets'][row, start : start + length], targets)
    np.testing.assert_allclose(
      packed_logits[row, start : start + length],
      plain_logits[example, :length],
      atol=1e-5,
      rtol=1e-5,
      err_msg=f'example {example}',
    )
    # The example's loss: its tokens' losses summed by segment id, vs its own padded row.
    segment = _segment_of(example)
    packed_loss = packed_losses[row][packed['targets_segment_ids'][row] == segment].sum()
    plain_loss = plain_losses[example, :length].sum()
    assert abs(packed_loss - plain_loss) < 1e-5, (example, packed_loss, plain_loss)
    assert plain_loss > 1.0  # Random parameters: a real loss, not a trivially equal zero.


def _segment_of(example):
  for members in PACKED_ROWS:
    if example in members:
      return int(np.flatnonzero(members == example)[0]) + 1
  raise KeyError(example)


def test_attention_never_crosses_example_boundaries():
  params = _random_params(CFG)
  split, packed = _packed_model_batch()
  before = _logits(params, packed)
  # Change every source and target token of row 0's middle example (example 1, segment 2),
  # except its EOS; its neighbours before (example 0) and after (example 4) must not notice.
  changed = {k: v.copy() for k, v in packed.items()}
  for side in ('inputs', 'targets'):
    in_segment = (changed[f'{side}_segment_ids'][0] == 2) & (changed[side][0] != EOS_ID)
    changed[side][0, in_segment] = (changed[side][0, in_segment] - 3 + 17) % (VOCAB - 3) + 3
    assert (changed[side] != packed[side]).sum() == in_segment.sum() > 0
  after = _logits(params, changed)
  places = _where_packed(packed)
  for example in (0, 4):
    row, start, length = places[example]
    np.testing.assert_allclose(
      after[row, start : start + length], before[row, start : start + length], atol=1e-6
    )
  row, start, length = places[1]
  assert (
    np.abs(after[row, start : start + length] - before[row, start : start + length]).max() > 1e-2
  )
  np.testing.assert_allclose(after[1], before[1], atol=1e-6)  # The other row.


def test_segment_ids_needed_on_both_sides():
  params = _random_params(CFG)
  ids = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match='both source and target'):
    Transformer(CFG).apply({'params': params}, ids, ids, src_segment_ids=ids)


# --- train_step / eval_step --------------------------------------------------------------------


def test_train_step_packed_equals_unpacked():
  params = _random_params(CFG)
  split, packed = _packed_model_batch(with_positions=True)
  unpacked = _unpacked_model_batch(split)
  model = Transformer(CFG)
  step = jax.jit(
    functools.partial(
      training_step.train_step,
      model=model,
      learning_rate_fn=lambda s: 1e-3,
      label_smoothing=SMOOTHING,
    ),
    compiler_options=FAST_COMPILE,
  )

  def state():
    return training_step.TrainState.create(
      apply_fn=model.apply,
      params=params,
      tx=optax.adam(1e-3),
      dropout_rng=jax.random.PRNGKey(0),
      skipped_steps=jnp.zeros((), jnp.int32),
      nonfinite_streak=jnp.zeros((), jnp.int32),
    )

  _, packed_metrics = step(state(), packed)
  _, plain_metrics = step(state(), unpacked)
  real_tokens = sum(t for _, t in EXAMPLE_LENGTHS)
  assert float(packed_metrics['token_count']) == float(plain_metrics['token_count']) == real_tokens
  packed_loss = float(packed_metrics['loss_sum']) / real_tokens
  plain_loss = float(plain_metrics['loss_sum']) / real_tokens
  assert abs(packed_loss - plain_loss) < 1e-5, (packed_loss, plain_loss)
  np.testing.assert_allclose(
    float(packed_metrics['grad_norm']), float(plain_metrics['grad_norm']), rtol=1e-5
  )
  assert float(packed_metrics['correct_tokens']) == float(plain_metrics['correct_tokens'])
  # eval_step agrees with the train step's loss on the packed batch (dropout is 0).
  eval_metrics = jax.jit(
    functools.partial(training_step.eval_step, model=model, label_smoothing=SMOOTHING),
    compiler_options=FAST_COMPILE,
  )(params, packed)
  np.testing.assert_allclose(
    float(eval_metrics['loss_sum']), float(packed_metrics['loss_sum']), rtol=1e-5
  )


# --- the packer --------------------------------------------------------------------------------


def _plan(split, seed=SEED, rows=16):
  source, target = split.lengths()
  return PackedPlan(source, target, rows=rows, length=PACK_LENGTH, seed=seed)


def test_every_eligible_example_once_per_epoch(split):
  source, target = split.lengths()
  eligible = np.flatnonzero(np.maximum(source, target) <= PACK_LENGTH)
  plan = _plan(split)
  assert plan.num_excluded == 3 and len(eligible) == NUM_EXAMPLES + 1
  np.testing.assert_array_equal(plan.eligible, eligible)
  orders = []
  for epoch in range(3):
    batches = plan.epoch(epoch)
    rows = [m for batch in batches for m in batch]
    assert all(len(batch) == plan.rows for batch in batches[:-1])
    assert 1 <= len(batches[-1]) <= plan.rows
    members = np.concatenate(rows)
    np.testing.assert_array_equal(np.sort(members), eligible)
    for m in rows:
      assert len(m) >= 1
      assert source[m].sum() <= PACK_LENGTH and target[m].sum() <= PACK_LENGTH
    orders.append(members)
  assert not np.array_equal(orders[0], orders[1])

  def listing(p, e):
    return [[m.tolist() for m in b] for b in p.epoch(e)]

  assert listing(plan, 1) == listing(_plan(split), 1)
  assert listing(plan, 1) != listing(_plan(split, seed=SEED + 1), 1)


def _check_batch(batch, split, rows, length=PACK_LENGTH):
  """Shapes, contents, segment ids and positions of a packed batch; returns its examples."""
  assert set(batch) == {
    f'{s}{x}' for s in ('inputs', 'targets') for x in ('', '_segment_ids', '_positions')
  }
  for value in batch.values():
    assert value.dtype == np.int32 and value.shape == (rows, length)
  examples = []
  for row in range(rows):
    segments = batch['inputs_segment_ids'][row]
    count = segments.max()
    assert count == batch['targets_segment_ids'][row].max()
    firsts = []
    for side in ('inputs', 'targets'):
      segments, ids = batch[f'{side}_segment_ids'][row], batch[side][row]
      used = int((segments > 0).sum())
      # Segments 1..k, consecutive and contiguous from the row start; then only padding.
      np.testing.assert_array_equal(np.unique(segments[:used]), np.arange(1, count + 1))
      assert (np.diff(segments[:used]) >= 0).all()
      assert not segments[used:].any() and not ids[used:].any()
      assert not batch[f'{side}_positions'][row, used:].any()
      for k in range(1, count + 1):
        columns = np.flatnonzero(segments == k)
        np.testing.assert_array_equal(
          batch[f'{side}_positions'][row, columns], np.arange(len(columns))
        )
        firsts.append(int(ids[columns[0]]))
    sources, targets = firsts[:count], firsts[count:]
    indices = [s - 4 for s in sources]
    assert [t - TARGET_ID_BASE for t in targets] == indices  # Same pair, same segment id.
    for k, index in enumerate(indices, start=1):
      for side in ('inputs', 'targets'):
        np.testing.assert_array_equal(
          batch[side][row][batch[f'{side}_segment_ids'][row] == k], split[index][side]
        )
    examples.extend(indices)
  return examples


def test_iterator_batches_match_plan(split):
  iterator, plan = make_packed_iterator(
    split, tokens_per_batch=PACK_TOKENS, length=PACK_LENGTH, seed=SEED, num_threads=1
  )
  assert plan.rows == PACK_TOKENS // PACK_LENGTH
  size = len(plan.epoch(0))
  seen = []
  for k in range(size + 2):
    batch = next(iterator)
    examples = _check_batch(batch, split, plan.rows)
    epoch, position = divmod(k, size)
    assert examples == np.concatenate(plan.epoch(epoch)[position]).tolist()
    if k < size:
      seen.extend(examples)
  np.testing.assert_array_equal(np.sort(seen), plan.eligible)


@pytest.mark.parametrize('past_boundary', [False, True])
def test_resume_from_state(split, past_boundary):
  kwargs = dict(tokens_per_batch=PACK_TOKENS, length=PACK_LENGTH, seed=SEED, num_threads=1)
  iterator, plan = make_packed_iterator(split, **kwargs)
  size = len(plan.epoch(0))
  n = size - 2 if past_boundary else 5
  _ = [next(iterator) for _ in range(n)]
  state = json.loads(json.dumps(iterator.get_state()))
  recorded = [next(iterator) for _ in range(5)]
  fresh, _ = make_packed_iterator(split, **kwargs)
  fresh.set_state(state)
  for a, b in zip(recorded, [next(fresh) for _ in range(5)]):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_shards_disjoint_and_complete(split, process_count):
  kwargs = dict(tokens_per_batch=PACK_TOKENS, length=PACK_LENGTH, seed=SEED, num_threads=1)
  reference, plan = make_packed_iterator(split, devices_per_process=process_count, **kwargs)
  size = len(plan.epoch(0))
  count = size + 1
  want = [next(reference) for _ in range(count)]
  shards = []
  for p in range(process_count):
    iterator, shard_plan = make_packed_iterator(
      split, process_index=p, process_count=process_count, **kwargs
    )
    assert shard_plan.rows == plan.rows and plan.rows % process_count == 0
    shards.append([next(iterator) for _ in range(count)])
  seen = []
  for k in range(count):
    for key in want[k]:
      np.testing.assert_array_equal(
        np.concatenate([shards[p][k][key] for p in range(process_count)]), want[k][key]
      )
    per_process = [
      set(_check_batch(shards[p][k], split, plan.rows // process_count))
      for p in range(process_count)
    ]
    for a in range(process_count):
      for b in range(a + 1, process_count):
        assert not per_process[a] & per_process[b]
    if k < size:
      seen.extend(set().union(*per_process))
  np.testing.assert_array_equal(np.sort(seen), plan.eligible)


def test_rows_and_arguments():
  split = _multi30k_like_split(50)
  _, plan = make_packed_iterator(
    split, tokens_per_batch=1000, length=PACK_LENGTH, seed=0, process_count=2, devices_per_process=4
  )
  assert plan.rows == 8  # 1000 // 64 = 15, down to a multiple of 8.
  with pytest.raises(ValueError, match='exactly one'):
    make_packed_iterator(split, length=PACK_LENGTH, seed=0)
  with pytest.raises(ValueError, match='exactly one'):
    make_packed_iterator(split, rows_per_batch=8, tokens_per_batch=512, length=PACK_LENGTH, seed=0)
  with pytest.raises(ValueError, match='multiple'):
    make_packed_iterator(split, rows_per_batch=6, length=PACK_LENGTH, seed=0, process_count=4)


def test_padding_fraction_below_fixed_and_token_budget(split):
  source, target = split.lengths()
  plan = _plan(split)
  eligible = plan.eligible
  real = int(source[eligible].sum() + target[eligible].sum())
  fixed = 1 - real / (2 * len(eligible) * PACK_LENGTH)
  batches = plan.epoch(0)
  packed = plan.padding_fraction(0)
  assert packed == pytest.approx(1 - real / (2 * len(batches) * plan.rows * PACK_LENGTH), abs=1e-12)
  budget = TokenBudgetPlan(
    source, target, tokens_per_batch=PACK_TOKENS, max_length=PACK_LENGTH, seed=SEED
  ).padding_fraction(0)
  print(
    f'\npadding on Multi30k-like lengths (L={PACK_LENGTH}, {len(eligible)} pairs): '
    f'fixed-length {fixed:.1%}, token-budget buckets {budget:.1%}, packed {packed:.1%} '
    f'({plan.examples_per_row(0):.2f} pairs per row)'
  )
  assert fixed > 0.75
  assert packed < 0.10
  assert packed < budget
  for epoch in (1, 2):
    assert plan.padding_fraction(epoch) < 0.10


def test_train_iterator_from_config(split):
  config = ml_collections.ConfigDict(
    {
      'batching': 'packed',
      'max_source_length': 48,
      'max_target_length': PACK_LENGTH,
      'tokens_per_batch': PACK_TOKENS,
      'seed': SEED,
      'grad_accum_steps': 1,
    }
  )
  iterator = input_pipeline.make_train_iterator(
    split, config, local_device_count=jax.local_device_count()
  )
  batch = next(iterator)
  rows = PACK_TOKENS // PACK_LENGTH // jax.local_device_count() * jax.local_device_count()
  _check_batch(batch, split, rows)
  config.batching = 'nonsense'
  with pytest.raises(ValueError, match="'packed'"):
    input_pipeline.make_train_iterator(split, config)
