"""`Translator`: a workdir's config, vocabulary and parameters (`from_checkpoint`, which
checkpoint: `checkpoints.served`), translating lists of sentences in length-sorted batches, and
its attention maps (`Translator.attention`). The model bound to the search: `decoding`; the
translate command's file handling: `text_files`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.checkpoints.served import restore_served_params
from transformer_jax.common.errors import UserInputError, is_integer, is_number
from transformer_jax.common.progress import Progress
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference.decoding import (
  EXTRA_DECODE_LENGTH,
  beam_decode,
  greedy_decode,
  source_bucket,
)
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import decode
from transformer_jax.search.decode import strip_after_eos
from transformer_jax.workdir.layout import Workdir


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
    workdir.check_vocabulary_unchanged(saved)
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
    params = restore_served_params(workdir, checkpoint, abstract_params)
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

  def score(
    self, sources: Sequence[str], targets: Sequence[str], *, per_token: bool = False
  ) -> list[dict]:
    """Each (source, target) pair's log-probability under the model (forced decoding: one
    forward pass per batch, no search), in input order: {'log_prob': sum, 'tokens': n (the
    target's EOS counted), 'mean': sum / n, 'token_log_probs': [...] with per_token}.

    As CTranslate2's `score_batch` scores: the EOS is scored, PAD is never a prediction. A
    target over max_len tokens (EOS counted) is a UserInputError. See `inference.scoring`.
    """
    from transformer_jax.inference import scoring  # It imports this module.

    return scoring.score_pairs(self, sources, targets, per_token=per_token)

  def attention(
    self,
    source: str,
    target: str | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    *,
    pad_to: int | None = None,
  ) -> AttentionMaps:
    """The model's attention weights for `source` and its translation `target`.

    Without `target` the sentence is translated first (beam search, as `translate`), so the
    maps show what the model attended to while producing its own output. `pad_to`: both sides
    padded to that many tokens (masked, so no weight of a real token changes), so that one
    compiled program serves every sentence (the server passes max_len).
    """
    if target is None:
      target = self.translate([source], beam_size=beam_size, alpha=alpha)[0]
    max_len = self.model_config.max_len
    source_ids = (self.tokenizer.encode(source)[: max_len - 1]) + [EOS_ID]
    target_ids = (self.target_tokenizer.encode(target)[: max_len - 1]) + [EOS_ID]
    width_src, width_tgt = (pad_to, pad_to) if pad_to else (len(source_ids), len(target_ids))
    src = np.full((1, width_src), PAD_ID, np.int32)  # [1, s]
    src[0, : len(source_ids)] = source_ids
    decoder_inputs = np.full((1, width_tgt), PAD_ID, np.int32)  # [1, t]
    decoder_inputs[0, : len(target_ids)] = [BOS_ID] + target_ids[:-1]
    _, state = self._attention_apply(self.params, src, decoder_inputs)
    weights = state['intermediates']

    def layers_heads(module: str, name: str, queries: int, keys: int) -> np.ndarray:
      # Sown once per scanned call: [layers, batch=1, heads, queries, keys] -> drop the batch
      # and the padding.
      (sown,) = weights[module][name]['attention_weights']
      return np.asarray(sown, np.float32)[:, 0, :, :queries, :keys]

    s, t = len(source_ids), len(target_ids)
    return AttentionMaps(
      source_tokens=self.tokenizer.pieces(source_ids[:-1]) + ['</s>'],
      target_tokens=self.tokenizer.pieces(target_ids[:-1]) + ['</s>'],
      encoder_self=layers_heads('encoder_layers', 'self_attention', s, s),
      decoder_self=layers_heads('decoder_layers', 'self_attention', t, t),
      cross=layers_heads('decoder_layers', 'cross_attention', t, s),
    )

  def align(
    self,
    sources: Sequence[str],
    targets: Sequence[str] | None = None,
    *,
    layer: int | None = None,
    words: bool = True,
    beam_size: int = 4,
    alpha: float = 0.6,
  ) -> list[tuple[str, str]]:
    """(translation, Pharaoh alignment 'i-j ...') per source, in order: each target piece's most
    attended source piece (`inference.alignments`: the last decoder layer by default,
    heads averaged, '</s>' on neither side), merged to whitespace words unless `words=False`.

    Without `targets` the sources are translated first (`translate`, beam_size and alpha); with
    them, the given targets are aligned (and returned as the translations). A blank source or
    target aligns to ''.
    """
    from transformer_jax.inference import alignments  # It imports this module.

    if isinstance(sources, (str, bytes)) or isinstance(targets, (str, bytes)):
      raise TypeError('Translator.align takes lists of sentences; pass [sentence]')
    alignments.check_layer(
      alignments.default_layer(self.model_config.num_decoder_layers) if layer is None else layer,
      self.model_config.num_decoder_layers,
    )
    if targets is None:
      targets = self.translate(sources, beam_size=beam_size, alpha=alpha)
    elif len(targets) != len(sources):
      raise UserInputError(f'Translator.align: {len(sources)} sources but {len(targets)} targets')
    max_len = self.model_config.max_len
    aligned = []
    for source, target in zip(sources, targets):
      if not source.strip() or not target.strip():
        aligned.append((target, ''))
        continue
      # Both sides padded to one power-of-two bucket: few shapes, few compilations.
      longest = max(len(self.tokenizer.encode(source)), len(self.target_tokenizer.encode(target)))
      maps = self.attention(source, target, pad_to=source_bucket(longest + 1, max_len))
      pairs = alignments.align(maps, layer)
      if words:
        pairs = alignments.merge_to_words(pairs, maps.source_tokens, maps.target_tokens)
      aligned.append((target, alignments.pharaoh(pairs)))
    return aligned

  @functools.cached_property
  def _attention_apply(self):
    return jax.jit(
      lambda params, src, tgt_in: self.model.apply(
        {'params': params}, src, tgt_in, mutable=['intermediates']
      )
    )
