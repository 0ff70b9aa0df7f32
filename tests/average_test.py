"""Tests for transformer_jax.average (checkpoint averaging) on tiny CPU checkpoints."""

import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from transformer_jax.checkpoints import averaging
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.checkpointer import (
  Checkpointer,
  read_metadata,
  restore_params_from,
)
from transformer_jax.common.errors import UserInputError
from transformer_jax.workdir.layout import Workdir

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


# --- averaging while a training run saves and prunes checkpoints in the same workdir ---


def _save_in_flight(checkpoint_dir, step):
  """Turns a finished step into what orbax leaves while still writing it: its temporary
  folder, without the commit marker."""
  tmp = os.path.join(checkpoint_dir, f'{step}.orbax-checkpoint-tmp-1764000000123456')
  os.rename(os.path.join(checkpoint_dir, str(step)), tmp)
  os.remove(os.path.join(tmp, 'commit_success.txt'))


def _half_delete(checkpoint_dir, step):
  """What pruning leaves midway (orbax unlinks a step's files before its folders): the step's
  own metadata and part of its state gone, the folders still there."""
  step_dir = os.path.join(checkpoint_dir, str(step))
  os.remove(os.path.join(step_dir, '_CHECKPOINT_METADATA'))
  shutil.rmtree(os.path.join(step_dir, 'state', 'd'))


def test_checkpoints_being_written_or_deleted_are_skipped_and_named(tmp_path, caplog):
  workdir = str(tmp_path)
  written = _write_workdir(workdir, [1, 2, 3, 4, 5])
  checkpoint_dir = os.path.join(workdir, 'checkpoints')
  _save_in_flight(checkpoint_dir, 5)
  _half_delete(checkpoint_dir, 4)
  with caplog.at_level(logging.WARNING):
    result = average_checkpoints(workdir, last=2)
  # The two newest complete checkpoints: steps 2 and 3 (constants 3 and 5 -> 4).
  assert result['averaged_steps'] == [2, 3] and result['skipped_steps'] == [4, 5]
  averaged = _restore_averaged(workdir, written)
  np.testing.assert_array_equal(np.asarray(averaged['dense']['bias']), np.full((4,), 4.0))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert (
    f'skipping incomplete checkpoint(s) 4, 5 in {checkpoint_dir}: being written or deleted by '
    'a training run, or left so by one that was killed'
  ) in warnings
  # Nothing was touched: the training run that owns them finishes or removes them.
  assert sorted(os.listdir(checkpoint_dir)) == [
    '1',
    '2',
    '3',
    '4',
    '5.orbax-checkpoint-tmp-1764000000123456',
  ]

  _half_delete(checkpoint_dir, 2)
  _half_delete(checkpoint_dir, 3)
  _half_delete(checkpoint_dir, 1)
  with pytest.raises(UserInputError, match=f'^no checkpoints in {checkpoint_dir}$'):
    average_checkpoints(workdir, last=2)


def test_a_checkpoint_pruned_while_it_is_read_is_replaced_by_the_newest_unused(
  tmp_path, monkeypatch, caplog
):
  from transformer_jax.checkpoints import checkpointer

  workdir = str(tmp_path)
  written = _write_workdir(workdir, [1, 2, 3, 4])
  checkpoint_dir = os.path.join(workdir, 'checkpoints')
  read_metadata_of = checkpointer._tree_metadata
  pruned = threading.Event()

  def prune_step_3_midway(item_dir):
    # As a training run does: it saves step 5, then prunes step 3 while it is being read.
    metadata = read_metadata_of(item_dir)
    if os.path.basename(os.path.dirname(item_dir)) == '3' and not pruned.is_set():
      pruned.set()
      written.update(_write_workdir(workdir, [5], seed=1))
      shutil.rmtree(os.path.join(checkpoint_dir, '3', 'state', 'd'))  # Its arrays go first,
      threading.Timer(0.3, shutil.rmtree, [os.path.join(checkpoint_dir, '3')]).start()  # ...
    return metadata

  monkeypatch.setattr(checkpointer, '_tree_metadata', prune_step_3_midway)
  with caplog.at_level(logging.WARNING):
    result = average_checkpoints(workdir, last=2)
  assert pruned.is_set()
  # Step 3 went while being read; step 5, saved meanwhile, took its place (constants 7, 9 -> 8).
  assert result['averaged_steps'] == [4, 5] and result['skipped_steps'] == [3]
  assert result['latest_step'] == 5
  averaged = _restore_averaged(workdir, written)
  np.testing.assert_array_equal(np.asarray(averaged['dense']['bias']), np.full((4,), 8.0))
  assert (
    f'checkpoint(s) 3 in {checkpoint_dir} were deleted while being read (a training run '
    'prunes old checkpoints): averaged steps 4, 5 instead'
  ) in [r.getMessage() for r in caplog.records]


