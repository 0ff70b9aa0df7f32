"""How a training run stops on SIGTERM/SIGINT: at once during start-up, between steps after.

`training.loop.train_and_evaluate` holds a `PreemptionFlag` for the whole run; its loop asks
`should_stop(step)` after every step, and the first call ends start-up.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax

from transformer_jax.common.errors import Interrupted


class PreemptionFlag:
  """SIGTERM/SIGINT: before the first training step they stop the run at once; from then on
  they set a flag that the loop checks between steps, to save a checkpoint and exit cleanly.

  Start-up (data, vocabulary, tokenizing, compiling and the first step) has nothing to save
  and takes up to an hour at scale, so a signal then raises `errors.Interrupted` in the main
  thread: `with` blocks clean up (the lock is released, tfds removes its unfinished dataset
  folder) and, since the run writes every file whole (a temporary file renamed into place),
  nothing is left half-written. Python runs a handler only between bytecodes, so a main
  thread inside one long C call (XLA compiling, SentencePiece training) would not see it for
  minutes: a watchdog thread, woken through `signal.set_wakeup_fd` as the signal arrives, ends
  the process itself (`os._exit`, same line, same exit status) if the handler has not run
  within `grace_seconds`. Such a call writes no file, so that leaves nothing half-written
  either; the kernel releases the workdir's lock (a gs:// lock expires, as after a kill). An
  interactive session (IPython, Jupyter, `python -i`) is the user's process, never ended: there
  the interruption comes when the C call returns.

  With several processes every one must stop at the same step, to save collectively. JAX's
  distributed runtime owns SIGTERM then: it passes a preemption notice received by any process
  to all of them, and `reached_preemption_sync_point` turns true on all at one step. So only
  SIGINT is caught here, and handed to that runtime as a SIGTERM, during start-up too (one
  process leaving on its own would leave the others waiting for it).
  """

  def __init__(self, grace_seconds: float = 3.0):
    self.signal_name = None
    self.start_up_interruption: Interrupted | None = None
    self._grace_seconds = grace_seconds
    self._starting = True
    self._handled = 0  # Signals the Python handler has run for (the watchdog compares).
    self._previous = {}
    self._wakeup = None  # (the watchdog pipe's write end, the wakeup fd it replaced)

  def __enter__(self):
    self._multiprocess = jax.process_count() > 1
    signals = (signal.SIGINT,) if self._multiprocess else (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
      self._previous[signum] = signal.signal(signum, self._handle)
    if not self._multiprocess and not _interactive():
      read_end, write_end = os.pipe()
      os.set_blocking(write_end, False)  # set_wakeup_fd's rule: a signal never blocks on it.
      self._wakeup = (write_end, signal.set_wakeup_fd(write_end, warn_on_full_buffer=False))
      threading.Thread(
        target=self._watch, args=(read_end,), name='start-up signal watchdog', daemon=True
      ).start()
    return self

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    self._handled += 1
    if self._multiprocess:
      # Restore JAX's SIGTERM handling (it was never replaced) and raise the notice there.
      os.kill(os.getpid(), signal.SIGTERM)
    elif self._starting:
      self.start_up_interruption = self._interruption(signum)
      raise self.start_up_interruption

  def _interruption(self, signum: int) -> Interrupted:
    return Interrupted(
      f'{signal.Signals(signum).name} received during start-up: stopped before the first '
      'training step (the files written so far are complete); rerun the same command to go on',
      signum,
    )

  def _watch(self, read_end: int) -> None:
    received = 0
    with os.fdopen(read_end, 'rb', buffering=0) as pipe:
      while numbers := pipe.read(64):  # b'': start-up is over and the write end closed.
        for signum in numbers:
          if signum not in (signal.SIGINT, signal.SIGTERM):
            continue
          received += 1
          deadline = time.monotonic() + self._grace_seconds
          while self._handled < received and time.monotonic() < deadline:
            time.sleep(0.05)
          if self._handled < received and self._starting:
            os.write(2, f'{self._interruption(signum)}\n'.encode())
            os._exit(128 + signum)

  def _end_start_up(self) -> None:
    """Steps are running: from now on a signal saves a checkpoint and stops between steps."""
    if self._wakeup is not None:
      write_end, previous = self._wakeup
      self._wakeup = None
      signal.set_wakeup_fd(previous)
      os.close(write_end)  # The watchdog reads the end of its pipe and returns.
    self._starting = False

  def should_stop(self, step: int) -> bool:
    if self._starting:
      if self.start_up_interruption is not None:  # Raised, and swallowed by some library.
        raise self.start_up_interruption
      self._end_start_up()
    if self._multiprocess:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

      return bool(multihost_utils.reached_preemption_sync_point(step))
    return self.signal_name is not None

  def __exit__(self, *exc):
    self._end_start_up()
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)


def _interactive() -> bool:
  return hasattr(sys, 'ps1') or bool(sys.flags.interactive) or 'IPython' in sys.modules
