"""Speed benchmark: training MFU, decoding speed, input-pipeline throughput, per model size.

    python -m transformer_jax.benchmark [--sizes=tiny,small,base] [--dtype=bfloat16] \
        [--json=bench.json] [--workdir=TRAINED_DEFAULT_RUN]

Prints one table row per model size and writes everything (with a description of the machine)
to --json. Every rate is divided by limits measured in the same run:

  * peak: the best time of a large N x N matrix product (2 N^3 FLOPs) in the benchmark's dtype,
    per device; MFU = achieved model FLOP/s / (peak x devices).
  * training: target tokens/s, model FLOPs per step (`flops.py`), achieved FLOP/s, MFU (on
    the padded batch the hardware computes, and "useful" MFU on the real tokens only), time to
    the first step (tracing + compilation + one step) and peak memory.
  * decoding: sentences/s and target tokens/s for greedy and beam search, with and without the
    decoding cache, and the speedup the cache buys; with --compare=ctranslate2 the same model
    and sources decoded by CTranslate2 too, the two timed in alternating rounds
    (`ctranslate2_comparison.py`); with --compare=transformers, ours beside
    `MarianMTModel.generate` on a random MarianMTModel of the size, imported
    (`transformers_comparison.py`).
  * input pipeline: examples/s and padding fraction of each batching mode, and the ratio to the
    examples/s the training step of the matching size consumes.
  * toolkit (`--sections=toolkit`, not run by default): issue 27's scoring, sampling and n-best
    through the `Translator` API beside greedy and beam search, and with --compare=ctranslate2
    CTranslate2's score_batch (`toolkit.py`).

Model FLOPs per training step: `flops.training_flops`; the formula and what each
term counts are in flops.py's docstring.

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
import socket
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax.benchmark.ctranslate2_comparison import (
  compare_ctranslate2,
  require_ctranslate2,
)
from transformer_jax.benchmark.decoding import benchmark_decoding, suppress_eos, trained_decoding
from transformer_jax.benchmark.end_to_end import MODES, end_to_end_rows, file_translation
from transformer_jax.benchmark.flops import FLOPS_FORMULA, PeakTimer
from transformer_jax.benchmark.pipeline import benchmark_pipeline
from transformer_jax.benchmark.toolkit import benchmark_toolkit
from transformer_jax.benchmark.training import (
  SIZES,
  SizeSpec,
  benchmark_training,
  set_mfu,
  size_spec,
  synthetic_ids,
  synthetic_lengths,
)
from transformer_jax.benchmark.transformers_comparison import (
  compare_transformers,
  require_transformers,
)
from transformer_jax.common import text_io
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import host_memory
from transformer_jax.workdir.layout import Workdir

SECTIONS = ('train', 'decode', 'pipeline', 'toolkit')
# Engines --compare decodes beside ours: CTranslate2 on an export of each size's weights
# (`ctranslate2_comparison.py`); transformers' MarianMTModel.generate on a random MarianMTModel of
# each size, imported here (`transformers_comparison.py`, the decode section only).
ENGINES = ('ctranslate2', 'transformers')

# Peak matmuls timed before each training step (best kept) for `mfu_paired_median`: enough to
# catch the machine's speed of the moment, few enough not to lengthen a run much.
_PAIRED_PEAK_REPEATS = 2


# --------------------------------------------------------------------------- Decoding --


def synthetic_decoding(
  spec: SizeSpec,
  params,
  *,
  batch_size: int,
  source_length: int,
  decode_length: int,
  batches: int,
  beam_size: int,
  alpha: float,
  seed: int = 0,
  compare: Sequence[str] = (),
  compare_rounds: int = 3,
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """An untrained model with EOS suppressed: every sentence is exactly decode_length tokens.
  `compare`: engines that decode the same model and sources beside ours (the row's
  'ctranslate2': `ctranslate2_comparison.compare_ctranslate2`)."""
  cfg = spec.model_config
  if max(source_length, decode_length) > cfg.max_len:
    cfg = cfg.replace(max_len=max(source_length, decode_length))
  params, suppressed = suppress_eos(params, cfg)
  rng = np.random.default_rng(seed + 1)
  sources = [
    synthetic_ids(
      rng, synthetic_lengths(rng, batch_size, source_length), source_length, cfg.vocab_size
    )
    for _ in range(batches)
  ]
  note = (
    f'untrained {spec.name} model, synthetic sources; EOS suppressed, so every sentence '
    f'decodes exactly {decode_length} tokens (no early stop)'
    if suppressed
    else f'untrained {spec.name} model, synthetic sources; could not suppress EOS (unknown '
    'parameter layout): decoding may stop early, see mean_output_tokens'
  )
  row = benchmark_decoding(
    spec.name,
    cfg,
    params,
    sources,
    max_decode_len=decode_length,
    beam_size=beam_size,
    alpha=alpha,
    note=note,
    trained=False,
    eos_suppressed=suppressed,
  )
  if 'ctranslate2' in compare:
    row['ctranslate2'] = compare_ctranslate2(
      cfg,
      params,
      sources,
      beam_size=beam_size,
      decode_length=decode_length,
      alpha=alpha,
      rounds=compare_rounds,
      progress=progress,
    )
  return row


# ----------------------------------------------------------------------------- Report --


def machine_info() -> dict:
  devices = jax.devices()
  return {
    'platform': devices[0].platform,
    'device_kind': devices[0].device_kind,
    'device_count': len(devices),
    'devices': [str(d) for d in devices],
    'process_count': jax.process_count(),
    'cpu_count': os.cpu_count(),
    'hostname': socket.gethostname(),
    'python': platform.python_version(),
    'machine': platform.machine(),
    'jax': jax.__version__,
    'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  }


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
  compare: Sequence[str] = ()  # Engines decoding beside ours: some of ENGINES.
  compare_rounds: int = 3
  # The decode section's end-to-end rows (end_to_end.py); () turns them off.
  end_to_end_batch_sizes: Sequence[int] = (32, 256)
  end_to_end_modes: Sequence[str] = MODES
  end_to_end_batches: int = 2
  # Lines of the file row's file (with --workdir; 0 turns it off).
  file_lines: int = 10_000


def _check_counts(options: Options) -> None:
  positive = (
    'train_steps',
    'peak_repeats',
    'decode_batch_size',
    'decode_source_length',
    'decode_length',
    'decode_batches',
    'beam_size',
    'pipeline_examples',
    'pipeline_batches',
    'pipeline_max_length',
    'compare_rounds',
    'end_to_end_batches',
  )
  for name in positive + ('rows_per_device', 'warmup_steps', 'peak_n', 'file_lines'):
    value, least = getattr(options, name), 1 if name in positive else 0
    if not is_integer(value) or value < least:
      raise UserInputError(f'--{name} must be an integer >= {least}, got {value!r}')
  for size in options.end_to_end_batch_sizes:
    # The flag gives strings ('32'), the library integers.
    if not (is_integer(size) or (isinstance(size, str) and size.isdigit())) or int(size) < 1:
      raise UserInputError(f'--end_to_end_batch_sizes: each must be an integer >= 1, got {size!r}')
  for mode in options.end_to_end_modes:
    if mode not in MODES:
      raise UserInputError(
        f'--end_to_end_modes: unknown mode {mode!r}; expected some of {", ".join(MODES)}'
      )
  if not options.alpha >= 0:  # NaN too.
    raise UserInputError(f'--alpha must be >= 0, got {options.alpha!r}')
  if options.dropout is not None and not 0 <= options.dropout < 1:
    raise UserInputError(f'--dropout must be in [0, 1), got {options.dropout!r}')


def _check_before_running(options: Options, json_path: str) -> None:
  """What would otherwise fail only after minutes of measuring: the names, the counts, the
  trained workdir, the --json output."""
  for name in options.sizes:
    if name not in SIZES:
      raise UserInputError(f'--sizes: unknown size {name!r}; expected some of {", ".join(SIZES)}')
  for section in options.sections:
    if section not in SECTIONS:
      raise UserInputError(
        f'--sections: unknown section {section!r}; expected some of {", ".join(SECTIONS)}'
      )
  if options.pipeline_size and options.pipeline_size not in SIZES:
    raise UserInputError(
      f'--pipeline_size: unknown size {options.pipeline_size!r}; expected one of {", ".join(SIZES)}'
    )
  _check_counts(options)
  for engine in options.compare:
    if engine not in ENGINES:
      raise UserInputError(f'--compare: unknown engine {engine!r}; expected {", ".join(ENGINES)}')
    if 'decode' not in options.sections and 'toolkit' not in options.sections:
      raise UserInputError('--compare compares decoding: add decode to --sections')
    if engine == 'transformers' and 'decode' not in options.sections:
      raise UserInputError('--compare=transformers compares decoding: add decode to --sections')
    (require_ctranslate2 if engine == 'ctranslate2' else require_transformers)()
  if options.workdir and 'decode' in options.sections:
    workdir = Workdir(options.workdir)
    workdir.read_run_config()  # A one-line error if it is not a training workdir.
    if not workdir.vocab_file.exists():
      raise FileNotFoundError(f'--workdir={options.workdir}: no vocabulary {workdir.vocab_file}')
  if json_path:
    text_io.check_writable_output(json_path, '--json')


def run(
  config: ml_collections.ConfigDict,
  options: Options,
  progress: Callable[[str], None] = lambda message: None,
  json_path: str = '',
) -> dict:
  """Runs the benchmark; returns the report, also written as JSON to `json_path` if given
  (checked before anything runs)."""
  _check_before_running(options, json_path)
  options = dataclasses.replace(
    options, end_to_end_batch_sizes=[int(size) for size in options.end_to_end_batch_sizes]
  )
  accelerator = jax.devices()[0].platform != 'cpu'
  dtype = options.dtype or ('bfloat16' if accelerator else 'float32')
  peak_n = options.peak_n or (8192 if accelerator else 2048)
  report: dict[str, Any] = {
    'machine': machine_info(),
    'settings': {
      **dataclasses.asdict(options),
      'dtype': dtype,
      'peak_n': peak_n,
      'flops_formula': FLOPS_FORMULA,
      'reuse_host_memory': host_memory.is_applied(),
    },
  }
  progress(f'peak: timing a {peak_n}x{peak_n} {dtype} matmul')
  peak_timer = PeakTimer(peak_n, dtype)
  report['peak'] = peak_timer.measure(options.peak_repeats)
  peak = report['peak']['initial_flops_per_second'] = report['peak']['flops_per_second']

  specs = {
    name: size_spec(
      name,
      config,
      dtype=dtype,
      dropout=options.dropout,
      attention_impl=options.attention_impl,
      remat=options.remat,
      rows_per_device=options.rows_per_device,
    )
    for name in options.sizes
  }
  report['training'], report['decoding'], report['toolkit'] = [], [], []
  report['end_to_end'], report['transformers'] = [], []
  steps_per_second = {}
  for name, spec in specs.items():
    params = None
    if 'train' in options.sections:
      progress(f'training: {name}')
      row, params = benchmark_training(
        spec,
        steps=options.train_steps,
        warmup_steps=options.warmup_steps,
        peak_flops=peak,
        seed=options.seed,
        peak_probe=lambda: peak_timer.measure(_PAIRED_PEAK_REPEATS)['flops_per_second'],
      )
      report['training'].append(row)
      steps_per_second[name] = row['steps_per_second']
      # The limit is the fastest the peak product ran at any point of the run: a start that
      # happened to be slow must not inflate every MFU.
      peak = max(peak, *row['peak_flops_each'])
    if params is None and {'decode', 'toolkit'} & set(options.sections):
      model = Transformer(spec.model_config)
      dummy = jnp.ones((1, 1), jnp.int32)
      params = model.init(jax.random.PRNGKey(options.seed), dummy, dummy)['params']
    if 'decode' in options.sections:
      progress(f'decoding: {name}')
      report['decoding'].append(
        synthetic_decoding(
          spec,
          params,
          batch_size=options.decode_batch_size,
          source_length=options.decode_source_length,
          decode_length=options.decode_length,
          batches=options.decode_batches,
          beam_size=options.beam_size,
          alpha=options.alpha,
          seed=options.seed,
          compare=options.compare,
          compare_rounds=options.compare_rounds,
          progress=progress,
        )
      )
      if options.end_to_end_batch_sizes and options.end_to_end_modes:
        report['end_to_end'].append(
          end_to_end_rows(
            name,
            spec.model_config,
            params,
            batch_sizes=options.end_to_end_batch_sizes,
            batches=options.end_to_end_batches,
            source_length=options.decode_source_length,
            decode_length=options.decode_length,
            beam_size=options.beam_size,
            alpha=options.alpha,
            rounds=options.compare_rounds,
            modes=options.end_to_end_modes,
            seed=options.seed,
            compare=options.compare,
            progress=progress,
          )
        )
      if 'transformers' in options.compare:
        report['transformers'].append(
          compare_transformers(
            name,
            spec.model_config,
            batch_size=options.decode_batch_size,
            beam_size=options.beam_size,
            decode_length=options.decode_length,
            alpha=options.alpha,
            rounds=options.compare_rounds,
            seed=options.seed,
            dtype=dtype,
            progress=progress,
          )
        )
    if 'toolkit' in options.sections:
      progress(f'toolkit: {name}')
      report['toolkit'].append(
        benchmark_toolkit(
          name,
          spec.model_config,
          params,
          batch_size=options.decode_batch_size,
          source_length=options.decode_source_length,
          decode_length=options.decode_length,
          batches=options.decode_batches,
          beam_size=options.beam_size,
          alpha=options.alpha,
          rounds=options.compare_rounds,
          seed=options.seed,
          compare=options.compare,
          peak_flops=peak,
          peak_probe=lambda: peak_timer.measure(_PAIRED_PEAK_REPEATS)['flops_per_second'],
          progress=progress,
        )
      )
    del params
  if report['training']:
    report['peak']['flops_per_second'] = peak  # The initial figure stays in 'initial_...'.
    for row in report['training']:
      set_mfu(row, peak)
  if 'decode' in options.sections and options.workdir:
    progress(f'decoding: trained model in {options.workdir}')
    report['decoding'].append(
      trained_decoding(
        options.workdir,
        batch_size=options.decode_batch_size,
        batches=options.decode_batches,
        beam_size=options.beam_size,
        alpha=options.alpha,
      )
    )
    if options.file_lines:
      progress(f'file translation: {options.file_lines} lines with {options.workdir}')
      report['file_translation'] = file_translation(
        options.workdir,
        lines=options.file_lines,
        batch_size=options.decode_batch_size,
        beam_size=options.beam_size,
        alpha=options.alpha,
        compare=options.compare,
        progress=progress,
      )

  if 'pipeline' in options.sections:
    size = options.pipeline_size or (
      'small' if 'small' in specs else (options.sizes[0] if options.sizes else 'small')
    )
    spec = specs.get(size) or size_spec(size, config, dtype=dtype)
    progress(f'input pipeline: batches of the {size} size')
    report['pipeline'] = benchmark_pipeline(
      num_examples=options.pipeline_examples,
      max_length=options.pipeline_max_length,
      tokens_per_batch=spec.target_tokens_per_device * jax.device_count(),
      num_batches=options.pipeline_batches,
      train_steps_per_second=steps_per_second.get(size),
      vocab_size=spec.model_config.vocab_size,
      size=size,
      seed=options.seed,
    )
  if json_path:
    write_json(report, json_path)
  return report


def write_json(report: dict, path: str) -> None:
  """The report as JSON at `path` (local or gs://; a regular file written whole, a pipe or
  /dev/stdout in place: `text_io.write_output`)."""
  text_io.write_output(path, json.dumps(report, indent=2, sort_keys=True), '--json')
