"""The host side of `Translator`'s batch loop, NumPy only: sentences encoded and checked
(`encode_sources`, `add_prefixes`), sorted by length (`by_length`), padded into the arrays a
search takes (`pad`, `search_inputs`), and the per-sentence PRNG keys of sampling
(`draw_keys`, folded inside the program)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
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
  """Keys each job's draws by positions[job.index] (integers in [0, 2^32), one per sentence)."""
  if isinstance(positions, (str, bytes)) or len(positions) != count:
    raise UserInputError(f'draw_positions must hold one integer per sentence ({count})')
  for job in jobs:
    position = positions[job.index]
    # The keys fold in 32 bits (`draw_keys`): a larger position would be another's.
    if (
      not isinstance(position, (int, np.integer))
      or isinstance(position, bool)
      or not 0 <= position < 2**32
    ):
      raise UserInputError(
        f'draw_positions[{job.index}] must be an integer in [0, 2^32), got {position!r}'
      )
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


def search_inputs(arrays: Arrays, options: DecodingOptions, positions: Sequence[int]) -> dict:
  """The traced inputs of the Translator's search program for one padded batch, as NumPy
  arrays (moved to the device together, in one explicit transfer): the caps and prefixes, and
  for sampling each draw's row repeated (sentence-major), its seed, positions and draw numbers
  (`draw_keys`) and the temperature and top_p."""
  inputs = {'max_lengths': arrays.max_lengths}
  if arrays.prefix is not None:
    inputs.update(prefix=arrays.prefix, prefix_lengths=arrays.prefix_lengths)
  if options.mode != 'sampling':
    return inputs
  draws = options.candidates
  rows = len(arrays.max_lengths)
  # Padding rows (beyond the batch) get sentence 0's keys; their draws are discarded.
  sentence_positions = np.zeros((rows,), np.uint32)
  sentence_positions[: len(positions)] = positions
  repeat = lambda x: np.repeat(x, draws, axis=0)  # noqa: E731
  inputs = {name: repeat(value) for name, value in inputs.items()}
  inputs.update(
    seed=np.uint32(options.seed),
    positions=repeat(sentence_positions),
    draws=np.tile(np.arange(draws, dtype=np.uint32), rows),
    temperature=np.float32(options.sampling_temperature),
    top_p=np.float32(options.sampling_topp),
  )
  return inputs


def draw_keys(seed: jax.Array, positions: jax.Array, draws: jax.Array) -> jax.Array:
  """Typed PRNG keys [rows]: row r, draw draws[r] of the sentence at position positions[r] of
  the caller's list, gets fold_in(fold_in(key(seed), position), draw), whatever batch it is in
  (traced: folded inside the search's program)."""
  seed_key = jax.random.key(seed)
  return jax.vmap(lambda p, d: jax.random.fold_in(jax.random.fold_in(seed_key, p), d))(
    positions, draws
  )
