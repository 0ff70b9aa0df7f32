"""`python -m transformer_jax.benchmark`: training MFU, decoding speed and input-pipeline
throughput per model size (see `runner.py` for what is measured and how):

    python -m transformer_jax.benchmark [--sizes=tiny,small,base] [--dtype=bfloat16] \
        [--json=bench.json] [--workdir=TRAINED_DEFAULT_RUN] [--compare=ctranslate2]
"""

import sys

from absl import flags

from transformer_jax import cli
from transformer_jax.benchmark import runner
from transformer_jax.benchmark.report import format_report
from transformer_jax.benchmark.training import SIZES
from transformer_jax.configs import default_config_file
from transformer_jax.training import host_memory

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_config_flag(
    default_config_file(),
    "Training config: optimiser/mesh settings of every size and the 'tiny' model and batch.",
    lock_config=False,
  )
  defaults = runner.Options()
  flags.DEFINE_list('sizes', list(defaults.sizes), f'Model sizes, some of {", ".join(SIZES)}.')
  flags.DEFINE_list(
    'sections',
    list(defaults.sections),
    'Parts to run: train, decode, pipeline, and toolkit (issue 27: scoring, sampling, n-best).',
  )
  flags.DEFINE_string('json', '', 'Write the full report as JSON here.')
  flags.DEFINE_enum(
    'dtype',
    None,
    ['float32', 'bfloat16'],
    'Compute dtype (default: float32 on CPU, bfloat16 on accelerators).',
  )
  flags.DEFINE_float('dropout', None, "Override every size's dropout rates (e.g. 0).")
  flags.DEFINE_enum(
    'attention_impl',
    '',
    ['', 'einsum', 'xla', 'cudnn'],
    "Every size's TransformerConfig.attention_impl ('' = its own); 'xla' and "
    "'cudnn' also set attention dropout to 0 (those kernels have none).",
  )
  flags.DEFINE_integer(
    'rows_per_device',
    0,
    'Training batch rows per device for every size '
    "(0 = each size's own: tiny/small/base/big 64); accelerators want more.",
  )
  flags.DEFINE_bool('remat', None, "Every size's TransformerConfig.remat (unset = its own).")
  flags.DEFINE_integer('train_steps', defaults.train_steps, 'Timed training steps per size.')
  flags.DEFINE_integer(
    'warmup_steps', defaults.warmup_steps, 'Untimed steps after the first (compiling) one.'
  )
  flags.DEFINE_integer(
    'peak_n',
    defaults.peak_n,
    'Matmul size of the peak measurement (0: 2048 on CPU, 8192 otherwise).',
  )
  flags.DEFINE_integer('peak_repeats', defaults.peak_repeats, 'Timed peak matmuls (best kept).')
  flags.DEFINE_integer('decode_batch_size', defaults.decode_batch_size, 'Sentences per batch.')
  flags.DEFINE_integer(
    'decode_source_length',
    defaults.decode_source_length,
    'Padded source length of synthetic decoding batches.',
  )
  flags.DEFINE_integer(
    'decode_length', defaults.decode_length, 'Tokens decoded per sentence by the untrained models.'
  )
  flags.DEFINE_integer(
    'decode_batches',
    defaults.decode_batches,
    'Timed batches per decoder (after one untimed, compiling call).',
  )
  flags.DEFINE_integer('beam_size', defaults.beam_size, 'Beam size of beam search.')
  flags.DEFINE_float('alpha', defaults.alpha, 'Length penalty of beam search.')
  cli.define_workdir_flag(
    'A trained default (number-words) workdir: also decode its test sentences with the '
    'trained model.',
    default='',
  )
  flags.DEFINE_integer(
    'pipeline_examples',
    defaults.pipeline_examples,
    'Synthetic pairs of the input-pipeline benchmark.',
  )
  flags.DEFINE_integer(
    'pipeline_batches', defaults.pipeline_batches, 'Timed batches per batching mode.'
  )
  flags.DEFINE_integer(
    'pipeline_max_length',
    defaults.pipeline_max_length,
    'Longest pair (and fixed/packed row length) of the pipeline benchmark.',
  )
  flags.DEFINE_string(
    'pipeline_size',
    defaults.pipeline_size,
    'Size whose batch budget and step rate the pipeline is compared with '
    '(default: small if benchmarked, else the first size).',
  )
  flags.DEFINE_integer('seed', defaults.seed, 'Seed of parameters and synthetic data.')
  flags.DEFINE_list(
    'compare',
    list(defaults.compare),
    "Engines that decode each untrained size's model and sources beside ours: ctranslate2 "
    "(float32, as many threads as XLA uses, and 1 thread for toolkit's scoring; "
    "pip install -e '.[export]'); transformers (MarianMTModel.generate on a random MarianMTModel "
    'of each size, imported, beam search end to end; the decode section).',
  )
  flags.DEFINE_integer(
    'compare_rounds',
    defaults.compare_rounds,
    'Alternating timed rounds of ours and the compared engine, and of the toolkit rows '
    '(medians reported).',
  )
  flags.DEFINE_list(
    'end_to_end_batch_sizes',
    [str(size) for size in defaults.end_to_end_batch_sizes],
    "Batch sizes of the decode section's end-to-end rows (Translator calls beside the search "
    'program alone; empty: none).',
  )
  flags.DEFINE_list(
    'end_to_end_modes',
    list(defaults.end_to_end_modes),
    'Modes of the end-to-end rows: some of greedy, beam, sampling, nbest.',
  )
  flags.DEFINE_integer(
    'end_to_end_batches', defaults.end_to_end_batches, 'Batches per end-to-end row.'
  )
  flags.DEFINE_integer(
    'file_lines',
    defaults.file_lines,
    "With --workdir: lines of the file the translate command (and CTranslate2's translate_file "
    'with --compare) translates, timed from the start (0: no file row).',
  )


