"""`Translator`: a workdir's config, vocabulary and parameters (`from_checkpoint`, which
checkpoint: `checkpoints.served`), translating lists of sentences in length-sorted batches, and
its attention maps (`Translator.attention`). The model bound to the search: `decoding`; the
translate command's file handling: `text_files`."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.checkpoints.served import restore_served_params
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.progress import Progress
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference import batches
from transformer_jax.inference.decoding import (
  beam_decode,
  greedy_decode,
  sample_decode,
  source_bucket,
  target_log_probs,
)
from transformer_jax.inference.options import DecodingOptions, Hypothesis, check_decoding_options
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import decode
from transformer_jax.search.decode import strip_after_eos
from transformer_jax.workdir.layout import Workdir

__all__ = [
  'AttentionMaps',
  'DecodingOptions',
  'Hypothesis',
  'Translator',
  'check_decoding_options',
  'forget_programs',
]

# The searches' keyword arguments that shape their programs (`Translator._build_programs`).
BEAM_STATIC = ('beam_size', 'alpha', 'max_decode_len', 'rule')
# Sampling's temperature and top_p are traced (a new value compiles nothing); whether each is
# applied at all (`tempered`, `nucleus`) is static, so that an unused filter costs nothing.
SAMPLE_STATIC = ('top_k', 'tempered', 'nucleus', 'max_decode_len')


class _Programs(NamedTuple):
  """A model's jitted programs (`Translator._jit_programs`); each takes the parameters first."""

  greedy: Callable
  beam: Callable
  sample: Callable
  token_log_probs: Callable
  attention: Callable


class _SharedPrograms:
  """The jitted programs of the last few models, by `Translator._programs_key`.

  jit caches its traces and executables per function object, so every Translator built its own
  and traced, lowered and compiled them again: restoring one workdir twice in a process (a
  notebook, a sweep, the server's reloads, the test suite) paid each compilation twice (the
  persistent cache saves XLA's part only). The parameters are arguments, never closed over, so a
  shared program serves any parameters of the model's shapes."""

  def __init__(self, capacity: int):
    self._capacity = capacity
    self._programs: collections.OrderedDict[Any, _Programs] = collections.OrderedDict()
    self._lock = threading.Lock()  # Servers build Translators beside a decoding thread.

  def get(self, key, build: Callable[[], _Programs]) -> _Programs:
    with self._lock:
      programs = self._programs.pop(key, None) or build()  # jax.jit itself compiles nothing.
      self._programs[key] = programs
      while len(self._programs) > self._capacity:
        self._programs.popitem(last=False)
      return programs

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()


_SHARED_PROGRAMS = _SharedPrograms(capacity=8)


