"""`Translator`: a workdir's config, vocabulary and parameters (`from_checkpoint`, which
checkpoint: `checkpoints.served`), translating lists of sentences in length-sorted batches, and
its attention maps (`Translator.attention`). The model bound to the search: `decoding`; the
translate command's file handling: `text_files`."""

from __future__ import annotations

import collections
import dataclasses
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
from transformer_jax.inference import alignments, batches, scoring
from transformer_jax.inference.alignments import AttentionMaps
from transformer_jax.inference.decoding import model_steps, source_bucket, target_log_probs
from transformer_jax.inference.options import (
  DecodingOptions,
  Hypothesis,
  check_decoding_options,
  check_dtype,
)
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import spec as search
from transformer_jax.search.decode import host_length_penalty, strip_after_eos
from transformer_jax.search.spec import SearchInputs
from transformer_jax.search.steps import Steps
from transformer_jax.workdir.layout import Workdir

__all__ = [
  'AttentionMaps',
  'DecodingOptions',
  'Hypothesis',
  'PendingHypotheses',
  'Translator',
  'check_decoding_options',
  'forget_programs',
]

# Batches dispatched ahead of the one being read back and post-processed: the host's work on
# batch i (detokenizing, ranking, MBR) overlaps the device's on batch i + 1.
BATCHES_IN_FLIGHT = 1


@dataclasses.dataclass(eq=False)
class PendingHypotheses:
  """A `Translator.launch_hypotheses` call between its halves: the batches not dispatched yet,
  those in flight (at most `BATCHES_IN_FLIGHT` + 1) and the results read back so far."""

  options: DecodingOptions
  scored: bool
  rows: int  # sources per batch
  batches: collections.deque  # [batches.Job] lists, shortest first, not dispatched yet
  results: list  # [Hypothesis] per sentence, in input order
  bar: Progress
  in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)


