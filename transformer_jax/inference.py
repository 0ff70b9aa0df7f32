"""Inference with a trained model: source ids -> output ids, and text -> text.

`greedy_decode` / `beam_decode` bind the model to the model-agnostic search in `decode.py`.
`Translator` restores a workdir's config, vocabulary and parameters (`from_checkpoint`) and
translates lists of sentences; `Translator.attention` returns its attention maps;
`translate_text` is the `translate` command's work (lines in, one translation per line out).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import IO, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax import decode, paths, text_io
from transformer_jax.checkpointing import (
  Checkpointer,
  is_params_checkpoint,
  read_metadata,
  restore_params_from,
)
from transformer_jax.config import TransformerConfig
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.decode import strip_after_eos
from transformer_jax.decoding_cache import extend_cache, reorder_beams, unstack_decoder_layers
from transformer_jax.errors import UserInputError, is_integer, is_number
from transformer_jax.models import Transformer
from transformer_jax.progress import Progress
from transformer_jax.workdir import Workdir


def init_cache(
  model: Transformer,
  params,
  encoded: jax.Array,
  src_ids: jax.Array,
  max_decode_len: int,
  beam_size: int = 1,
):
  """Creates the decoding cache (`Transformer.create_cache`) of src_ids.shape[0] sentences,
  beam_size rows each: empty self-attention keys/values for `max_decode_len` positions and the
  cross-attention keys/values projected once per sentence from the encoder output."""
  del src_ids  # The steps read it: the cache holds only what the encoder output gives.
  _, variables = model.apply(
    {'params': params},
    encoded,
    max_decode_len=max_decode_len,
    beam_size=beam_size,
    mutable=['cache'],
    method=Transformer.create_cache,
  )
  return variables['cache']


# The self-attention cache of beam search's first steps; it doubles, up to the decode length.
_FIRST_CACHE_LENGTH = 8


def _cache_lengths(max_decode_len) -> tuple:
  """Cached beam search's cache lengths, each a loop of its own (`decode.beam_search`'s
  cache_lengths): 8, 16, 32, ... below max_decode_len, then max_decode_len, which replaces
  the last power of two if that is within 25% of it (64 for 66: a loop compiled for 2 steps).
  A symbolic length (jax.export) gets one loop."""
  if not isinstance(max_decode_len, int):
    return (max_decode_len,)
  lengths, length = [], _FIRST_CACHE_LENGTH
  while length < max_decode_len:
    lengths.append(length)
    length *= 2
  if lengths and 1.25 * lengths[-1] >= max_decode_len:
    lengths.pop()
  return (*lengths, max_decode_len)


def _cached_step_fn(model: Transformer, params, src_ids: jax.Array) -> decode.StepFn:
  """The searches' step: tokens [rows, 1] and the cache -> (logits [rows, v], new cache), for
  rows = b sentences (src_ids [b, s]) x the cache's beams."""
  params = unstack_decoder_layers(params)  # Once, outside the search loop.

  def step_fn(token_ids, cache):
    logits, variables = model.apply(
      {'params': params, 'cache': cache},
      None,  # The encoder output: the cache holds its keys and values.
      src_ids,
      token_ids,
      use_cache=True,
      mutable=['cache'],
      method=Transformer.decode,
    )
    return logits[:, -1], variables['cache']

  return step_fn


