"""The decode section's end-to-end rows (issue 49): what a user runs, `Translator.translate` and
`Translator.hypotheses`, text in and text out, beside the search program alone on the same
batches, and CTranslate2's `translate_batch` on the export of the same weights.

For each batch size and each mode (greedy, beam, sampling, n-best):

- `end_to_end`: the Translator call over all sentences (tokenizing, sorting, padding, moving
  each batch, the search, the fetch, ranking and text);
- `program`: the same jitted search program (`Translator._search`) called on the very
  arguments the Translator passed it (recorded in a first call, already on the device), all
  batches dispatched and then waited for: the device's part alone;
- `host_share` = (end_to_end - program) / end_to_end, per round, its median: the time the
  device would idle if the host's work did not overlap it;
- `dispatches_per_batch`: XLA executions of one end-to-end call (counted from a profiler trace,
  `dispatches.count_dispatches`) over its batches;
- with --compare=ctranslate2, for greedy and beam: `ctranslate2`, a float32
  `ctranslate2.Translator` on as many threads as XLA uses, `translate_batch` over the same
  sentences' pieces with `max_batch_size` = the batch size, decoding exactly as many tokens as
  ours (`min_decoding_length = max_decoding_length`), and `ratio` = ours end to end / theirs,
  per round.

The model is the toolkit rows' one (`toolkit._capped_model`): untrained, EOS suppressed, max_len =
max(source length, decode length), so every output has exactly max_len - 1 tokens and an EOS, in
every mode and on both engines. Variants are timed in `rounds` rounds, the order rotated each
round; figures are medians over rounds.

`file_translation` is the file row: the `translate` command over a file of `lines` lines of a
trained workdir's test sentences, wall time from the command's start, against a Python process
that opens CTranslate2 on that workdir's export and runs `translate_file` (the same beam and
batch size), from its start too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import jax
import numpy as np

from transformer_jax.benchmark import ctranslate2_comparison
from transformer_jax.benchmark.decoding import suppress_eos
from transformer_jax.benchmark.dispatches import count_dispatches
from transformer_jax.benchmark.toolkit import StandInTokenizer, _capped_model, _timed_rounds
from transformer_jax.benchmark.training import synthetic_ids, synthetic_lengths
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import TransformerConfig

MODES = ('greedy', 'beam', 'sampling', 'nbest')
# Modes CTranslate2's translate_batch decodes as ours (sampling's draws and the n-best lists
# are their own rows in the toolkit section).
_COMPARED = ('greedy', 'beam')


def _calls(translator: Translator, mode: str, beam_size: int, alpha: float, seed: int):
  """The user's call of each mode over a list of sentences."""
  if mode == 'greedy':
    return lambda sentences: translator.translate(sentences, beam_size=1)
  if mode == 'beam':
    return lambda sentences: translator.translate(sentences, beam_size=beam_size, alpha=alpha)
  if mode == 'sampling':
    return lambda sentences: translator.hypotheses(sentences, sampling=True, seed=seed)
  return lambda sentences: translator.hypotheses(
    sentences, beam_size=beam_size, alpha=alpha, num_hypotheses=beam_size
  )


def _recorded_program(translator: Translator, call: Callable[[], object]):
  """Runs `call` once, recording every (src, inputs, spec) the Translator passes its search
  program; returns a function that runs the program alone on those arguments."""
  program, recorded = translator._search, []

  def recording(params, src, inputs, *, spec):
    recorded.append((src, inputs, spec))
    return program(params, src, inputs, spec=spec)

  translator._search = recording
  try:
    call()
  finally:
    translator._search = program
  params = translator.params

  def alone():
    outputs = [program(params, src, inputs, spec=spec) for src, inputs, spec in recorded]
    return jax.block_until_ready(outputs)

  return alone, len(recorded)


def _median(values: Sequence[float]) -> float:
  return float(np.median(values))


