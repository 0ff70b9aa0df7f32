"""Sharding: data / FSDP / tensor parallel layouts by config alone, equal results, portable
checkpoints. The multi-device checks run in subprocesses with 8 fake CPU devices, one per test."""

import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from transformer_jax.training import sharding

from conftest import FAST_COMPILE_FLAGS, REPO_ROOT

MESH = {'data': 2, 'fsdp': 1, 'tensor': 4}


def test_fit_spec_drops_size_one_axes_and_replicates_what_does_not_divide():
  # FSDP rules on a (2, 1, 4) mesh: 'fsdp' (size 1) splits nothing and disappears.
  assert sharding.fit_spec(P(None, 'fsdp', 'tensor', None), (3, 32, 4, 8), MESH) == (
    P(None, None, 'tensor', None),
    [],
  )
  # 3 heads do not divide tensor=4: replicated, and reported.
  assert sharding.fit_spec(P(None, 'fsdp', 'tensor', None), (3, 32, 3, 8), MESH) == (
    P(None, None, None, None),
    [(2, ('tensor',))],
  )
  # The batch over ('data', 'fsdp') jointly collapses to 'data' when fsdp is 1.
  assert sharding.fit_spec(P(('data', 'fsdp'), None), (16, 24), MESH) == (P('data', None), [])
  assert sharding.fit_spec(P(('data', 'tensor')), (16,), MESH) == (P(('data', 'tensor')), [])
  with pytest.raises(ValueError, match="mesh axes \\['model'\\]"):
    sharding.fit_spec(P('model'), (8,), MESH)


def test_create_mesh_shapes():
  import jax

  mesh = sharding.create_mesh((-1, 1, 1))
  assert mesh.axis_names == ('data', 'fsdp', 'tensor')
  assert dict(mesh.shape) == {'data': jax.device_count(), 'fsdp': 1, 'tensor': 1}
  with pytest.raises(ValueError, match='one size per axis'):
    sharding.create_mesh((-1,))
  with pytest.raises(ValueError, match='more than one -1'):
    sharding.create_mesh((-1, -1, 1))


# Shared by the 8-device scripts below (run by _run_on_8_devices, which formats in the paths;
# hence the doubled braces).
_PREAMBLE = textwrap.dedent("""
    import os, sys, tempfile
    # Compiling dominates this script's time (conftest.py's FAST_COMPILE_FLAGS). Every layout
    # below runs under the same flags, so comparisons are unaffected.
    os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8 {fast_compile_flags}'
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from absl import logging
    logging.set_verbosity(logging.INFO)
    assert jax.device_count() == 8, jax.devices()
    from jax.sharding import PartitionSpec as P
    from conftest import tiny_config
    from transformer_jax.training import run_config, sharding
    from transformer_jax.training.trainer import Trainer
    from transformer_jax.checkpoints.checkpointer import Checkpointer

    config = tiny_config('unused')
    config.model.num_heads = 4  # d_model 32, d_ff 64, vocab 96: every sharded dim divides 8.
    model_config = run_config.model_config_from(config, 96)
    rng = np.random.default_rng(0)
    batch = {{'inputs': rng.integers(4, 96, (16, 24)).astype(np.int32),
             'targets': rng.integers(4, 96, (16, 20)).astype(np.int32)}}
    batch['inputs'][:, 15:] = 0   # Padding, so masking takes part.
    batch['targets'][3:, 12:] = 0

    def trainer_for(mesh_shape, devices=None, model=model_config, grad_accum_steps=1):
      layout_config = config.copy_and_resolve_references()
      layout_config.mesh_shape = mesh_shape  # By config alone, unless devices are given.
      layout_config.grad_accum_steps = grad_accum_steps
      mesh = sharding.create_mesh(mesh_shape, devices=devices) if devices else None
      return Trainer(layout_config, model, mesh)

    def specs(tree):
      return jax.tree_util.tree_map(lambda x: x.sharding.spec, tree)
""")