def greedy_decode(
  model: Transformer, params, src_ids: jax.Array, *, max_decode_len: int, use_cache: bool = True
) -> jax.Array:
  """Greedy translation of a batch of source ids [b, s] -> output ids [b, max_decode_len].

  Rows end with EOS followed by padding. Call under jit (`max_decode_len`, `use_cache` static).
  """
  batch_size = src_ids.shape[0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  if use_cache:
    # One cache length: greedy's cache is beam_size times smaller than beam search's, and
    # growing it (`_cache_lengths`) measured no faster, for one more compiled loop per length.
    return decode.greedy_search(
      _cached_step_fn(model, params, src_ids),
      init_cache(model, params, encoded, src_ids, max_decode_len),
      batch_size=batch_size,
      max_decode_len=max_decode_len,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      pad_id=PAD_ID,
    )

  def logits_fn(target_input_ids):
    return model.apply(
      {'params': params}, encoded, src_ids, target_input_ids, method=Transformer.decode
    )

  return decode.greedy_search_uncached(
    logits_fn,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
  )


def beam_decode(
  model: Transformer,
  params,
  src_ids: jax.Array,
  *,
  beam_size: int,
  alpha: float,
  max_decode_len: int,
  max_lengths: jax.Array | None = None,
  use_cache: bool = True,
  rule: str = 'exact',
) -> tuple[jax.Array, jax.Array]:
  """Beam search: source ids [b, s] -> (ids [b, beam, max_decode_len], scores [b, beam]).

  Best hypothesis first; scores are log-probabilities divided by the GNMT length penalty.
  `max_lengths` [b] caps each sentence's output (e.g. its source length + 50). `rule`:
  decode.BEAM_RULES ('ctranslate2' ends and stops as CTranslate2 does; decode.beam_search).
  """
  batch_size = src_ids.shape[0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  common = dict(
    batch_size=batch_size,
    beam_size=beam_size,
    max_decode_len=max_decode_len,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    alpha=alpha,
    max_lengths=max_lengths,
    rule=rule,
  )
  if use_cache:
    cache_lengths = _cache_lengths(max_decode_len)
    # Made for batch * beam rows; its keys/values are never gathered, only its beam table.
    cache = init_cache(model, params, encoded, src_ids, cache_lengths[0], beam_size)
    return decode.beam_search(
      _cached_step_fn(model, params, src_ids),
      cache,
      reorder_cache=reorder_beams,
      cache_lengths=cache_lengths if len(cache_lengths) > 1 else (),
      extend_cache=extend_cache,
      **common,
    )

  # The uncached decoder runs on batch * beam rows; the source side is the same for every beam.
  beam_encoded, beam_src = decode.expand_to_beams((encoded, src_ids), beam_size, batch_size)

  def logits_fn(target_input_ids):
    return model.apply(
      {'params': params}, beam_encoded, beam_src, target_input_ids, method=Transformer.decode
    )

  return decode.beam_search_uncached(logits_fn, **common)


# Source lengths are padded to powers of two from this one (source_bucket).
MIN_SOURCE_BUCKET = 8
# Extra target positions beyond the source length that decoding may use.
EXTRA_DECODE_LENGTH = 50


def source_bucket(length: int, limit: int) -> int:
  """Smallest power of two >= length (at least 8, at most limit): few shapes, few compiles."""
  bucket = MIN_SOURCE_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, limit)


@dataclasses.dataclass(frozen=True)
class AttentionMaps:
  """Attention weights of one sentence pair, per layer and head (rows: queries, sum to 1).

  Tokens are SentencePiece pieces; each side ends with '</s>'. The decoder's query at target
  position i reads target pieces 0..i-1 (and BOS) and predicts target piece i.
  """

  source_tokens: list[str]
  target_tokens: list[str]
  encoder_self: np.ndarray  # [layers, heads, source, source]
  decoder_self: np.ndarray  # [layers, heads, target, target]
  cross: np.ndarray  # [layers, heads, target, source]


def check_decoding_options(
  beam_size: int = 4, alpha: float = 0.6, batch_size: int = 64, beam_rule: str = 'exact'
) -> None:
  """One-line errors for impossible decoding settings, raised before any checkpoint is read."""
  if beam_rule not in decode.BEAM_RULES:
    raise UserInputError(f'beam_rule must be one of {decode.BEAM_RULES}, got {beam_rule!r}')
  if not is_integer(beam_size) or beam_size < 1:
    raise UserInputError(f'beam_size must be a positive integer, got {beam_size!r}')
  if not is_number(alpha) or not 0 <= alpha < float('inf'):
    raise UserInputError(f'alpha must be a finite number >= 0, got {alpha!r}')
  if not is_integer(batch_size) or batch_size < 1:
    raise UserInputError(f'batch_size must be a positive integer, got {batch_size!r}')


class Translator:
  """Translation with a restored model: `.translate(list_of_str) -> list_of_str` (beam search,
  or greedy with beam_size=1)."""

  def __init__(
    self,
    model_config: TransformerConfig,
    params,
    tokenizer: Tokenizer,
    batch_size: int = 64,
    target_tokenizer: Tokenizer | None = None,
  ):
    """target_tokenizer: segments given targets (`attention`) where the workdir has its own
    target segmentation (Workdir.target_vocab_file); tokenizer does everything else."""
    check_decoding_options(batch_size=batch_size)
    self.model_config = model_config
    self.model = Transformer(model_config)
    self.params = params
    self.tokenizer = tokenizer
    self.target_tokenizer = target_tokenizer or tokenizer
    self.batch_size = batch_size
    self._greedy = jax.jit(
      lambda params, src, max_decode_len: greedy_decode(
        self.model, params, src, max_decode_len=max_decode_len
      ),
      static_argnums=(2,),
    )
    self._beam = jax.jit(
      lambda params, src, max_lengths, beam_size, alpha, max_decode_len, rule: beam_decode(
        self.model,
        params,
        src,
        beam_size=beam_size,
        alpha=alpha,
        max_decode_len=max_decode_len,
        max_lengths=max_lengths,
        rule=rule,
      )[0][:, 0],
      static_argnums=(3, 4, 5, 6),
    )

  @classmethod
  def from_checkpoint(
    cls, workdir: str, checkpoint: int | str | None = None, batch_size: int = 64
  ) -> 'Translator':
    """Loads the config, vocabulary and parameters of a workdir.

    checkpoint: a step number, 'averaged' (written by `python -m transformer_jax.average`),
    'latest', or None: the averaged checkpoint if it was made from the latest training
    checkpoint, else the latest training checkpoint, else (an imported model not fine-tuned
    yet) the imported parameters.
    """
    check_decoding_options(batch_size=batch_size)
    workdir = Workdir(workdir)
    saved = workdir.read_run_config()
    model_config = TransformerConfig.from_dict(saved['model'])
    if model_config.attention_impl == 'cudnn' and jax.default_backend() != 'gpu':
      # Trained with the GPU kernel: the same parameters translate anywhere through XLA's.
      model_config = model_config.replace(attention_impl='xla')
    tokenizer = Tokenizer.load(workdir.vocab_file)
    if tokenizer.vocab_size != model_config.vocab_size:
      raise UserInputError(
        f'{tokenizer.path}: vocabulary has {tokenizer.vocab_size} pieces but '
        f'the model in {workdir.config_file} expects {model_config.vocab_size}'
      )
    model = Transformer(model_config)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dummy = jnp.ones((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dummy, dummy))
    abstract_params = jax.tree_util.tree_map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
      nn.meta.unbox(abstract['params']),
    )
    params = _restore(workdir, checkpoint, abstract_params)
    target_file = workdir.target_vocab_file
    target_tokenizer = Tokenizer.load(target_file) if target_file.exists() else None
    return cls(model_config, params, tokenizer, batch_size, target_tokenizer)

  def translate(
    self,
    sentences: Sequence[str],
    beam_size: int = 4,
    alpha: float = 0.6,
    *,
    beam_rule: str = 'exact',
    progress: bool = False,
  ) -> list[str]:
    """One translation per input sentence, in order. Empty input gives empty output.

    beam_size 1 is greedy decoding; otherwise beam search with the GNMT length penalty
    ((5 + len) / 6)^alpha (the paper: beam 4, alpha 0.6). Outputs are at most the source length
    + 50 tokens and at most the model's max_len, EOS counted on both sides. Sentences are sorted
    by length into batches and returned in the original order. `beam_rule`: decode.BEAM_RULES
    ('ctranslate2': CTranslate2's search, see decode.beam_search). `progress`: reports sentences
    translated, batch by batch, with rate and ETA (for files; see `progress.py`).
    """
    if isinstance(sentences, (str, bytes)):
      # A str is a sequence too: it would be translated character by character.
      raise TypeError(
        'Translator.translate takes a list of sentences, got a single '
        f'{type(sentences).__name__}; pass [sentence]'
      )
    check_decoding_options(beam_size, alpha, beam_rule=beam_rule)  # batch_size: in __init__.
    max_len = self.model_config.max_len
    encoded: list[list[int] | None] = []
    for index, sentence in enumerate(sentences):
      if not isinstance(sentence, str):
        raise UserInputError(
          f'Translator.translate: sentence {index} is {type(sentence).__name__}, not str'
        )
      if not sentence.strip():
        encoded.append(None)
        continue
      ids = self.tokenizer.encode(sentence)
      if len(ids) + 1 > max_len:
        logging.warning(
          'sentence %d has %d tokens; truncated to the model maximum %d',
          index,
          len(ids) + 1,
          max_len,
        )
        ids = ids[: max_len - 1]
      encoded.append(ids + [EOS_ID])
    outputs = [''] * len(sentences)
    # Sorting by length keeps padding (and the number of distinct shapes) small.
    order = sorted(
      (i for i, ids in enumerate(encoded) if ids is not None), key=lambda i: len(encoded[i])
    )

    # Blank lines are translated already (to blank lines): counted from the start.
    bar = Progress(
      total=len(sentences),
      initial=len(sentences) - len(order),
      unit='sentences',
      description='translating',
      enabled=None if progress else False,
    )
    for start in range(0, len(order), self.batch_size):
      rows = order[start : start + self.batch_size]
      source_length = source_bucket(max(len(encoded[i]) for i in rows), max_len)
      src = np.full((self.batch_size, source_length), PAD_ID, np.int32)
      max_lengths = np.ones((self.batch_size,), np.int32)
      for row, index in enumerate(rows):
        src[row, : len(encoded[index])] = encoded[index]
        max_lengths[row] = len(encoded[index]) + EXTRA_DECODE_LENGTH
      max_decode_len = min(max_len, source_length + EXTRA_DECODE_LENGTH)
      max_lengths = np.minimum(max_lengths, max_decode_len)
      if beam_size == 1:
        tokens = self._greedy(self.params, src, max_decode_len)
      else:
        tokens = self._beam(
          self.params, src, max_lengths, beam_size, float(alpha), max_decode_len, beam_rule
        )
      outputs_ids = strip_after_eos(np.asarray(tokens), EOS_ID, pad_id=PAD_ID)
      for row, (index, ids) in enumerate(zip(rows, outputs_ids)):
        # Greedy search runs to the batch's longest cap; each output keeps its own (the
        # cap counts the EOS, as beam search's does).
        outputs[index] = self.tokenizer.decode(ids[: max_lengths[row] - 1])
      bar.update(len(rows))
    bar.close()
    return outputs

  def attention(
    self, source: str, target: str | None = None, beam_size: int = 4, alpha: float = 0.6
  ) -> AttentionMaps:
    """The model's attention weights for `source` and its translation `target`.

    Without `target` the sentence is translated first (beam search, as `translate`), so the
    maps show what the model attended to while producing its own output.
    """
    if target is None:
      target = self.translate([source], beam_size=beam_size, alpha=alpha)[0]
    max_len = self.model_config.max_len
    source_ids = (self.tokenizer.encode(source)[: max_len - 1]) + [EOS_ID]
    target_ids = (self.target_tokenizer.encode(target)[: max_len - 1]) + [EOS_ID]
    src = np.asarray([source_ids], np.int32)  # [1, s]
    decoder_inputs = np.asarray([[BOS_ID] + target_ids[:-1]], np.int32)  # [1, t]
    _, state = self._attention_apply(self.params, src, decoder_inputs)
    weights = state['intermediates']

    def layers_heads(module: str, name: str) -> np.ndarray:
      # Sown once per scanned call: [layers, batch=1, heads, queries, keys] -> drop the batch.
      (sown,) = weights[module][name]['attention_weights']
      return np.asarray(sown, np.float32)[:, 0]

    return AttentionMaps(
      source_tokens=self.tokenizer.pieces(source_ids[:-1]) + ['</s>'],
      target_tokens=self.tokenizer.pieces(target_ids[:-1]) + ['</s>'],
      encoder_self=layers_heads('encoder_layers', 'self_attention'),
      decoder_self=layers_heads('decoder_layers', 'self_attention'),
      cross=layers_heads('decoder_layers', 'cross_attention'),
    )

  @functools.cached_property
  def _attention_apply(self):
    return jax.jit(
      lambda params, src, tgt_in: self.model.apply(
        {'params': params}, src, tgt_in, mutable=['intermediates']
      )
    )


