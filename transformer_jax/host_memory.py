"""Host memory: keep what XLA:CPU frees for the next step instead of returning it to the kernel.

XLA's CPU backend allocates every step's temporaries (activations kept for the backward pass,
the [tokens, vocab] logits and their gradient: gigabytes for the paper's base model) with
malloc and frees them when the step ends. glibc serves blocks over 32 MB with a fresh mmap and
unmaps them on free, and trims the heap top back to the kernel, so every step touches its
temporaries as new pages, and the page faults take a large share of the step in the kernel.
`reuse_freed_memory` tells glibc to keep one heap for all threads, never to use mmap for large
blocks and never to trim, so from the second step on the same pages are reused and no page
faults remain. The costs: the process keeps its peak heap until it exits, and fragmentation
makes that larger than one step needs; and XLA's compiler threads share the one arena, so
compiling is slower. The figures are in bench/README.md, "Optimisations tried".

It acts through `mallopt`, so only with glibc (Linux), and it must run before JAX starts its
threads (i.e. before the first JAX computation or device query) to cover them: the entry points
call it first thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied = False


def reuse_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory for reuse; returns whether it could.

  Idempotent. A no-op returning False where malloc is not glibc's (macOS, musl, Windows).
  """
  global _applied
  if _applied:
    return True
  if not sys.platform.startswith('linux'):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    mallopt = libc.mallopt
    if not hasattr(libc, 'gnu_get_libc_version'):  # mallopt exists elsewhere, not these knobs.
      return False
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  # One arena: threads other than the main one otherwise get their own, which serve large
  # blocks by mmap whatever M_MMAP_MAX says. mmap never: large blocks come from the heap.
  # Trim never (-1 disables trimming, mallopt(3)): freed blocks stay mapped for the next step.
  _applied = all(
    mallopt(parameter, value) == 1
    for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  )
  return _applied


def reuse_freed_memory_if_configured(config) -> bool:
  """`reuse_freed_memory()` unless the training config sets `reuse_host_memory` False."""
  return config.get('reuse_host_memory', True) and reuse_freed_memory()


def is_applied() -> bool:
  """Whether `reuse_freed_memory` has taken effect in this process."""
  return _applied
