"""Tests for transformer_jax.checkpoints.checkpointer (tiny arrays; CPU)."""

import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from transformer_jax.checkpoints.checkpointer import Checkpointer


class KeyedTrainState(train_state.TrainState):
  """TrainState plus a dropout key, as the training loop carries one."""

  dropout_key: jax.Array


def _make_state(seed: int = 0, step: int = 0) -> KeyedTrainState:
  rng = np.random.default_rng(seed)
  params = {
    'dense': {
      'kernel': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
      'bias': jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    },
    'embed': jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16),
  }
  state = KeyedTrainState.create(
    apply_fn=lambda p, x: x,
    params=params,
    tx=optax.adam(1e-3),
    dropout_key=jax.random.PRNGKey(seed),
  )
  # Take one optimizer step so opt_state moments are non-trivial.
  grads = jax.tree.map(jnp.ones_like, params)
  state = state.apply_gradients(grads=grads)
  return state.replace(step=jnp.asarray(step, jnp.int32))


def _abstract(state, sharding=None):
  """Abstract tree with a sharding attached to every leaf."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding), state
  )


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert jnp.result_type(x) == jnp.result_type(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip(tmp_path):
  state = _make_state(seed=1, step=7)
  data_state = {'epoch': 2, 'position': 12345, 'name': 'train'}
  with Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.save(7, state, data_state)
    ckpt.wait_until_finished()
    restored, restored_data = ckpt.restore(_abstract(state))
  _assert_trees_equal(restored, state)
  assert restored_data == data_state
  # Static fields come from the abstract tree, so the restored state is usable.
  assert restored.tx is state.tx and restored.apply_fn is state.apply_fn


def test_keep_and_restore_specific_step(tmp_path):
  states = {s: _make_state(seed=s, step=s) for s in (1, 2, 3)}
  with Checkpointer(str(tmp_path), keep=2) as ckpt:
    for s, st in states.items():
      ckpt.save(s, st, {'position': s})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3]
    assert ckpt.latest_step() == 3
    restored, data = ckpt.restore(_abstract(states[2]), step=2)
    _assert_trees_equal(restored, states[2])
    assert data == {'position': 2}
    with pytest.raises(FileNotFoundError, match='step 1'):
      ckpt.restore(_abstract(states[1]), step=1)


def test_restore_params_only(tmp_path):
  state = _make_state(seed=4, step=4)
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(4, state)
    params = ckpt.restore_params(_abstract(state.params))
    _, data = ckpt.restore(_abstract(state))
  _assert_trees_equal(params, state.params)
  assert data == {}


def test_missing_checkpoint_raises(tmp_path):
  directory = str(tmp_path / 'empty')
  with Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(FileNotFoundError, match='no checkpoint in') as err:
      ckpt.restore(_abstract(_make_state()))
    assert directory in str(err.value)
    with pytest.raises(FileNotFoundError, match=re.escape(directory)):
      ckpt.restore_params({'w': jax.ShapeDtypeStruct((1,), jnp.float32)})


# Runs in a fresh interpreter: the fake device count must be fixed before jax
# initialises its backend, and this test process already has 1 CPU device.
_CROSS_LAYOUT_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from transformer_jax.checkpoints.checkpointer import Checkpointer

    assert jax.device_count() == 8, jax.devices()
    mesh8 = Mesh(np.array(jax.devices()), ('data',))
    mesh1 = Mesh(np.array(jax.devices()[:1]), ('data',))
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    sharded = jax.device_put(value, NamedSharding(mesh8, P('data')))
    state = {'params': {'w': sharded}, 'step': jnp.asarray(3, jnp.int32)}
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(3, state, {'position': 9})
    ckpt.wait_until_finished()

    def abstract(sharding):
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
          state)
    for target in (NamedSharding(mesh1, P()), NamedSharding(mesh8, P())):
      restored, data = ckpt.restore(abstract(target))
      assert data == {'position': 9}
      w = restored['params']['w']
      assert w.sharding == target, (w.sharding, target)
      np.testing.assert_array_equal(np.asarray(w), value)
      assert int(restored['step']) == 3
      params = ckpt.restore_params(abstract(target)['params'])
      np.testing.assert_array_equal(np.asarray(params['w']), value)
      assert params['w'].sharding == target
    ckpt.close()
    print('CROSS_LAYOUT_OK')
""")


