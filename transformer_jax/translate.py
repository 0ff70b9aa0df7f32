"""Translate with a trained workdir: `Translator` in Python, `python -m transformer_jax.translate`.

    python -m transformer_jax.translate --workdir=DIR < source.txt > hypotheses.txt

Reads one sentence per line from stdin (or --input) and writes exactly one translation per
line to stdout (or --output), in order (an empty line gives an empty line). When stdin is a
terminal, translates each line as it is typed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from transformer_jax import inference
from transformer_jax.average import averaged_dir
from transformer_jax.checkpointing import (Checkpointer, CorruptCheckpointError,
                                           is_params_checkpoint, read_metadata,
                                           restore_params_from)
from transformer_jax.config import TransformerConfig, UserInputError, is_integer, is_number
from transformer_jax.decode import strip_after_eos
from transformer_jax.metric_writers import quiet_library_logs
from transformer_jax.models import Transformer
from transformer_jax.run_config import CONFIG_FILE
from transformer_jax.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

_MIN_BUCKET = 8
# Extra target positions beyond the source length that decoding may use.
_EXTRA_DECODE_LENGTH = 50


def _bucket(length: int, limit: int) -> int:
  """Smallest power of two >= length (at least 8, at most limit): few shapes, few compiles."""
  bucket = _MIN_BUCKET
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


def check_decoding_options(beam_size: int = 4, alpha: float = 0.6, batch_size: int = 64) -> None:
  """One-line errors for impossible decoding settings, raised before any checkpoint is read."""
  if not is_integer(beam_size) or beam_size < 1:
    raise UserInputError(f'beam_size must be a positive integer, got {beam_size!r}')
  if not is_number(alpha) or not alpha >= 0:
    raise UserInputError(f'alpha must be a number >= 0, got {alpha!r}')
  if not is_integer(batch_size) or batch_size < 1:
    raise UserInputError(f'batch_size must be a positive integer, got {batch_size!r}')


class Translator:
  """Translation with a restored model: `.translate(list_of_str) -> list_of_str` (beam search,
  or greedy with beam_size=1)."""

  def __init__(self, model_config: TransformerConfig, params, tokenizer: Tokenizer,
               batch_size: int = 64):
    check_decoding_options(batch_size=batch_size)
    self.model_config = model_config
    self.model = Transformer(model_config)
    self.params = params
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self._greedy = jax.jit(
        lambda params, src, max_decode_len: inference.greedy_decode(
            self.model, params, src, max_decode_len=max_decode_len),
        static_argnums=(2,))
    self._beam = jax.jit(
        lambda params, src, max_lengths, beam_size, alpha, max_decode_len: inference.beam_decode(
            self.model, params, src, beam_size=beam_size, alpha=alpha,
            max_decode_len=max_decode_len, max_lengths=max_lengths)[0][:, 0],
        static_argnums=(3, 4, 5))

  @classmethod
  def from_checkpoint(cls, workdir: str, checkpoint: int | str | None = None,
                      batch_size: int = 64) -> 'Translator':
    """Loads the config, vocabulary and parameters of a workdir.

    checkpoint: a step number, 'averaged' (written by `python -m transformer_jax.average`),
    'latest', or None: the averaged checkpoint if it was made from the latest training
    checkpoint, else the latest training checkpoint.
    """
    check_decoding_options(batch_size=batch_size)
    config_path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(config_path):
      raise FileNotFoundError(f'{config_path} not found: is {workdir} a training workdir?')
    with open(config_path) as f:
      try:
        saved = json.load(f)
      except json.JSONDecodeError as error:
        raise UserInputError(f'{config_path}: not valid JSON ({error})') from None
    model_config = TransformerConfig.from_dict(saved['model'])
    if model_config.attention_impl == 'cudnn' and jax.default_backend() != 'gpu':
      # Trained with the GPU kernel: the same parameters translate anywhere through XLA's.
      model_config = model_config.replace(attention_impl='xla')
    tokenizer = Tokenizer.load(os.path.join(workdir, 'vocab.model'))
    if tokenizer.vocab_size != model_config.vocab_size:
      raise UserInputError(f'{tokenizer.path}: vocabulary has {tokenizer.vocab_size} pieces but '
                           f'the model in {config_path} expects {model_config.vocab_size}')
    model = Transformer(model_config)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dummy = jnp.ones((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dummy, dummy))
    abstract_params = jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        nn.meta.unbox(abstract['params']))
    params = _restore(workdir, checkpoint, abstract_params)
    return cls(model_config, params, tokenizer, batch_size)

  def translate(self, sentences: Sequence[str], beam_size: int = 4,
                alpha: float = 0.6) -> list[str]:
    """One translation per input sentence, in order. Empty input gives empty output.

    beam_size 1 is greedy decoding; otherwise beam search with the GNMT length penalty
    ((5 + len) / 6)^alpha (the paper: beam 4, alpha 0.6). Outputs are at most the source length
    + 50 tokens (and the model's max_len). Sentences are sorted by length into batches and
    returned in the original order.
    """
    if isinstance(sentences, (str, bytes)):
      # A str is a sequence too: it would be translated character by character.
      raise TypeError('Translator.translate takes a list of sentences, got a single '
                      f'{type(sentences).__name__}; pass [sentence]')
    check_decoding_options(beam_size, alpha)  # batch_size was checked in __init__.
    max_len = self.model_config.max_len
    encoded: list[list[int] | None] = []
    for index, sentence in enumerate(sentences):
      if not sentence.strip():
        encoded.append(None)
        continue
      ids = self.tokenizer.encode(sentence)
      if len(ids) + 1 > max_len:
        logging.warning('sentence %d has %d tokens; truncated to the model maximum %d',
                        index, len(ids) + 1, max_len)
        ids = ids[:max_len - 1]
      encoded.append(ids + [EOS_ID])
    outputs = [''] * len(sentences)
    # Sorting by length keeps padding (and the number of distinct shapes) small.
    order = sorted((i for i, ids in enumerate(encoded) if ids is not None),
                   key=lambda i: len(encoded[i]))
    for start in range(0, len(order), self.batch_size):
      rows = order[start:start + self.batch_size]
      source_length = _bucket(max(len(encoded[i]) for i in rows), max_len)
      src = np.full((self.batch_size, source_length), PAD_ID, np.int32)
      max_lengths = np.ones((self.batch_size,), np.int32)
      for row, index in enumerate(rows):
        src[row, :len(encoded[index])] = encoded[index]
        max_lengths[row] = len(encoded[index]) + _EXTRA_DECODE_LENGTH
      max_decode_len = min(max_len, source_length + _EXTRA_DECODE_LENGTH)
      if beam_size == 1:
        tokens = self._greedy(self.params, src, max_decode_len)
      else:
        tokens = self._beam(self.params, src, np.minimum(max_lengths, max_decode_len),
                            beam_size, float(alpha), max_decode_len)
      for row, ids in zip(rows, strip_after_eos(np.asarray(tokens), EOS_ID, pad_id=PAD_ID)):
        outputs[row] = self.tokenizer.decode(ids)
    return outputs


  def attention(self, source: str, target: str | None = None, beam_size: int = 4,
                alpha: float = 0.6) -> AttentionMaps:
    """The model's attention weights for `source` and its translation `target`.

    Without `target` the sentence is translated first (beam search, as `translate`), so the
    maps show what the model attended to while producing its own output.
    """
    if target is None:
      target = self.translate([source], beam_size=beam_size, alpha=alpha)[0]
    max_len = self.model_config.max_len
    source_ids = (self.tokenizer.encode(source)[:max_len - 1]) + [EOS_ID]
    target_ids = (self.tokenizer.encode(target)[:max_len - 1]) + [EOS_ID]
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
        cross=layers_heads('decoder_layers', 'cross_attention'))

  @functools.cached_property
  def _attention_apply(self):
    return jax.jit(lambda params, src, tgt_in: self.model.apply(
        {'params': params}, src, tgt_in, mutable=['intermediates']))


def _restore(workdir: str, checkpoint: int | str | None, abstract_params):
  averaged = averaged_dir(workdir)
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None,
                    async_save=False) as checkpointer:
    if checkpoint == 'averaged' or (checkpoint is None and is_params_checkpoint(averaged)):
      if not is_params_checkpoint(averaged):
        raise FileNotFoundError(f'no averaged checkpoint in {averaged}: run '
                                f'`python -m transformer_jax.average --workdir={workdir}`')
      made_from = read_metadata(averaged).get('latest_step')
      latest = checkpointer.latest_step()
      if checkpoint == 'averaged' or made_from == latest:
        logging.info('loading the average of checkpoints %s from %s',
                     read_metadata(averaged).get('averaged_steps'), averaged)
        return restore_params_from(averaged, abstract_params)
      logging.warning('%s was made up to step %s but the latest checkpoint is %s; loading the '
                      'latest (rerun transformer_jax.average to refresh it)', averaged,
                      made_from, latest)
    step = None if checkpoint in (None, 'latest') else int(checkpoint)
    return checkpointer.restore_params(abstract_params, step)


def checkpoint_flag_value(value: str | None) -> int | str | None:
  """--checkpoint: a step number, 'averaged' or 'latest'."""
  if value is None or value in ('averaged', 'latest'):
    return value
  try:
    return int(value)
  except ValueError:
    raise UserInputError(f"--checkpoint must be a step number, 'averaged' or 'latest', "
                         f'got {value!r}') from None


FLAGS = flags.FLAGS


def _define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config.json, vocab.model, checkpoints).')
  flags.DEFINE_string('checkpoint', None, "Step number, 'averaged' or 'latest' (default: the "
                      'averaged checkpoint if current, else the latest).')
  flags.DEFINE_integer('batch_size', 64, 'Sentences decoded together.')
  flags.DEFINE_integer('beam_size', 4, 'Beam size; 1 = greedy (the paper: 4).')
  flags.DEFINE_string('input', None, 'Read sentences from this file instead of stdin.')
  flags.DEFINE_string('output', None, 'Write translations to this file instead of stdout.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent ((5+len)/6)^alpha (the paper: 0.6).')
  flags.mark_flags_as_required(['workdir'])


def _decode_line(raw: bytes) -> str:
  # Bytes that are not UTF-8 become U+FFFD instead of ending the run.
  return raw.decode('utf-8', errors='replace').rstrip('\r\n')


def _interactive(translator: Translator) -> None:
  """A terminal on stdin: translate each line as soon as it is typed."""
  print('Type a sentence and press Enter (Ctrl-D to quit).', file=sys.stderr)
  for raw in sys.stdin.buffer:
    (translation,) = translator.translate([_decode_line(raw)], beam_size=FLAGS.beam_size,
                                          alpha=FLAGS.alpha)
    print(translation, flush=True)


def main(argv):
  del argv
  quiet_library_logs()
  try:
    check_decoding_options(FLAGS.beam_size, FLAGS.alpha, FLAGS.batch_size)
    if FLAGS.input and not os.path.exists(FLAGS.input):
      raise FileNotFoundError(f'--input={FLAGS.input}: no such file')
    if FLAGS.input and os.path.isdir(FLAGS.input):
      raise UserInputError(f'--input={FLAGS.input}: is a directory, not a text file')
    translator = Translator.from_checkpoint(
        FLAGS.workdir, checkpoint_flag_value(FLAGS.checkpoint), FLAGS.batch_size)
  except (FileNotFoundError, UserInputError, CorruptCheckpointError) as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  if not FLAGS.input and sys.stdin.isatty():
    _interactive(translator)
    return
  if FLAGS.input:
    with open(FLAGS.input, 'rb') as f:
      lines = [_decode_line(raw) for raw in f]
  else:
    lines = [_decode_line(raw) for raw in sys.stdin.buffer]
  translations = translator.translate(lines, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha)
  text = ''.join(t.replace('\n', ' ') + '\n' for t in translations)
  if FLAGS.output:
    tmp = FLAGS.output + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, FLAGS.output)  # Never a half-written output file.
  else:
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == '__main__':
  _define_flags()
  app.run(main)
