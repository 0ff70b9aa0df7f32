"""Scalars and text to the console and to TensorBoard event files, without TensorFlow.

Only process 0 writes (on multi-host runs every process computes the same global metrics).
"""

from __future__ import annotations

import os
import struct
import time

import jax
import numpy as np

from transformer_jax.common.log import format_duration, log


class MetricWriter:
  """TensorBoard event files in `logdir`, local or gs:// (tensorboardX writes Cloud Storage
  through google-cloud-storage, re-uploading the event file at each flush)."""

  def __init__(self, logdir: str | os.PathLike, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    if self.enabled:
      # Imported lazily: tensorboardX pulls in protobuf machinery nobody else needs.
      from tensorboardX import SummaryWriter

      logdir = os.fspath(logdir)
      if not logdir.startswith('gs://'):  # Cloud Storage has no folders to create.
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


class TrainingLog:
  """Training metrics of the steps since the last log line: to the console and TensorBoard.

  Keeps the device metrics of each step and fetches them only every `log_every_steps`, so
  logging never waits for the device mid-window.
  """

  def __init__(self, writer: MetricWriter, final_step: int, start_step: int):
    # The step the run is to end at (the ETA's): num_train_steps, or a timed cooldown's end.
    self._writer, self.final_step = writer, final_step
    self._pending = []
    self.restart_clock(start_step)

  def restart_clock(self, step: int | None = None) -> None:
    """Starts the throughput window now (evaluation and checkpointing are not training)."""
    self._window_start = time.time()
    if step is not None:
      self._window_step = step

  def add(self, metrics: dict) -> None:
    self._pending.append(metrics)

  def write(self, step: int, skipped_steps: int) -> None:
    totals, self._pending = jax.device_get(self._pending), []
    tokens = sum(float(m['token_count']) for m in totals)
    loss = sum(float(m['loss_sum']) for m in totals if np.isfinite(m['loss_sum'])) / max(
      tokens, 1.0
    )
    elapsed = max(time.time() - self._window_start, 1e-9)
    steps_per_second = (step - self._window_step) / elapsed
    scalars = {
      'train/loss': loss,
      'train/learning_rate': float(totals[-1]['learning_rate']),
      'train/grad_norm': float(totals[-1]['grad_norm']),
      'train/target_tokens_per_second': tokens / elapsed,
      'train/steps_per_second': steps_per_second,
      'train/skipped_steps': float(skipped_steps),
    }
    if 'rdrop_kl_sum' in totals[-1]:  # R-Drop: the two dropout copies' KL(p1||p2) + KL(p2||p1).
      scalars['train/rdrop_kl'] = sum(float(m['rdrop_kl_sum']) for m in totals) / max(tokens, 1.0)
    self._writer.write_scalars(step, scalars)
    eta = (self.final_step - step) / max(steps_per_second, 1e-9)
    log(
      f'step {step}/{self.final_step} | loss {loss:.4f} | '
      f'lr {scalars["train/learning_rate"]:.2e} | '
      f'{scalars["train/target_tokens_per_second"]:,.0f} tok/s | '
      f'{steps_per_second:.2f} steps/s | ETA {format_duration(eta)}'
      + (f' | {skipped_steps} non-finite steps skipped' if skipped_steps else '')
    )
    self.restart_clock(step)


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float, float]]]:
  """The scalars `MetricWriter` wrote in `logdir`: {tag: [(step, wall time, value)]}, in the
  order written (a resumed run's event files one after another), without TensorFlow.

  An event file is a sequence of records: an 8-byte little-endian length, a 4-byte CRC of it,
  the serialized `Event`, a 4-byte CRC of that (TFRecord; the CRCs are not checked: a record
  cut short by a crash ends the file's reading instead).
  """
  from etils import epath
  from tensorboardX.proto import event_pb2

  scalars: dict[str, list[tuple[int, float, float]]] = {}
  files = sorted(epath.Path(logdir).glob('events.out.tfevents.*'))
  for path in files:
    data = path.read_bytes()
    offset = 0
    while offset + 12 <= len(data):
      (length,) = struct.unpack_from('<Q', data, offset)
      record = data[offset + 12 : offset + 12 + length]
      if len(record) < length:
        break
      offset += 12 + length + 4
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.HasField('simple_value'):
          scalars.setdefault(value.tag, []).append(
            (int(event.step), float(event.wall_time), float(value.simple_value))
          )
  return scalars