_LAYOUTS = textwrap.dedent("""
    layouts = {{'one': ((-1, 1, 1), jax.devices()[:1]), 'data': ((8, 1, 1), None),
               'fsdp': ((1, 8, 1), None), 'tensor': ((2, 1, 4), None),
               # FSDP=8 with the 16 rows as 2 accumulated micro-batches of 8 (one per device).
               'fsdp_accumulate_2': ((1, 8, 1), None, model_config, 2)}}
    trainers = {{name: trainer_for(*layout) for name, layout in layouts.items()}}
    # Sharded initialisation gives the same values whatever the layout (FSDP: no device ever
    # holds a whole parameter). The other layouts start from a host copy (saves compiles).
    initial = jax.device_get(trainers['fsdp'].init_state(seed=0))
    one_initial = jax.device_get(trainers['one'].init_state(seed=0))
    for a, b in zip(jax.tree_util.tree_leaves(initial), jax.tree_util.tree_leaves(one_initial)):
      np.testing.assert_array_equal(a, b)
    results = {{}}
    for name, trainer in trainers.items():
      target = trainer.state_shardings  # Same leaves; the TrainState's static tx differs.
      state = jax.device_put(jax.tree_util.tree_unflatten(
          jax.tree_util.tree_structure(target), jax.tree_util.tree_leaves(initial)), target)
      for _ in range(2):
        state, metrics = trainer.step(state, batch)
      results[name] = state, jax.device_get(metrics)

    # Parameter shardings follow the rules.
    fsdp_state = results['fsdp'][0]
    p = specs(fsdp_state.params)
    assert p['encoder_layers']['ffn']['wi']['kernel'] == P(None, 'fsdp', None), p
    assert p['encoder_layers']['ffn']['wo']['kernel'] == P(None, None, 'fsdp'), p
    assert p['shared_embedding']['embedding'] == P(None, 'fsdp'), p
    assert p['decoder_layers']['self_attention']['query']['kernel'] == \\
        P(None, 'fsdp', None, None), p
    adam = fsdp_state.opt_state[0]
    assert specs(adam.mu) == p and specs(adam.nu) == p  # Optimiser state sharded like params.
    assert fsdp_state.params['encoder_layers']['ffn']['wi']['kernel'] \\
        .addressable_shards[0].data.shape == (1, 4, 64)  # Each device holds 1/8 of it.
    t = specs(results['tensor'][0].params)
    assert t['decoder_layers']['self_attention']['query']['kernel'] == \\
        P(None, None, 'tensor', None), t
    assert t['decoder_layers']['self_attention']['out']['kernel'] == \\
        P(None, 'tensor', None, None), t
    assert t['encoder_layers']['ffn']['wi']['kernel'] == P(None, None, 'tensor'), t
    assert t['encoder_layers']['ffn']['wo']['kernel'] == P(None, 'tensor', None), t
    assert t['shared_embedding']['embedding'] == P('tensor', None), t
    d = specs(results['data'][0].params)
    assert all(s == P(*[None] * len(s)) for s in jax.tree_util.tree_leaves(d)), d
    assert trainers['tensor'].batch_sharding.spec == P(('data', 'fsdp'))

    # Every layout trains like one device, compared after 2 steps. Layouts differ only in the
    # order of float32 reductions (sharded contractions, gradient all-reduce/reduce-scatter).
    # Adam's early updates are ~lr * g / |g|, which would turn rounding noise in a near-zero
    # gradient into an lr-sized difference; no such gradient exists here (every parameter,
    # the shared embedding included via the output projection, gets a real gradient), so the
    # default tolerances hold: measured max |diff| ~1e-6 on parameters of size ~0.1-1.
    state_1, m_1 = results['one']
    params_1 = jax.device_get(state_1.params)
    for name in ('data', 'fsdp', 'tensor', 'fsdp_accumulate_2'):
      state_n, m_n = results[name]
      np.testing.assert_allclose(m_n['loss_sum'], m_1['loss_sum'], rtol=1e-5, err_msg=name)
      np.testing.assert_allclose(m_n['grad_norm'], m_1['grad_norm'], rtol=1e-5, err_msg=name)
      params_n = jax.device_get(state_n.params)
      worst, used = 0.0, 0.0
      for a, b in zip(jax.tree_util.tree_leaves(params_1), jax.tree_util.tree_leaves(params_n)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
        worst = max(worst, float(np.max(np.abs(a - b))))
        used = max(used, float(np.max(np.abs(a - b) / (1e-6 + 1e-5 * np.abs(a)))))
      print(f'{{name}}: loss_sum {{float(m_n["loss_sum"]):.6f}} vs {{float(m_1["loss_sum"]):.6f}}, '
            f'grad_norm rel diff {{abs(m_n["grad_norm"] / m_1["grad_norm"] - 1):.2g}}, '
            f'max param diff {{worst:.2g}} ({{used:.0%}} of tolerance)')

    # Checkpoints move between layouts: FSDP=8 -> 1 device and 1 device -> FSDP=8.
    with tempfile.TemporaryDirectory() as tmp:
      for source, target in (('fsdp', 'one'), ('one', 'fsdp')):
        directory = os.path.join(tmp, source)
        with Checkpointer(directory, async_save=False) as checkpointer:
          checkpointer.save(2, results[source][0])
        with Checkpointer(directory, keep=None) as checkpointer:
          restored, _ = checkpointer.restore(trainers[target].abstract_state, 2)
        expected = trainers[target].abstract_state
        for got, want, saved in zip(jax.tree_util.tree_leaves(restored),
                                    jax.tree_util.tree_leaves(expected),
                                    jax.tree_util.tree_leaves(results[source][0])):
          assert got.sharding == want.sharding, (source, target, got.sharding, want.sharding)
          np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))

    # 4 heads on tensor=8 cannot be split: replicated (and logged), the rest still is.
    print('divisibility check', file=sys.stderr)
    t8 = specs(trainer_for((1, 1, 8)).abstract_state.params)
    assert t8['decoder_layers']['self_attention']['query']['kernel'] == \\
        P(None, None, None, None), t8
    assert t8['encoder_layers']['ffn']['wi']['kernel'] == P(None, None, 'tensor'), t8
    assert t8['shared_embedding']['embedding'] == P('tensor', None), t8
    print('OK')
""")