def end_to_end_rows(
  name: str,
  model_config: TransformerConfig,
  params,
  *,
  batch_sizes: Sequence[int],
  batches: int,
  source_length: int,
  decode_length: int,
  beam_size: int,
  alpha: float,
  rounds: int,
  modes: Sequence[str] = MODES,
  seed: int = 0,
  compare: Sequence[str] = (),
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """The end-to-end rows of one size: {batch size: {mode: figures}} and the settings."""
  cfg = model_config
  params, suppressed = suppress_eos(params, cfg)
  cfg, params = _capped_model(cfg, params, max(source_length, decode_length))
  params = jax.device_get(params)
  tokenizer = StandInTokenizer(cfg.vocab_size)
  row = {
    'model': name,
    'eos_suppressed': suppressed,
    'max_len': cfg.max_len,
    'source_length': source_length,
    'beam_size': beam_size,
    'alpha': alpha,
    'rounds': rounds,
    'batches': batches,
    'load_before': os.getloadavg(),
    'ctranslate2': None,
    'batch_sizes': {},
  }
  with tempfile.TemporaryDirectory(prefix='end-to-end-benchmark-') as directory:
    engine = None
    if 'ctranslate2' in compare:
      threads = ctranslate2_comparison.xla_cpu_threads()
      engine = ctranslate2_comparison.ctranslate2_translator(cfg, params, directory, threads)
      row['ctranslate2'] = ctranslate2_comparison.engine_record(threads)
    for batch_size in batch_sizes:
      translator = Translator(cfg, params, tokenizer, batch_size=batch_size)
      rng = np.random.default_rng(seed + 3)
      ids = synthetic_ids(
        rng,
        synthetic_lengths(rng, batch_size * batches, source_length),
        source_length,
        cfg.vocab_size,
      )
      pieces = [[f'p{i}' for i in row_ids if i not in (PAD_ID, EOS_ID)] for row_ids in ids]
      sentences = [' '.join(p) for p in pieces]
      figures = {}
      for mode in modes:
        progress(f'  end to end: {name} {mode}, batch {batch_size}')
        figures[mode] = _mode_figures(
          translator, mode, sentences, pieces, engine, beam_size, alpha, rounds, seed, cfg
        )
      row['batch_sizes'][str(batch_size)] = figures
      del translator
  row['load_after'] = os.getloadavg()
  return row


def _mode_figures(translator, mode, sentences, pieces, engine, beam_size, alpha, rounds, seed, cfg):
  user_call = _calls(translator, mode, beam_size, alpha, seed)
  start = time.perf_counter()
  user_call(sentences)  # Compiles.
  first_call = time.perf_counter() - start
  program, launched = _recorded_program(translator, lambda: user_call(sentences))
  program()
  _, executions = count_dispatches(lambda: user_call(sentences))
  variants = {'end_to_end': lambda: user_call(sentences), 'program': program}
  options = None
  if engine is not None and mode in _COMPARED:
    # Exactly our outputs' length: max_len - 1 tokens, then the EOS.
    options = dict(
      beam_size=1 if mode == 'greedy' else beam_size,
      max_batch_size=translator.batch_size,
      min_decoding_length=cfg.max_len - 1,
      max_decoding_length=cfg.max_len - 1,
    )
    variants['ctranslate2'] = lambda: engine.translate_batch(pieces, **options)
    variants['ctranslate2']()  # Its first call allocates its buffers.
  seconds, outputs = _timed_rounds(variants, rounds)
  sentences_count = len(sentences)
  tokens = sentences_count * cfg.max_len  # Every output: max_len - 1 tokens and its EOS.
  figures = {
    'first_call_seconds': first_call,
    'batches_launched': launched,
    'dispatches_per_batch': executions / launched,
  }
  for variant, each in seconds.items():
    median = _median(each)
    figures[variant] = {
      'sentences_per_second': sentences_count / median,
      'target_tokens_per_second': tokens / median,
      'seconds_each_round': each,
    }
  figures['host_share'] = _median(
    [(e - p) / e for e, p in zip(seconds['end_to_end'], seconds['program'])]
  )
  if 'ctranslate2' in seconds:
    ratios = [t / o for o, t in zip(seconds['end_to_end'], seconds['ctranslate2'])]
    figures['ratio'] = _median(ratios)
    figures['ratio_min'], figures['ratio_max'] = min(ratios), max(ratios)
    ours = outputs['end_to_end']
    theirs = [' '.join(result.hypotheses[0]) for result in outputs['ctranslate2']]
    figures['same_best_hypothesis'] = float(np.mean([a == b for a, b in zip(ours, theirs)]))
  return figures


# ----------------------------------------------------------------------------- The file row --

_CTRANSLATE2_FILE_SCRIPT = """
import sys, time
began = time.perf_counter()
import ctranslate2, sentencepiece
model, vocabulary, source, output, beam, batch, threads, alpha = sys.argv[1:]
sp = sentencepiece.SentencePieceProcessor(model_file=vocabulary)
translator = ctranslate2.Translator(model, device='cpu', compute_type='float32',
                                    intra_threads=int(threads), inter_threads=1)
translator.translate_file(source, output, max_batch_size=int(batch), beam_size=int(beam),
                          length_penalty=float(alpha),
                          source_tokenize_fn=sp.encode_as_pieces,
                          target_detokenize_fn=sp.decode_pieces)
print(time.perf_counter() - began)
"""


def file_translation(
  workdir: str,
  *,
  lines: int,
  batch_size: int,
  beam_size: int,
  alpha: float,
  compare: Sequence[str] = (),
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """The `translate` command over a file of `lines` test sentences of a trained number-words
  `workdir`, from the command's start to its exit; and CTranslate2's translate_file on the
  workdir's export, from its process's start."""
  from transformer_jax.data import number_words  # The trained row's task.
  from transformer_jax.workdir.layout import Workdir

  numbers = number_words.sample_numbers('test', lines, seed=0)
  row = {'workdir': workdir, 'lines': lines, 'batch_size': batch_size, 'beam_size': beam_size}
  with tempfile.TemporaryDirectory(prefix='file-benchmark-') as directory:
    source = os.path.join(directory, 'source.txt')
    with open(source, 'w', encoding='utf-8') as f:
      f.writelines(number_words.english_words(n) + '\n' for n in numbers)
    ours_out = os.path.join(directory, 'ours.txt')
    command = [
      sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}',
      f'--input={source}', f'--output={ours_out}', f'--beam_size={beam_size}',
      f'--alpha={alpha}', f'--batch_size={batch_size}',
    ]  # fmt: skip
    progress(f'  file: translate of {lines} lines')
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    row['ours_seconds'] = time.perf_counter() - start
    row['ours_sentences_per_second'] = lines / row['ours_seconds']
    if 'ctranslate2' in compare:
      export = os.path.join(directory, 'export')
      progress('  file: export --format=ctranslate2 (untimed)')
      subprocess.run(
        [sys.executable, '-m', 'transformer_jax.export', f'--workdir={workdir}',
         '--format=ctranslate2', f'--out={export}'],
        check=True, capture_output=True,
      )  # fmt: skip
      theirs_out = os.path.join(directory, 'ctranslate2.txt')
      threads = ctranslate2_comparison.xla_cpu_threads()
      arguments = [export, os.fspath(Workdir(workdir).vocab_file), source, theirs_out]
      arguments += [str(beam_size), str(batch_size), str(threads), str(alpha)]
      progress(f'  file: CTranslate2 translate_file of {lines} lines')
      start = time.perf_counter()
      subprocess.run(
        [sys.executable, '-c', _CTRANSLATE2_FILE_SCRIPT, *arguments], check=True,
        capture_output=True,
      )  # fmt: skip
      row['ctranslate2_seconds'] = time.perf_counter() - start
      row['ctranslate2_sentences_per_second'] = lines / row['ctranslate2_seconds']
      row['ratio'] = row['ctranslate2_seconds'] / row['ours_seconds']
      with open(ours_out, encoding='utf-8') as a, open(theirs_out, encoding='utf-8') as b:
        pairs = list(zip(a.read().splitlines(), b.read().splitlines()))
      row['same_output'] = float(np.mean([x == y for x, y in pairs])) if pairs else 0.0
  return row
