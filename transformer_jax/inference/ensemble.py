"""Ensembles at decode time: several models sharing a vocabulary translate together, each step
taking the log of the (weighted) mean of their probabilities (`search.ensemble`).

What must agree: the vocabulary, byte for byte (the SHA-256 of each workdir's vocab.model, and
of its target.spm where there is one), which fixes the vocabulary size and the BOS/EOS/PAD ids
(`Tokenizer` refuses any other ids); and the architecture (`model.config.architecture_fields`
but max_len: depth, width, heads, normalisation, positions, ...), so that a member trained for
another task or imported from elsewhere is not mixed in by a slip of a path. Both are read from
the small files (vocab.model, config.json) before any parameters are restored; an error names
both workdirs and the first field that differs. Nothing in the mixture needs equal shapes, so
`mixed_architectures=True` (Python only) allows different architectures on purpose: each
member encodes the source with its own parameters and keeps its own cache. What may always
differ: the training-only fields (dropout, dtype, remat, attention kernel) and max_len: members
of different max_len translate within the smallest one (sources truncated to it, outputs
capped by it), so that no member reads a position it has no encoding for.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import logging

from transformer_jax.common.errors import UserInputError, is_number
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference.decoding import model_steps, target_log_probs
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import architecture_fields
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import spec as search
from transformer_jax.search.ensemble import ensemble_steps, mix_log_probs, normalised_weights
from transformer_jax.search.spec import SearchInputs, SearchSpec
from transformer_jax.search.steps import Steps
from transformer_jax.workdir.layout import Workdir


def members_steps(models: Sequence[Transformer], params: Sequence, src_ids, weights=None) -> Steps:
  """The members as one `search.Steps`: each member's model steps (`decoding.model_steps`:
  its own encoding of the source, its own cache), mixed (`search.ensemble.ensemble_steps`)."""
  members = [model_steps(model, p, src_ids) for model, p in zip(models, params)]
  return ensemble_steps(members, weights, pad_id=PAD_ID, bos_id=BOS_ID)


def ensemble_greedy_decode(
  models: Sequence[Transformer],
  params: Sequence,
  src_ids: jax.Array,
  *,
  max_decode_len: int,
  weights: Sequence[float] | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> jax.Array:
  """`decoding.greedy_decode` for an ensemble: member m is models[m] with params[m]; source
  ids [b, s] -> output ids [b, max_decode_len]. Call under jit (`max_decode_len` static)."""
  spec = SearchSpec('greedy', max_decode_len, BOS_ID, EOS_ID, PAD_ID)
  inputs = SearchInputs(prefix=prefix, prefix_lengths=prefix_lengths)
  steps = members_steps(models, params, src_ids, weights)
  tokens, _ = search.run(spec, steps, src_ids.shape[0], inputs)
  return tokens[:, 0]


def ensemble_beam_decode(
  models: Sequence[Transformer],
  params: Sequence,
  src_ids: jax.Array,
  *,
  beam_size: int,
  alpha: float,
  max_decode_len: int,
  max_lengths: jax.Array | None = None,
  rule: str = 'exact',
  weights: Sequence[float] | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`decoding.beam_decode` (cached) for an ensemble: source ids [b, s] -> (ids [b, beam,
  max_decode_len], scores [b, beam]), scores the mixture's log-probs over the GNMT penalty."""
  spec = SearchSpec(
    'beam', max_decode_len, BOS_ID, EOS_ID, PAD_ID, beam_size=beam_size, alpha=alpha, rule=rule
  )
  inputs = SearchInputs(max_lengths=max_lengths, prefix=prefix, prefix_lengths=prefix_lengths)
  steps = members_steps(models, params, src_ids, weights)
  return search.run(spec, steps, src_ids.shape[0], inputs)


