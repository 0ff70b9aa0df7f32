"""The training part of the benchmark: model sizes, synthetic batches, timed steps and MFU."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from transformer_jax.benchmark.flops import matmul_params, training_flops
from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import count_params
from transformer_jax.training.run_config import model_config_from
from transformer_jax.training.trainer import Trainer

SIZES = ('tiny', 'small', 'base', 'big')
# Lowest id of an ordinary token: pad, eos, bos and unk come first.
_FIRST_TOKEN_ID = max(PAD_ID, EOS_ID, BOS_ID, UNK_ID) + 1
# Real lengths of synthetic rows: this fraction of the padded length.
_REAL_LENGTH_FRACTION = (0.7, 0.8)


# ------------------------------------------------------------------------------ Sizes --


@dataclasses.dataclass(frozen=True)
class SizeSpec:
  """One benchmarked model size: its training config, model and batch shape (per device)."""

  name: str
  config: ml_collections.ConfigDict  # Optimiser, mesh and rules; lengths set to the batch's.
  model_config: TransformerConfig
  rows_per_device: int
  source_length: int  # Padded lengths of the training batch.
  target_length: int

  @property
  def target_tokens_per_device(self) -> int:
    return self.rows_per_device * self.target_length


def size_spec(
  name: str,
  base_config: ml_collections.ConfigDict,
  *,
  dtype: str,
  dropout: float | None = None,
  attention_impl: str = '',
  remat: bool | None = None,
  rows_per_device: int = 0,
) -> SizeSpec:
  """tiny: base_config's model and batch (the default config: d 128, 3+3, vocab 256, 64 pairs
  x 24/16 tokens). small: d 256, 3+3, ff 1024, 4 heads, vocab 8000, dropout 0.3/0.1 as the
  Multi30k config, 64 x 32 = 2,048 target tokens. base / big: the paper's base / big model,
  vocab 37,000, 64 x 64 = 4,096 target tokens. Batch sizes are per device; `rows_per_device`
  overrides the rows of any size."""
  config = ml_collections.ConfigDict(base_config.to_dict())
  if name == 'tiny':
    model_fields = config.model.to_dict()
    vocab_size = config.vocab_size
    rows, source_length, target_length = (
      config.per_device_batch_size,
      config.max_source_length,
      config.max_target_length,
    )
  elif name == 'small':
    model_fields = dict(
      config.model.to_dict(),
      d_model=256,
      d_ff=1024,
      num_heads=4,
      num_encoder_layers=3,
      num_decoder_layers=3,
      dropout_rate=0.3,
      attention_dropout_rate=0.1,
      max_len=128,
    )
    vocab_size, rows, source_length, target_length = 8000, 64, 32, 32
  elif name in ('base', 'big'):
    model_fields = getattr(TransformerConfig, name)(37000).to_dict()
    model_fields.pop('vocab_size')
    vocab_size, rows, source_length, target_length = 37000, 64, 64, 64
  else:
    raise UserInputError(f'unknown size {name!r}; expected one of {", ".join(SIZES)}')
  rows = rows_per_device or rows
  model_fields['dtype'] = dtype
  if dropout is not None:
    model_fields['dropout_rate'] = model_fields['attention_dropout_rate'] = dropout
  if attention_impl:
    model_fields['attention_impl'] = attention_impl
    if attention_impl != 'einsum':
      model_fields['attention_dropout_rate'] = 0.0  # The fused kernels have no attention dropout.
  if remat is not None:
    model_fields['remat'] = remat
  model_fields['max_len'] = max(model_fields['max_len'], source_length, target_length)
  config.model = ml_collections.ConfigDict(model_fields)
  config.vocab_size = vocab_size
  config.max_source_length, config.max_target_length = source_length, target_length
  config.per_device_batch_size = rows
  return SizeSpec(
    name, config, model_config_from(config, vocab_size), rows, source_length, target_length
  )


# --------------------------------------------------------------------------- Training --


def synthetic_lengths(rng: np.random.Generator, rows: int, padded_length: int) -> np.ndarray:
  low, high = (max(1, round(f * padded_length)) for f in _REAL_LENGTH_FRACTION)
  return rng.integers(low, high + 1, size=rows)


def synthetic_ids(
  rng: np.random.Generator, lengths: np.ndarray, padded_length: int, vocab_size: int
) -> np.ndarray:
  """Right-padded rows of random ordinary ids ending with EOS."""
  ids = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=(len(lengths), padded_length))
  positions = np.arange(padded_length)[None, :]
  ids = np.where(positions == lengths[:, None] - 1, EOS_ID, ids)
  return np.where(positions < lengths[:, None], ids, PAD_ID).astype(np.int32)


def synthetic_batch(
  rng: np.random.Generator, rows: int, source_length: int, target_length: int, vocab_size: int
) -> dict[str, np.ndarray]:
  source_lengths = synthetic_lengths(rng, rows, source_length)
  target_lengths = synthetic_lengths(rng, rows, target_length)
  return {
    'inputs': synthetic_ids(rng, source_lengths, source_length, vocab_size),
    'targets': synthetic_ids(rng, target_lengths, target_length, vocab_size),
  }


def peak_memory(device: jax.Device) -> tuple[float | None, str]:
  """(bytes, what they are): the device allocator's peak, or on CPU the process's peak RSS."""
  if device.platform != 'cpu':
    try:
      stats = device.memory_stats() or {}
    except Exception:  # Not every backend implements memory_stats.
      stats = {}
    if 'peak_bytes_in_use' in stats:
      return float(stats['peak_bytes_in_use']), 'device peak_bytes_in_use (whole run so far)'
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  rss *= 1 if sys.platform == 'darwin' else 1024  # Linux reports KiB, macOS bytes.
  return float(rss), 'process peak RSS (whole run so far)'


def set_mfu(row: dict, peak_flops: float) -> None:
  """A training row's MFU figures against `peak_flops` per device (`peak_flops_used`)."""
  limit = peak_flops * row['devices']
  row['peak_flops_used'] = peak_flops
  row['mfu'] = row['achieved_flops_per_second'] / limit
  row['mfu_median_step'] = row['flops_per_step'] / row['step_seconds_median'] / limit
  row['mfu_best_step'] = row['flops_per_step'] / row['step_seconds_min'] / limit
  row['useful_mfu'] = row['useful_flops_per_step'] / row['step_seconds'] / limit