def forget_programs() -> None:
  """Drops the shared programs: for code patched after a Translator was made (benchmarks of
  variants; the training side's `training.trainer.forget_programs`)."""
  _SHARED_PROGRAMS.clear()


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
    self._build_programs()

  def _searches(self) -> tuple:
    """(greedy, beam, sample, target_log_probs): `decoding`'s functions bound to this model,
    each taking the parameters first. An ensemble (`inference.ensemble`) returns its own, and
    its own `_programs_key`."""
    model = self.model
    return (
      functools.partial(greedy_decode, model),
      functools.partial(beam_decode, model),
      functools.partial(sample_decode, model),
      functools.partial(target_log_probs, model),
    )

  def _programs_key(self) -> tuple:
    """Everything `_searches` and `_attention_apply` close over (the parameters are arguments):
    Translators of equal keys share their jitted programs (`_SharedPrograms`)."""
    return (type(self).__name__, self.model)

  def _build_programs(self) -> None:
    """The jitted searches every decoding mode runs (`_decode_batch`), over `_searches`, shared
    with every Translator of the same model (`_SharedPrograms`). Shapes and the keyword
    arguments are static: one program per batch shape and setting."""
    programs = _SHARED_PROGRAMS.get(self._programs_key(), self._jit_programs)
    self._greedy, self._beam, self._sample, self._token_log_probs, self._attention_apply = programs

  def _jit_programs(self) -> _Programs:
    greedy, beam, sample, log_probs = self._searches()
    model = self.model

    def run_sample(
      params, src, keys, max_lengths, prefix, prefix_lengths, temperature, top_p, **static
    ):
      return sample(
        params,
        src,
        keys=keys,
        max_lengths=max_lengths,
        prefix=prefix,
        prefix_lengths=prefix_lengths,
        top_k=static['top_k'],
        max_decode_len=static['max_decode_len'],
        # Each filter statically off (1) unless applied.
        temperature=temperature if static['tempered'] else 1.0,
        top_p=top_p if static['nucleus'] else 1.0,
      )

    return _Programs(
      greedy=jax.jit(
        lambda params, src, prefix, prefix_lengths, *, max_decode_len: greedy(
          params,
          src,
          max_decode_len=max_decode_len,
          prefix=prefix,
          prefix_lengths=prefix_lengths,
        ),
        static_argnames=('max_decode_len',),
      ),
      beam=jax.jit(
        lambda params, src, max_lengths, prefix, prefix_lengths, **static: beam(
          params,
          src,
          max_lengths=max_lengths,
          prefix=prefix,
          prefix_lengths=prefix_lengths,
          **static,
        ),
        static_argnames=BEAM_STATIC,
      ),
      sample=jax.jit(run_sample, static_argnames=SAMPLE_STATIC),
      token_log_probs=jax.jit(log_probs),
      attention=jax.jit(
        lambda params, src, tgt_in: model.apply(
          {'params': params}, src, tgt_in, mutable=['intermediates']
        )
      ),
    )

  @classmethod
  def from_checkpoint(
    cls, workdir: str, checkpoint: int | str | None = None, batch_size: int = 64
  ) -> 'Translator':
    """Loads the config, vocabulary and parameters of a workdir.

    checkpoint: a step number, 'averaged' (written by `python -m transformer_jax.average`),
    'best' (kept by training's config.best_checkpoint_metric), 'latest', or None: the averaged
    checkpoint if it was made from the latest training checkpoint, else the latest training
    checkpoint, else (an imported model not fine-tuned yet) the imported parameters.
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
    target_prefix: Sequence[str | None] | None = None,
    draw_positions: Sequence[int] | None = None,
    progress: bool = False,
    **options,
  ) -> list[str]:
    """One translation per input sentence, in order. Empty input gives empty output.

    beam_size 1 is greedy decoding; otherwise beam search with the GNMT length penalty
    ((5 + len) / 6)^alpha (the paper: beam 4, alpha 0.6). Outputs are at most the source length
    + 50 tokens and at most the model's max_len, EOS counted on both sides. Sentences are sorted
    by length into batches and returned in the original order. `options`: the other fields of
    `DecodingOptions` (beam_rule, sampling and its settings, seed, mbr; num_hypotheses must be
    1: `hypotheses` returns more). `target_prefix`: one text per sentence (or None) its
    translation starts with, and `draw_positions`, as for `hypotheses`. `progress`: reports
    sentences translated, batch by batch, with rate and ETA (for files; see `progress.py`).
    """
    decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, **options).check()
    if decoding.num_hypotheses != 1:
      raise UserInputError(
        'Translator.translate returns one translation per sentence; '
        f'num_hypotheses={decoding.num_hypotheses} needs Translator.hypotheses()'
      )
    found = self._hypotheses(
      sentences, decoding, target_prefix, progress, scored=False, draw_positions=draw_positions
    )
    return [candidates[0].text if candidates else '' for candidates in found]

  def hypotheses(
    self,
    sentences: Sequence[str],
    beam_size: int = 4,
    alpha: float = 0.6,
    *,
    target_prefix: Sequence[str | None] | None = None,
    draw_positions: Sequence[int] | None = None,
    progress: bool = False,
    **options,
  ) -> list[list[Hypothesis]]:
    """num_hypotheses `Hypothesis`es per sentence (text, log_prob, score, tokens), best first,
    in input order; a blank sentence gives [] (no hypothesis).

    Options: `DecodingOptions` (inference/options.py). Beam search returns its K best finished
    hypotheses by score (log_prob over the GNMT penalty); greedy its one; sampling K draws,
    sorted by score; MBR its K candidates of highest expected chrF (`utility`). Draws depend on
    the seed, the sentence's position in `sentences` and its text only: not on batch_size or
    the other sentences.

    target_prefix: per sentence, a text (segmented by the target vocabulary) whose pieces the
    search is forced through before it continues freely (as CTranslate2's target_prefix), or
    None / '' for none. Its log-probability counts in the scores. It must leave room for the
    EOS within the sentence's length cap (source + 50 tokens, at most max_len).

    draw_positions: the position each sentence's draws are keyed by instead of its index (a
    server batching several requests passes each sentence's index in its own request).
    """
    decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, **options).check()
    return self._hypotheses(
      sentences, decoding, target_prefix, progress, scored=True, draw_positions=draw_positions
    )

  def _hypotheses(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    progress: bool,
    *,
    scored: bool,
    draw_positions: Sequence[int] | None = None,
  ) -> list[list[Hypothesis]]:
    """The batch loop of translate and hypotheses: encode, sort by length, decode each batch
    (`_decode_batch`), return in input order. `scored`: greedy's log-probabilities are computed
    (by greedy as top-k 1 sampling; the other searches have them anyway)."""
    jobs = batches.encode_sources(sentences, self.tokenizer, self.model_config.max_len)
    if target_prefix is not None:
      batches.add_prefixes(jobs, target_prefix, self.target_tokenizer, len(sentences))
    if draw_positions is not None:
      batches.set_draw_positions(jobs, draw_positions, len(sentences))
    results: list[list[Hypothesis]] = [[] for _ in sentences]
    rows_per_batch = batches.sentences_per_batch(self.batch_size, options)
    order = batches.by_length(jobs)
    # Blank lines are translated already (to blank lines): counted from the start.
    bar = Progress(
      total=len(sentences),
      initial=len(sentences) - len(order),
      unit='sentences',
      description='translating',
      enabled=None if progress else False,
    )
    for start in range(0, len(order), rows_per_batch):
      batch = [jobs[i] for i in order[start : start + rows_per_batch]]
      for job, found in zip(batch, self._decode_batch(batch, rows_per_batch, options, scored)):
        results[job.index] = found
      bar.update(len(batch))
    bar.close()
    return results

  def _decode_batch(
    self, batch: list[batches.Job], rows: int, options: DecodingOptions, scored: bool
  ) -> list[list[Hypothesis]]:
    """The hypotheses of each source in `batch` (at most `rows`, padded to `rows`), by the
    options' mode, ranked and cut to num_hypotheses (MBR: re-ranked by utility)."""
    arrays = batches.pad(batch, rows, self.model_config.max_len)
    forcing = (arrays.prefix, arrays.prefix_lengths)
    log_probs = None  # [rows, candidates]
    if options.mode == 'greedy' and not scored:
      tokens = np.asarray(
        self._greedy(self.params, arrays.src, *forcing, max_decode_len=arrays.max_decode_len)
      )[:, None]  # [rows, 1, L]
    elif options.mode == 'beam':
      tokens, scores = self._beam(
        self.params,
        arrays.src,
        arrays.max_lengths,
        *forcing,
        beam_size=options.beam_size,
        alpha=float(options.alpha),
        max_decode_len=arrays.max_decode_len,
        rule=options.beam_rule,
      )
      tokens, scores = np.asarray(tokens), np.asarray(scores, np.float64)  # [rows, k, L], [rows, k]
    else:
      # Sampling; and greedy with its log-probabilities, as top-k 1 sampling: the argmax at every
      # step (ties: the lower id, as argmax), caps and prefixes as greedy's, and each output's
      # log-probability from the same loop instead of a second, teacher-forced pass.
      draws = options.candidates
      repeat = lambda x: None if x is None else np.repeat(x, draws, axis=0)  # noqa: E731
      keys = batches.sampling_keys(options.seed, [job.position for job in batch], rows, draws)
      greedy = options.mode == 'greedy'
      tokens, log_probs = self._sample(
        self.params,
        repeat(arrays.src),
        keys,
        repeat(arrays.max_lengths),
        repeat(arrays.prefix),
        repeat(arrays.prefix_lengths),
        np.float32(options.sampling_temperature),
        np.float32(options.sampling_topp),
        top_k=1 if greedy else options.sampling_topk,
        tempered=options.sampling_temperature != 1 and not greedy,
        nucleus=options.sampling_topp < 1 and not greedy,
        max_decode_len=arrays.max_decode_len,
      )
      # [rows * draws, L] -> [rows, draws, L]: sentence-major, as repeated.
      tokens = np.asarray(tokens).reshape(rows, draws, -1)
      log_probs = np.asarray(log_probs, np.float64).reshape(rows, draws)
    found = []
    for row, job in enumerate(batch):
      # Greedy runs to the batch's longest cap; each output keeps its own (EOS counted).
      pieces = [
        ids[: arrays.max_lengths[row] - 1]
        for ids in strip_after_eos(tokens[row], EOS_ID, pad_id=PAD_ID)
      ]
      if options.mode == 'beam':
        # Slots beam search never filled score -inf; the first is always a hypothesis.
        kept = [c for c in range(len(pieces)) if c == 0 or np.isfinite(scores[row, c])]
        penalty = [float(decode.length_penalty(len(pieces[c]) + 1, options.alpha)) for c in kept]
        sums = [float(scores[row, c]) * p for c, p in zip(kept, penalty)]
        pieces = [pieces[c] for c in kept]
      elif log_probs is not None:
        sums = [float(v) for v in log_probs[row]]
      else:
        sums = [math.nan]
      found.append(self._rank(pieces, sums, options))
    return found

  def _rank(self, pieces: list[list[int]], sums: list[float], options: DecodingOptions):
    candidates = [
      Hypothesis(
        text=self.tokenizer.decode(ids),
        log_prob=total,
        score=total / float(decode.length_penalty(len(ids) + 1, options.alpha)),
        tokens=len(ids) + 1,
      )
      for ids, total in zip(pieces, sums)
    ]
    # Best first; a stable sort keeps beam search's own order (and draws' order) in ties.
    candidates.sort(key=lambda h: -h.score if math.isfinite(h.score) else math.inf)
    if options.mbr:
      from transformer_jax.inference import mbr  # sacrebleu's chrF: only for MBR.

      candidates = candidates[: options.candidates]  # Beam search's N best of its beam_size.

      _, utilities = mbr.select([h.text for h in candidates])
      ranked = sorted(range(len(candidates)), key=lambda c: -utilities[c])
      candidates = [dataclasses.replace(candidates[c], utility=float(utilities[c])) for c in ranked]
    return candidates[: options.num_hypotheses]

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