def _restore(workdir: Workdir, checkpoint: int | str | None, abstract_params):
  if not (checkpoint in (None, 'averaged', 'latest') or is_integer(checkpoint)):
    raise UserInputError(
      f"checkpoint must be a step number, 'averaged' or 'latest', got {checkpoint!r}"
    )
  averaged = workdir.averaged
  with Checkpointer(workdir.checkpoints, keep=None, async_save=False) as checkpointer:
    if checkpoint == 'averaged' or (checkpoint is None and is_params_checkpoint(averaged)):
      if not is_params_checkpoint(averaged):
        raise FileNotFoundError(
          f'no averaged checkpoint in {averaged}: run '
          f'`python -m transformer_jax.average --workdir={workdir.path}`'
        )
      made_from = read_metadata(averaged).get('latest_step')
      latest = checkpointer.latest_step()
      if checkpoint == 'averaged' or made_from == latest:
        logging.info(
          'loading the average of checkpoints %s from %s',
          read_metadata(averaged).get('averaged_steps'),
          averaged,
        )
        return restore_params_from(averaged, abstract_params)
      logging.warning(
        '%s was made up to step %s but the latest checkpoint is %s; loading the '
        'latest (rerun transformer_jax.average to refresh it)',
        averaged,
        made_from,
        latest,
      )
    step = None if checkpoint in (None, 'latest') else int(checkpoint)
    if (
      step is None and checkpointer.latest_step() is None and is_params_checkpoint(workdir.imported)
    ):
      # An imported model not fine-tuned yet (`imported_workdir`): its parameters are the latest.
      logging.info('loading the imported model from %s', workdir.imported)
      return restore_params_from(workdir.imported, abstract_params)
    return checkpointer.restore_params(abstract_params, step)


