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
call it first thing. It is for XLA:CPU only (on GPUs and TPUs the step's temporaries live in
device memory, and the one arena would only slow compiling), and since JAX cannot be asked for
its backend without starting it, `expected_accelerator` guesses the backend the way JAX will
choose it: from JAX_PLATFORM_NAME / JAX_PLATFORMS, else from the accelerator plugins installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys

from absl import logging

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied = False
_skip_logged = False  # Whether reuse_freed_memory_if_configured has logged why it did nothing.


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


def installed_accelerator_plugins() -> list[str]:
  """The accelerator backends JAX would find here, found as JAX finds them, without importing.

  PJRT plugins (jax[cuda12] / jax[cuda13] / ROCm / ...: `jax_plugins.xla_cuda12` etc., from the
  jax-cudaNN-pjrt wheels) are modules of the `jax_plugins` namespace package or entry points of
  the `jax_plugins` group; a library named in PJRT_NAMES_AND_LIBRARY_PATHS; TPUs are driven
  through the `libtpu` module (jax[tpu]) or a TPU_LIBRARY_PATH.
  """
  found = set()
  spec = importlib.util.find_spec('jax_plugins')
  if spec is not None and spec.submodule_search_locations:
    found.update(module.name for module in pkgutil.iter_modules(spec.submodule_search_locations))
  found.update(
    entry_point.name for entry_point in importlib.metadata.entry_points(group='jax_plugins')
  )
  for name_and_path in filter(None, os.environ.get('PJRT_NAMES_AND_LIBRARY_PATHS', '').split(',')):
    found.add(name_and_path.split(';' if sys.platform == 'win32' else ':')[0])
  if importlib.util.find_spec('libtpu') is not None or os.environ.get('TPU_LIBRARY_PATH'):
    found.add('libtpu')
  return sorted(found)


def expected_accelerator() -> str | None:
  """Why JAX's default backend will be an accelerator here, or None for XLA:CPU.

  Decided without starting JAX, in JAX's order: JAX_PLATFORM_NAME, else the first of
  JAX_PLATFORMS, else any accelerator plugin installed (`installed_accelerator_plugins`). A
  plugin installed on a host without its device is taken as an accelerator although JAX would
  fall back to the CPU: JAX_PLATFORMS=cpu says otherwise.
  """
  for variable in ('JAX_PLATFORM_NAME', 'JAX_PLATFORMS'):
    value = os.environ.get(variable, '').strip().lower()
    if value:
      return None if value.split(',')[0].strip() == 'cpu' else f'{variable}={value}'
  plugins = installed_accelerator_plugins()
  return f'accelerator plugins installed: {", ".join(plugins)}' if plugins else None


def reuse_freed_memory_if_configured(config) -> bool:
  """`reuse_freed_memory()` unless the training config sets `reuse_host_memory` False or JAX
  is expected to run on an accelerator (`expected_accelerator`; logged)."""
  if not config.get('reuse_host_memory', True):
    return False
  accelerator = expected_accelerator()
  if accelerator:
    global _skip_logged
    if not _skip_logged:  # Once: train.py and training.loop both call this.
      _skip_logged = True
      # absl's logging, not common.log.log: that asks JAX for the process index.
      logging.info(
        'Host memory: the CPU-only malloc tuning is off, JAX is expected to run on an '
        'accelerator (%s; it applies under JAX_PLATFORMS=cpu).',
        accelerator,
      )
    return False
  return reuse_freed_memory()


def is_applied() -> bool:
  """Whether `reuse_freed_memory` has taken effect in this process."""
  return _applied
