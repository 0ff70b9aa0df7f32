"""Progress of long host-side work (vocabulary, token cache, staging, averaging, translation).

    with progress(total=len(pairs), unit='pairs', description='tokenizing train') as bar:
      for chunk in chunks:
        ...
        bar.update(len(chunk))

    for path in progress(paths, unit='checkpoints', description='averaging'):
      ...

On a terminal (stderr is a tty) this is a tqdm bar. Otherwise (output to a file, a log, a
pipe) it is plain log lines through `common.log.log`, at most one every `interval` seconds
plus a final one, each with the count out of the total, the rate, the time elapsed and the
ETA; byte counts (unit='B', unit_scale=True) read as 1.50MB/3.00MB and MB/s. Only process 0
reports; the other processes of a multi-host job count silently.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Callable, Iterable, Iterator

import jax
from tqdm import tqdm

from transformer_jax.common import log as common_log

# Seconds between two log lines when output is not a terminal.
INTERVAL_S = 30.0


class Progress:
  """Counts work done and reports it: a tqdm bar on a terminal, periodic log lines otherwise.

  `update(n)` adds n units; `close()` (or leaving the `with` block) ends the report with a
  final line; iterating over a Progress made with an iterable counts one per item. A `with`
  block left by an exception closes the bar without a final line.

  stream: where a terminal bar would go (default: stderr); its `isatty()` chooses the mode.
  clock, log: injectable for tests (default: time.monotonic, common.log.log).
  enabled: default True on process 0 only.
  """

  def __init__(
    self,
    iterable: Iterable | None = None,
    *,
    total: int | float | None = None,
    unit: str = 'it',
    description: str = '',
    unit_scale: bool = False,
    unit_divisor: int = 1000,
    initial: int | float = 0,
    interval: float | None = None,
    stream: IO[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] | None = None,
    enabled: bool | None = None,
  ):
    if total is None and iterable is not None and hasattr(iterable, '__len__'):
      total = len(iterable)
    self.iterable = iterable
    self.total = total
    self.unit = unit
    self.description = description
    self.unit_scale = unit_scale
    self.unit_divisor = unit_divisor
    self.initial = initial
    self.n = initial
    self.interval = INTERVAL_S if interval is None else interval
    self._clock = clock
    self._start = self._last_line = clock()
    self._closed = False
    self._bar = None
    self._log = None
    if enabled is None:
      enabled = jax.process_index() == 0
    if not enabled:
      return
    stream = sys.stderr if stream is None else stream
    if _is_terminal(stream):
      self._bar = tqdm(
        total=total,
        initial=initial,
        # tqdm writes '12.5it/s'; a word unit reads better apart: '12.5 sentences/s'.
        unit=unit if unit_scale else f' {unit}',
        unit_scale=unit_scale,
        unit_divisor=unit_divisor,
        desc=description or None,
        file=stream,
        dynamic_ncols=True,
      )
    else:
      self._log = common_log.log if log is None else log

  def __iter__(self) -> Iterator:
    if self.iterable is None:
      raise TypeError('this Progress was made without an iterable; call update(n) instead')
    with self:
      for item in self.iterable:
        yield item
        self.update()

  def __enter__(self) -> 'Progress':
    return self

  def __exit__(self, exc_type, exc_value, traceback) -> None:
    self.close(final_line=exc_type is None)

  def update(self, n: int | float = 1) -> None:
    self.n += n
    if self._bar is not None:
      self._bar.update(n)
    elif self._log is not None and self._clock() - self._last_line >= self.interval:
      self._last_line = self._clock()
      self._log(self.line())

  @property
  def closed(self) -> bool:
    return self._closed

  def close(self, final_line: bool = True) -> None:
    """Ends the report (idempotent): the bar stays on screen; a log gets its final line."""
    if self._closed:
      return
    self._closed = True
    if self._bar is not None:
      self._bar.close()
    elif self._log is not None and final_line:
      self._log(self.line(final=True))

  def line(self, final: bool = False) -> str:
    """'<description>: 1,234/5,000 pairs (25%) | 61.7 pairs/s | elapsed 00:20 | ETA 01:01'.

    Without a total: no percentage and no ETA. The final line ends 'done in <elapsed>'.
    """
    elapsed = max(self._clock() - self._start, 0.0)
    rate = (self.n - self.initial) / elapsed if elapsed > 0 else None
    # tqdm's own validity rule: a count past the total means the total was wrong.
    total = self.total if self.total and self.n <= self.total + 0.5 else None
    counted = self._amount(self.n) + (f'/{self._amount(total)}' if total else '')
    if not self.unit_scale:
      counted += f' {self.unit}'
    if total:
      counted += f' ({100 * self.n / total:.0f}%)'
    parts = [counted, self._rate(rate)]
    if final:
      parts.append(f'done in {tqdm.format_interval(elapsed)}')
    else:
      parts.append(f'elapsed {tqdm.format_interval(elapsed)}')
      if total:
        eta = tqdm.format_interval((total - self.n) / rate) if rate else '?'
        parts.append(f'ETA {eta}')
    text = ' | '.join(parts)
    return f'{self.description}: {text}' if self.description else text

  def _amount(self, count: int | float) -> str:
    if self.unit_scale:
      return tqdm.format_sizeof(count, divisor=self.unit_divisor) + self.unit
    return f'{int(count):,}' if float(count).is_integer() else f'{count:,.1f}'

  def _rate(self, rate: float | None) -> str:
    if self.unit_scale:
      return (tqdm.format_sizeof(rate, divisor=self.unit_divisor) if rate else '?') + (
        f'{self.unit}/s'
      )
    if rate is None:
      text = '?'
    elif rate >= 100:
      text = f'{rate:,.0f}'
    else:
      text = f'{rate:.3g}'
    return f'{text} {self.unit}/s'


def progress(iterable: Iterable | None = None, **kwargs) -> Progress:
  """A `Progress` (see there): `with progress(total=..., unit=..., description=...) as bar:`
  then `bar.update(n)`, or `for item in progress(items, ...)`."""
  return Progress(iterable, **kwargs)


def _is_terminal(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # No isatty, or a closed stream.
    return False