def translate_text(
  workdir: str,
  *,
  checkpoint: int | str | None = None,
  batch_size: int = 64,
  beam_size: int = 4,
  alpha: float = 0.6,
  beam_rule: str = 'exact',
  input_path: str | None = None,
  output_path: str | None = None,
  stdin: IO[bytes] | None = None,
  stdout: IO[str] | None = None,
) -> None:
  """The `translate` command: one translation per input line, in order (empty in, empty out).

  Reads `input_path` (or stdin) and writes `output_path` (or stdout). When stdin is a
  terminal, translates each line as soon as it is typed. Bytes that are not UTF-8 become
  U+FFFD instead of ending the run.
  """
  stdin = stdin or sys.stdin.buffer
  stdout = stdout or sys.stdout
  check_decoding_options(beam_size, alpha, batch_size, beam_rule)
  if input_path is not None:
    text_io.check_readable_file(input_path, '--input')
  if output_path is not None:  # Before any work: translations with nowhere to go are lost.
    text_io.check_writable_output(output_path, '--output')
  translator = Translator.from_checkpoint(workdir, checkpoint, batch_size)
  if input_path is None and stdin.isatty():
    print('Type a sentence and press Enter (Ctrl-D to quit).', file=sys.stderr)
    for raw in stdin:
      (translation,) = translator.translate(
        [text_io.decode_line(raw)], beam_size, alpha, beam_rule=beam_rule
      )
      print(translation, file=stdout, flush=True)
    return
  if input_path is not None:
    with paths.resolve(input_path, '--input').open('rb') as f:
      lines = [text_io.decode_line(raw) for raw in f]
  else:
    lines = [text_io.decode_line(raw) for raw in stdin]
  translations = translator.translate(
    lines, beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, progress=True
  )
  text_io.write_lines(translations, output_path, stdout)
