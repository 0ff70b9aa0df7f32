"""The project's console log: `log()` (process 0 only), the console kept to this project's
lines (`quiet_library_logs`), and durations as people read them."""

from __future__ import annotations

import logging as python_logging

import jax
from absl import logging


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
