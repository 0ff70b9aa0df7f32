"""Speed benchmark: training MFU, decoding speed, input-pipeline throughput, per model size.

    python -m transformer_jax.benchmark [--sizes=tiny,small,base] [--dtype=bfloat16] \
        [--json=bench.json] [--workdir=TRAINED_DEFAULT_RUN]

Prints one table row per model size and writes everything (with a description of the machine)
to --json. Every rate is divided by limits measured in the same run:

  * peak: the best time of a large N x N matrix product (2 N^3 FLOPs) in the benchmark's dtype,
    per device; MFU = achieved model FLOP/s / (peak x devices).
  * training: target tokens/s, model FLOPs per step (`benchmark_flops`), achieved FLOP/s, MFU (on
    the padded batch the hardware computes, and "useful" MFU on the real tokens only), time to
    the first step (tracing + compilation + one step) and peak memory.
  * decoding: sentences/s and target tokens/s for greedy and beam search, with and without the
    decoding cache, and the speedup the cache buys.
  * input pipeline: examples/s and padding fraction of each batching mode, and the ratio to the
    examples/s the training step of the matching size consumes.

Model FLOPs per training step: `benchmark_flops.training_flops`; the formula and what each
term counts are in benchmark_flops.py's docstring.

Synthetic data: batches of random token ids whose real lengths are drawn in 70-80% of the padded
length, so no dataset is needed. Decoding uses an untrained model whose end-of-sentence logit
is pushed to -30 (a parameter edit, the same computation), so every sentence decodes exactly
--decode_length tokens with no early stop; with --workdir it instead decodes number-words test
sentences with the trained model, which stops at real lengths.

The figures are wall-clock times of this process: run on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import resource
import socket
import sys
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax import host_memory, run_config, train_lib
# DECODE_MODES and BATCHING_MODES are re-exported: users read them from here.
from transformer_jax.benchmark_decoding import (DECODE_MODES, benchmark_decoding,  # noqa: F401
                                               suppress_eos, trained_decoding)
# Re-exported too: bench/ceiling.py, bench/levers.py and tests read them from here.
from transformer_jax.benchmark_flops import (FLOPS_FORMULA, PeakTimer,  # noqa: F401
                                            matmul_params, measure_peak, training_flops)
from transformer_jax.benchmark_pipeline import BATCHING_MODES, benchmark_pipeline  # noqa: F401
from transformer_jax.benchmark_report import format_report
from transformer_jax.config import TransformerConfig, UserInputError, is_integer
from transformer_jax.models import Transformer, count_params
from transformer_jax.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SIZES = ('tiny', 'small', 'base', 'big')
# Lowest id of an ordinary token: pad, eos, bos and unk come first.
_FIRST_TOKEN_ID = max(PAD_ID, EOS_ID, BOS_ID, UNK_ID) + 1
# Real lengths of synthetic rows: this fraction of the padded length.
_REAL_LENGTH_FRACTION = (0.7, 0.8)
# Peak matmuls timed before each training step (best kept) for `mfu_paired_median`: enough to
# catch the machine's speed of the moment, few enough not to lengthen a run much.
_PAIRED_PEAK_REPEATS = 2


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


def size_spec(name: str, base_config: ml_collections.ConfigDict, *, dtype: str,
              dropout: float | None = None, attention_impl: str = '',
              remat: bool | None = None, rows_per_device: int = 0) -> SizeSpec:
  """tiny: base_config's model and batch (the default config: d 128, 3+3, vocab 256, 64 pairs
  x 24/16 tokens). small: d 256, 3+3, ff 1024, 4 heads, vocab 8000, dropout 0.3/0.1 as the
  Multi30k config, 64 x 32 = 2,048 target tokens. base / big: the paper's base / big model,
  vocab 37,000, 64 x 64 = 4,096 target tokens. Batch sizes are per device; `rows_per_device`
  overrides the rows of any size."""
  config = ml_collections.ConfigDict(base_config.to_dict())
  if name == 'tiny':
    model_fields = config.model.to_dict()
    vocab_size = config.vocab_size
    rows, source_length, target_length = (config.per_device_batch_size,
                                          config.max_source_length, config.max_target_length)
  elif name == 'small':
    model_fields = dict(config.model.to_dict(), d_model=256, d_ff=1024, num_heads=4,
                        num_encoder_layers=3, num_decoder_layers=3, dropout_rate=0.3,
                        attention_dropout_rate=0.1, max_len=128)
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
  return SizeSpec(name, config, train_lib.model_config_from(config, vocab_size), rows,
                  source_length, target_length)


# --------------------------------------------------------------------------- Training --

def synthetic_lengths(rng: np.random.Generator, rows: int, padded_length: int) -> np.ndarray:
  low, high = (max(1, round(f * padded_length)) for f in _REAL_LENGTH_FRACTION)
  return rng.integers(low, high + 1, size=rows)


def synthetic_ids(rng: np.random.Generator, lengths: np.ndarray, padded_length: int,
                  vocab_size: int) -> np.ndarray:
  """Right-padded rows of random ordinary ids ending with EOS."""
  ids = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=(len(lengths), padded_length))
  positions = np.arange(padded_length)[None, :]
  ids = np.where(positions == lengths[:, None] - 1, EOS_ID, ids)
  return np.where(positions < lengths[:, None], ids, PAD_ID).astype(np.int32)


def synthetic_batch(rng: np.random.Generator, rows: int, source_length: int,
                    target_length: int, vocab_size: int) -> dict[str, np.ndarray]:
  source_lengths = synthetic_lengths(rng, rows, source_length)
  target_lengths = synthetic_lengths(rng, rows, target_length)
  return {'inputs': synthetic_ids(rng, source_lengths, source_length, vocab_size),
          'targets': synthetic_ids(rng, target_lengths, target_length, vocab_size)}


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


def benchmark_training(spec: SizeSpec, *, steps: int, warmup_steps: int, peak_flops: float,
                       seed: int = 0, num_batches: int = 4,
                       peak_probe: Callable[[], float] | None = None) -> tuple[dict, Any]:
  """Times `steps` training steps after `warmup_steps`; returns (row, trained params).

  `peak_probe` (optional) times the peak matmul again, in FLOP/s, right before every timed
  step, so that each step's MFU divides by the limit of its own moment (`mfu_paired_median`).
  """
  trainer = train_lib.Trainer(spec.config, spec.model_config)
  devices = trainer.mesh.devices.size
  rows = spec.rows_per_device * devices  # Global; each process feeds its local devices' rows.
  local_rows = spec.rows_per_device * jax.local_device_count()
  rng = np.random.default_rng(seed + jax.process_index())
  batches = [synthetic_batch(rng, local_rows, spec.source_length, spec.target_length,
                             spec.model_config.vocab_size) for _ in range(num_batches)]
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
  median_step, best_step = ((float(np.median(step_times)), min(step_times)) if step_times
                            else (float('nan'), float('nan')))
  loss = float(metrics['loss_sum']) / max(float(metrics['token_count']), 1.0)

  padded = training_flops(spec.model_config, [spec.source_length] * rows,
                          [spec.target_length] * rows)
  # Mean over the batches the timed steps used (each batch has its own real lengths).
  used = [batches[i % num_batches] for i in range(max(steps, 1))]
  useful = np.mean([training_flops(spec.model_config, (b['inputs'] != PAD_ID).sum(1),
                                   (b['targets'] != PAD_ID).sum(1))['total'] for b in used])
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
      'mfu_paired_median': (float(np.median([padded['total'] / (t * p * devices)
                                             for t, p in zip(step_times, step_peaks)]))
                            if step_peaks else None),
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
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    return {'xla_step_memory_bytes': float(total),
            'xla_temp_memory_bytes': float(stats.temp_size_in_bytes)}
  except Exception as error:  # Informational only; not every backend reports it.
    return {'xla_step_memory_error': f'{type(error).__name__}: {error}'}


# --------------------------------------------------------------------------- Decoding --

def synthetic_decoding(spec: SizeSpec, params, *, batch_size: int, source_length: int,
                       decode_length: int, batches: int, beam_size: int, alpha: float,
                       seed: int = 0) -> dict:
  """An untrained model with EOS suppressed: every sentence is exactly decode_length tokens."""
  cfg = spec.model_config
  if max(source_length, decode_length) > cfg.max_len:
    cfg = cfg.replace(max_len=max(source_length, decode_length))
  params, suppressed = suppress_eos(params, cfg)
  rng = np.random.default_rng(seed + 1)
  sources = [synthetic_ids(rng, synthetic_lengths(rng, batch_size, source_length),
                           source_length, cfg.vocab_size) for _ in range(batches)]
  note = (f'untrained {spec.name} model, synthetic sources; EOS suppressed, so every sentence '
          f'decodes exactly {decode_length} tokens (no early stop)' if suppressed else
          f'untrained {spec.name} model, synthetic sources; could not suppress EOS (unknown '
          'parameter layout): decoding may stop early, see mean_output_tokens')
  return benchmark_decoding(spec.name, cfg, params, sources, max_decode_len=decode_length,
                            beam_size=beam_size, alpha=alpha, note=note, trained=False,
                            eos_suppressed=suppressed)


# ----------------------------------------------------------------------------- Report --

def machine_info() -> dict:
  devices = jax.devices()
  return {'platform': devices[0].platform, 'device_kind': devices[0].device_kind,
          'device_count': len(devices), 'devices': [str(d) for d in devices],
          'process_count': jax.process_count(), 'cpu_count': os.cpu_count(),
          'hostname': socket.gethostname(), 'python': platform.python_version(),
          'machine': platform.machine(), 'jax': jax.__version__,
          'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}


@dataclasses.dataclass
class Options:
  sizes: Sequence[str] = ('tiny', 'small')
  sections: Sequence[str] = ('train', 'decode', 'pipeline')
  dtype: str = ''  # '' = float32 on CPU, bfloat16 on accelerators.
  dropout: float | None = None
  attention_impl: str = ''  # '' = each size's own ('einsum').
  remat: bool | None = None  # None = each size's own (off).
  rows_per_device: int = 0  # 0 = each size's own batch rows.
  train_steps: int = 10
  warmup_steps: int = 2
  peak_n: int = 0  # 0 = 2048 on CPU, 8192 on accelerators.
  peak_repeats: int = 5
  decode_batch_size: int = 32
  decode_source_length: int = 24
  decode_length: int = 24
  decode_batches: int = 3
  beam_size: int = 4
  alpha: float = 0.6
  workdir: str = ''
  pipeline_examples: int = 30_000
  pipeline_batches: int = 200
  pipeline_max_length: int = 64
  pipeline_size: str = ''  # '' = small if benchmarked, else the first size.
  seed: int = 0


def _check_counts(options: Options) -> None:
  positive = ('train_steps', 'peak_repeats', 'decode_batch_size', 'decode_source_length',
              'decode_length', 'decode_batches', 'beam_size', 'pipeline_examples',
              'pipeline_batches', 'pipeline_max_length')
  for name in positive + ('rows_per_device', 'warmup_steps', 'peak_n'):
    value, least = getattr(options, name), 1 if name in positive else 0
    if not is_integer(value) or value < least:
      raise UserInputError(f'--{name} must be an integer >= {least}, got {value!r}')
  if options.alpha < 0:
    raise UserInputError(f'--alpha must be >= 0, got {options.alpha!r}')
  if options.dropout is not None and not 0 <= options.dropout < 1:
    raise UserInputError(f'--dropout must be in [0, 1), got {options.dropout!r}')


def run(config: ml_collections.ConfigDict, options: Options,
        progress: Callable[[str], None] = lambda message: None) -> dict:
  """Runs the benchmark; returns the report (what --json writes)."""
  for name in options.sizes:
    if name not in SIZES:
      raise UserInputError(f'--sizes: unknown size {name!r}; expected some of {", ".join(SIZES)}')
  for section in options.sections:
    if section not in ('train', 'decode', 'pipeline'):
      raise UserInputError(f'--sections: unknown section {section!r}; expected some of '
                           'train, decode, pipeline')
  _check_counts(options)
  accelerator = jax.devices()[0].platform != 'cpu'
  dtype = options.dtype or ('bfloat16' if accelerator else 'float32')
  peak_n = options.peak_n or (8192 if accelerator else 2048)
  report: dict[str, Any] = {
      'machine': machine_info(),
      'settings': {**dataclasses.asdict(options), 'dtype': dtype, 'peak_n': peak_n,
                   'flops_formula': FLOPS_FORMULA,
                   'reuse_host_memory': host_memory.is_applied()},
  }
  progress(f'peak: timing a {peak_n}x{peak_n} {dtype} matmul')
  peak_timer = PeakTimer(peak_n, dtype)
  report['peak'] = peak_timer.measure(options.peak_repeats)
  peak = report['peak']['initial_flops_per_second'] = report['peak']['flops_per_second']

  specs = {name: size_spec(name, config, dtype=dtype, dropout=options.dropout,
                              attention_impl=options.attention_impl, remat=options.remat,
                              rows_per_device=options.rows_per_device)
           for name in options.sizes}
  report['training'], report['decoding'] = [], []
  steps_per_second = {}
  for name, spec in specs.items():
    params = None
    if 'train' in options.sections:
      progress(f'training: {name}')
      row, params = benchmark_training(spec, steps=options.train_steps,
                                       warmup_steps=options.warmup_steps, peak_flops=peak,
                                       seed=options.seed, peak_probe=lambda: peak_timer.measure(
                                           _PAIRED_PEAK_REPEATS)['flops_per_second'])
      report['training'].append(row)
      steps_per_second[name] = row['steps_per_second']
      # The limit is the fastest the peak product ran at any point of the run: a start that
      # happened to be slow must not inflate every MFU.
      peak = max(peak, *row['peak_flops_each'])
    if 'decode' in options.sections:
      progress(f'decoding: {name}')
      if params is None:
        model = Transformer(spec.model_config)
        dummy = jnp.ones((1, 1), jnp.int32)
        params = model.init(jax.random.PRNGKey(options.seed), dummy, dummy)['params']
      report['decoding'].append(synthetic_decoding(
          spec, params, batch_size=options.decode_batch_size,
          source_length=options.decode_source_length, decode_length=options.decode_length,
          batches=options.decode_batches, beam_size=options.beam_size, alpha=options.alpha,
          seed=options.seed))
    del params
  if report['training']:
    report['peak']['flops_per_second'] = peak  # The initial figure stays in 'initial_...'.
    for row in report['training']:
      set_mfu(row, peak)
  if 'decode' in options.sections and options.workdir:
    progress(f'decoding: trained model in {options.workdir}')
    report['decoding'].append(trained_decoding(
        options.workdir, batch_size=options.decode_batch_size, batches=options.decode_batches,
        beam_size=options.beam_size, alpha=options.alpha))

  if 'pipeline' in options.sections:
    size = options.pipeline_size or ('small' if 'small' in specs else
                                     (options.sizes[0] if options.sizes else 'small'))
    spec = specs.get(size) or size_spec(size, config, dtype=dtype)
    progress(f'input pipeline: batches of the {size} size')
    report['pipeline'] = benchmark_pipeline(
        num_examples=options.pipeline_examples, max_length=options.pipeline_max_length,
        tokens_per_batch=spec.target_tokens_per_device * jax.device_count(),
        num_batches=options.pipeline_batches, train_steps_per_second=steps_per_second.get(size),
        vocab_size=spec.model_config.vocab_size, size=size, seed=options.seed)
  return report


def _define_flags():
  from absl import flags

  default_config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'configs', 'default.py')
  run_config.define_config_flag(
      default_config, 'Training config: optimiser/mesh settings of every size and '
      "the 'tiny' model and batch.", lock_config=False)
  defaults = Options()
  flags.DEFINE_list('sizes', list(defaults.sizes), f'Model sizes, some of {", ".join(SIZES)}.')
  flags.DEFINE_list('sections', list(defaults.sections), 'Parts to run: train, decode, pipeline.')
  flags.DEFINE_string('json', '', 'Write the full report as JSON here.')
  flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16'],
                    'Compute dtype (default: float32 on CPU, bfloat16 on accelerators).')
  flags.DEFINE_float('dropout', None, "Override every size's dropout rates (e.g. 0).")
  flags.DEFINE_enum('attention_impl', '', ['', 'einsum', 'xla', 'cudnn'],
                    "Every size's TransformerConfig.attention_impl ('' = its own); 'xla' and "
                    "'cudnn' also set attention dropout to 0 (those kernels have none).")
  flags.DEFINE_integer('rows_per_device', 0, "Training batch rows per device for every size "
                       "(0 = each size's own: tiny/small/base/big 64); accelerators want more.")
  flags.DEFINE_bool('remat', None, "Every size's TransformerConfig.remat (unset = its own).")
  flags.DEFINE_integer('train_steps', defaults.train_steps, 'Timed training steps per size.')
  flags.DEFINE_integer('warmup_steps', defaults.warmup_steps,
                       'Untimed steps after the first (compiling) one.')
  flags.DEFINE_integer('peak_n', defaults.peak_n,
                       'Matmul size of the peak measurement (0: 2048 on CPU, 8192 otherwise).')
  flags.DEFINE_integer('peak_repeats', defaults.peak_repeats, 'Timed peak matmuls (best kept).')
  flags.DEFINE_integer('decode_batch_size', defaults.decode_batch_size, 'Sentences per batch.')
  flags.DEFINE_integer('decode_source_length', defaults.decode_source_length,
                       'Padded source length of synthetic decoding batches.')
  flags.DEFINE_integer('decode_length', defaults.decode_length,
                       'Tokens decoded per sentence by the untrained models.')
  flags.DEFINE_integer('decode_batches', defaults.decode_batches,
                       'Timed batches per decoder (after one untimed, compiling call).')
  flags.DEFINE_integer('beam_size', defaults.beam_size, 'Beam size of beam search.')
  flags.DEFINE_float('alpha', defaults.alpha, 'Length penalty of beam search.')
  flags.DEFINE_string('workdir', '', 'A trained default (number-words) workdir: also decode '
                      'its test sentences with the trained model.')
  flags.DEFINE_integer('pipeline_examples', defaults.pipeline_examples,
                       'Synthetic pairs of the input-pipeline benchmark.')
  flags.DEFINE_integer('pipeline_batches', defaults.pipeline_batches,
                       'Timed batches per batching mode.')
  flags.DEFINE_integer('pipeline_max_length', defaults.pipeline_max_length,
                       'Longest pair (and fixed/packed row length) of the pipeline benchmark.')
  flags.DEFINE_string('pipeline_size', defaults.pipeline_size,
                      'Size whose batch budget and step rate the pipeline is compared with '
                      '(default: small if benchmarked, else the first size).')
  flags.DEFINE_integer('seed', defaults.seed, 'Seed of parameters and synthetic data.')


def main(argv):
  from absl import flags
  from transformer_jax.checkpointing import CorruptCheckpointError
  from transformer_jax.metric_writers import quiet_library_logs

  if len(argv) > 1:
    raise SystemExit(f'unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  f = flags.FLAGS
  config = run_config.loaded_config(f)
  host_memory.reuse_freed_memory_if_configured(config)  # Before JAX starts threads.
  options = Options(
      sizes=[s for s in f.sizes if s], sections=[s for s in f.sections if s],
      dtype=f.dtype or '', dropout=f.dropout,
      attention_impl=f.attention_impl, remat=f.remat,
      rows_per_device=f.rows_per_device, train_steps=f.train_steps,
      warmup_steps=f.warmup_steps, peak_n=f.peak_n, peak_repeats=f.peak_repeats,
      decode_batch_size=f.decode_batch_size, decode_source_length=f.decode_source_length,
      decode_length=f.decode_length, decode_batches=f.decode_batches, beam_size=f.beam_size,
      alpha=f.alpha, workdir=f.workdir, pipeline_examples=f.pipeline_examples,
      pipeline_batches=f.pipeline_batches, pipeline_max_length=f.pipeline_max_length,
      pipeline_size=f.pipeline_size, seed=f.seed)
  try:
    report = run(config, options,
                 progress=lambda message: print(f'[benchmark] {message}', file=sys.stderr,
                                                flush=True))
  except (UserInputError, FileNotFoundError, CorruptCheckpointError) as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  print(format_report(report))
  if f.json:
    directory = os.path.dirname(os.path.abspath(f.json))
    os.makedirs(directory, exist_ok=True)
    with open(f.json, 'w') as out:
      json.dump(report, out, indent=2, sort_keys=True)
    print(f'wrote {f.json}')


if __name__ == '__main__':
  from absl import app

  _define_flags()
  app.run(main, flags_parser=run_config.parse_flags)
