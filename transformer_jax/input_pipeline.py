"""Input pipeline: tfds `array_record` data sources (no TensorFlow) fed through grain.

Examples become fixed-length int32 arrays ('inputs' = source ids + EOS, 'targets' = target ids +
EOS, both right-padded with 0), so every training batch has one shape and `jit` compiles once.
The training iterator is a grain iterator whose `get_state()` is small JSON, saved with every
checkpoint so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import grain
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from transformer_jax import number_words
from transformer_jax.tokenizer import EOS_ID, Tokenizer

Batch = dict[str, np.ndarray]


def load_data_sources(config: ml_collections.ConfigDict, data_dir: str) -> dict[str, Any]:
  """Random-access sources of every split of `config.dataset`, preparing the embedded task."""
  name = config.dataset
  if name.split('/')[0] == 'number_words':
    config_name = name.split('/')[1] if '/' in name else 'default'
    number_words.prepare(data_dir, config_name)
    name = f'number_words/{config_name}'
  try:
    return tfds.data_source(name, data_dir=data_dir, try_gcs=False)
  except (tfds.core.registered.DatasetNotFoundError, FileNotFoundError, AssertionError) as error:
    raise ValueError(f'dataset {config.dataset!r} is not prepared in {data_dir}: '
                     f'{str(error).splitlines()[0]}') from None


def _text(example: dict, key: str) -> str:
  value = example[key]
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def training_sentences(source, config: ml_collections.ConfigDict) -> Iterator[str]:
  """Both sides of the first `vocab_max_examples` training pairs, for the shared vocabulary."""
  count = min(len(source), config.vocab_max_examples)
  for index in range(count):
    example = source[index]
    yield _text(example, config.source_key)
    yield _text(example, config.target_key)


def load_or_train_tokenizer(config: ml_collections.ConfigDict, workdir: str,
                            train_source) -> Tokenizer:
  """The workdir's vocabulary if it exists (a resumed run), else a new one trained and saved."""
  path = os.path.join(workdir, 'vocab.model')
  if os.path.exists(path):
    return Tokenizer.load(path)
  tokenizer = Tokenizer.train(training_sentences(train_source, config),
                              vocab_size=config.vocab_size,
                              model_type=config.vocab_model_type)
  tokenizer.save(path)
  return tokenizer


class _Tokenize(grain.transforms.Map):
  """{'en': bytes, 'de': bytes} -> {'inputs': ids + EOS, 'targets': ids + EOS} (unpadded)."""

  def __init__(self, tokenizer: Tokenizer, source_key: str, target_key: str):
    self._tokenizer = tokenizer
    self._source_key, self._target_key = source_key, target_key

  def map(self, example):
    return {
        'inputs': self._tokenizer.encode(_text(example, self._source_key)) + [EOS_ID],
        'targets': self._tokenizer.encode(_text(example, self._target_key)) + [EOS_ID],
    }


class _FitsLengths(grain.transforms.Filter):

  def __init__(self, max_source_length: int, max_target_length: int):
    self._max_source_length, self._max_target_length = max_source_length, max_target_length

  def filter(self, example) -> bool:
    return (len(example['inputs']) <= self._max_source_length
            and len(example['targets']) <= self._max_target_length)


def pad_batch(examples: list[dict], max_source_length: int, max_target_length: int,
              batch_size: int | None = None) -> Batch:
  """Stacks examples into right-padded int32 arrays; extra all-padding rows up to batch_size."""
  rows = batch_size or len(examples)
  inputs = np.zeros((rows, max_source_length), np.int32)
  targets = np.zeros((rows, max_target_length), np.int32)
  for row, example in enumerate(examples):
    source_ids = example['inputs'][:max_source_length]
    target_ids = example['targets'][:max_target_length]
    inputs[row, :len(source_ids)] = source_ids
    targets[row, :len(target_ids)] = target_ids
  return {'inputs': inputs, 'targets': targets}


def make_train_iterator(source, tokenizer: Tokenizer, config: ml_collections.ConfigDict, *,
                        batch_size: int, seed: int, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
  """Endless, shuffled (a new order every epoch), fixed-shape batches of this process's shard.

  `batch_size` is this process's share of the global batch. Each process reads a disjoint slice
  of the data (every process_count-th example), so together they cover it once per epoch.
  """
  dataset = (
      grain.MapDataset.source(source)
      .slice(slice(process_index, None, process_count))
      .shuffle(seed=seed)
      .repeat(None)
      .map(_Tokenize(tokenizer, config.source_key, config.target_key))
      .to_iter_dataset()
      .filter(_FitsLengths(config.max_source_length, config.max_target_length))
      .batch(batch_size, drop_remainder=True,
             batch_fn=lambda examples: pad_batch(list(examples), config.max_source_length,
                                                 config.max_target_length)))
  return iter(dataset)


def make_eval_batches(source, tokenizer: Tokenizer, config: ml_collections.ConfigDict, *,
                      batch_size: int, max_examples: int | None = None) -> list[Batch]:
  """Every example of a split exactly once, in order; over-long ones truncated, never dropped.

  The last batch is filled up with all-padding rows (zero weight) so all batches share a shape.
  """
  count = len(source) if max_examples is None else min(len(source), max_examples)
  tokenize = _Tokenize(tokenizer, config.source_key, config.target_key)
  batches = []
  for start in range(0, count, batch_size):
    examples = [tokenize.map(source[i]) for i in range(start, min(start + batch_size, count))]
    batches.append(pad_batch(examples, config.max_source_length, config.max_target_length,
                             batch_size))
  return batches


def eval_texts(source, config: ml_collections.ConfigDict,
               max_examples: int | None = None) -> tuple[list[str], list[str]]:
  """(sources, references) as text, in split order."""
  count = len(source) if max_examples is None else min(len(source), max_examples)
  examples = [source[i] for i in range(count)]
  return ([_text(e, config.source_key) for e in examples],
          [_text(e, config.target_key) for e in examples])