def _run_on_8_devices(body: str, timeout: int = 300) -> subprocess.CompletedProcess:
  """_PREAMBLE + `body` in a fresh Python with 8 fake CPU devices; it must print 'OK'."""
  code = (_PREAMBLE + body).format(
    repo=REPO_ROOT, tests=os.path.join(REPO_ROOT, 'tests'), fast_compile_flags=FAST_COMPILE_FLAGS
  )
  result = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, timeout=timeout
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
  assert 'OK' in result.stdout
  print(result.stdout)
  return result


def test_layouts_equal_one_device_and_checkpoints_move_between_them():
  result = _run_on_8_devices(_LAYOUTS)
  divisibility_log = result.stderr.split('divisibility check')[-1]
  assert "'heads' of size 4 is not divisible by mesh axes tensor=8" in divisibility_log, (
    result.stderr[-3000:]
  )


_TENSOR_CHECKPOINT = textwrap.dedent("""
    import re

    def named_leaves(tree):
      return [(jax.tree_util.keystr(path), leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]

    def tensor_dims(x):
      return [dim for dim, axes in enumerate(x.sharding.spec)
              if 'tensor' in ((axes,) if isinstance(axes, str) else axes or ())]

    def assert_bitwise(got, want, what):
      got, want = np.asarray(jax.device_get(got)), np.asarray(want)
      assert (got.dtype, got.shape) == (want.dtype, want.shape), (what, got.dtype, want.dtype)
      if got.tobytes() != want.tobytes():
        np.testing.assert_array_equal(got, want, err_msg=what)
        raise AssertionError(f'{{what}}: equal values but different bits (e.g. -0.0 and 0.0)')

    tensor, data = trainer_for((2, 1, 4)), trainer_for((8, 1, 1))
    one = trainer_for((-1, 1, 1), jax.devices()[:1])  # Built for its abstract state only.
    state = tensor.init_state(seed=0)
    for _ in range(2):
      state, _ = tensor.step(state, batch)

    # What is saved really is split: every attention (q, k, v, out) and FFN (wi, wo) kernel,
    # and its two Adam moments, holds 1/4 of it per device along one dimension over 'tensor'.
    split = re.compile(r"(_attention'\\]\\['(query|key|value|out)|\\['ffn'\\]\\['w[io])'\\]"
                       r"\\['kernel'\\]$")
    kernels = [(name, x) for name, x in named_leaves(state) if split.search(name)]
    assert len(kernels) == 3 * 16, [name for name, _ in kernels]  # params, mu, nu
    for name, x in kernels:
      dims = tensor_dims(x)
      assert len(dims) == 1, (name, x.sharding.spec)
      assert x.addressable_shards[0].data.shape[dims[0]] * 4 == x.shape[dims[0]], name
    saved = named_leaves(jax.device_get(state))
    num_params = sum(name.startswith('.params') for name, _ in saved)
    assert sum(name.startswith('.opt_state') for name, _ in saved) > 2 * num_params, num_params

    with tempfile.TemporaryDirectory() as tmp:
      directory = os.path.join(tmp, 'tensor')
      with Checkpointer(directory, async_save=False) as checkpointer:
        checkpointer.save(2, state, {{'layout': 'tensor'}})
      # The next step under the saving layout: what a run resumed elsewhere must reproduce.
      next_tensor, metrics_tensor = jax.device_get(tensor.step(state, batch))
      with Checkpointer(directory, keep=None) as checkpointer:
        restored = {{'data': checkpointer.restore(data.abstract_state),
                    'one': checkpointer.restore(one.abstract_state)}}
        # As Translator.from_checkpoint does: parameters only, onto one device.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored_params = checkpointer.restore_params(jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            one.abstract_state.params))

    # Bitwise the saved values, now in the target layout (no 'tensor' left anywhere).
    for layout, trainer in (('data', data), ('one', one)):
      got, data_state = restored[layout]
      assert data_state == {{'layout': 'tensor'}}, data_state
      got, want = named_leaves(got), named_leaves(trainer.abstract_state)
      assert [n for n, _ in got] == [n for n, _ in saved] == [n for n, _ in want], layout
      for (name, x), (_, value), (_, target) in zip(got, saved, want):
        assert x.sharding == target.sharding, (layout, name, x.sharding, target.sharding)
        assert not tensor_dims(x), (layout, name, x.sharding)
        assert_bitwise(x, value, f'{{layout}} {{name}}')
      query = dict(got)[".params['decoder_layers']['self_attention']['query']['kernel']"]
      assert query.sharding.spec == P(None, None, None, None), (layout, query.sharding)
      assert [s.data.shape for s in query.addressable_shards] == \\
          [query.shape] * len(trainer.mesh.devices.flat), (layout, query.addressable_shards)
    got = named_leaves(restored_params)
    assert [n for n, _ in got] == [n[len('.params'):] for n, _ in saved if n.startswith('.params')]
    for (name, x), (_, value) in zip(got, [(n, v) for n, v in saved if n.startswith('.params')]):
      assert x.sharding == device, (name, x.sharding)
      assert_bitwise(x, value, f'params-only {{name}}')

    # One more step from the restored state under data parallelism equals the tensor-parallel
    # one (same tolerance as the layout comparison above; only reduction order differs).
    next_data, metrics_data = jax.device_get(data.step(restored['data'][0], batch))
    for key in ('loss_sum', 'grad_norm'):
      np.testing.assert_allclose(metrics_data[key], metrics_tensor[key], rtol=1e-5, err_msg=key)
    assert [n for n, _ in named_leaves(next_data)] == [n for n, _ in saved]
    worst, moved = 0.0, 0.0
    for (name, a), (_, b), (_, before) in zip(named_leaves(next_tensor), named_leaves(next_data),
                                              saved):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
      if name.startswith('.params'):
        worst = max(worst, float(np.max(np.abs(a - b))))
        moved = max(moved, float(np.max(np.abs(a - before))))
    assert moved > 1e-4, moved  # The step did change the parameters.
    print(f'tensor -> data: next step max param diff {{worst:.2g}} (step moved them {{moved:.2g}})')
    print('OK')
""")


