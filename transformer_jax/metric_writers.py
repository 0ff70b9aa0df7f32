"""Scalars and text to the console and to TensorBoard event files, without TensorFlow.

Only process 0 writes (on multi-host runs every process computes the same global metrics).
"""

from __future__ import annotations

import logging as python_logging
import os

import jax
from absl import logging


class MetricWriter:

  def __init__(self, logdir: str, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    if self.enabled:
      # Imported lazily: tensorboardX pulls in protobuf machinery nobody else needs.
      from tensorboardX import SummaryWriter
      os.makedirs(logdir, exist_ok=True)
      self._writer = SummaryWriter(logdir=logdir)

  def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
    if not self._writer:
      return
    for name, value in scalars.items():
      self._writer.add_scalar(name, float(value), global_step=step)
    self._writer.flush()

  def write_texts(self, step: int, texts: dict[str, str]) -> None:
    if not self._writer:
      return
    for name, value in texts.items():
      self._writer.add_text(name, value, global_step=step)
    self._writer.flush()

  def close(self) -> None:
    if self._writer:
      self._writer.close()
      self._writer = None


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m{seconds:02d}s' if hours else f'{minutes}m{seconds:02d}s'


def log(message: str) -> None:
  if jax.process_index() == 0:
    logging.info(message)


class _OnlyOwnInfo(python_logging.Filter):
  """Drops libraries' INFO chatter (orbax logs every save step by step); warnings pass."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    return record.levelno >= python_logging.WARNING or 'transformer_jax' in record.pathname


def quiet_library_logs() -> None:
  """Keeps the console to this project's progress lines plus everyone's warnings and errors."""
  # On the handler, not a logger: libraries log through their own loggers (jax, orbax via absl),
  # and a logger's filter only sees records logged to that logger directly.
  logging.get_absl_handler().addFilter(_OnlyOwnInfo())
