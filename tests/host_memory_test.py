"""host_memory: after `reuse_freed_memory`, a large block freed and allocated again costs no
page faults (glibc otherwise unmaps it on free and the kernel faults every page back in); the
tuning is skipped, with a log line, where JAX is expected to run on an accelerator. And
matmul's CPU-only kernel-gradient switch logs its choice once."""

import logging
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from transformer_jax.model import matmul
from transformer_jax.training import host_memory

from conftest import REPO_ROOT

# Allocates 256 MB with malloc, writes every page, frees it; twice. Prints the minor page
# faults of the second round.
_SCRIPT = """
import ctypes, resource, sys
sys.path.insert(0, {repo!r})
if sys.argv[1] == 'reuse':
  from transformer_jax.training import host_memory
  assert host_memory.reuse_freed_memory() and host_memory.is_applied()
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 256 << 20
def touch():
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  libc.free(block)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(mode: str) -> int:
  result = subprocess.run(
    [sys.executable, '-c', _SCRIPT.format(repo=REPO_ROOT), mode],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc only')
def test_freed_blocks_are_reused_without_page_faults():
  pages = (256 << 20) // 4096  # 65,536 pages of 4 KiB.
  # glibc's default: the block is mmapped afresh, every page faults in again (huge pages, if
  # the kernel uses them here, cut the count by up to 512x, hence the loose bound).
  assert _second_round_faults('default') > pages // 1024
  # Reused: the same pages, already mapped.
  assert _second_round_faults('reuse') < 64


# --- Off on accelerators: decided before JAX starts, from the environment and installed plugins.


@pytest.fixture
def decisions(monkeypatch):
  """No platform variables, no plugins, and a stand-in for mallopt (never tune this process)."""
  for variable in ('JAX_PLATFORMS', 'JAX_PLATFORM_NAME', 'PJRT_NAMES_AND_LIBRARY_PATHS'):
    monkeypatch.delenv(variable, raising=False)
  monkeypatch.delenv('TPU_LIBRARY_PATH', raising=False)
  monkeypatch.setattr(host_memory, 'installed_accelerator_plugins', lambda: [])
  monkeypatch.setattr(host_memory, '_skip_logged', False)
  calls = []
  monkeypatch.setattr(host_memory, 'reuse_freed_memory', lambda: calls.append(1) or True)
  return calls


def _decide(caplog, config=None):
  config = config or ml_collections.ConfigDict({'reuse_host_memory': True})
  caplog.clear()
  with caplog.at_level(logging.INFO):
    applied = host_memory.reuse_freed_memory_if_configured(config)
  return applied, [
    r.getMessage() for r in caplog.records if 'malloc tuning is off' in r.getMessage()
  ]


@pytest.mark.parametrize(
  'env, plugins, reason',
  [
    ({}, ['xla_cuda12'], 'accelerator plugins installed: xla_cuda12'),
    ({}, ['libtpu'], 'accelerator plugins installed: libtpu'),
    ({'JAX_PLATFORMS': 'cuda'}, [], 'JAX_PLATFORMS=cuda'),
    ({'JAX_PLATFORMS': 'tpu,cpu'}, [], 'JAX_PLATFORMS=tpu,cpu'),
    ({'JAX_PLATFORM_NAME': 'gpu'}, [], 'JAX_PLATFORM_NAME=gpu'),
  ],
)
def test_skipped_with_a_log_line_where_an_accelerator_is_expected(
  decisions, monkeypatch, caplog, env, plugins, reason
):
  for variable, value in env.items():
    monkeypatch.setenv(variable, value)
  monkeypatch.setattr(host_memory, 'installed_accelerator_plugins', lambda: plugins)
  applied, lines = _decide(caplog)
  assert not applied and decisions == []  # mallopt never called.
  assert len(lines) == 1 and reason in lines[0] and 'JAX_PLATFORMS=cpu' in lines[0], lines
  assert _decide(caplog) == (False, [])  # Said once (train.py and training.loop both ask).


@pytest.mark.parametrize(
  'env, plugins',
  [
    ({}, []),  # Nothing installed: XLA:CPU.
    ({'JAX_PLATFORMS': 'cpu'}, ['xla_cuda12', 'libtpu']),  # The CPU chosen over the plugins.
    ({'JAX_PLATFORMS': 'cpu,cuda'}, ['xla_cuda12']),  # The first platform is the default.
    ({'JAX_PLATFORMS': ''}, []),  # Empty: JAX chooses, as if unset.
  ],
)
def test_applied_where_jax_will_run_on_the_cpu(decisions, monkeypatch, caplog, env, plugins):
  for variable, value in env.items():
    monkeypatch.setenv(variable, value)
  monkeypatch.setattr(host_memory, 'installed_accelerator_plugins', lambda: plugins)
  assert _decide(caplog) == (True, []) and decisions == [1]


def test_config_switch_still_wins(decisions, caplog):
  config = ml_collections.ConfigDict({'reuse_host_memory': False})
  assert _decide(caplog, config) == (False, []) and decisions == []


# A fake jax[cuda12] + jax[tpu] install: the PJRT plugin as a `jax_plugins` namespace module (as
# the jax-cuda12-pjrt wheel installs it), an entry point of the `jax_plugins` group (as that
# wheel also declares it), and a `libtpu` module. Run in a subprocess that sees only the fakes
# and the standard library (absl stubbed; importing JAX would fail), so that what is really
# installed does not count and nothing of the fakes reaches this process's JAX.
_DETECT = """
import importlib.util, sys, types
sys.path[:] = [sys.argv[2]] + [p for p in sys.path if p and 'site-packages' not in p]
absl = types.ModuleType('absl')
absl.logging = types.ModuleType('absl.logging')
sys.modules.update({'absl': absl, 'absl.logging': absl.logging})
spec = importlib.util.spec_from_file_location('host_memory', sys.argv[1])
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
print(host_memory.installed_accelerator_plugins(), host_memory.expected_accelerator())
"""


@pytest.mark.parametrize(
  'installed, expected',
  [
    ([], '[] None'),
    (['jax_plugins/xla_cuda12/__init__.py'], "['xla_cuda12'] accelerator plugins installed"),
    (['fake_pjrt-1.dist-info/entry_points.txt'], "['xla_fake'] accelerator plugins installed"),
    (['libtpu/__init__.py'], "['libtpu'] accelerator plugins installed"),
  ],
)
def test_plugins_found_as_jax_finds_them_without_starting_it(tmp_path, installed, expected):
  for path in installed:
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).touch()
  if installed and installed[0].endswith('entry_points.txt'):
    (tmp_path / installed[0]).write_text('[jax_plugins]\nxla_fake = jax_plugins.xla_fake\n')
    (tmp_path / 'fake_pjrt-1.dist-info' / 'METADATA').write_text('Name: fake-pjrt\nVersion: 1\n')
  hidden = (
    'JAX_PLATFORMS',
    'JAX_PLATFORM_NAME',
    'PJRT_NAMES_AND_LIBRARY_PATHS',
    'TPU_LIBRARY_PATH',
  )
  env = {k: v for k, v in os.environ.items() if k not in hidden and k != 'PYTHONPATH'}
  module = os.path.join(REPO_ROOT, 'transformer_jax', 'training', 'host_memory.py')
  result = subprocess.run(
    [sys.executable, '-c', _DETECT, module, str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(expected), result.stdout


def test_projection_gradient_choice_logged_once(monkeypatch, caplog):
  monkeypatch.setattr(matmul, '_logged', False)
  with caplog.at_level(logging.INFO):
    choices = [matmul.row_major_kernel_grads() for _ in range(3)]
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Projections:')]
  if jax.default_backend() == 'cpu':
    assert choices == [True] * 3
    assert lines == [
      'Projections: kernel gradients by the row-major custom VJP, for XLA:CPU (backend cpu).'
    ]
  else:
    assert choices == [False] * 3 and len(lines) == 1 and 'by autodiff' in lines[0], lines
