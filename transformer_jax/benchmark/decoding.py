"""Decoding part of the benchmark: sentences/s of greedy and beam search, with and without the
key/value cache. Run through `python -m transformer_jax.benchmark` (which see).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import flax.linen as nn
import jax
import numpy as np

from transformer_jax.data import input_pipeline, number_words
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID
from transformer_jax.inference import decoding
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.workdir.layout import Workdir

DECODE_MODES = ('greedy_cached', 'greedy_uncached', 'beam_cached', 'beam_uncached')

# Added to the end-of-sentence logit of untrained decoding models (logits are ~N(0, 1)).
_EOS_SUPPRESSION = -30.0


def suppress_eos(params, cfg: TransformerConfig, margin: float = _EOS_SUPPRESSION):
  """Parameters whose decoder never prefers EOS (same shapes, same computation).

  The last LayerNorm before the output projection gets scale 0, bias 1 on feature 0, so that
  feature is the constant 1, and the output projection's EOS weight on it becomes `margin`.
  Returns (params, True), or (params unchanged, False) if the parameter layout is unknown.
  """
  params = jax.tree_util.tree_map(np.array, jax.device_get(nn.meta.unbox(params)))  # A copy.
  try:
    if cfg.pre_norm:
      norm = params['decoder_norm']
      scale, bias = norm['scale'], norm['bias']
      scale[0], bias[0] = 0.0, 1.0
    else:
      norm = params['decoder_layers']['ffn_block']['norm']  # [layers, d]: the last layer's.
      scale, bias = norm['scale'], norm['bias']
      scale[-1, 0], bias[-1, 0] = 0.0, 1.0
    if cfg.share_embeddings:
      params['shared_embedding']['embedding'][EOS_ID, 0] = margin
    else:
      params['output_projection']['kernel'][0, EOS_ID] = margin
  except (KeyError, IndexError, TypeError, ValueError):
    return params, False
  return params, True


def _decoders(model, *, max_decode_len: int, beam_size: int, alpha: float) -> dict[str, Callable]:
  """The four decoders, jitted: params, src [b, s] -> output ids [b, max_decode_len]."""
  decoders = {}
  for cache in (True, False):
    suffix = 'cached' if cache else 'uncached'
    decoders[f'greedy_{suffix}'] = jax.jit(
      functools.partial(
        decoding.greedy_decode, model, max_decode_len=max_decode_len, use_cache=cache
      )
    )
    decoders[f'beam_{suffix}'] = jax.jit(
      lambda params, src, cache=cache: decoding.beam_decode(
        model,
        params,
        src,
        beam_size=beam_size,
        alpha=alpha,
        max_decode_len=max_decode_len,
        use_cache=cache,
      )[0][:, 0]
    )  # Best beam.
  return decoders


def benchmark_decoding(
  name: str,
  model_config: TransformerConfig,
  params,
  sources: list[np.ndarray],
  *,
  max_decode_len: int,
  beam_size: int,
  alpha: float,
  note: str,
  **extra,
) -> dict:
  """Sentences/s and generated tokens/s of each decoder over `sources` (same-shape batches).

  The first batch is decoded once untimed (compilation), then every batch is timed.
  """
  model = Transformer(model_config)
  params = jax.device_put(params)
  modes = {}
  for mode, decoder in _decoders(
    model, max_decode_len=max_decode_len, beam_size=beam_size, alpha=alpha
  ).items():
    start = time.perf_counter()
    jax.block_until_ready(decoder(params, sources[0]))
    compile_seconds = time.perf_counter() - start
    outputs = []
    start = time.perf_counter()
    for src in sources:
      outputs.append(decoder(params, src))
    jax.block_until_ready(outputs)
    elapsed = time.perf_counter() - start
    outputs = np.concatenate([np.asarray(o) for o in outputs])
    sentences = outputs.shape[0]
    tokens = int((outputs != PAD_ID).sum())  # Every generated token, EOS included.
    modes[mode] = {
      'sentences_per_second': sentences / elapsed,
      'tokens_per_second': tokens / elapsed,
      'mean_output_tokens': tokens / sentences,
      'seconds': elapsed,
      'first_call_seconds': compile_seconds,
    }
  speedup = {
    kind: modes[f'{kind}_cached']['sentences_per_second']
    / modes[f'{kind}_uncached']['sentences_per_second']
    for kind in ('greedy', 'beam')
  }
  return {
    'model': name,
    'batch_size': int(sources[0].shape[0]),
    'batches': len(sources),
    'source_length': int(sources[0].shape[1]),
    'mean_source_tokens': float(np.mean([(s != PAD_ID).sum(1).mean() for s in sources])),
    'max_decode_len': max_decode_len,
    'beam_size': beam_size,
    'alpha': alpha,
    'note': note,
    'modes': modes,
    'cache_speedup': speedup,
    **extra,
  }


def trained_decoding(
  workdir: str, *, batch_size: int, batches: int, beam_size: int, alpha: float
) -> dict:
  """The trained model of a number-words workdir on the task's test sentences."""
  translator = Translator.from_checkpoint(workdir)
  saved = Workdir(workdir).read_run_config()['config']
  source_length, max_decode_len = saved['max_source_length'], saved['max_target_length']
  numbers = number_words.sample_numbers('test', batch_size * batches, seed=0)
  sentences = [number_words.english_words(n) for n in numbers]
  ids = [translator.tokenizer.encode(s)[: source_length - 1] + [EOS_ID] for s in sentences]
  sources = [
    input_pipeline.pad_batch(
      [
        {'inputs': np.asarray(i, np.int32), 'targets': np.zeros((0,), np.int32)}
        for i in ids[start : start + batch_size]
      ],
      source_length,
      1,
    )['inputs']
    for start in range(0, len(ids), batch_size)
  ]
  return benchmark_decoding(
    f'trained:{os.path.basename(os.path.normpath(workdir))}',
    translator.model_config,
    translator.params,
    sources,
    max_decode_len=max_decode_len,
    beam_size=beam_size,
    alpha=alpha,
    note=f'trained model of {workdir}, number-words test sentences, stops at EOS',
    trained=True,
    eos_suppressed=False,
  )
