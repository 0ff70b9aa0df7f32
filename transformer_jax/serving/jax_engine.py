"""The translation server's JAX engine: one `Translator` per batch bucket over one set of
parameters, every shape compiled at start-up, and a counter of XLA compilations per mode.

A batch of n sentences runs on the smallest bucket >= n (powers of two up to --max_batch_size);
sampling's d draws per sentence are rows too, so its batches are buckets of up to
max(1, --max_batch_size // d) sentences (`JaxEngine.batch_size_for`). With `Translator`'s own
length buckets (sources, target prefixes, greedy's scored outputs), `JaxEngine.warm_up`
compiles every program a request can need, once per mode --decoding serves
(`decoding_modes.Served.warm_up_options`), and `CompileCounter` (`jax.monitoring`) shows
/metrics, per mode, that none are compiled afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from transformer_jax.data.tokenizer import EOS_ID
from transformer_jax.inference import batches
from transformer_jax.inference.decoding import EXTRA_DECODE_LENGTH, source_bucket
from transformer_jax.inference.options import DecodingOptions, Hypothesis
from transformer_jax.inference.translator import AttentionMaps, PendingHypotheses, Translator
from transformer_jax.serving.batcher import Engine
from transformer_jax.serving.decoding_modes import Served


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
    # What the engine is running (`counting`): each compilation is counted under it too.
    self.mode = 'other'
    self.by_mode: collections.Counter[str] = collections.Counter()
    self.persistent_cache_hits = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event == self.EVENT:
      self.count += 1
      self.by_mode[self.mode] += 1
      self.seconds += duration
      logging.info('compiled %s in %.2f s', kwargs.get('fun_name'), duration)

  def _on_event(self, event: str, **kwargs) -> None:
    if event == self.CACHE_HIT:
      self.persistent_cache_hits += 1

  @contextlib.contextmanager
  def counting(self, mode: str):
    """Compilations until the end of the block count as `mode`'s."""
    previous, self.mode = self.mode, mode
    try:
      yield
    finally:
      self.mode = previous

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)