def test_a_damaged_checkpoint_that_stays_is_still_an_error(tmp_path, monkeypatch):
  from transformer_jax.checkpoints import checkpointer
  from transformer_jax.common.errors import CorruptCheckpointError

  monkeypatch.setattr(checkpointer, '_PRUNE_SECONDS', 0.3)
  workdir = str(tmp_path)
  _write_workdir(workdir, [1, 2])
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '2', 'state', 'd'))  # and nobody deletes it
  with pytest.raises(
    CorruptCheckpointError, match='checkpoint step 2 at .* is damaged or incomplete'
  ):
    average_checkpoints(workdir, last=2)


_SAVE_AND_PRUNE = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from average_test import _params, _state
from transformer_jax.checkpoints.checkpointer import Checkpointer
with Checkpointer(sys.argv[1], keep=2) as checkpointer:  # Saves in the background, prunes.
  for step in range(1, 100000):
    checkpointer.save(step, _state(_params(2.0 * step - 1.0, np.zeros((3, 4), np.float32)), step))
    if step == 3:
      print('saving', flush=True)
"""


def test_average_in_a_loop_while_checkpoints_are_saved_and_pruned(tmp_path):
  """The real race: a process saving a checkpoint as fast as it can and keeping 2, while
  `average --last=2` runs again and again for 5 s. Before, about one average in thirty
  failed ('damaged or incomplete': a step deleted while it was read)."""
  checkpoint_dir = tmp_path / 'checkpoints'
  saver = subprocess.Popen(
    [sys.executable, '-c', _SAVE_AND_PRUNE, str(checkpoint_dir), os.path.dirname(__file__)],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  averages, failures = [], []
  try:
    assert saver.stdout.readline().strip() == 'saving'
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
      try:
        averages.append(average_checkpoints(str(tmp_path), last=2))
      except Exception as error:  # pylint: disable=broad-except
        failures.append(f'{type(error).__name__}: {error}')
  finally:
    saver.kill()
    saver.wait()
  assert not failures, failures[:3]
  assert len(averages) >= 5
  # Two complete checkpoints when the saver is between saves; one while the newest is still
  # being written and the oldest is already being pruned (a loaded machine sees both).
  assert all(1 <= len(result['averaged_steps']) <= 2 for result in averages), averages[:3]
  assert any(len(result['averaged_steps']) == 2 for result in averages)
  latest = averages[-1]
  bias = np.asarray(
    restore_params_from(
      latest['path'],
      {
        'dense': {
          'bias': jax.ShapeDtypeStruct((4,), jnp.float32),
          'kernel': jax.ShapeDtypeStruct((3, 4), jnp.float32),
        },
        'embed': jax.ShapeDtypeStruct((5, 2), jnp.bfloat16),
      },
    )['dense']['bias']
  )
  np.testing.assert_array_equal(
    bias, np.full((4,), float(np.mean([2 * s - 1 for s in latest['averaged_steps']])))
  )
