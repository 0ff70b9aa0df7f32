"""Tests for transformer_jax.decode with toy callables (no model; CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decode import (greedy_search, greedy_search_uncached,
                                    strip_after_eos)

PAD, BOS, EOS = 0, 1, 2
VOCAB = 13
BIG = 1e6  # forces/forbids a token whatever the random part says


class ToyModel:
  """Causal toy: logits_i = T[x_i] + U[x_{i-1}] + P[i] (+ masks), where EOS is
  forced at position eos_pos[b] and forbidden elsewhere, and PAD is never
  chosen. Depending on x_{i-1} too means the cached step must carry real state
  (the previous token), not only a position counter.
  """

  def __init__(self, eos_pos, max_len, seed=0):
    rng = np.random.default_rng(seed)
    self.t = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)
    self.u = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)
    self.p = rng.normal(size=(max_len, VOCAB)).astype(np.float32)
    self.eos_pos = np.asarray(eos_pos, np.int32)                    # [b]
    self.batch, self.max_len = len(eos_pos), max_len

  def logits_at(self, xp, cur, prev, pos):
    """xp: np or jnp; cur, prev: int[b]; pos: scalar. -> float32[b, V]."""
    vocab_ids = xp.arange(VOCAB)
    eos_sign = xp.where(xp.asarray(self.eos_pos) == pos, BIG, -BIG)  # [b]
    mask = (xp.where(vocab_ids == EOS, 1.0, 0.0)[None] * eos_sign[:, None]
            - xp.where(vocab_ids == PAD, BIG, 0.0)[None])            # [b, V]
    logits = xp.asarray(self.t)[cur] + xp.asarray(self.u)[prev]
    return (logits + xp.asarray(self.p)[pos] + mask).astype(xp.float32)

  def logits_fn(self, inputs):
    """Uncached: int32[b, L] -> float32[b, L, V]; position i sees <= i."""
    prev = jnp.concatenate([jnp.full_like(inputs[:, :1], PAD), inputs[:, :-1]],
                           axis=1)
    return jnp.stack([self.logits_at(jnp, inputs[:, i], prev[:, i], i)
                      for i in range(inputs.shape[1])], axis=1)

  def init_cache(self):
    return {'pos': jnp.int32(0), 'calls': jnp.int32(0),
            'prev': jnp.full((self.batch,), PAD, jnp.int32)}

  def step_fn(self, token, cache):
    """Cached: int32[b, 1] -> float32[b, V]; advances the cache by one."""
    cur = token[:, 0]
    logits = self.logits_at(jnp, cur, cache['prev'], cache['pos'])
    return logits, {'pos': cache['pos'] + 1, 'calls': cache['calls'] + 1,
                    'prev': cur}

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
  return dict(batch_size=model.batch, max_decode_len=model.max_len,
              bos_id=BOS, eos_id=EOS, pad_id=PAD)


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
  out = np.asarray(greedy_search(MODEL.step_fn, MODEL.init_cache(),
                                 **_kwargs(MODEL)))
  for row, eos_pos in zip(out, MODEL.eos_pos):
    if eos_pos < MODEL.max_len:
      assert row[eos_pos] == EOS                     # EOS itself is kept
      assert (row[:eos_pos] != EOS).all() and (row[:eos_pos] != PAD).all()
      assert (row[eos_pos + 1:] == PAD).all()        # pad after it
    else:
      assert (row != EOS).all() and (row != PAD).all()  # fills the length


@pytest.mark.parametrize('eos_pos, expected_calls', [
    ([2, 4, 1], 5),   # last row ends at step 4 -> steps 0..4
    ([0, 0, 0], 1),
    ([2, 99, 1], 10),  # one row never ends -> all max_decode_len steps
])
def test_early_stop_counts_step_calls(eos_pos, expected_calls):
  model = ToyModel(eos_pos=eos_pos, max_len=10, seed=1)
  tokens, cache = greedy_search(model.step_fn, model.init_cache(),
                                return_cache=True, **_kwargs(model))
  assert int(cache['calls']) == expected_calls == int(cache['pos'])
  np.testing.assert_array_equal(tokens, model.numpy_reference())


def test_works_under_jit():
  search = jax.jit(functools.partial(greedy_search, MODEL.step_fn,
                                     **_kwargs(MODEL)))
  uncached = jax.jit(functools.partial(greedy_search_uncached, MODEL.logits_fn,
                                       **_kwargs(MODEL)))
  inside = jax.jit(lambda cache: greedy_search(
      MODEL.step_fn, cache, **_kwargs(MODEL)) + 0)
  reference = MODEL.numpy_reference()
  np.testing.assert_array_equal(search(MODEL.init_cache()), reference)
  np.testing.assert_array_equal(uncached(), reference)
  np.testing.assert_array_equal(inside(MODEL.init_cache()), reference)


def test_rejects_empty_shapes():
  with pytest.raises(ValueError):
    greedy_search(MODEL.step_fn, MODEL.init_cache(), batch_size=4,
                  max_decode_len=0, bos_id=BOS, eos_id=EOS)


@pytest.mark.parametrize('tokens, expected', [
    ([[5, 6, EOS, PAD]], [[5, 6]]),
    ([[EOS, PAD, PAD, PAD]], [[]]),
    ([[5, 6, 7, 8]], [[5, 6, 7, 8]]),                 # no EOS: whole row
    ([[5, EOS, 7, EOS]], [[5]]),                      # first EOS only
    ([[5, PAD, 6, EOS], [EOS, 9, 9, 9]], [[5, 6], []]),  # pads dropped
])
def test_strip_after_eos(tokens, expected):
  assert strip_after_eos(np.asarray(tokens, np.int32), EOS) == expected