class JaxEngine(Engine):
  """`Translator`s sharing one set of parameters, one per batch size used: a batch runs on the
  smallest batch size that holds it (`batch_size_for`), so its shapes are among those
  `warm_up` compiled."""

  name = 'jax'
  has_attention = True
  # `launch` only dispatches (`Translator.launch_hypotheses`): the batcher keeps a batch in flight.
  overlaps = True

  def __init__(
    self, translator: Translator, max_batch_size: int, counter: CompileCounter | None = None
  ):
    self.max_batch_size = max_batch_size
    self.tokenizer = translator.tokenizer
    self.target_tokenizer = translator.target_tokenizer
    self.model_config = translator.model_config
    self.params = translator.params
    self.buckets = batch_buckets(max_batch_size)
    self.counter = counter
    self._translators: dict[int, Translator] = {}

  @classmethod
  def load(
    cls,
    workdir: str,
    checkpoint: int | str | None,
    max_batch_size: int,
    counter: CompileCounter | None = None,
    *,
    dtype: str | None = None,
  ) -> 'JaxEngine':
    """dtype: the inference dtype (`Translator`'s; None: the model's own). The parameters are
    cast once, here: every batch size's Translator (`_translator`) shares them, and the config
    that says so (no Translator casts them again)."""
    translator = Translator.from_checkpoint(workdir, checkpoint, max_batch_size, dtype=dtype)
    return cls(translator, max_batch_size, counter)

  def _translator(self, batch_size: int) -> Translator:
    """The Translator of that batch size (its programs are its own: one per size, shared)."""
    if batch_size not in self._translators:
      self._translators[batch_size] = Translator(
        self.model_config,
        self.params,
        self.tokenizer,
        batch_size=batch_size,
        target_tokenizer=self.target_tokenizer,
      )
    return self._translators[batch_size]

  def batch_size_for(self, sentences: int, options: DecodingOptions) -> int:
    """The Translator batch size (rows) for that many non-blank sentences: the smallest bucket
    that holds them; sampling's d draws each are rows, in buckets of up to
    max(1, max_batch_size // d) sentences (a larger batch is decoded a bucket at a time)."""
    draws = options.candidates if options.mode == 'sampling' else 1
    buckets = batch_buckets(max(1, self.max_batch_size // draws))
    fitting = [size for size in buckets if size >= sentences]
    return (fitting[0] if fitting else buckets[-1]) * draws

  def length(self, sentence: str) -> int:
    return len(self.tokenizer.encode(sentence))

  def length_buckets(self) -> list[int]:
    max_len = self.model_config.max_len
    return sorted({source_bucket(n, max_len) for n in range(1, max_len + 1)})

  def check(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
  ) -> None:
    """A prefix that cannot fit its sentence: refused before it is queued (in a batch it would
    fail every request of the batch)."""
    if target_prefix is not None:
      jobs = batches.encode_sources(sentences, self.tokenizer, self.model_config.max_len)
      name = lambda index: f'"target_prefix"[{index}]'  # noqa: E731
      batches.add_prefixes(jobs, target_prefix, self.target_tokenizer, len(sentences), name)

  def decode(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    draw_positions: Sequence[int],
  ) -> list[list[Hypothesis]]:
    return self.finish(self.launch(sentences, options, target_prefix, draw_positions))

  def launch(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    draw_positions: Sequence[int],
  ) -> tuple[str, Translator, PendingHypotheses]:
    """Dispatches the batch (its first Translator batch: sampling's may need several) and
    returns; `finish` reads it back."""
    rows = sum(1 for sentence in sentences if sentence.strip())  # Blank ones are not decoded.
    if rows > self.max_batch_size:
      raise ValueError(f'{rows} sentences in one batch; at most {self.max_batch_size}')
    translator = self._translator(self.batch_size_for(rows, options))
    with self._counting(options.mode):  # jit compiles when it dispatches.
      pending = translator.launch_hypotheses(
        list(sentences),
        options.beam_size,
        options.alpha,
        target_prefix=target_prefix,
        draw_positions=draw_positions,
        **_other_fields(options),
      )
    return options.mode, translator, pending

  def finish(self, launched: tuple[str, Translator, PendingHypotheses]) -> list[list[Hypothesis]]:
    mode, translator, pending = launched
    with self._counting(mode):  # It dispatches the batch's other Translator batches, if any.
      return translator.finish_hypotheses(pending)

  def _counting(self, mode: str):
    return self.counter.counting(mode) if self.counter else contextlib.nullcontext()

  def warm_up(self, served: Served) -> None:
    """Decodes one sentence per (served mode, batch size, length bucket, prefix bucket)
    (`Translator.hypotheses`, which decodes greedy with its log-probabilities in one loop)."""
    sentences = [self._sentence_of(length) for length in self.length_buckets()]
    for options, prefixed in served.warm_up_options():
      sizes = sorted({self.batch_size_for(n, options) for n in range(1, self.max_batch_size + 1)})
      for size in sizes:
        translator = self._translator(size)
        began = time.perf_counter()
        with self._counting(options.mode):
          for sentence in sentences:
            for prefix in self._prefixes(sentence) if prefixed else [None]:
              translator.hypotheses(
                [sentence],
                options.beam_size,
                options.alpha,
                target_prefix=None if prefix is None else [prefix],
                **_other_fields(options),
              )
        logging.info(
          'warmed up %s%s batch size %d in %.2f s',
          options,
          ' with prefixes' if prefixed else '',
          size,
          time.perf_counter() - began,
        )
    with self._counting('attention'):
      self._attention(sentences[0], sentences[0])

  def _prefixes(self, source: str) -> list[str]:
    """A target prefix per prefix length bucket a prefix of `source` can reach: the longest
    its cap allows in the bucket (the EOS needs room: at most cap - 1 pieces). A source of the
    longest length of its bucket has its bucket's largest cap, so it reaches every prefix
    bucket any batch of that source bucket can hold."""
    max_len = self.model_config.max_len
    cap = min(self.length(source) + 1 + EXTRA_DECODE_LENGTH, max_len)
    found = []
    for bucket in self.length_buckets():
      pieces = min(bucket, cap - 1)
      if source_bucket(pieces, max_len) == bucket:
        found.append(self._sentence_of(pieces + 1, self.target_tokenizer))
    return found

  def _sentence_of(self, length: int, tokenizer=None) -> str:
    """A sentence of `length` - 1 pieces (with EOS: `length` tokens), one word repeated."""
    tokenizer = tokenizer or self.tokenizer
    for piece in range(EOS_ID + 1, tokenizer.vocab_size):
      word = tokenizer.decode([piece]).strip()
      if not word or any(char.isspace() for char in word):
        continue
      sentence = ' '.join([word] * (length - 1))
      if len(tokenizer.encode(sentence)) == length - 1:
        return sentence
    raise RuntimeError(f'no warm-up sentence of {length} tokens in this vocabulary')

  def attention(self, source: str, beam_size: int, alpha: float) -> dict[str, Any]:
    """The translation of `source` and its cross-attention, [layers][heads][target][source]."""
    # hypotheses, as requests decode: the programs warm_up compiled (greedy's included).
    (found,) = self._translator(self.buckets[0]).hypotheses([source], beam_size, alpha)
    target = found[0].text if found else ''
    maps = self._attention(source, target)
    return {
      'translation': target,
      'source_tokens': maps.source_tokens,
      'target_tokens': maps.target_tokens,
      'cross_attention': np.round(maps.cross.astype(np.float64), 5).tolist(),
    }

  def _attention(self, source: str, target: str) -> AttentionMaps:
    # At one shape, (1, max_len) on both sides: one compiled program serves every sentence.
    translator = self._translator(self.buckets[0])
    return translator.attention(source, target, pad_to=self.model_config.max_len)


def _other_fields(options: DecodingOptions) -> dict[str, Any]:
  """The options' fields but beam_size and alpha, as Translator.hypotheses' keywords."""
  fields = dataclasses.asdict(options)
  del fields['beam_size'], fields['alpha']
  return fields