def ensemble_target_log_probs(
  models: Sequence[Transformer], params: Sequence, src_ids, tgt_ids, weights=None
) -> jax.Array:
  """`decoding.target_log_probs` for an ensemble: each target token's log-probability under
  the mixture log(sum_m w_m p_m), PAD and BOS excluded from every member's softmax: float32 [b, t].
  The mixture at a token needs only each member's probability of that token, so each member
  scores alone (its logits reduced block by block, never all stored) and the scores are mixed."""
  members = [target_log_probs(model, p, src_ids, tgt_ids) for model, p in zip(models, params)]
  return jnp.where(tgt_ids == PAD_ID, 0.0, mix_log_probs(members, weights))  # [b, t]


def check_weights(weights, count: int) -> tuple[float, ...]:
  """The weights normalised (`search.ensemble.normalised_weights`), or a one-line error."""
  if weights is not None:
    weights = list(weights)
    if not all(is_number(w) for w in weights):
      raise UserInputError(f'ensemble weights must be numbers, got {weights!r}')
  try:
    return normalised_weights(weights, count)
  except ValueError as error:
    raise UserInputError(str(error)) from None


def _check_same_vocabulary(workdirs: Sequence[Workdir]) -> None:
  """A one-line error naming both files where a member's vocabulary (or target vocabulary)
  is not the first member's; read before any parameters are restored."""
  first = workdirs[0]
  for workdir in workdirs:
    if not workdir.vocab_file.exists():
      raise UserInputError(f'{workdir.vocab_file}: no vocabulary (is {workdir} a workdir?)')
  expected = first.vocabulary_identity()
  for workdir in workdirs[1:]:
    found = workdir.vocabulary_identity()
    for key, files in (
      ('vocab_sha256', (first.vocab_file, workdir.vocab_file)),
      ('target_vocab_sha256', (first.target_vocab_file, workdir.target_vocab_file)),
    ):
      if expected.get(key) != found.get(key):
        hashes = [str(h)[:12] if h else 'absent' for h in (expected.get(key), found.get(key))]
        raise UserInputError(
          f'ensemble members must share their vocabulary: {files[0]} (sha256 {hashes[0]}) '
          f'differs from {files[1]} (sha256 {hashes[1]})'
        )


# Architecture fields an ensemble's members may differ in: the mixture only caps lengths by it.
_MAY_DIFFER = ('max_len',)


def check_same_architecture(named_configs: Sequence[tuple[str, dict]]) -> None:
  """A one-line error naming both members and the first architecture field where a member's
  model config (a dict, as config.json's 'model') differs from the first member's."""
  (first_name, first), *others = named_configs
  fields = [name for name in architecture_fields() if name not in _MAY_DIFFER]
  for name, config in others:
    for field in ['vocab_size', *fields]:
      if first.get(field) != config.get(field):
        raise UserInputError(
          f'ensemble members must share their architecture: {first_name} has {field}='
          f'{first.get(field)!r}, {name} has {field}={config.get(field)!r} (Python: '
          'Ensemble(..., mixed_architectures=True) mixes them on purpose)'
        )


def _workdir_model_config(workdir: Workdir) -> dict:
  config = workdir.read_run_config()
  model = dict(config.get('model', {}))
  model.setdefault('vocab_size', config.get('vocab_size'))
  return model


class _EnsembleBatches(Translator):
  """Translator's tokenising, length bucketing, batching, ranking and detokenising, with the
  ensemble's steps in place of one model's (`_steps`) over `self.params`, here the
  members' parameters, a tuple."""

  def __init__(self, translators: Sequence[Translator], weights, batch_size: int):
    first = translators[0]
    max_len = min(t.model_config.max_len for t in translators)
    self._models = tuple(t.model for t in translators)
    self._weights = weights
    # Only max_len of this config is read (truncation and the decode cap).
    super().__init__(
      first.model_config.replace(max_len=max_len),
      tuple(t.params for t in translators),
      first.tokenizer,
      batch_size,
      first.target_tokenizer,
    )

  def _steps(self, params, src) -> Steps:
    """The mixture's steps in place of one model's (`Translator._steps`)."""
    return members_steps(self._models, params, src, self._weights)

  def _log_probs(self, params, src, tgt):
    """The mixture's teacher-forced log-probs (`ensemble_target_log_probs`)."""
    return ensemble_target_log_probs(self._models, params, src, tgt, self._weights)

  def _programs_key(self) -> tuple:
    """What `_steps` closes over (`Translator._programs_key`): the members' models, their
    weights, and the model whose max_len caps the output."""
    return (type(self).__name__, self.model, self._models, self._weights)


