"""Device dispatches counted, not guessed: the XLA executions a call runs, read from a JAX
profiler trace (each executable launched is one `ExecuteHelper` event on the host), so that an
eager `jnp` operation hidden in a loop counts as much as a jitted program. The benchmark's
end-to-end rows report them per batch (`decoding.py`); tests hold the batch loop to them."""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Callable

import jax

# The host-side event of one executable's launch, in every PJRT client's trace.
_EXECUTION_EVENT = 'ExecuteHelper'


def count_dispatches(call: Callable[[], Any]) -> tuple[Any, int]:
  """(call(), the XLA executions it launched), its results made ready inside the trace."""
  with tempfile.TemporaryDirectory(prefix='dispatches_') as folder:
    jax.profiler.start_trace(folder)
    try:
      result = call()
      jax.block_until_ready(result)
    finally:
      jax.profiler.stop_trace()
    (trace,) = glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)
    profile = jax.profiler.ProfileData.from_file(trace)
  executions = 0
  for plane in profile.planes:
    if not plane.name.startswith('/host'):
      continue
    for line in plane.lines:
      executions += sum(_EXECUTION_EVENT in event.name for event in line.events)
  return result, executions
