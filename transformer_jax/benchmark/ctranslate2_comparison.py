"""`--compare=ctranslate2`: the decoding benchmark's model decoded by CTranslate2 beside ours.

The same weights (random, EOS suppressed: `decoding.suppress_eos`) become a CTranslate2 model
through `ctranslate2_spec.model_spec`, the exporter's own converter, with a stand-in
vocabulary of one made-up piece per id (CTranslate2 maps pieces to ids and nothing else).
Both sides decode the same sources to exactly `decode_length` tokens: ours because EOS never
wins, CTranslate2's because `min_decoding_length = max_decoding_length = decode_length`.
CTranslate2 runs float32 on as many threads as XLA:CPU uses (`intra_threads`).

On a shared machine the speed of the moment drifts, so the two sides are timed in alternating
rounds (ours then CTranslate2's, then the other way round) and every figure is a median over
the rounds; `ratio` is ours / CTranslate2's of each round, its median and its spread.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.exporters import ctranslate2_runtime, ctranslate2_spec
from transformer_jax.inference import decoding
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

ENGINES = ('ctranslate2',)


def require_ctranslate2():
  """The ctranslate2 module, or a one-line UserInputError saying how to install it."""
  return ctranslate2_runtime.import_ctranslate2('--compare=ctranslate2')


def xla_cpu_threads() -> int:
  """The cores XLA:CPU's thread pool uses: those this process may run on."""
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


class StandInVocabulary:
  """What `ctranslate2_spec.model_spec` reads of a tokenizer: one distinct piece per id."""

  path = '<benchmark: synthetic vocabulary>'

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def pieces(self, ids: Sequence[int]) -> list[str]:
    special = {PAD_ID: '<pad>', EOS_ID: '</s>', 2: '<s>', 3: '<unk>'}
    return [special.get(int(i), f'p{int(i)}') for i in ids]


def ctranslate2_translator(model_config: TransformerConfig, params, directory: str, threads: int):
  """A float32 `ctranslate2.Translator` of our parameters, saved in `directory`."""
  vocabulary = StandInVocabulary(model_config.vocab_size)
  spec = ctranslate2_spec.model_spec(model_config, params, vocabulary)
  spec.optimize(quantization='float32')
  spec.save(directory)
  return open_ctranslate2(directory, threads)


def engine_record(threads: int) -> dict:
  """What a report row says of the CTranslate2 it compared with."""
  return {
    'version': require_ctranslate2().__version__,
    'compute_type': 'float32',
    'intra_threads': threads,
  }


def open_ctranslate2(directory: str, threads: int):
  """The float32 `ctranslate2.Translator` of a model saved in `directory`, on `threads` cores."""
  return require_ctranslate2().Translator(
    directory, device='cpu', compute_type='float32', intra_threads=threads, inter_threads=1
  )


def _source_pieces(batch: np.ndarray, pieces: list[str]) -> list[list[str]]:
  """Padded ids [b, s] ending in EOS -> pieces without padding or EOS (CTranslate2 adds it)."""
  rows = []
  for row in batch.tolist():
    ids = [i for i in row if i != PAD_ID]
    rows.append([pieces[i] for i in (ids[:-1] if ids and ids[-1] == EOS_ID else ids)])
  return rows