class Ensemble:
  """Several `Translator`s sharing a vocabulary, translating as one: `.translate(list_of_str)
  -> list_of_str` (beam search, or greedy with beam_size=1), as `Translator.translate`.

  weights: one positive number per member (normalised; None: uniform). mixed_architectures:
  allow members of different architectures (the module's docstring)."""

  def __init__(
    self,
    translators: Sequence[Translator],
    weights: Sequence[float] | None = None,
    batch_size=64,
    *,
    mixed_architectures: bool = False,
  ):
    translators = tuple(translators)
    if not translators:
      raise UserInputError('an ensemble needs at least one member')
    self.weights = check_weights(weights, len(translators))
    first = translators[0]
    for other in translators[1:]:
      for name in ('tokenizer', 'target_tokenizer'):
        ours, theirs = getattr(first, name), getattr(other, name)
        if ours.model_bytes != theirs.model_bytes:
          raise UserInputError(
            f'ensemble members must share their vocabulary: {ours.path} differs from {theirs.path}'
          )
    if not mixed_architectures:
      check_same_architecture(
        [(f'member {i + 1}', dataclasses.asdict(t.model_config)) for i, t in enumerate(translators)]
      )
    max_lens = sorted({t.model_config.max_len for t in translators})
    if len(max_lens) > 1:
      logging.info('ensemble members have max_len %s: translating within %d', max_lens, max_lens[0])
    self.translators = translators
    self._batches = _EnsembleBatches(translators, self.weights, batch_size)

  @classmethod
  def from_checkpoints(
    cls,
    members: Sequence[tuple[str, int | str | None] | str],
    weights: Sequence[float] | None = None,
    batch_size: int = 64,
    *,
    mixed_architectures: bool = False,
    dtype: str | None = None,
  ) -> 'Ensemble':
    """Loads each (workdir, checkpoint) pair (`Translator.from_checkpoint`; a bare workdir:
    its default checkpoint), each in `dtype` (`Translator`). The vocabularies, architectures
    and weights are checked first, before any parameters are read."""
    members = [(member, None) if isinstance(member, str) else tuple(member) for member in members]
    if not members:
      raise UserInputError('an ensemble needs at least one member')
    check_weights(weights, len(members))
    workdirs = [Workdir(workdir) for workdir, _ in members]
    _check_same_vocabulary(workdirs)
    if not mixed_architectures:
      check_same_architecture([(str(w), _workdir_model_config(w)) for w in workdirs])
    # dtype only when given: tests stand a fake in for from_checkpoint.
    given = {} if dtype is None else {'dtype': dtype}
    translators = [
      Translator.from_checkpoint(workdir, checkpoint, batch_size, **given)
      for workdir, checkpoint in members
    ]
    return cls(translators, weights, batch_size, mixed_architectures=mixed_architectures)

  @property
  def tokenizer(self) -> Tokenizer:
    return self.translators[0].tokenizer

  @property
  def max_len(self) -> int:
    return self._batches.model_config.max_len

  @property
  def batch_size(self) -> int:
    return self._batches.batch_size

  def translate(self, sentences: Sequence[str], beam_size: int = 4, alpha: float = 0.6, **kwargs):
    """One translation per input sentence, in order: `Translator.translate` (the same options,
    truncation, caps, batching and errors) with the ensemble's searches."""
    return self._batches.translate(sentences, beam_size, alpha, **kwargs)

  def hypotheses(self, sentences: Sequence[str], beam_size: int = 4, alpha: float = 0.6, **kwargs):
    """`Translator.hypotheses` with the ensemble's searches; log_prob and score are the
    mixture's."""
    return self._batches.hypotheses(sentences, beam_size, alpha, **kwargs)

  def score(self, sources: Sequence[str], targets: Sequence[str], *, per_token: bool = False):
    """`Translator.score` under the mixture: each target token's log(sum_m w_m p_m)."""
    return self._batches.score(sources, targets, per_token=per_token)