def test_tensor_parallel_checkpoint_restores_under_data_parallel_and_on_one_device():
  _run_on_8_devices(_TENSOR_CHECKPOINT)


@pytest.mark.parametrize(
  'name, value, several',
  [
    ('SLURM_NTASKS', '4', True),
    ('SLURM_NTASKS', '1', False),
    ('OMPI_COMM_WORLD_SIZE', '2', True),
    ('TPU_WORKER_HOSTNAMES', 'w-0,w-1', True),
    ('TPU_WORKER_HOSTNAMES', 'localhost', False),
    ('JAX_COORDINATOR_ADDRESS', '10.0.0.1:1234', True),
  ],
)
def test_multiprocess_environment_is_detected(monkeypatch, name, value, several):
  for variable, _ in sharding._CLUSTER_ENV:
    monkeypatch.delenv(variable, raising=False)
  assert sharding.multiprocess_environment() is None
  # A single-process run never starts the distributed runtime.
  assert sharding.initialize_distributed() is False
  monkeypatch.setenv(name, value)
  assert sharding.multiprocess_environment() == (name if several else None)


def test_coordinator_address_needs_process_count_and_id():
  from transformer_jax.common.errors import UserInputError

  with pytest.raises(UserInputError, match='--coordinator_address needs --num_processes'):
    sharding.initialize_distributed('127.0.0.1:1234', num_processes=2)