def main(argv):
  del argv
  config = cli.loaded_config(FLAGS)
  host_memory.reuse_freed_memory_if_configured(config)  # Before JAX starts threads.
  options = runner.Options(
    sizes=[s for s in FLAGS.sizes if s],
    sections=[s for s in FLAGS.sections if s],
    dtype=FLAGS.dtype or '',
    dropout=FLAGS.dropout,
    attention_impl=FLAGS.attention_impl,
    remat=FLAGS.remat,
    rows_per_device=FLAGS.rows_per_device,
    train_steps=FLAGS.train_steps,
    warmup_steps=FLAGS.warmup_steps,
    peak_n=FLAGS.peak_n,
    peak_repeats=FLAGS.peak_repeats,
    decode_batch_size=FLAGS.decode_batch_size,
    decode_source_length=FLAGS.decode_source_length,
    decode_length=FLAGS.decode_length,
    decode_batches=FLAGS.decode_batches,
    beam_size=FLAGS.beam_size,
    alpha=FLAGS.alpha,
    workdir=FLAGS.workdir,
    pipeline_examples=FLAGS.pipeline_examples,
    pipeline_batches=FLAGS.pipeline_batches,
    pipeline_max_length=FLAGS.pipeline_max_length,
    pipeline_size=FLAGS.pipeline_size,
    seed=FLAGS.seed,
    compare=[engine for engine in FLAGS.compare if engine],
    compare_rounds=FLAGS.compare_rounds,
    end_to_end_batch_sizes=[size for size in FLAGS.end_to_end_batch_sizes if size],
    end_to_end_modes=[m for m in FLAGS.end_to_end_modes if m],
    end_to_end_batches=FLAGS.end_to_end_batches,
    file_lines=FLAGS.file_lines,
  )
  report = runner.run(
    config,
    options,
    progress=lambda message: print(f'[benchmark] {message}', file=sys.stderr, flush=True),
    json_path=FLAGS.json,
  )
  print(format_report(report))
  if FLAGS.json:
    print(f'wrote {FLAGS.json}')


def run():
  _define_flags()
  cli.run(main, config_flag=True)


if __name__ == '__main__':
  run()