class _Programs(NamedTuple):
  """A model's jitted programs (`Translator._jit_programs`); each takes the parameters first."""

  # (params, src, inputs, *, spec) -> (tokens [rows, n, L], scores [rows, n]): every search.
  search: Callable
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
    *,
    dtype: str | None = None,
  ):
    """target_tokenizer: segments given targets (`attention`) where the workdir has its own
    target segmentation (Workdir.target_vocab_file); tokenizer does everything else. dtype:
    the inference dtype ('float32', 'bfloat16', 'float16'; None: the model config's), the
    compute dtype of every product and of the parameters' matrices (`cast_params`)."""
    check_decoding_options(batch_size=batch_size)
    check_dtype(dtype)
    if dtype is not None:
      model_config = model_config.replace(dtype=dtype)
      params = cast_params(params, dtype)
    self.model_config = model_config
    self.model = Transformer(model_config)
    # On the device once, explicitly: the batch loop then moves only its batches.
    self.params = jax.device_put(params)
    self.tokenizer = tokenizer
    self.target_tokenizer = target_tokenizer or tokenizer
    self.batch_size = batch_size
    self._build_programs()

  def _steps(self, params, src) -> Steps:
    """What every search decodes with (`search.Steps`): the model's, over `params`. An ensemble
    (`inference.ensemble`) returns the mixture's, and its own `_programs_key`."""
    return model_steps(self.model, params, src)

  def _log_probs(self, params, src, tgt):
    """Teacher-forced log-probs float32 [b, t] of tgt given src (`decoding.target_log_probs`)."""
    return target_log_probs(self.model, params, src, tgt)

  def _programs_key(self) -> tuple:
    """Everything `_steps` and `_log_probs` close over (the parameters are arguments):
    Translators of equal keys share their jitted programs (`_SharedPrograms`)."""
    return (type(self).__name__, self.model)

  def _build_programs(self) -> None:
    """The jitted programs every decoding mode runs, shared with every Translator of the same
    model (`_SharedPrograms`). Shapes and the spec are static: one program per batch shape
    and search."""
    programs = _SHARED_PROGRAMS.get(self._programs_key(), self._jit_programs)
    self._search, self._token_log_probs, self._attention_apply = programs

  def _jit_programs(self) -> _Programs:
    steps, model = self._steps, self.model

    def run_search(params, src, inputs, *, spec):
      # Sampling's keys are folded here, inside the program: no dispatch of their own.
      keys = None
      if spec.mode == 'sampling':
        keys = batches.draw_keys(inputs['seed'], inputs['positions'], inputs['draws'])
      search_inputs = SearchInputs(
        max_lengths=inputs['max_lengths'],
        prefix=inputs.get('prefix'),
        prefix_lengths=inputs.get('prefix_lengths'),
        keys=keys,
        temperature=inputs.get('temperature'),
        top_p=inputs.get('top_p'),
      )
      return search.run(spec, steps(params, src), src.shape[0], search_inputs)

    return _Programs(
      search=jax.jit(run_search, static_argnames=('spec',)),
      token_log_probs=jax.jit(self._log_probs),
      attention=jax.jit(
        lambda params, src, tgt_in: model.apply(
          {'params': params}, src, tgt_in, mutable=['intermediates']
        )
      ),
    )

  @classmethod
  def from_checkpoint(
    cls,
    workdir: str,
    checkpoint: int | str | None = None,
    batch_size: int = 64,
    *,
    dtype: str | None = None,
  ) -> 'Translator':
    """Loads the config, vocabulary and parameters of a workdir.

    checkpoint: a step number, 'averaged' (written by `python -m transformer_jax.average`),
    'best' (kept by training's config.best_checkpoint_metric), 'latest', or None: the averaged
    checkpoint if it was made from the latest training checkpoint, else the latest training
    checkpoint, else (an imported model not fine-tuned yet) the imported parameters. dtype:
    the inference dtype (`Translator`).
    """
    check_decoding_options(batch_size=batch_size, dtype=dtype)
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
    return cls(model_config, params, tokenizer, batch_size, target_tokenizer, dtype=dtype)

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

  def launch_hypotheses(
    self,
    sentences: Sequence[str],
    beam_size: int = 4,
    alpha: float = 0.6,
    *,
    target_prefix: Sequence[str | None] | None = None,
    draw_positions: Sequence[int] | None = None,
    **options,
  ) -> PendingHypotheses:
    """`hypotheses` in two halves, for a caller with its own batches to overlap (the server's
    batcher): this one encodes the sentences and dispatches their first batch, then returns;
    `finish_hypotheses` dispatches the others (one ahead, as `hypotheses` does) and returns
    exactly what `hypotheses` would have."""
    decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, **options).check()
    return self._start(
      sentences, decoding, target_prefix, False, scored=True, draw_positions=draw_positions
    )

  def finish_hypotheses(self, pending: PendingHypotheses) -> list[list[Hypothesis]]:
    """The hypotheses of a `launch_hypotheses` call, in input order."""
    return self._complete(pending)

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
    """The batch loop of translate and hypotheses: encode, sort by length, decode each batch,
    return in input order. `scored`: greedy sums its outputs' log-probabilities in its loop
    (the other searches have them anyway).

    Each batch is one explicit transfer to the device, one program (`_launch`) and one
    explicit fetch back (`_finish`); everything per hypothesis (penalties, sums, ranking,
    text) is NumPy and Python on that fetch. Batch i + 1 is dispatched before batch i is read
    back (`BATCHES_IN_FLIGHT`), so the host's work overlaps the device's."""
    pending = self._start(
      sentences, options, target_prefix, progress, scored=scored, draw_positions=draw_positions
    )
    return self._complete(pending)

  def _start(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    progress: bool,
    *,
    scored: bool,
    draw_positions: Sequence[int] | None = None,
  ) -> PendingHypotheses:
    """The loop's first half: the batches made and the first one dispatched."""
    jobs = batches.encode_sources(sentences, self.tokenizer, self.model_config.max_len)
    if target_prefix is not None:
      batches.add_prefixes(jobs, target_prefix, self.target_tokenizer, len(sentences))
    if draw_positions is not None:
      batches.set_draw_positions(jobs, draw_positions, len(sentences))
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
    batched = [
      [jobs[i] for i in order[start : start + rows_per_batch]]
      for start in range(0, len(order), rows_per_batch)
    ]
    pending = PendingHypotheses(
      options, scored, rows_per_batch, collections.deque(batched), [[] for _ in sentences], bar
    )
    if pending.batches:
      first = pending.batches.popleft()
      pending.in_flight.append(self._launch(first, rows_per_batch, options, scored))
    return pending

  def _complete(self, pending: PendingHypotheses) -> list[list[Hypothesis]]:
    """The loop's second half: each other batch dispatched, then the oldest read back."""
    options, scored, in_flight = pending.options, pending.scored, pending.in_flight

    def finish_oldest() -> None:
      batch, arrays, outputs = in_flight.popleft()
      for job, found in zip(batch, self._finish(batch, arrays, outputs, options, scored)):
        pending.results[job.index] = found
      pending.bar.update(len(batch))

    while pending.batches:
      in_flight.append(self._launch(pending.batches.popleft(), pending.rows, options, scored))
      if len(in_flight) > BATCHES_IN_FLIGHT:
        finish_oldest()
    while in_flight:
      finish_oldest()
    pending.bar.close()
    return pending.results

  def _launch(self, batch: list[batches.Job], rows: int, options: DecodingOptions, scored: bool):
    """Dispatches one batch's search (at most `rows` sources, padded to `rows`): its inputs
    moved in one explicit transfer, its program run asynchronously. Returns (batch, the host
    arrays, the program's outputs, still on the device)."""
    arrays = batches.pad(batch, rows, self.model_config.max_len)
    spec = options.spec(arrays.max_decode_len, scored=scored)
    inputs = batches.search_inputs(arrays, options, [job.position for job in batch])
    src = arrays.src
    if options.mode == 'sampling':
      # Each draw is a row: [rows, s] -> [rows * draws, s], sentence-major.
      src = np.repeat(src, options.candidates, axis=0)
    src, inputs = jax.device_put((src, inputs))
    return batch, arrays, self._search(self.params, src, inputs, spec=spec)

  def _finish(
    self, batch, arrays: batches.Arrays, outputs, options: DecodingOptions, scored: bool
  ) -> list[list[Hypothesis]]:
    """The hypotheses of each source of a launched batch: its outputs fetched in one explicit
    transfer, then ranked and cut to num_hypotheses (MBR: re-ranked by utility) on the host."""
    tokens, scores = jax.device_get(outputs)  # [rows', n, L], [rows', n]
    if options.mode == 'sampling':
      draws = options.candidates
      # [rows * draws, 1, L] -> [rows, draws, L]: sentence-major, as repeated.
      tokens = tokens.reshape(-1, draws, tokens.shape[-1])
      scores = scores.reshape(-1, draws)
    scores = scores.astype(np.float64)
    found = []
    for row, job in enumerate(batch):
      # Each output keeps its own cap (EOS counted).
      pieces = [
        ids[: arrays.max_lengths[row] - 1]
        for ids in strip_after_eos(tokens[row], EOS_ID, pad_id=PAD_ID)
      ]
      if options.mode == 'beam':
        # Slots beam search never filled score -inf; the first is always a hypothesis.
        kept = [c for c in range(len(pieces)) if c == 0 or np.isfinite(scores[row, c])]
        sums = [
          float(scores[row, c]) * host_length_penalty(len(pieces[c]) + 1, options.alpha)
          for c in kept
        ]
        pieces = [pieces[c] for c in kept]
      elif options.mode == 'greedy' and not scored:
        sums = [math.nan]
      else:
        sums = [float(v) for v in scores[row]]
      found.append(self._rank(pieces, sums, options))
    return found

  def _rank(self, pieces: list[list[int]], sums: list[float], options: DecodingOptions):
    candidates = [
      Hypothesis(
        text=self.tokenizer.decode(ids),
        log_prob=total,
        score=total / host_length_penalty(len(ids) + 1, options.alpha),
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
    src, decoder_inputs = jax.device_put((src, decoder_inputs))
    _, state = self._attention_apply(self.params, src, decoder_inputs)
    weights = jax.device_get(state['intermediates'])  # One fetch: every layer's maps.

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


def cast_params(params, dtype: str):
  """The parameters for inference in `dtype`: the matrices (every `kernel`, the embedding
  tables) in it, once, so that each product reads half the bytes; vectors (biases, layer-norm
  scales) stay float32, as the layers compute their statistics in float32 anyway. By name, not
  by rank: the stacked layers hold their vectors as [layers, d] arrays."""
  target = jnp.dtype(dtype)

  def cast(path, leaf):
    name = getattr(path[-1], 'key', None) if path else None
    matrix = name in _MATRIX_NAMES and jnp.issubdtype(leaf.dtype, jnp.floating)
    return leaf.astype(target) if matrix else leaf

  return jax.tree_util.tree_map_with_path(cast, params)


# The parameters cast_params casts: DenseGeneral's kernels, nn.Embed's tables, learned positions.
_MATRIX_NAMES = ('kernel', 'embedding', 'position_embedding')