def benchmark_training(
  spec: SizeSpec,
  *,
  steps: int,
  warmup_steps: int,
  peak_flops: float,
  seed: int = 0,
  num_batches: int = 4,
  peak_probe: Callable[[], float] | None = None,
) -> tuple[dict, Any]:
  """Times `steps` training steps after `warmup_steps`; returns (row, trained params).

  `peak_probe` (optional) times the peak matmul again, in FLOP/s, right before every timed
  step, so that each step's MFU divides by the limit of its own moment (`mfu_paired_median`).
  """
  trainer = Trainer(spec.config, spec.model_config)
  devices = trainer.mesh.devices.size
  rows = spec.rows_per_device * devices  # Global; each process feeds its local devices' rows.
  local_rows = spec.rows_per_device * jax.local_device_count()
  rng = np.random.default_rng(seed + jax.process_index())
  batches = [
    synthetic_batch(
      rng, local_rows, spec.source_length, spec.target_length, spec.model_config.vocab_size
    )
    for _ in range(num_batches)
  ]
  state = trainer.init_state(seed)
  params_count = count_params(state.params)

  # Time to the first step, in parts: tracing and lowering, XLA compilation (the jitted call
  # below then finds the executable in JAX's cache), and the first call itself, which also
  # touches all of the step's memory for the first time.
  started = time.perf_counter()
  with jax.set_mesh(trainer.mesh), nn.logical_axis_rules(trainer.rules):
    lowered = trainer.train_step.lower(state, trainer.global_batch(batches[0]))
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
  compiled_at = time.perf_counter()
  state, metrics = trainer.step(state, batches[0])
  jax.block_until_ready((state, metrics))
  first_step = time.perf_counter() - started
  for i in range(warmup_steps):
    state, metrics = trainer.step(state, batches[(i + 1) % num_batches])
  jax.block_until_ready((state, metrics))

  # Each step timed on its own (ended with block_until_ready), so a noisy machine shows as a
  # spread: the mean is what a run gets, the best what the hardware can do.
  step_times, step_peaks = [], []
  for i in range(steps):
    if peak_probe is not None:
      step_peaks.append(peak_probe())
    start = time.perf_counter()
    state, metrics = trainer.step(state, batches[i % num_batches])
    jax.block_until_ready((state, metrics))
    step_times.append(time.perf_counter() - start)
  step_time = float(np.mean(step_times)) if step_times else float('nan')
  median_step, best_step = (
    (float(np.median(step_times)), min(step_times)) if step_times else (float('nan'), float('nan'))
  )
  loss = float(metrics['loss_sum']) / max(float(metrics['token_count']), 1.0)

  padded = training_flops(
    spec.model_config, [spec.source_length] * rows, [spec.target_length] * rows
  )
  # Mean over the batches the timed steps used (each batch has its own real lengths).
  used = [batches[i % num_batches] for i in range(max(steps, 1))]
  useful = np.mean(
    [
      training_flops(
        spec.model_config, (b['inputs'] != PAD_ID).sum(1), (b['targets'] != PAD_ID).sum(1)
      )['total']
      for b in used
    ]
  )
  real_targets = float(np.mean([(b['targets'] != PAD_ID).sum() for b in used]))
  # Real-token figures from this process's rows, scaled to the global batch.
  useful *= rows / local_rows
  real_targets *= rows / local_rows
  achieved = padded['total'] / step_time
  memory, memory_source = peak_memory(jax.devices()[0])
  row = {
    'size': spec.name,
    'model': spec.model_config.to_dict(),
    'params': params_count,
    'matmul_params': matmul_params(spec.model_config),
    'devices': devices,
    'batch_rows': rows,
    'source_length': spec.source_length,
    'target_length': spec.target_length,
    'padded_target_tokens_per_step': rows * spec.target_length,
    'real_target_tokens_per_step': real_targets,
    'timed_steps': steps,
    'step_seconds': step_time,
    'step_seconds_median': median_step,
    'step_seconds_min': best_step,
    'step_seconds_each': [float(t) for t in step_times],
    'steps_per_second': 1.0 / step_time,
    'examples_per_second': rows / step_time,
    'target_tokens_per_second': real_targets / step_time,
    'padded_target_tokens_per_second': rows * spec.target_length / step_time,
    'flops_per_step': padded['total'],
    'flops_per_step_dense': padded['dense'],
    'flops_per_step_attention': padded['attention'],
    'useful_flops_per_step': float(useful),
    'achieved_flops_per_second': achieved,
    # Each step against the peak timed just before it: robust to a machine whose speed
    # drifts during the run (other tenants), which moves the step and its limit alike.
    'peak_flops_each': [float(p) for p in step_peaks],
    'mfu_paired_median': (
      float(
        np.median([padded['total'] / (t * p * devices) for t, p in zip(step_times, step_peaks)])
      )
      if step_peaks
      else None
    ),
    'first_step_seconds': first_step,
    'trace_seconds': lowered_at - started,
    'compile_seconds': compiled_at - lowered_at,
    'peak_memory_bytes': memory,
    'peak_memory_source': memory_source,
    'final_loss': loss,
  }
  row.update(_compiled_memory(compiled))
  set_mfu(row, peak_flops)
  return row, state.params


def _compiled_memory(compiled) -> dict:
  """XLA's own account of the step's memory (arguments + outputs + temporaries, per device)."""
  try:
    stats = compiled.memory_analysis()
    total = (
      stats.argument_size_in_bytes
      + stats.output_size_in_bytes
      - stats.alias_size_in_bytes
      + stats.temp_size_in_bytes
    )
    return {
      'xla_step_memory_bytes': float(total),
      'xla_temp_memory_bytes': float(stats.temp_size_in_bytes),
    }
  except Exception as error:  # Informational only; not every backend reports it.
    return {'xla_step_memory_error': f'{type(error).__name__}: {error}'}