def _timed(function: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  result = function()
  return time.perf_counter() - start, result


def _interleaved(ours: Callable[[], Any], theirs: Callable[[], Any], rounds: int):
  """Seconds of each side per round, alternating which goes first; and the last outputs."""
  seconds = {'ours': [], 'ctranslate2': []}
  outputs = {}
  for index in range(rounds):
    order = (('ours', ours), ('ctranslate2', theirs))
    for side, function in order if index % 2 == 0 else order[::-1]:
      elapsed, outputs[side] = _timed(function)
      seconds[side].append(elapsed)
  return seconds, outputs


def _our_decoder(model: Transformer, beam_size: int, decode_length: int, alpha: float):
  """Jitted: params, src [b, s] -> the best hypothesis [b, decode_length]."""
  if beam_size == 1:
    return jax.jit(
      lambda params, src: decoding.greedy_decode(model, params, src, max_decode_len=decode_length)
    )
  return jax.jit(
    lambda params, src: decoding.beam_decode(
      model, params, src, beam_size=beam_size, alpha=alpha, max_decode_len=decode_length
    )[0][:, 0]
  )


def compare_setting(
  model_config: TransformerConfig,
  params,
  translator,
  sources: list[np.ndarray],
  *,
  beam_size: int,
  decode_length: int,
  alpha: float,
  rounds: int,
) -> dict:
  """One decoding setting, both engines, `rounds` interleaved rounds over all `sources`."""
  pieces = StandInVocabulary(model_config.vocab_size).pieces(range(model_config.vocab_size))
  decoder = _our_decoder(Transformer(model_config), beam_size, decode_length, alpha)
  batch_pieces = [_source_pieces(batch, pieces) for batch in sources]
  options = dict(
    beam_size=beam_size,
    max_batch_size=len(sources[0]),
    min_decoding_length=decode_length,
    max_decoding_length=decode_length,
  )

  def ours():
    outputs = [decoder(params, src) for src in sources]
    return np.concatenate([np.asarray(o) for o in jax.block_until_ready(outputs)])

  def theirs():
    return [
      result.hypotheses[0]
      for batch in batch_pieces
      for result in translator.translate_batch(batch, **options)
    ]

  first_call, _ = _timed(ours)  # Compilation.
  theirs()  # CTranslate2's first call allocates its buffers.
  seconds, outputs = _interleaved(ours, theirs, rounds)
  sentences = sum(len(batch) for batch in sources)
  our_tokens = int((outputs['ours'] != PAD_ID).sum())
  their_tokens = sum(len(hypothesis) for hypothesis in outputs['ctranslate2'])
  index = {piece: i for i, piece in enumerate(pieces)}
  their_ids = [[index[p] for p in hypothesis] for hypothesis in outputs['ctranslate2']]
  same = sum(
    list(mine[mine != PAD_ID]) == theirs_ for mine, theirs_ in zip(outputs['ours'], their_ids)
  )
  ratios = [t / o for o, t in zip(seconds['ours'], seconds['ctranslate2'])]  # ours / theirs speed
  figures = {}
  for side, tokens in (('ours', our_tokens), ('ctranslate2', their_tokens)):
    median = float(np.median(seconds[side]))
    figures[side] = {
      'tokens_per_second': tokens / median,
      'milliseconds_per_sentence': 1e3 * median / sentences,
      'seconds_each_round': seconds[side],
      'mean_output_tokens': tokens / sentences,
    }
  return {
    'beam_size': beam_size,
    'batch_size': int(sources[0].shape[0]),
    'sentences': sentences,
    'rounds': rounds,
    'first_call_seconds': first_call,
    **figures,
    'ratio': float(np.median(ratios)),
    'ratio_min': float(min(ratios)),
    'ratio_max': float(max(ratios)),
    'same_best_hypothesis': same / sentences,
  }


def compare_ctranslate2(
  model_config: TransformerConfig,
  params,
  sources: list[np.ndarray],
  *,
  beam_size: int,
  decode_length: int,
  alpha: float,
  rounds: int,
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """The three settings of issue 18 for one model: beam search and greedy over `sources`
  (throughput), and beam search on one sentence at a time (latency, the first batch's
  sentences). Parameters are the EOS-suppressed ones ours decodes."""
  threads = xla_cpu_threads()
  params = jax.device_get(params)
  single = [batch[i : i + 1] for batch in sources[:1] for i in range(min(len(batch), 8))]
  settings = {
    'beam': (beam_size, sources),
    'greedy': (1, sources),
    'beam_latency': (beam_size, single),
  }
  results = {'intra_threads': threads, 'compute_type': 'float32', 'settings': {}}
  with tempfile.TemporaryDirectory(prefix='ctranslate2-benchmark-') as directory:
    translator = ctranslate2_translator(model_config, params, directory, threads)
    results['version'] = require_ctranslate2().__version__
    for name, (beam, batches) in settings.items():
      progress(f'  ctranslate2 comparison: {name} (beam {beam}, batch {len(batches[0])})')
      results['settings'][name] = compare_setting(
        model_config,
        params,
        translator,
        batches,
        beam_size=beam,
        decode_length=decode_length,
        alpha=alpha,
        rounds=rounds,
      )
  return results
