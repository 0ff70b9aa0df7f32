"""Tests for transformer_jax.training.optim: the paper's schedule and Adam settings (tiny; CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.training.optim import make_optimizer, rsqrt_schedule, with_cooldown


def _paper_lr(step, d_model=512, warmup=4000, scale=1.0):
  """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
  return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize('count', [0, 1, 399, 3999, 4000, 9999])
def test_rsqrt_schedule_matches_paper(count):
  schedule = rsqrt_schedule(512, 4000)
  np.testing.assert_allclose(float(schedule(count)), _paper_lr(count + 1), rtol=1e-5)
  scaled = rsqrt_schedule(512, 4000, scale=2.0)
  np.testing.assert_allclose(float(scaled(count)), 2.0 * _paper_lr(count + 1), rtol=1e-5)


def test_rsqrt_schedule_known_values():
  schedule = rsqrt_schedule(512, 4000)
  # First update (count 0 = paper step 1): 512^-0.5 * 4000^-1.5.
  np.testing.assert_allclose(float(schedule(0)), 1.7469281e-7, rtol=1e-5)
  # Peak at paper step 4000 (count 3999): (512 * 4000)^-0.5.
  np.testing.assert_allclose(float(schedule(3999)), 6.9877124e-4, rtol=1e-5)
  assert float(schedule(3998)) < float(schedule(3999))
  assert float(schedule(4000)) < float(schedule(3999))
  # Warmup is linear, the decay is 1/sqrt(step).
  np.testing.assert_allclose(float(schedule(1999)), 0.5 * float(schedule(3999)), rtol=1e-5)
  np.testing.assert_allclose(float(schedule(15999)), 0.5 * float(schedule(3999)), rtol=1e-5)


def test_cooldown_falls_linearly_to_zero_over_the_last_steps():
  base = rsqrt_schedule(128, 250, scale=0.3)
  cooled = with_cooldown(base, total_steps=2000, cooldown_steps=500)
  # Unchanged before the last 500 updates (counts 0..1499).
  for count in (0, 249, 1000, 1499):
    assert float(cooled(count)) == float(base(count))
  # Count c of the last 500 gets (2000 - c) / 500 of the base rate: 1 at 1500, 1/500 at 1999.
  for count in (1500, 1750, 1999):
    np.testing.assert_allclose(
      float(cooled(count)), float(base(count)) * (2000 - count) / 500, rtol=1e-6
    )
  assert float(cooled(2000)) == 0.0 and float(cooled(2600)) == 0.0  # Resumed past the end.
  assert with_cooldown(base, 2000, 0) is base


def test_make_optimizer_applies_the_cooldown():
  _, schedule = make_optimizer(d_model=128, warmup_steps=250, total_steps=100, cooldown_steps=10)
  _, paper = make_optimizer(d_model=128, warmup_steps=250)
  assert float(schedule(89)) == float(paper(89))
  np.testing.assert_allclose(float(schedule(95)), float(paper(95)) * 0.5, rtol=1e-6)


def test_the_constant_schedule_warms_up_then_holds_its_rate():
  """Fine-tuning's schedule: linear warmup over 100 updates to 3e-5, then 3e-5 until the
  cooldown (last 20 of 200); the optimiser state has the paper schedule's structure, so a
  fine-tuning run and a from-scratch one checkpoint the same tree."""
  tx, schedule = make_optimizer(
    d_model=512,
    warmup_steps=100,
    schedule='constant',
    learning_rate=3e-5,
    total_steps=200,
    cooldown_steps=20,
  )
  got = [float(schedule(count)) for count in (0, 49, 99, 100, 179, 189, 199)]
  expected = [3e-7, 1.5e-5, 3e-5, 3e-5, 3e-5, 3e-5 * 11 / 20, 3e-5 / 20]
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  paper, _ = make_optimizer(d_model=512, warmup_steps=100)
  params = {'w': jnp.ones(3)}
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(paper.init(params))