def test_cross_layout_restore(tmp_path):
  env = dict(os.environ)
  env['XLA_FLAGS'] = (
    env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = repo_root + os.pathsep + env.get('PYTHONPATH', '')
  result = subprocess.run(
    [sys.executable, '-c', _CROSS_LAYOUT_SCRIPT, str(tmp_path / 'ckpt')],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert 'CROSS_LAYOUT_OK' in result.stdout


# ---- params-only checkpoints (save_params / restore_params_from) ----

from transformer_jax.checkpoints.checkpointer import (  # noqa: E402
  is_params_checkpoint,
  read_metadata,
  restore_params_from,
  save_params,
)
from transformer_jax.common.errors import UserInputError  # noqa: E402


def test_params_checkpoint_round_trip(tmp_path):
  params = _make_state(seed=5).params
  host = jax.tree.map(np.asarray, params)  # NumPy leaves, as averaging produces
  directory = str(tmp_path / 'averaged')
  metadata = {'averaged_steps': [3, 4], 'latest_step': 4}
  assert save_params(directory, host, metadata) == directory
  assert is_params_checkpoint(directory)
  assert read_metadata(directory) == metadata
  abstract = _abstract(params)
  restored = restore_params_from(directory, abstract)
  _assert_trees_equal(restored, params)
  for leaf in jax.tree.leaves(restored):
    assert isinstance(leaf, jax.Array) and leaf.sharding == abstract['embed'].sharding

  # Replacing: the new contents win, and no staging folders are left behind.
  doubled = jax.tree.map(lambda x: x * 2, host)
  save_params(directory, doubled, {'latest_step': 9})
  assert read_metadata(directory) == {'latest_step': 9}
  _assert_trees_equal(restore_params_from(directory, abstract), doubled)
  assert os.listdir(tmp_path) == ['averaged']

  # A model that does not fit the saved tree: one-line UserInputError.
  wrong = dict(
    abstract, embed=jax.ShapeDtypeStruct((6, 2), jnp.bfloat16, sharding=abstract['embed'].sharding)
  )
  with pytest.raises(UserInputError, match=r'embed has shape \(5, 2\).*\(6, 2\)'):
    restore_params_from(directory, wrong)
  with pytest.raises(UserInputError, match='missing extra'):
    restore_params_from(directory, dict(abstract, extra=abstract['embed']))


def test_params_checkpoint_missing_or_incomplete(tmp_path, monkeypatch):
  directory = str(tmp_path / 'averaged')
  with pytest.raises(FileNotFoundError, match='no params checkpoint in'):
    read_metadata(directory)
  with pytest.raises(FileNotFoundError, match='no params checkpoint in'):
    restore_params_from(directory, {'w': jax.ShapeDtypeStruct((1,), jnp.float32)})
  # Non-JSON metadata fails before anything is written.
  with pytest.raises(TypeError):
    save_params(directory, {'w': np.ones(2, np.float32)}, {'bad': object()})
  assert os.listdir(tmp_path) == []
  # So does a leaf that is not an array.
  with pytest.raises(TypeError, match=r"leaf \['w'\] is a object"):
    save_params(directory, {'w': object()}, {})
  assert os.listdir(tmp_path) == []

  # A save that dies mid-write (params committed, metadata not yet durable)
  # leaves nothing that looks like a checkpoint.
  def failing_fsync(fd):
    raise OSError('disk gone')

  monkeypatch.setattr(os, 'fsync', failing_fsync)
  with pytest.raises(OSError, match='disk gone'):
    save_params(directory, {'w': np.ones(2, np.float32)}, {})
  monkeypatch.undo()
  assert not is_params_checkpoint(directory) and os.listdir(tmp_path) == []
  # Leftover staging folders from a killed process are cleaned by the next save.
  os.makedirs(tmp_path / '.averaged.tmp-dead')
  save_params(directory, {'w': np.ones(2, np.float32)}, {})
  assert os.listdir(tmp_path) == ['averaged']


def test_restore_params_to_host(tmp_path):
  state = _make_state(seed=6, step=6)
  with Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(6, state)
    host = ckpt.restore_params_to_host()
  for got, want in zip(jax.tree.leaves(host), jax.tree.leaves(state.params)):
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, np.asarray(want))
  assert jax.tree.structure(host) == jax.tree.structure(
    jax.tree.map(np.asarray, dict(state.params))
  )


# ---- checksums of params-only checkpoints ----

from transformer_jax.checkpoints.checksums import checksums  # noqa: E402
from transformer_jax.common.errors import CorruptCheckpointError  # noqa: E402


def _checked_params(seed: int = 0) -> dict:
  """Host params as averaging writes them. 'w' (4 KiB of random float32) is big enough that
  orbax stores its bytes in a data file of their own, outside the CRC-checked b-tree nodes
  that hold tiny arrays inline: a byte flipped there restores silently with wrong values."""
  rng = np.random.default_rng(seed)
  return {
    'w': rng.normal(size=(32, 32)).astype(np.float32),
    'b': rng.normal(size=(4,)).astype(np.float32),
    'embed': rng.normal(size=(5, 2)).astype(jnp.bfloat16),
  }


def _data_files(item_dir) -> list[str]:
  """The chunk files orbax (OCDBT) wrote under an item folder, largest (the array bytes) first."""
  files = [
    f
    for f in glob.glob(os.path.join(item_dir, '**', '*'), recursive=True)
    if os.path.isfile(f) and os.sep + 'd' + os.sep in f
  ]
  assert files, os.listdir(item_dir)
  return sorted(files, key=os.path.getsize, reverse=True)


def _damage_file(path, how):
  data = bytearray(pathlib.Path(path).read_bytes())
  if how == 'flip':
    data[len(data) // 2] ^= 0xFF
  elif how == 'truncate':
    data = data[: len(data) // 3]
  else:
    assert how == 'delete', how
    os.remove(path)
    return
  pathlib.Path(path).write_bytes(bytes(data))


def test_params_checkpoint_records_and_hides_checksums(tmp_path):
  params = _checked_params()
  directory = str(tmp_path / 'averaged')
  metadata = {'averaged_steps': [1, 2], 'latest_step': 2}
  save_params(directory, params, metadata)
  assert read_metadata(directory) == metadata  # the reserved key stays internal
  with open(os.path.join(directory, 'metadata.json')) as f:
    on_disk = json.load(f)
  assert on_disk == dict(metadata, _checksums=checksums(params))
  assert sorted(on_disk['_checksums']) == ['b', 'embed', 'w']
  assert all(len(sums) == 2 for sums in on_disk['_checksums'].values())
  abstract = _abstract(params)
  _assert_trees_equal(restore_params_from(directory, abstract), params)
  # Restoring into another dtype verifies the stored values, then casts (no false alarm).
  as_bf16 = dict(
    abstract, w=jax.ShapeDtypeStruct((32, 32), jnp.bfloat16, sharding=abstract['w'].sharding)
  )
  restored = restore_params_from(directory, as_bf16)
  assert restored['w'].dtype == jnp.bfloat16 and restored['w'].sharding == abstract['w'].sharding
  np.testing.assert_array_equal(np.asarray(restored['w']), params['w'].astype(jnp.bfloat16))
  # The user cannot shadow the reserved key; it fails before anything is written.
  with pytest.raises(ValueError, match="'_checksums' is reserved"):
    save_params(str(tmp_path / 'other'), params, {'_checksums': {}})
  assert os.listdir(tmp_path) == ['averaged']


def test_params_checkpoint_flipped_byte_is_named(tmp_path):
  params = _checked_params(seed=1)
  directory = str(tmp_path / 'averaged')
  save_params(directory, params, {'latest_step': 2})
  # One byte in the middle of w's data: orbax itself reads this back without complaint.
  _damage_file(_data_files(os.path.join(directory, 'params'))[0], 'flip')
  with pytest.raises(CorruptCheckpointError) as error:
    restore_params_from(directory, _abstract(params))
  assert str(error.value) == (
    f'params checkpoint at {directory} is damaged: w does not match the checksum written with it'
  )


def test_params_checkpoint_without_checksums_still_loads(tmp_path):
  params = _checked_params(seed=2)
  directory = str(tmp_path / 'averaged')
  save_params(directory, params, {'latest_step': 5})
  # As written before checksums existed: the user's metadata only.
  with open(os.path.join(directory, 'metadata.json'), 'w') as f:
    json.dump({'latest_step': 5}, f)
  assert read_metadata(directory) == {'latest_step': 5}
  _assert_trees_equal(restore_params_from(directory, _abstract(params)), params)


@pytest.mark.parametrize('how', ['truncate', 'delete', 'metadata'])
def test_params_checkpoint_unreadable_is_one_line(tmp_path, how):
  params = _checked_params(seed=3)
  directory = str(tmp_path / 'averaged')
  save_params(directory, params, {'latest_step': 5})
  if how == 'metadata':
    with open(os.path.join(directory, 'metadata.json'), 'w') as f:
      f.write('{"latest_step": 5, "_checks')  # cut off mid-write
  else:
    for path in _data_files(os.path.join(directory, 'params')):
      _damage_file(path, how)
  with pytest.raises(CorruptCheckpointError) as error:
    restore_params_from(directory, _abstract(params))
  message = str(error.value)
  assert message.startswith(f'params checkpoint at {directory} is damaged or incomplete ('), message
  assert '\n' not in message and len(message) < len(directory) + 300, message
  if how == 'metadata':
    with pytest.raises(CorruptCheckpointError, match='JSONDecodeError'):
      read_metadata(directory)


def _damaged_step(tmp_path, how) -> tuple[str, dict]:
  """A step-3 checkpoint of {'params': ...} whose chunk files are damaged as `how` says."""
  params = _checked_params(seed=4)
  directory = str(tmp_path / 'checkpoints')
  with Checkpointer(directory, async_save=False) as ckpt:
    ckpt.save(3, {'params': params, 'step': jnp.asarray(3, jnp.int32)})
  chunks = _data_files(os.path.join(directory, '3', 'state'))
  for path in chunks[:1] if how == 'flip' else chunks:  # flip: only w's data, as above
    _damage_file(path, how)
  return directory, params


def test_restore_params_to_host_verifies_checksums(tmp_path):
  directory, _ = _damaged_step(tmp_path, 'flip')
  with Checkpointer(directory, keep=None, async_save=False) as ckpt:
    with pytest.raises(CorruptCheckpointError) as error:
      ckpt.restore_params_to_host(3)
  assert str(error.value) == (
    f'checkpoint step 3 at {directory}/3 is damaged: params/w does '
    'not match the checksum written with it'
  )


def test_restore_params_to_host_unreadable_is_one_line(tmp_path):
  directory, _ = _damaged_step(tmp_path, 'truncate')
  with Checkpointer(directory, keep=None, async_save=False) as ckpt:
    with pytest.raises(
      CorruptCheckpointError,
      match=f'^checkpoint step 3 at {re.escape(directory)}/3 is damaged or '
      r'incomplete \(\w+: [^\n]*\)$',
    ):
      ckpt.restore_params_to_host(3)
