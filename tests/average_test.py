"""Tests for transformer_jax.average (checkpoint averaging) on tiny CPU checkpoints."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from transformer_jax import averaging
from transformer_jax.averaging import average_checkpoints
from transformer_jax.checkpointing import Checkpointer, read_metadata, restore_params_from
from transformer_jax.errors import UserInputError
from transformer_jax.workdir import Workdir

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class KeyedTrainState(train_state.TrainState):
  """Fields as the training loop's state: step, params, opt_state, dropout_rng."""

  dropout_rng: jax.Array


def _state(params, step):
  state = KeyedTrainState.create(
    apply_fn=None, params=params, tx=optax.adam(1e-3), dropout_rng=jax.random.PRNGKey(step)
  )
  return state.replace(step=jnp.asarray(step, jnp.int32))


def _params(value, noise):
  return {
    'dense': {
      'kernel': jnp.asarray(noise, jnp.float32),
      'bias': jnp.full((4,), value, jnp.float32),
    },
    'embed': jnp.full((5, 2), value, jnp.bfloat16),
  }


def _write_workdir(workdir, steps, seed=0):
  """Saves one checkpoint per step, step s with constant leaves 2*s - 1 (1, 3, 5, ...)."""
  rng = np.random.default_rng(seed)
  written = {}
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
    for step in steps:
      params = _params(2.0 * step - 1.0, rng.normal(size=(3, 4)).astype(np.float32))
      ckpt.save(step, _state(params, step), {'position': step})
      written[step] = jax.tree.map(np.asarray, params)
  return written


def _restore_averaged(workdir, written):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), next(iter(written.values()))
  )
  return restore_params_from(Workdir(workdir).averaged, abstract)


def test_two_checkpoints_mean(tmp_path):
  workdir = str(tmp_path)
  written = _write_workdir(workdir, [1, 2])
  result = average_checkpoints(workdir, last=2)
  assert result['averaged_steps'] == [1, 2] and result['latest_step'] == 2
  assert result['path'] == str(Workdir(workdir).averaged)
  assert read_metadata(result['path']) == {
    'averaged_steps': [1, 2],
    'latest_step': 2,
    'last_requested': 2,
  }
  averaged = _restore_averaged(workdir, written)
  # Constant leaves 1.0 and 3.0 average to exactly 2.0, in float32 and bfloat16 alike.
  np.testing.assert_array_equal(np.asarray(averaged['dense']['bias']), np.full((4,), 2.0))
  assert averaged['embed'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(averaged['embed'], np.float32), np.full((5, 2), 2.0))
  expected = (written[1]['dense']['kernel'].astype(np.float64) + written[2]['dense']['kernel']) / 2
  kernel = np.asarray(averaged['dense']['kernel'])
  assert kernel.dtype == np.float32
  np.testing.assert_allclose(kernel, expected, rtol=0, atol=1e-7)


def test_last_selects_newest_and_too_few_warns(tmp_path, caplog):
  workdir = str(tmp_path)
  written = _write_workdir(workdir, [1, 2, 3])
  # last=1: exactly the newest checkpoint's params.
  assert average_checkpoints(workdir, last=1)['averaged_steps'] == [3]
  averaged = _restore_averaged(workdir, written)
  for got, want in zip(jax.tree.leaves(averaged), jax.tree.leaves(written[3])):
    np.testing.assert_array_equal(np.asarray(got), want)
  # last=2 of 3: steps 2 and 3 (constants 3 and 5 -> 4); replaces the earlier output.
  assert average_checkpoints(workdir, last=2)['averaged_steps'] == [2, 3]
  averaged = _restore_averaged(workdir, written)
  np.testing.assert_array_equal(np.asarray(averaged['dense']['bias']), np.full((4,), 4.0))
  # last > available: all three (1, 3, 5 -> 3), with a warning naming how many there are.
  with caplog.at_level(logging.WARNING):
    result = average_checkpoints(workdir, last=5)
  assert result['averaged_steps'] == [1, 2, 3]
  assert read_metadata(Workdir(workdir).averaged)['last_requested'] == 5
  assert any('only 3 checkpoint' in record.getMessage() for record in caplog.records)
  averaged = _restore_averaged(workdir, written)
  np.testing.assert_array_equal(np.asarray(averaged['dense']['bias']), np.full((4,), 3.0))
  # Only the final averaged dir is left: no staging or retired copies.
  assert sorted(os.listdir(workdir)) == ['averaged', 'checkpoints']
  # Averaging read everything and pruned nothing.
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3]


def test_user_errors(tmp_path):
  for bad in (0, -3):
    with pytest.raises(UserInputError, match='--last'):
      average_checkpoints(str(tmp_path), last=bad)
  with pytest.raises(UserInputError, match='no checkpoints in .*checkpoints'):
    average_checkpoints(str(tmp_path), last=5)
  assert not os.path.exists(tmp_path / 'checkpoints')  # a failed run creates nothing
  os.makedirs(tmp_path / 'checkpoints')
  with pytest.raises(UserInputError, match='no checkpoints in'):
    average_checkpoints(str(tmp_path), last=5)
  assert not os.path.exists(Workdir(str(tmp_path)).averaged)


def test_mismatched_checkpoints_rejected(tmp_path):
  workdir = str(tmp_path)
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
    ckpt.save(1, _state({'w': jnp.zeros((2, 3))}, 1))
    ckpt.save(2, _state({'w': jnp.zeros((3, 3))}, 2))
  with pytest.raises(UserInputError, match=r'step 2 .*w: \(3, 3\)'):
    average_checkpoints(workdir, last=2)


def _run_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['PYTHONPATH'] = REPO_ROOT + os.pathsep + env.get('PYTHONPATH', '')
  return subprocess.run(
    [sys.executable, '-m', 'transformer_jax.average', *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_cli(tmp_path):
  workdir = str(tmp_path / 'work')
  _write_workdir(workdir, [1, 2, 3])
  result = _run_cli(f'--workdir={workdir}', '--last=2')
  assert result.returncode == 0, result.stderr[-4000:]
  assert 'steps 2, 3' in result.stdout and str(Workdir(workdir).averaged) in result.stdout
  assert read_metadata(Workdir(workdir).averaged)['averaged_steps'] == [2, 3]

  empty = str(tmp_path / 'empty')
  result = _run_cli(f'--workdir={empty}', '--last=2')
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert lines == [f'error: no checkpoints in {os.path.join(empty, "checkpoints")}'], lines


def test_module_has_no_orbax_import():
  with open(averaging.__file__) as f:
    assert 'orbax' not in f.read().replace('orbax-', '')