def _adam_reference(grads, lrs, b1=0.9, b2=0.98, eps=1e-9):
  """Adam (Kingma & Ba) with bias correction, eps outside the square root, in float64."""
  m = v = 0.0
  updates = []
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    g = np.asarray(g, np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    updates.append(-lr * m_hat / (np.sqrt(v_hat) + eps))
  return updates


def test_make_optimizer_is_papers_adam():
  optimizer, schedule = make_optimizer(d_model=512, warmup_steps=4000)
  # 1e-9 is the size of eps, so the eps term is visible in the update (-lr / 2 there).
  g1 = np.array([0.5, -2.0, 1e-9, 3e-4], np.float32)
  g2 = np.array([-1.0, 0.5, 1e-9, 1e-2], np.float32)
  params = {'w': jnp.zeros(4)}
  state = optimizer.init(params)
  got = []
  for g in (g1, g2):
    updates, state = optimizer.update({'w': jnp.asarray(g)}, state, params)
    got.append(np.asarray(updates['w']))
  lrs = [float(schedule(0)), float(schedule(1))]
  expected = _adam_reference([g1, g2], lrs)
  # First step: bias correction makes it -lr * g / (|g| + eps).
  np.testing.assert_allclose(
    expected[0], -lrs[0] * g1.astype(np.float64) / (np.abs(g1) + 1e-9), rtol=1e-7
  )
  np.testing.assert_allclose(got[0][2], -lrs[0] / 2, rtol=1e-5)
  for step in range(2):
    np.testing.assert_allclose(got[step], expected[step], rtol=1e-5)
  # The second step depends on b1 and b2: optax's default b2=0.999 (or another b1) would
  # not match (they differ by > 0.1% where the check above allows 1e-5).
  for b1, b2 in ((0.9, 0.999), (0.8, 0.98)):
    other = _adam_reference([g1, g2], lrs, b1=b1, b2=b2)
    assert not np.allclose(got[1], other[1], rtol=1e-3, atol=0)


def test_make_optimizer_clips_global_norm():
  optimizer, schedule = make_optimizer(d_model=512, warmup_steps=4000, grad_clip_norm=1.0)
  g1 = np.array([30.0, -40.0], np.float32)  # norm 50 -> clipped to [0.6, -0.8]
  g2 = np.array([0.3, 0.4], np.float32)  # norm 0.5 -> unchanged
  params = {'w': jnp.zeros(2)}
  state = optimizer.init(params)
  got = []
  for g in (g1, g2):
    updates, state = optimizer.update({'w': jnp.asarray(g)}, state, params)
    got.append(np.asarray(updates['w']))
  expected = _adam_reference([g1 / 50.0, g2], [float(schedule(0)), float(schedule(1))])
  for step in range(2):
    np.testing.assert_allclose(got[step], expected[step], rtol=1e-5)
  # Without clipping the second update differs (Adam is scale-invariant only per step).
  unclipped = _adam_reference([g1, g2], [float(schedule(0)), float(schedule(1))])
  assert np.abs(unclipped[1] - expected[1]).max() > 1e-2 * np.abs(expected[1]).max()


def test_make_optimizer_scale():
  _, schedule = make_optimizer(d_model=512, warmup_steps=4000, learning_rate_scale=2.0)
  np.testing.assert_allclose(float(schedule(3999)), 2.0 * _paper_lr(4000), rtol=1e-5)
  assert isinstance(make_optimizer(d_model=512, warmup_steps=4000)[0], optax.GradientTransformation)


def test_weight_decay_is_decoupled_and_spares_vectors():
  """AdamW: the update is Adam's plus -lr x weight_decay x the parameter, for matrices only."""
  optimizer, schedule = make_optimizer(d_model=512, warmup_steps=4000, weight_decay=0.1)
  params = {
    'kernel': jnp.array([[1.0, -2.0], [3.0, 0.5]]),
    'embedding': jnp.array([[4.0], [-1.0]]),
    'bias': jnp.array([2.0, -3.0]),
    'scale': jnp.array([1.5]),
  }
  grads = {
    'kernel': jnp.array([[0.5, -1.0], [1e-3, 2.0]]),
    'embedding': jnp.array([[0.0], [0.3]]),
    'bias': jnp.array([0.2, -0.1]),
    'scale': jnp.array([0.0]),
  }
  state = optimizer.init(params)
  params_now = params
  for count in range(2):
    updates, state = optimizer.update(grads, state, params_now)
    lr = float(schedule(count))
    for name in params:
      g = np.asarray(grads[name], np.float64).ravel()
      adam = _adam_reference([g] * (count + 1), [float(schedule(c)) for c in range(count + 1)])
      decay = -lr * 0.1 * np.asarray(params_now[name]).ravel() if params[name].ndim >= 2 else 0
      np.testing.assert_allclose(
        np.asarray(updates[name]).ravel(), adam[count] + decay, rtol=1e-5, atol=1e-12
      )
    params_now = optax.apply_updates(params_now, updates)
  # A zero gradient still shrinks a matrix entry (the embedding's first row) and leaves a
  # vector's (the layer-norm scale) where it was.
  assert float(params_now['embedding'][0, 0]) < 4.0
  assert float(params_now['scale'][0]) == 1.5


def test_no_weight_decay_is_the_papers_adam_with_its_state_layout():
  params = {'kernel': jnp.ones((2, 3)), 'bias': jnp.zeros(3)}
  plain, _ = make_optimizer(d_model=512, warmup_steps=4000)
  zero, _ = make_optimizer(d_model=512, warmup_steps=4000, weight_decay=0.0)
  decayed, _ = make_optimizer(d_model=512, warmup_steps=4000, weight_decay=1e-4)
  structure = jax.tree_util.tree_structure
  assert structure(zero.init(params)) == structure(plain.init(params))
  # Checkpoints of AdamW runs have another layout: train.py refuses to resume across 0
  # (tests/bad_input_test.py).
  assert structure(decayed.init(params)) != structure(plain.init(params))


def test_timed_cooldown_scales_the_updates_from_where_it_is_placed():
  from transformer_jax.training import optim

  params = {'kernel': jnp.ones((2, 3)), 'bias': jnp.zeros(3)}
  plain, _ = make_optimizer(d_model=128, warmup_steps=4)
  timed, _ = make_optimizer(d_model=128, warmup_steps=4, timed=True)
  grads = [
    jax.tree_util.tree_map(lambda p, i=i: jnp.full_like(p, (-1.0) ** i * (i + 1)), params)
    for i in range(8)
  ]
  plain_state, timed_state = plain.init(params), timed.init(params)
  assert optim.timed_cooldown_remaining(timed_state) is None
  assert optim.timed_cooldown_remaining(plain_state) is None
  factors = []
  for i, g in enumerate(grads):
    if i == 3:  # Placed after 3 updates: the next 4 get 4/4, 3/4, 2/4, 1/4 of the rate, then 0.
      timed_state = optim.start_timed_cooldown(timed_state, jnp.int32(4))
      assert optim.timed_cooldown_remaining(timed_state) == 4
    expected, plain_state = plain.update(g, plain_state, params)
    got, timed_state = timed.update(g, timed_state, params)
    factors.append(float(got['kernel'][0, 0] / expected['kernel'][0, 0]))
    np.testing.assert_allclose(got['bias'], factors[-1] * expected['bias'], rtol=1e-6)
  np.testing.assert_allclose(factors, [1, 1, 1, 1, 0.75, 0.5, 0.25, 0], rtol=1e-6)
  assert optim.timed_cooldown_remaining(timed_state) == 0
  # The learning rate the step reports (`step.train_step`) carries the same factor.
  assert float(optim.learning_rate_factor(timed_state)) == 0.0
  assert optim.learning_rate_factor(plain_state) == 1.0
  # Off, the state keeps Adam's layout (checkpoints unchanged); on, it adds three scalars.
  structure = jax.tree_util.tree_structure
  unused, _ = make_optimizer(d_model=128, warmup_steps=4, timed=False)
  assert structure(unused.init(params)) == structure(plain.init(params))
  assert (
    len(jax.tree_util.tree_leaves(timed_state)) == len(jax.tree_util.tree_leaves(plain_state)) + 3
  )
