"""Tests for transformer_jax.search.decode with toy callables (no model; CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.search import candidates as search_candidates
from transformer_jax.search import decode, sampling
from transformer_jax.search.decode import (
  beam_search,
  beam_search_uncached,
  expand_to_beams,
  greedy_search,
  greedy_search_uncached,
  strip_after_eos,
)

PAD, BOS, EOS = 0, 1, 2
VOCAB = 13
BIG = 1e6  # forces/forbids a token whatever the random part says


class ToyModel:
  """Causal toy: logits_i = T[x_i] + U[x_{i-1}] + P[i] (+ masks), where EOS is
  forced at position eos_pos[b] and forbidden elsewhere, and PAD and BOS are
  never chosen (the searches mask them too: test_no_search_chooses_bos_and_...). Depending
  on x_{i-1} too means the cached step must carry real state (the previous token), not only a
  position counter. With beam_size > 1 the
  callables take batch * beam_size batch-major rows (beam search's rows).
  """

  def __init__(self, eos_pos, max_len, seed=0, beam_size=1):
    rng = np.random.default_rng(seed)
    self.t = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)
    self.u = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)
    self.p = rng.normal(size=(max_len, VOCAB)).astype(np.float32)
    self.eos_pos = np.asarray(eos_pos, np.int32)  # [b]
    self.row_eos_pos = np.repeat(self.eos_pos, beam_size)  # [rows]
    self.batch, self.max_len = len(eos_pos), max_len

  def logits_at(self, xp, cur, prev, pos):
    """xp: np or jnp; cur, prev: int[b]; pos: scalar. -> float32[b, V]."""
    vocab_ids = xp.arange(VOCAB)
    eos_sign = xp.where(xp.asarray(self.row_eos_pos) == pos, BIG, -BIG)
    mask = (
      xp.where(vocab_ids == EOS, 1.0, 0.0)[None] * eos_sign[:, None]
      - xp.where((vocab_ids == PAD) | (vocab_ids == BOS), BIG, 0.0)[None]
    )  # [b, V]
    logits = xp.asarray(self.t)[cur] + xp.asarray(self.u)[prev]
    return (logits + xp.asarray(self.p)[pos] + mask).astype(xp.float32)

  def logits_fn(self, inputs, xp=jnp):
    """Uncached: int32[b, L] -> float32[b, L, V]; position i sees <= i."""
    prev = xp.concatenate([xp.full_like(inputs[:, :1], PAD), inputs[:, :-1]], axis=1)
    return xp.stack(
      [self.logits_at(xp, inputs[:, i], prev[:, i], i) for i in range(inputs.shape[1])], axis=1
    )

  def init_cache(self):
    return {
      'pos': jnp.int32(0),
      'calls': jnp.int32(0),
      'prev': jnp.full((self.batch,), PAD, jnp.int32),
    }

  def step_fn(self, token, cache):
    """Cached: int32[b, 1] -> float32[b, V]; advances the cache by one."""
    cur = token[:, 0]
    logits = self.logits_at(jnp, cur, cache['prev'], cache['pos'])
    return logits, {'pos': cache['pos'] + 1, 'calls': cache['calls'] + 1, 'prev': cur}

  def numpy_reference(self):
    """Plain Python loop over steps; each row stops at its first EOS."""
    out = np.full((self.batch, self.max_len), PAD, np.int32)
    cur, prev = np.full(self.batch, BOS), np.full(self.batch, PAD)
    done = np.zeros(self.batch, bool)
    for i in range(self.max_len):
      tok = np.argmax(self.logits_at(np, cur, prev, i), axis=-1)
      for b in range(self.batch):
        if not done[b]:
          out[b, i] = tok[b]
          done[b] = tok[b] == EOS
      prev, cur = cur, tok
    return out


def _kwargs(model):
  return dict(
    batch_size=model.batch, max_decode_len=model.max_len, bos_id=BOS, eos_id=EOS, pad_id=PAD
  )


# Rows: EOS at 3, EOS first, EOS at last position, never EOS.
MODEL = ToyModel(eos_pos=[3, 0, 7, 99], max_len=8)


def test_cached_equals_uncached_equals_numpy_reference():
  cached = greedy_search(MODEL.step_fn, MODEL.init_cache(), **_kwargs(MODEL))
  uncached = greedy_search_uncached(MODEL.logits_fn, **_kwargs(MODEL))
  reference = MODEL.numpy_reference()
  assert cached.shape == (4, 8) and cached.dtype == jnp.int32
  np.testing.assert_array_equal(cached, reference)
  np.testing.assert_array_equal(uncached, reference)
  # The random part must matter, or the test proves little.
  assert len(set(reference[3].tolist())) > 2


def test_eos_convention():
  out = np.asarray(greedy_search(MODEL.step_fn, MODEL.init_cache(), **_kwargs(MODEL)))
  for row, eos_pos in zip(out, MODEL.eos_pos):
    if eos_pos < MODEL.max_len:
      assert row[eos_pos] == EOS  # EOS itself is kept
      assert (row[:eos_pos] != EOS).all() and (row[:eos_pos] != PAD).all()
      assert (row[eos_pos + 1 :] == PAD).all()  # pad after it
    else:
      assert (row != EOS).all() and (row != PAD).all()  # fills the length


@pytest.mark.parametrize(
  'eos_pos, expected_calls',
  [
    ([2, 4, 1], 5),  # last row ends at step 4 -> steps 0..4
    ([0, 0, 0], 1),
    ([2, 99, 1], 10),  # one row never ends -> all max_decode_len steps
  ],
)
def test_early_stop_counts_step_calls(eos_pos, expected_calls):
  model = ToyModel(eos_pos=eos_pos, max_len=10, seed=1)
  tokens, cache = greedy_search(
    model.step_fn, model.init_cache(), return_cache=True, **_kwargs(model)
  )
  assert int(cache['calls']) == expected_calls == int(cache['pos'])
  np.testing.assert_array_equal(tokens, model.numpy_reference())


def test_works_under_jit():
  search = jax.jit(functools.partial(greedy_search, MODEL.step_fn, **_kwargs(MODEL)))
  uncached = jax.jit(functools.partial(greedy_search_uncached, MODEL.logits_fn, **_kwargs(MODEL)))
  inside = jax.jit(lambda cache: greedy_search(MODEL.step_fn, cache, **_kwargs(MODEL)) + 0)
  reference = MODEL.numpy_reference()
  np.testing.assert_array_equal(search(MODEL.init_cache()), reference)
  np.testing.assert_array_equal(uncached(), reference)
  np.testing.assert_array_equal(inside(MODEL.init_cache()), reference)


def test_rejects_empty_shapes():
  with pytest.raises(ValueError):
    greedy_search(
      MODEL.step_fn, MODEL.init_cache(), batch_size=4, max_decode_len=0, bos_id=BOS, eos_id=EOS
    )


@pytest.mark.parametrize(
  'tokens, expected',
  [
    ([[5, 6, EOS, PAD]], [[5, 6]]),
    ([[EOS, PAD, PAD, PAD]], [[]]),
    ([[5, 6, 7, 8]], [[5, 6, 7, 8]]),  # no EOS: whole row
    ([[5, EOS, 7, EOS]], [[5]]),  # first EOS only
    ([[5, PAD, 6, EOS], [EOS, 9, 9, 9]], [[5, 6], []]),  # pads dropped
  ],
)
def test_strip_after_eos(tokens, expected):
  assert strip_after_eos(np.asarray(tokens, np.int32), EOS) == expected


# --- Beam search ---------------------------------------------------------------


def _beam_kwargs(model, beam_size, alpha=0.6):
  return dict(_kwargs(model), beam_size=beam_size, alpha=alpha)


def _sequence_scores(np_logits_fn, tokens, alpha):
  """NumPy reference: log P(y) (PAD and BOS excluded) / ((5 + |y|) / 6) ** alpha for
  every returned beam, recomputed from the logits along tokens [b, k, L]."""
  tokens = np.asarray(tokens)
  b, k, length = tokens.shape
  rows = tokens.reshape(b * k, length)
  inputs = np.concatenate([np.full((b * k, 1), BOS), rows[:, :-1]], axis=1)
  logits = np.asarray(np_logits_fn(inputs), np.float64)
  logits[..., [PAD, BOS]] = -np.inf
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  scores = []
  for r, row in enumerate(rows.tolist()):
    n = row.index(EOS) + 1 if EOS in row else length
    total = sum(logp[r, i, row[i]] for i in range(n))
    scores.append(total / ((5 + n) / 6) ** alpha)
  return np.asarray(scores).reshape(b, k)


def _check_layout(tokens, scores, batch, beam, length):
  """Shapes, dtypes, best first, EOS convention, never PAD before the end;
  empty slots (score -inf) hold only PAD."""
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  assert tokens.shape == (batch, beam, length) and tokens.dtype == np.int32
  assert scores.shape == (batch, beam) and scores.dtype == np.float32
  assert (scores[:, :-1] >= scores[:, 1:]).all()
  for row, score in zip(tokens.reshape(-1, length).tolist(), scores.ravel()):
    n = row.index(EOS) + 1 if EOS in row else (length if score > -np.inf else 0)
    assert PAD not in row[:n] and set(row[n:]) <= {PAD}


@pytest.mark.parametrize('alpha', [0.0, 0.6])
def test_beam_size_one_equals_greedy(alpha):
  # On this toy EOS is either forced or forbidden, so once a beam ends no
  # continuation can beat it; in general alpha > 0 lets a longer hypothesis
  # found later win even with beam 1 (alpha = 0 never does).
  model = ToyModel(eos_pos=[3, 0, 7, 99], max_len=8)
  tokens, scores = beam_search(model.step_fn, model.init_cache(), **_beam_kwargs(model, 1, alpha))
  _check_layout(tokens, scores, 4, 1, 8)
  np.testing.assert_array_equal(tokens[:, 0], model.numpy_reference())


TRAP_A, TRAP_B, TRAP_VOCAB = 3, 4, 10  # tokens 5..9: fillers


def _bos_first_logits_fn(inputs):
  """BOS the likeliest token after every prefix: 0.5, then A 0.3 and EOS 0.2 after BOS, EOS 0.4
  and A 0.1 after A (TRAP_A); every other token ~0."""
  table = np.full((TRAP_VOCAB, TRAP_VOCAB), -1e9, np.float32)
  table[:, BOS] = np.log(0.5)
  table[:, TRAP_A], table[:, EOS] = np.log(0.1), np.log(0.4)
  table[BOS, TRAP_A], table[BOS, EOS] = np.log(0.3), np.log(0.2)
  return jnp.asarray(table)[inputs]


def test_no_search_chooses_bos_nor_counts_its_probability():
  """BOS is never a prediction (candidates.mask_never_predicted): every search chooses and
  scores from the softmax without it. Greedy writes A, EOS with log-prob log(0.3 / 0.5) +
  log(0.4 / 0.5); beam 2 ranks A, EOS (0.48) above EOS (0.4), which it would not with BOS
  counted (0.12 against 0.2)."""
  kwargs = dict(batch_size=1, max_decode_len=4, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  greedy = greedy_search_uncached(_bos_first_logits_fn, **kwargs)
  np.testing.assert_array_equal(greedy, [[TRAP_A, EOS, PAD, PAD]])
  tokens, log_probs = sampling.sample_search_uncached(
    _bos_first_logits_fn, keys=jax.random.split(jax.random.key(0), 1), top_k=1, **kwargs
  )
  np.testing.assert_array_equal(tokens, greedy)
  np.testing.assert_allclose(log_probs, [np.log(0.6 * 0.8)], rtol=1e-6)
  tokens, scores = beam_search_uncached(_bos_first_logits_fn, beam_size=2, alpha=0.0, **kwargs)
  np.testing.assert_array_equal(tokens[0], [[TRAP_A, EOS, PAD, PAD], [EOS, PAD, PAD, PAD]])
  np.testing.assert_allclose(scores[0], np.log([0.6 * 0.8, 0.4]), rtol=1e-6)
  # Sampling draws from the softmax without BOS: A's share of first tokens is 0.3 / 0.5.
  draws = 400
  rows = dict(kwargs, batch_size=draws)
  tokens, _ = sampling.sample_search_uncached(
    _bos_first_logits_fn, keys=jax.random.split(jax.random.key(1), draws), **rows
  )
  tokens = np.asarray(tokens)
  assert BOS not in tokens
  share = np.mean(tokens[:, 0] == TRAP_A)
  assert abs(share - 0.6) < 4 * np.sqrt(0.6 * 0.4 / draws), share


def _trap_logits_fn(inputs, xp=jnp):
  """Next-token logits from the last input token only. After BOS: A 0.6,
  B 0.4. After A: only fillers, none likely (logits 0, -0.1, ..). After B or a
  filler: EOS ~1. Greedy: A, 5, EOS (p ~ 0.145); best: B, EOS (p = 0.4)."""
  tiny = -1e9
  table = np.full((TRAP_VOCAB, TRAP_VOCAB), tiny, np.float32)
  table[BOS, TRAP_A], table[BOS, TRAP_B] = np.log(0.6), np.log(0.4)
  table[TRAP_A, 5:] = -0.1 * np.arange(5)
  table[[TRAP_B, EOS, PAD, 5, 6, 7, 8, 9], EOS] = 0.0
  return xp.asarray(table)[inputs]


@pytest.mark.parametrize('beam_size, alpha', [(2, 0.6), (3, 0.0)])
def test_beam_escapes_greedy_trap(beam_size, alpha):
  kwargs = dict(batch_size=1, max_decode_len=4, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  greedy = greedy_search_uncached(_trap_logits_fn, **kwargs)
  np.testing.assert_array_equal(greedy, [[TRAP_A, 5, EOS, PAD]])
  tokens, scores = beam_search_uncached(_trap_logits_fn, beam_size=beam_size, alpha=alpha, **kwargs)
  _check_layout(tokens, scores, 1, beam_size, 4)
  np.testing.assert_array_equal(tokens[0, :2], [[TRAP_B, EOS, PAD, PAD], [TRAP_A, 5, EOS, PAD]])
  np.testing.assert_allclose(scores[0, 0], np.log(0.4) / (7 / 6) ** alpha, rtol=1e-6)
  np.testing.assert_allclose(
    scores, _sequence_scores(functools.partial(_trap_logits_fn, xp=np), tokens, alpha), rtol=1e-6
  )


def test_beam_scores_are_penalized_log_probs(alpha=0.6):
  # alpha = 0: see test_beam_escapes_greedy_trap.
  # EOS at 3 and at 1: all beams end; 99: all fall back to alive beams.
  model = ToyModel(eos_pos=[3, 99, 1], max_len=6, seed=2, beam_size=4)
  tokens, scores = beam_search(model.step_fn, model.init_cache(), **_beam_kwargs(model, 4, alpha))
  _check_layout(tokens, scores, 3, 4, 6)
  assert (tokens[0, :, 3] == EOS).all() and (tokens[2, :, 1] == EOS).all()
  assert (tokens[1] != EOS).all()
  assert len({tuple(beam) for beam in np.asarray(tokens[0]).tolist()}) == 4
  reference = _sequence_scores(lambda x: model.logits_fn(x, xp=np), tokens, alpha)
  np.testing.assert_allclose(scores, reference, rtol=0, atol=1e-5)


def test_beam_cached_equals_uncached():
  model = ToyModel(eos_pos=[3, 0, 7, 99], max_len=8, beam_size=4)
  cached = beam_search(model.step_fn, model.init_cache(), **_beam_kwargs(model, 4))
  uncached = beam_search_uncached(model.logits_fn, **_beam_kwargs(model, 4))
  np.testing.assert_array_equal(cached[0], uncached[0])
  np.testing.assert_allclose(cached[1], uncached[1], rtol=0, atol=1e-5)
  # The toy must make the beams differ, or reordering is not exercised.
  assert len({tuple(beam) for beam in np.asarray(cached[0][3]).tolist()}) == 4


class HistoryToy:
  """Logits from a hash of the whole prefix, with EOS likelier over time. The
  cached step keeps the prefix in the cache ([batch, L] array, plus scalar
  position and call counters), so cache rows that do not follow their parent
  beams give wrong logits."""

  MOD = 97

  def __init__(self, batch, max_len, beam_size, seed=3):
    rng = np.random.default_rng(seed)
    self.w = rng.normal(size=(self.MOD, VOCAB)).astype(np.float32)
    self.w[:, EOS] += 1.5 * np.arange(self.MOD) / self.MOD - 1.0
    self.weights = rng.integers(1, self.MOD, size=max_len).astype(np.int32)
    self.batch, self.max_len, self.beam_size = batch, max_len, beam_size

  def _logits(self, xp, hist):
    """hist int32[rows, L]: inputs so far, PAD after -> float32[rows, V]."""
    code = (hist * xp.asarray(self.weights)).sum(axis=1) % self.MOD
    return xp.asarray(self.w)[code]

  def logits_fn(self, inputs, xp=jnp):
    length = inputs.shape[1]
    return xp.stack(
      [self._logits(xp, xp.where(xp.arange(length) <= i, inputs, PAD)) for i in range(length)],
      axis=1,
    )

  def init_cache(self):
    return {
      'hist': jnp.full((self.batch, self.max_len), PAD, jnp.int32),
      'pos': jnp.int32(0),
      'calls': jnp.int32(0),
    }

  def step_fn(self, token, cache):
    hist = jax.lax.dynamic_update_slice_in_dim(cache['hist'], token, cache['pos'], axis=1)
    return self._logits(jnp, hist), {
      'hist': hist,
      'pos': cache['pos'] + 1,
      'calls': cache['calls'] + 1,
    }


def test_beam_cache_rows_follow_parent_beams():
  toy = HistoryToy(batch=2, max_len=7, beam_size=4)
  kwargs = dict(batch_size=2, beam_size=4, max_decode_len=7, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  cached = beam_search(toy.step_fn, toy.init_cache(), **kwargs)
  uncached = beam_search_uncached(toy.logits_fn, **kwargs)
  np.testing.assert_array_equal(cached[0], uncached[0])
  np.testing.assert_allclose(cached[1], uncached[1], rtol=0, atol=1e-5)
  np.testing.assert_allclose(
    cached[1],
    _sequence_scores(lambda x: toy.logits_fn(x, xp=np), cached[0], 0.6),
    rtol=0,
    atol=1e-5,
  )
  tokens = np.asarray(cached[0])
  assert (tokens == EOS).any() and len({tuple(r) for r in tokens[0]}) == 4

  def misordered_step(token, cache):  # beams read a sibling's history
    hist = cache['hist'].reshape(2, 4, -1)
    return toy.step_fn(token, dict(cache, hist=jnp.roll(hist, 1, axis=1).reshape(8, -1)))

  wrong = beam_search(misordered_step, toy.init_cache(), **kwargs)
  assert not (np.array_equal(wrong[0], cached[0]) and np.allclose(wrong[1], cached[1]))


def test_expand_to_beams():
  tree = {'kv': jnp.arange(6).reshape(2, 3), 'index': jnp.int32(5)}
  expanded = expand_to_beams(tree, 3, batch_size=2)
  np.testing.assert_array_equal(expanded['kv'][:, 0], [0, 0, 0, 3, 3, 3])
  assert expanded['index'].shape == () and int(expanded['index']) == 5
  with pytest.raises(ValueError):
    expand_to_beams({'kv': jnp.zeros((3, 2))}, 3, batch_size=2)
  with pytest.raises(ValueError):
    beam_search(MODEL.step_fn, MODEL.init_cache(), **_beam_kwargs(MODEL, 0))


def test_beam_max_lengths():
  # EOS forbidden by the toy everywhere: forced ends only (EOS keeps its
  # model log-prob, ~ -1e6). Sentence 2 has no limit within max_decode_len.
  model = ToyModel(eos_pos=[99, 99, 99], max_len=6, beam_size=3)
  tokens, scores = beam_search(
    model.step_fn, model.init_cache(), max_lengths=jnp.array([3, 1, 9]), **_beam_kwargs(model, 3)
  )
  tokens = np.asarray(tokens)
  _check_layout(tokens, scores, 3, 3, 6)
  assert (tokens[0, :, 2] == EOS).all() and (tokens[0, :, 3:] == PAD).all()
  # Length 1: the one hypothesis is EOS; the other slots stay empty.
  np.testing.assert_array_equal(tokens[1], [[EOS] + [PAD] * 5] + [[PAD] * 6] * 2)
  assert np.isfinite(scores[1, 0]) and (scores[1, 1:] == -np.inf).all()
  assert (tokens[2] != EOS).all() and (tokens[2] != PAD).all()


@pytest.mark.parametrize(
  'eos_pos, beam_size, expected_calls',
  [
    ([2, 4, 1], 4, 5),  # every sentence's 4 beams end at its EOS step
    ([0, 0, 0], 1, 1),
    # Only one hypothesis can end at step 0; three slots remain to be filled
    # by (very unlikely) longer ones, so the search goes on.
    ([0, 0, 0], 4, 10),
  ],
)
def test_beam_early_stop_counts_step_calls(eos_pos, beam_size, expected_calls):
  model = ToyModel(eos_pos=eos_pos, max_len=10, seed=1, beam_size=beam_size)
  calls = []
  tokens, _ = beam_search(
    lambda token, cache: _record_calls(model.step_fn, token, cache, calls),
    model.init_cache(),
    **_beam_kwargs(model, beam_size),
  )
  assert calls == list(range(1, expected_calls + 1))
  for sentence, pos in enumerate(eos_pos):
    if pos < 10:
      assert np.asarray(tokens)[sentence, 0, pos] == EOS


def _record_calls(step_fn, token, cache, calls):
  """step_fn that sends the cache's call counter (a 0-d leaf, shared by all
  rows) to the host after every call."""
  logits, cache = step_fn(token, cache)
  jax.debug.callback(lambda n: calls.append(int(n)), cache['calls'])
  return logits, cache


def test_beam_works_under_jit():
  model = ToyModel(eos_pos=[3, 0, 7, 99], max_len=8, beam_size=2)
  kwargs = _beam_kwargs(model, 2)
  max_lengths = jnp.array([8, 8, 5, 6])  # traced, not bound
  search = jax.jit(functools.partial(beam_search, model.step_fn, **kwargs))
  uncached = jax.jit(functools.partial(beam_search_uncached, model.logits_fn, **kwargs))
  tokens, scores = search(model.init_cache(), max_lengths=max_lengths)
  _check_layout(tokens, scores, 4, 2, 8)
  tokens_ref, scores_ref = uncached(max_lengths=max_lengths)
  np.testing.assert_array_equal(tokens, tokens_ref)
  np.testing.assert_allclose(scores, scores_ref, rtol=0, atol=1e-5)
  tokens = np.asarray(tokens)
  # Every hypothesis ends by its sentence's max length (8, 8, 5, 6); sentence
  # 1's second one is the best of those forced to end at 8.
  assert (tokens[0, :, 3] == EOS).all() and (tokens[2, :, 4] == EOS).all()
  assert (tokens[3, :, 5] == EOS).all()
  assert tokens[1, 0, 0] == EOS and tokens[1, 1, 7] == EOS


# --- Model-shaped caches: reorder_cache, cache_lengths, the vocabulary step ------------------


class SlotHistoryToy(HistoryToy):
  """HistoryToy with a cache laid out as a model's keys/values are: each position written once,
  in the slot of the beam that decoded it, never moved ('slots' [b, beam, L]), and a table of
  which slot holds each position of a row's prefix ('origin' [b * beam, L]). Only the table
  follows the parents (`reorder`). The slot history also has a length of its own, which
  `extend` grows (beam search's cache_lengths); `lengths` records it at every step."""

  def init_cache(self, length=None):
    length = length or self.max_len
    rows = self.batch * self.beam_size
    return {
      'slots': jnp.full((self.batch, self.beam_size, length), PAD, jnp.int32),
      'origin': jnp.zeros((rows, length), jnp.int32),
      'pos': jnp.int32(0),
      'calls': jnp.int32(0),
    }

  def step_fn(self, token, cache, lengths=None):
    b, k, length = cache['slots'].shape
    pos, slot = cache['pos'], jnp.arange(b * k) % k
    slots = jax.lax.dynamic_update_slice_in_dim(cache['slots'], token.reshape(b, k, 1), pos, axis=2)
    origin = jax.lax.dynamic_update_slice_in_dim(cache['origin'], slot[:, None], pos, axis=1)
    # Row r's prefix: position t from slot origin[r, t] of its sentence.
    sentence = jnp.arange(b * k) // k
    hist = slots[sentence[:, None], origin, jnp.arange(length)]  # [b * k, length]
    hist = jnp.where(jnp.arange(length) <= pos, hist, PAD)
    hist = jnp.pad(hist, ((0, 0), (0, self.max_len - length)), constant_values=PAD)
    if lengths is not None:
      jax.debug.callback(lambda n: lengths.append(int(n)), length)
    new = dict(cache, slots=slots, origin=origin, pos=pos + 1, calls=cache['calls'] + 1)
    return self._logits(jnp, hist), new

  @staticmethod
  def reorder(cache, rows):
    return dict(cache, origin=jnp.take(cache['origin'], rows, axis=0))

  @staticmethod
  def extend(cache, length):
    grow = length - cache['slots'].shape[2]
    return dict(
      cache,
      slots=jnp.pad(cache['slots'], ((0, 0), (0, 0), (0, grow)), constant_values=PAD),
      origin=jnp.pad(cache['origin'], ((0, 0), (0, grow))),
    )


@pytest.mark.parametrize('batch, beam_size', [(1, 4), (2, 4), (3, 2)])
def test_beam_search_with_a_cache_reordered_by_its_own_table(batch, beam_size):
  toy = SlotHistoryToy(batch=batch, max_len=7, beam_size=beam_size)
  kwargs = dict(
    batch_size=batch, beam_size=beam_size, max_decode_len=7, bos_id=BOS, eos_id=EOS, pad_id=PAD
  )
  cached = beam_search(toy.step_fn, toy.init_cache(), reorder_cache=toy.reorder, **kwargs)
  uncached = beam_search_uncached(toy.logits_fn, **kwargs)
  np.testing.assert_array_equal(cached[0], uncached[0])
  np.testing.assert_allclose(cached[1], uncached[1], rtol=0, atol=1e-5)
  assert len({tuple(r) for r in np.asarray(cached[0])[0]}) == beam_size
  if beam_size == 4:
    # The table is what carries the beams: moving nothing gives other hypotheses.
    wrong = beam_search(toy.step_fn, toy.init_cache(), reorder_cache=lambda c, r: c, **kwargs)
    assert not (np.array_equal(wrong[0], cached[0]) and np.allclose(wrong[1], cached[1]))


def test_beam_search_grows_the_cache_through_its_lengths():
  toy = SlotHistoryToy(batch=2, max_len=7, beam_size=3)
  kwargs = dict(batch_size=2, beam_size=3, max_decode_len=7, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  lengths = []
  tokens, scores = beam_search(
    functools.partial(toy.step_fn, lengths=lengths),
    toy.init_cache(length=2),
    reorder_cache=toy.reorder,
    cache_lengths=(2, 4, 7),
    extend_cache=toy.extend,
    **kwargs,
  )
  reference = beam_search_uncached(toy.logits_fn, **kwargs)
  np.testing.assert_array_equal(tokens, reference[0])
  np.testing.assert_allclose(scores, reference[1], rtol=0, atol=1e-5)
  # Steps 0-1 ran on 2 positions, 2-3 on 4, then 7 (until the search was decided).
  assert lengths[:4] == [2, 2, 4, 4] and set(lengths[4:]) <= {7}, lengths
  # Expanded to beams by beam_search, then grown: the default reordering works as well.
  plain = beam_search(
    HistoryToy(2, 7, 3).step_fn,
    HistoryToy(2, 7, 3).init_cache(),
    cache_lengths=(3, 7),
    extend_cache=lambda cache, length: cache,
    **kwargs,
  )
  np.testing.assert_array_equal(plain[0], reference[0])


@pytest.mark.parametrize(
  'cache_lengths, extend, message',
  [
    ((2, 4), True, 'must end at max_decode_len'),
    ((4, 2, 7), True, 'must increase'),
    ((2, 7), False, 'with extend_cache'),
  ],
)
def test_cache_lengths_are_checked(cache_lengths, extend, message):
  toy = SlotHistoryToy(batch=1, max_len=7, beam_size=2)
  with pytest.raises(ValueError, match=message):
    beam_search(
      toy.step_fn,
      toy.init_cache(),
      reorder_cache=toy.reorder,
      cache_lengths=cache_lengths,
      extend_cache=toy.extend if extend else None,
      batch_size=1,
      beam_size=2,
      max_decode_len=7,
      bos_id=BOS,
      eos_id=EOS,
    )


@pytest.mark.parametrize('n', [13, 256, 1000, 8000, 37000, 4099])
@pytest.mark.parametrize('ties', [False, True])
def test_top_k_by_blocks_is_top_k(n, ties):
  rng = np.random.default_rng(n)
  x = rng.normal(size=(3, 2, n)).astype(np.float32)
  if ties:
    x = np.round(x * 2) / 2  # Many equal values: the lower index comes first, as top_k's.
  for count in (1, 8):
    values, index, block_max = search_candidates.top_k_by_blocks(jnp.asarray(x), min(count, n))
    expected_values, expected_index = jax.lax.top_k(x, min(count, n))
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(index, expected_index)
    np.testing.assert_array_equal(np.max(block_max, axis=-1), x.max(axis=-1))


@pytest.mark.parametrize('vocab', [5, 300])
def test_best_extensions_equal_a_top_k_over_every_extension(vocab):
  """The per-beam top-k then top-k over beam x count equals the search's former step: a
  log-softmax over the whole vocabulary (PAD and BOS excluded) and one top-k over beam x vocab, with
  forced EOS, dead beams and tied logits. BOS, the best logit of sentence 0, is left out of
  both, as PAD is."""
  b, k, count = 3, 4, 8
  rng = np.random.default_rng(vocab)
  logits = np.round(rng.normal(size=(b, k, vocab)), 1).astype(np.float32)  # ties
  logits[0, :, BOS] = 5.0
  alive = rng.normal(size=(b, k)).astype(np.float32)
  alive[1, 2:] = -np.inf  # dead beams
  only_eos = np.array([False, False, True])
  scores, parent, token = search_candidates.best_extensions(
    jnp.asarray(logits),
    jnp.asarray(alive),
    jnp.asarray(only_eos),
    count,
    eos_id=EOS,
    pad_id=PAD,
    bos_id=BOS,
  )
  logp = jax.nn.log_softmax(jnp.asarray(logits).at[..., [PAD, BOS]].set(-jnp.inf))
  logp = jnp.where(only_eos[:, None, None] & (jnp.arange(vocab) != EOS), -jnp.inf, logp)
  candidates = jnp.where(alive[:, :, None] == -jnp.inf, -jnp.inf, alive[:, :, None] + logp)
  expected, index = jax.lax.top_k(candidates.reshape(b, k * vocab), count)
  finite = np.isfinite(expected)
  np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(parent)[finite], (index // vocab)[finite])
  np.testing.assert_array_equal(np.asarray(token)[finite], (index % vocab)[finite])
  assert (np.asarray(token)[2][np.isfinite(scores[2])] == EOS).all()
  assert BOS not in np.asarray(token)[np.isfinite(scores)]


# --- Beam search, rule 'ctranslate2' -------------------------------------------


def _table_logits_fn(probabilities):
  """Next-token logits from the last input token only: probabilities {prev: {token: p}};
  unlisted tokens get logit -1e9, prev tokens not listed (PAD, EOS) end at once."""
  table = np.full((TRAP_VOCAB, TRAP_VOCAB), -1e9, np.float32)
  table[:, EOS] = 0.0
  for prev, row in probabilities.items():
    table[prev, EOS] = -1e9
    for token, p in row.items():
      table[prev, token] = np.log(p)
  return lambda inputs: jnp.asarray(table)[inputs]


def _search_both_rules(logits_fn, beam_size, max_decode_len, alpha=0.0):
  kwargs = dict(batch_size=1, max_decode_len=max_decode_len, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  return {
    rule: beam_search_uncached(logits_fn, beam_size=beam_size, alpha=alpha, rule=rule, **kwargs)
    for rule in decode.BEAM_RULES
  }


def test_ctranslate2_rule_ends_hypotheses_only_among_the_k_best_candidates():
  # Beam 2. Step 0: A .5, B .3, EOS .2: EOS is the 3rd of 4 candidates, so only the exact
  # rule ends the empty hypothesis. Step 1: A 5 .35, B 6 .18, A EOS .15, B EOS .12: no EOS among
  # the 2 best. Step 2: both beams end (p 1). alpha 0: scores are log-probs.
  logits_fn = _table_logits_fn(
    {
      BOS: {TRAP_A: 0.5, TRAP_B: 0.3, EOS: 0.2},
      TRAP_A: {EOS: 0.3, 5: 0.7},
      TRAP_B: {EOS: 0.4, 6: 0.6},
    }
  )
  results = _search_both_rules(logits_fn, beam_size=2, max_decode_len=4)
  tokens, scores = results['exact']
  np.testing.assert_array_equal(tokens[0], [[TRAP_A, 5, EOS, PAD], [EOS, PAD, PAD, PAD]])
  np.testing.assert_allclose(scores[0], np.log([0.35, 0.2]), rtol=1e-6)
  tokens, scores = results['ctranslate2']
  np.testing.assert_array_equal(tokens[0], [[TRAP_A, 5, EOS, PAD], [TRAP_B, 6, EOS, PAD]])
  np.testing.assert_allclose(scores[0], np.log([0.35, 0.18]), rtol=1e-6)


def test_ctranslate2_rule_stops_once_the_best_candidate_ended_and_k_hypotheses_did():
  # Beam 2. Step 0: EOS .55 (the best candidate: it ends), A .45. Step 1: A 5 .405, A EOS .045:
  # the 2nd hypothesis ends, so rule 'ctranslate2' stops after 2 steps; the exact rule goes on,
  # since A 5 (.405) can still beat A EOS, and finds A 5 EOS at step 2.
  logits_fn = _table_logits_fn({BOS: {EOS: 0.55, TRAP_A: 0.45}, TRAP_A: {EOS: 0.1, 5: 0.9}})
  calls = {rule: [] for rule in decode.BEAM_RULES}
  kwargs = dict(batch_size=1, max_decode_len=6, bos_id=BOS, eos_id=EOS, pad_id=PAD, beam_size=2)
  results = {}
  for rule in decode.BEAM_RULES:

    def counted(inputs, rule=rule):
      jax.debug.callback(lambda: calls[rule].append(1))
      return logits_fn(inputs)

    results[rule] = beam_search_uncached(counted, alpha=0.0, rule=rule, **kwargs)
  np.testing.assert_array_equal(results['exact'][0][0, 1, :3], [TRAP_A, 5, EOS])
  np.testing.assert_allclose(results['exact'][1][0], np.log([0.55, 0.405]), rtol=1e-6)
  np.testing.assert_array_equal(results['ctranslate2'][0][0, 1, :2], [TRAP_A, EOS])
  np.testing.assert_allclose(results['ctranslate2'][1][0], np.log([0.55, 0.045]), rtol=1e-6)
  assert (len(calls['exact']), len(calls['ctranslate2'])) == (3, 2)


def test_ctranslate2_rule_ends_the_k_best_candidates_at_the_length_cap():
  # EOS never likely: at the last step the 3 best candidates end without EOS, as CTranslate2's.
  model = ToyModel(eos_pos=[99, 99], max_len=5, seed=4, beam_size=3)
  tokens, scores = beam_search(
    model.step_fn, model.init_cache(), rule='ctranslate2', **_beam_kwargs(model, 3, alpha=0.0)
  )
  _check_layout(tokens, scores, 2, 3, 5)
  assert (np.asarray(tokens) != EOS).all() and (np.asarray(tokens) != PAD).all()
  reference = _sequence_scores(lambda x: model.logits_fn(x, xp=np), tokens, 0.0)
  np.testing.assert_allclose(scores, reference, rtol=0, atol=1e-5)


def test_ctranslate2_rule_cached_equals_uncached_and_never_beats_the_exact_rule():
  kwargs = dict(batch_size=3, beam_size=3, max_decode_len=8, bos_id=BOS, eos_id=EOS, pad_id=PAD)
  compared = 0
  for seed in range(6):
    toy = HistoryToy(batch=3, max_len=8, beam_size=3, seed=seed)
    cached = beam_search(toy.step_fn, toy.init_cache(), rule='ctranslate2', **kwargs)
    uncached = beam_search_uncached(toy.logits_fn, rule='ctranslate2', **kwargs)
    np.testing.assert_array_equal(cached[0], uncached[0])
    np.testing.assert_allclose(cached[1], uncached[1], rtol=0, atol=1e-5)
    reference = _sequence_scores(lambda x, toy=toy: toy.logits_fn(x, xp=np), cached[0], 0.6)
    np.testing.assert_allclose(cached[1], reference, rtol=0, atol=1e-5)
    # Both keep the same alive beams and the exact rule ends a superset of hypotheses, so its
    # best is at least as good wherever the ctranslate2 rule's best ended with EOS (at the
    # length cap it also ends hypotheses without EOS, which the exact rule does not).
    _, exact_scores = beam_search(toy.step_fn, toy.init_cache(), **kwargs)
    ended = (np.asarray(cached[0])[:, 0] == EOS).any(axis=1)
    assert (np.asarray(exact_scores)[ended, 0] >= np.asarray(cached[1])[ended, 0] - 1e-6).all()
    compared += int(ended.sum())
  assert compared >= 6


def test_unknown_beam_rule_is_refused():
  with pytest.raises(ValueError, match='rule must be one of'):
    beam_search_uncached(
      _trap_logits_fn,
      batch_size=1,
      beam_size=2,
      max_decode_len=4,
      bos_id=BOS,
      eos_id=EOS,
      rule='marian',
    )
