"""host_memory: after `reuse_freed_memory`, a large block freed and allocated again costs no
page faults (glibc otherwise unmaps it on free and the kernel faults every page back in)."""

import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# Allocates 256 MB with malloc, writes every page, frees it; twice. Prints the minor page
# faults of the second round.
_SCRIPT = """
import ctypes, resource, sys
sys.path.insert(0, {repo!r})
if sys.argv[1] == 'reuse':
  from transformer_jax import host_memory
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
