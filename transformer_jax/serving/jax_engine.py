"""The translation server's JAX engine: one `Translator` per batch bucket over one set of
parameters, every shape compiled at start-up, and a counter of XLA compilations.

A batch of n sentences runs on the smallest bucket >= n (powers of two up to --max_batch_size);
with `Translator`'s own length buckets, `JaxEngine.warm_up` compiles every program a request
can need, once per served (beam_size, alpha) pair, and `CompileCounter` (`jax.monitoring`)
shows /metrics that none are compiled afterwards.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from transformer_jax.data.tokenizer import EOS_ID
from transformer_jax.inference.decoding import source_bucket
from transformer_jax.inference.translator import AttentionMaps, Translator
from transformer_jax.serving.batcher import DecodingKey, Engine


def batch_buckets(max_batch_size: int) -> list[int]:
  """Powers of two below max_batch_size, then max_batch_size: at most 2x padding."""
  buckets = [1]
  while buckets[-1] * 2 < max_batch_size:
    buckets.append(buckets[-1] * 2)
  return sorted(set(buckets + [max_batch_size]))


class CompileCounter:
  """Counts XLA compilations in this process (each executable built, or loaded from JAX's
  persistent cache), through `jax.monitoring`'s backend-compile duration event."""

  EVENT = '/jax/core/compile/backend_compile_duration'
  CACHE_HIT = '/jax/compilation_cache/cache_hits'

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self.persistent_cache_hits = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event == self.EVENT:
      self.count += 1
      self.seconds += duration
      logging.info('compiled %s in %.2f s', kwargs.get('fun_name'), duration)

  def _on_event(self, event: str, **kwargs) -> None:
    if event == self.CACHE_HIT:
      self.persistent_cache_hits += 1

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)


class JaxEngine(Engine):
  """`Translator`s sharing one set of parameters, one per batch bucket: a batch of n sentences
  runs on the smallest bucket >= n, so its shapes are among those `warm_up` compiled."""

  name = 'jax'
  has_attention = True

  def __init__(self, translator: Translator, max_batch_size: int):
    self.max_batch_size = max_batch_size
    self.tokenizer = translator.tokenizer
    self.model_config = translator.model_config
    self.params = translator.params
    self.buckets = batch_buckets(max_batch_size)
    self._translators = {
      size: Translator(
        self.model_config,
        self.params,
        self.tokenizer,
        batch_size=size,
        target_tokenizer=translator.target_tokenizer,
      )
      for size in self.buckets
    }

  @classmethod
  def load(cls, workdir: str, checkpoint: int | str | None, max_batch_size: int) -> 'JaxEngine':
    return cls(Translator.from_checkpoint(workdir, checkpoint, max_batch_size), max_batch_size)

  def length(self, sentence: str) -> int:
    return len(self.tokenizer.encode(sentence))

  def length_buckets(self) -> list[int]:
    max_len = self.model_config.max_len
    return sorted({source_bucket(n, max_len) for n in range(1, max_len + 1)})

  def translate(self, sentences: Sequence[str], beam_size: int, alpha: float) -> list[str]:
    rows = sum(1 for sentence in sentences if sentence.strip())  # Blank ones are not decoded.
    if rows > self.max_batch_size:
      raise ValueError(f'{rows} sentences in one batch; at most {self.max_batch_size}')
    size = next(size for size in self.buckets if size >= rows)
    return self._translators[size].translate(list(sentences), beam_size=beam_size, alpha=alpha)

  def warm_up(self, options: Sequence[DecodingKey]) -> None:
    """Decodes one sentence per (decoding option, batch bucket, length bucket)."""
    sentences = [self._sentence_of(length) for length in self.length_buckets()]
    for beam_size, alpha in options:
      for size, translator in self._translators.items():
        for sentence in sentences:
          began = time.perf_counter()
          translator.translate([sentence], beam_size=beam_size, alpha=alpha)
          logging.info(
            'warmed up beam_size=%d alpha=%g batch %d length %d in %.2f s',
            beam_size,
            alpha,
            size,
            self.length(sentence) + 1,
            time.perf_counter() - began,
          )
    self._attention(sentences[0], sentences[0])

  def _sentence_of(self, length: int) -> str:
    """A sentence of `length` - 1 pieces (with EOS: `length` tokens), one word repeated."""
    for piece in range(EOS_ID + 1, self.tokenizer.vocab_size):
      word = self.tokenizer.decode([piece]).strip()
      if not word or any(char.isspace() for char in word):
        continue
      sentence = ' '.join([word] * (length - 1))
      if self.length(sentence) == length - 1:
        return sentence
    raise RuntimeError(f'no warm-up sentence of {length} tokens in this vocabulary')

  def attention(self, source: str, beam_size: int, alpha: float) -> dict[str, Any]:
    """The translation of `source` and its cross-attention, [layers][heads][target][source]."""
    (target,) = self._translators[self.buckets[0]].translate([source], beam_size, alpha)
    maps = self._attention(source, target)
    return {
      'translation': target,
      'source_tokens': maps.source_tokens,
      'target_tokens': maps.target_tokens,
      'cross_attention': np.round(maps.cross.astype(np.float64), 5).tolist(),
    }

  def _attention(self, source: str, target: str) -> AttentionMaps:
    # At one shape, (1, max_len) on both sides: one compiled program serves every sentence.
    translator = self._translators[self.buckets[0]]
    return translator.attention(source, target, pad_to=self.model_config.max_len)
