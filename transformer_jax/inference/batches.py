"""The host side of `Translator`'s batch loop, NumPy only: sentences encoded and checked
(`encode_sources`, `add_prefixes`), sorted by length (`by_length`), padded into the arrays a
search takes (`pad`), and the per-sentence PRNG keys of sampling (`sampling_keys`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference.decoding import EXTRA_DECODE_LENGTH, source_bucket
from transformer_jax.inference.options import DecodingOptions


@dataclasses.dataclass
class Job:
  """One non-blank sentence to decode."""

  index: int  # its position in the caller's list
  ids: list[int]  # source pieces + EOS, at most max_len
  cap: int  # most output tokens, EOS counted: source tokens + 50, at most max_len
  prefix: list[int] | None = None  # forced first target pieces
  position: int = -1  # what sampling keys its draws by (`sampling_keys`); -1: index

  def __post_init__(self):
    if self.position < 0:
      self.position = self.index


def encode_sources(sentences: Sequence[str], tokenizer: Tokenizer, max_len: int) -> list[Job]:
  """A Job per non-blank sentence (blank ones translate to ''); sources longer than max_len
  tokens (EOS counted) are cut to it with a warning."""
  if isinstance(sentences, (str, bytes)):
    # A str is a sequence too: it would be translated character by character.
    raise TypeError(
      'Translator.translate takes a list of sentences, got a single '
      f'{type(sentences).__name__}; pass [sentence]'
    )
  jobs = []
  for index, sentence in enumerate(sentences):
    if not isinstance(sentence, str):
      raise UserInputError(
        f'Translator.translate: sentence {index} is {type(sentence).__name__}, not str'
      )
    if not sentence.strip():
      continue
    ids = tokenizer.encode(sentence)
    if len(ids) + 1 > max_len:
      logging.warning(
        'sentence %d has %d tokens; truncated to the model maximum %d',
        index,
        len(ids) + 1,
        max_len,
      )
      ids = ids[: max_len - 1]
    ids = ids + [EOS_ID]
    jobs.append(Job(index, ids, min(len(ids) + EXTRA_DECODE_LENGTH, max_len)))
  return jobs


def add_prefixes(
  jobs: list[Job],
  target_prefix: Sequence[str | None],
  target_tokenizer: Tokenizer,
  count: int,
  name=lambda index: f'target_prefix {index}',
) -> None:
  """Sets each job's prefix: the pieces of target_prefix[job.index] (None or blank: none).

  One-line errors: not one entry per sentence, an entry that is not text, a prefix that
  leaves no room for the EOS within the sentence's cap (`name(index)` names the entry)."""
  if isinstance(target_prefix, (str, bytes)):
    raise TypeError('target_prefix takes one text (or None) per sentence, not a single str')
  if len(target_prefix) != count:
    raise UserInputError(
      f'target_prefix has {len(target_prefix)} entries for {count} sentences: give one per '
      'sentence (None for none)'
    )
  for job in jobs:
    text = target_prefix[job.index]
    if text is None:
      continue
    if not isinstance(text, str):
      raise UserInputError(f'{name(job.index)} is {type(text).__name__}, not str')
    pieces = target_tokenizer.encode(text) if text.strip() else []
    if len(pieces) + 1 > job.cap:
      raise UserInputError(
        f'{name(job.index)} has {len(pieces)} pieces; its source allows at most {job.cap - 1} '
        f'before the EOS (the source length + {EXTRA_DECODE_LENGTH}, at most max_len)'
      )
    job.prefix = pieces or None


def set_draw_positions(jobs: list[Job], positions: Sequence[int], count: int) -> None:
  """Keys each job's draws by positions[job.index] (non-negative integers, one per sentence)."""
  if isinstance(positions, (str, bytes)) or len(positions) != count:
    raise UserInputError(f'draw_positions must hold one integer per sentence ({count})')
  for job in jobs:
    position = positions[job.index]
    if not isinstance(position, (int, np.integer)) or isinstance(position, bool) or position < 0:
      raise UserInputError(f'draw_positions[{job.index}] must be an integer >= 0, got {position!r}')
    job.position = int(position)


def sentences_per_batch(batch_size: int, options: DecodingOptions) -> int:
  """Sentences decoded together: batch_size, except sampling's, whose draws are rows too
  (batch_size // draws sentences, at least one)."""
  if options.mode == 'sampling':
    return max(1, batch_size // options.candidates)
  return batch_size


def by_length(jobs: list[Job]) -> list[int]:
  """Positions in `jobs`, shortest source first: little padding and few distinct shapes."""
  return sorted(range(len(jobs)), key=lambda i: len(jobs[i].ids))


@dataclasses.dataclass
class Arrays:
  src: np.ndarray  # int32 [rows, source bucket]
  max_lengths: np.ndarray  # int32 [rows]: each row's cap (1 for padding rows)
  max_decode_len: int  # the batch's decode length: source bucket + 50, at most max_len
  prefix: np.ndarray | None  # int32 [rows, prefix bucket], or None: no row has one
  prefix_lengths: np.ndarray | None  # int32 [rows]


def pad(batch: list[Job], rows: int, max_len: int) -> Arrays:
  """The batch's sources padded to `rows` rows and a power-of-two length (`source_bucket`)."""
  source_length = source_bucket(max(len(job.ids) for job in batch), max_len)
  max_decode_len = min(max_len, source_length + EXTRA_DECODE_LENGTH)
  src = np.full((rows, source_length), PAD_ID, np.int32)
  max_lengths = np.ones((rows,), np.int32)
  for row, job in enumerate(batch):
    src[row, : len(job.ids)] = job.ids
    max_lengths[row] = min(job.cap, max_decode_len)
  prefix = prefix_lengths = None
  longest = max(len(job.prefix or ()) for job in batch)
  if longest:
    prefix = np.full((rows, source_bucket(longest, max_len)), PAD_ID, np.int32)
    prefix_lengths = np.zeros((rows,), np.int32)
    for row, job in enumerate(batch):
      if job.prefix:
        prefix[row, : len(job.prefix)] = job.prefix
        prefix_lengths[row] = len(job.prefix)
  return Arrays(src, max_lengths, max_decode_len, prefix, prefix_lengths)


def sampling_keys(seed: int, indices: Sequence[int], rows: int, draws: int) -> jax.Array:
  """Typed PRNG keys [rows * draws], sentence-major: draw d of the sentence at position i of
  the caller's list gets fold_in(fold_in(key(seed), i), d), whatever batch it is in. Padding
  rows (beyond len(indices)) get sentence 0's keys; their draws are discarded."""
  positions = np.zeros((rows,), np.uint32)
  positions[: len(indices)] = indices
  return _fold_keys(jax.random.key(seed), positions, draws=draws)


@functools.partial(jax.jit, static_argnames=('draws',))
def _fold_keys(seed_key, positions, *, draws: int):
  def sentence_keys(position):
    key = jax.random.fold_in(seed_key, position)
    return jax.vmap(lambda d: jax.random.fold_in(key, d))(jnp.arange(draws))

  return jax.vmap(sentence_keys)(positions).reshape(-1)  # [rows, draws] -> [rows * draws]
