"""Input pipeline: tfds `array_record` data sources (no TensorFlow) fed through grain.

Sources are read once into token ids (`TokenizedSplit`, cached in the workdir), then
`make_train_iterator` gives the training batches in the configured form: 'fixed' (every pair
padded to the maximum lengths, one shape), or the planned forms of `batching.py` ('tokens':
length buckets; 'packed': several pairs per row). Its `get_state()` is small JSON, saved with
every checkpoint so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import difflib
import io
import itertools
import json
import os
from typing import Any, Callable, Iterator

import grain
import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import log
from transformer_jax.common.progress import progress
from transformer_jax.data import batching, number_words, staging, text_dataset
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer
from transformer_jax.workdir.layout import Workdir

Batch = dict[str, np.ndarray]


def _accept_any(identity: str) -> None:
  del identity


def resolve_dataset(
  config: ml_collections.ConfigDict,
  data_dir: str,
  check_identity: Callable[[str], None] = _accept_any,
) -> tuple[str, str | None]:
  """(the tfds name to read, the data's identity), preparing the datasets this package builds.

  'number_words[/config]' is generated offline; 'text' prepares the user's parallel files in
  config.data.dir (once per content: the name carries the files' hash); anything else must be
  a tfds dataset already prepared as array_record in data_dir, whose identity (None here) is
  read from it (`load_data_sources`). `check_identity` sees the identity before anything is
  prepared.
  """
  name = config.dataset
  if name.split('/')[0] == 'number_words':
    config_name = name.split('/')[1] if '/' in name else 'default'
    identity = _number_words_identity(config_name)
    check_identity(identity)
    number_words.prepare(data_dir, config_name)
    return f'number_words/{config_name}', identity
  if name == 'text':
    text_dir = paths.resolve(config.data.dir, 'config.data.dir')
    if paths.is_gcs(text_dir):  # Read from a local copy, like a prepared dataset.
      text_dir = staging.stage(text_dir.parent, text_dir.name) / text_dir.name
    src_paths, tgt_paths = text_dataset.text_paths(
      os.fspath(text_dir), config.data.src_lang, config.data.tgt_lang
    )
    # The name is the identity: it carries the hash of the files' contents (not their paths).
    name = text_dataset.prepare_text_dataset(
      src_path_by_split=src_paths,
      tgt_path_by_split=tgt_paths,
      data_dir=data_dir,
      src_lang=config.data.src_lang,
      tgt_lang=config.data.tgt_lang,
      max_chars=config.data.max_chars,
      check_name=check_identity,
    )
    return name, name
  return name, None


def _describe_dataset(name: str, version: object, examples: dict[str, int]) -> str:
  """One line: the name, version and example count of every split."""
  counts = ', '.join(f'{split} {examples[split]}' for split in sorted(examples))
  return f'{name} {version} ({counts})'


def _number_words_identity(config_name: str) -> str:
  """The generated task is its code's version and its variant's split sizes."""
  variant = number_words.NumberWords.builder_configs[config_name]
  sizes = {
    'train': variant.train_size,
    'validation': variant.validation_size,
    'test': variant.test_size,
  }
  return _describe_dataset(f'number_words/{config_name}', number_words.NumberWords.VERSION, sizes)


def load_data_sources(
  config: ml_collections.ConfigDict,
  data_dir: str | os.PathLike,
  check_identity: Callable[[str], None] = _accept_any,
) -> dict[str, Any]:
  """Random-access sources of every split of the (prepared) dataset, by split name, with its
  tfds 'name' and its 'identity' (a line that changes with its content, not with its path).

  A gs:// data_dir is read from a verified local copy (`staging.py`). The datasets this
  package builds itself, when the bucket does not hold them (`prepare_data` puts them there),
  are prepared straight into that local cache on each host.

  `check_identity` is called with the identity before anything is prepared (for a prepared
  tfds dataset, once it is opened): a resumed run refuses other data there, with nothing
  written.
  """
  data_dir = paths.resolve(data_dir, 'config.data_dir')
  if paths.is_gcs(data_dir):
    built_here = config.dataset == 'text' or config.dataset.split('/')[0] == 'number_words'
    if built_here and (config.dataset == 'text' or not (data_dir / config.dataset).exists()):
      data_dir = staging.local_data_dir(data_dir)
    else:
      data_dir = staging.stage(data_dir, config.dataset)
  data_dir = os.fspath(data_dir)
  name, identity = resolve_dataset(config, data_dir, check_identity)
  try:
    sources = tfds.data_source(name, data_dir=data_dir, try_gcs=False)
  except (tfds.core.registered.DatasetNotFoundError, FileNotFoundError, AssertionError) as error:
    raise UserInputError(
      f'dataset {config.dataset!r} is not prepared in {data_dir}: {str(error).splitlines()[0]}'
      f'{_did_you_mean(config.dataset)}'
    ) from None
  for split in (config.train_split, config.eval_split, config.test_split):
    if split not in sources:
      raise UserInputError(
        f'dataset {name!r} has no split {split!r} (it has '
        f'{", ".join(sorted(sources))}); set config.train_split / '
        'eval_split / test_split'
      )
  features = list(sources[config.train_split].dataset_info.features.keys())
  for field in ('src_lang', 'tgt_lang'):
    if config.data[field] not in features:
      raise UserInputError(
        f'config.data.{field}={config.data[field]!r}: dataset {name!r} has no such feature '
        f'(it has {", ".join(features)})'
      )
  if identity is None:  # A tfds dataset prepared elsewhere: what its metadata says of it.
    version = sources[config.train_split].dataset_info.version
    identity = _describe_dataset(name, version, {s: len(sources[s]) for s in sources})
    check_identity(identity)
  return {'name': name, 'identity': identity, **sources}


def _did_you_mean(name: str) -> str:
  """A hint when `name` is a near miss of a dataset this package builds itself."""
  close = difflib.get_close_matches(name.lower(), ['number_words', 'number_words/tiny', 'text'])
  return f" (did you mean config.dataset='{close[0]}'?)" if close else ''


def example_text(example: dict, key: str) -> str:
  value = example[key]
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def read_examples(
  source, start: int = 0, stop: int | None = None, chunk_size: int = 1024
) -> Iterator[dict]:
  """Examples [start, stop) of a tfds data source, in order, read in chunks.

  `source[i]` costs ~1 ms per call (a fresh array_record read each time); reading a chunk at once
  is >10x cheaper per example.
  """
  stop = len(source) if stop is None else min(stop, len(source))
  for chunk_start in range(start, stop, chunk_size):
    yield from source.__getitems__(list(range(chunk_start, min(chunk_start + chunk_size, stop))))


def training_sentences(source, config: ml_collections.ConfigDict) -> Iterator[str]:
  """Both sides of the first `vocab_max_examples` training pairs, for the shared vocabulary."""
  for example in read_examples(source, 0, config.vocab_max_examples):
    yield example_text(example, config.data.src_lang)
    yield example_text(example, config.data.tgt_lang)


def load_target_tokenizer(workdir: Workdir) -> Tokenizer | None:
  """The workdir's target-side segmentation (`Workdir.target_vocab_file`: the same ids as its
  vocabulary, e.g. an imported OPUS-MT model's target.spm), or None: one model segments both."""
  path = workdir.target_vocab_file
  return Tokenizer.load(path) if path.exists() else None


def load_or_train_tokenizer(
  config: ml_collections.ConfigDict, workdir: Workdir, train_source, *, trained: bool = False
) -> Tokenizer:
  """The workdir's vocabulary if it exists (a resumed run), else a new one trained and saved.

  A vocabulary of another size than config.vocab_size is kept only by a workdir whose run was
  saved (resuming then refuses the changed field, naming it) or that holds parameters
  (`trained`: they were trained with it, even if config.json was lost); one left by a run that
  failed before saving its config is stale, and is trained again. A workdir with parameters
  but no vocabulary is refused before this (`training.run_config.check_resume`).
  """
  path = workdir.vocab_file
  if path.exists():
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size == config.vocab_size or trained or workdir.read_run_config_if_present():
      return tokenizer
    log(
      f'{path} has {tokenizer.vocab_size} pieces but config.vocab_size={config.vocab_size}, and '
      'no run was saved in this workdir: training a new vocabulary'
    )
  try:
    tokenizer = Tokenizer.train(
      training_sentences(train_source, config),
      vocab_size=config.vocab_size,
      model_type=config.vocab_model_type,
      report=True,
      total=2 * min(config.vocab_max_examples, len(train_source)),  # training_sentences' count
    )
  except RuntimeError as error:  # SentencePiece reports bad settings as RuntimeError.
    raise UserInputError(
      f'config.vocab_size={config.vocab_size} / '
      f'config.vocab_model_type={config.vocab_model_type!r}: SentencePiece '
      f'cannot train this vocabulary: {str(error).strip()}'
    ) from None
  if jax.process_index() == 0:
    tokenizer.save(path)
  return tokenizer


class TokenizedSplit:
  """Token ids of every example of one split, in memory: {'inputs', 'targets'} per index.

  Tokenizing once (and caching the result in the workdir, next to the vocabulary it belongs
  to) means no epoch pays for reading, proto decoding and SentencePiece again. Ids are stored
  flat with offsets: inputs of example i are inputs_flat[inputs_offsets[i]:inputs_offsets[i+1]].
  Sequences carry their EOS.
  """

  _FIELDS = ('inputs_flat', 'inputs_offsets', 'targets_flat', 'targets_offsets')

  def __init__(self, arrays: dict[str, np.ndarray]):
    self._arrays = arrays

  def __len__(self) -> int:
    return len(self._arrays['inputs_offsets']) - 1

  def lengths(self) -> tuple[np.ndarray, np.ndarray]:
    """(source lengths, target lengths) of every example, EOS included."""
    return (np.diff(self._arrays['inputs_offsets']), np.diff(self._arrays['targets_offsets']))

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    arrays = self._arrays
    if not 0 <= index < len(self):
      raise IndexError(index)
    return {
      'inputs': arrays['inputs_flat'][
        arrays['inputs_offsets'][index] : arrays['inputs_offsets'][index + 1]
      ],
      'targets': arrays['targets_flat'][
        arrays['targets_offsets'][index] : arrays['targets_offsets'][index + 1]
      ],
    }

  @classmethod
  def build(
    cls,
    source,
    tokenizer: Tokenizer,
    config: ml_collections.ConfigDict,
    cache_path: str | os.PathLike | None = None,
    dataset_name: str = '',
    target_tokenizer: Tokenizer | None = None,
  ) -> 'TokenizedSplit':
    """Loads `cache_path` if it was made from the same source and vocabulary, else tokenizes
    (targets with target_tokenizer if given: `load_target_tokenizer`)."""
    identity = {
      'dataset': dataset_name,
      'keys': [config.data.src_lang, config.data.tgt_lang],
      'examples': len(source),
      'vocabulary': tokenizer.fingerprint,
    }
    if target_tokenizer is not None:
      identity['target_vocabulary'] = target_tokenizer.fingerprint
    fingerprint = json.dumps(identity, sort_keys=True)
    cache_path = paths.local_or_remote(cache_path) if cache_path else None
    if cache_path and cache_path.exists():
      with cache_path.open('rb') as f, np.load(f, allow_pickle=False) as cached:
        if str(cached['fingerprint']) == fingerprint:
          return cls({name: cached[name] for name in cls._FIELDS})

    # Chunk by chunk, straight into int32 arrays: at WMT14 size (4.5M pairs) lists of Python
    # ints for a whole split would take ~10 GB; this keeps peak memory near the result's size.
    chunks = {'inputs': [], 'targets': []}
    name = cache_path.name.removesuffix('.npz') if cache_path else dataset_name
    with progress(
      total=len(source), unit='pairs', description=f'tokenizing {name or "split"}'
    ) as bar:
      for chunk_start in range(0, len(source), _TOKENIZE_CHUNK):
        examples = list(read_examples(source, chunk_start, chunk_start + _TOKENIZE_CHUNK))
        for side, key, segmenter in (
          ('inputs', config.data.src_lang, tokenizer),
          ('targets', config.data.tgt_lang, target_tokenizer or tokenizer),
        ):
          ids = segmenter.encode_batch([example_text(example, key) for example in examples])
          chunks[side].append(_flatten([sequence + [EOS_ID] for sequence in ids]))
        bar.update(len(examples))
    split = cls._from_chunks(chunks)
    if cache_path and jax.process_index() == 0:
      buffer = io.BytesIO()
      np.savez(buffer, fingerprint=np.array(fingerprint), **split._arrays)
      # Whole or not at all: a crash never leaves half a cache.
      paths.write_atomically(cache_path, buffer.getvalue())
    return split

  @classmethod
  def from_sequences(cls, inputs: list, targets: list) -> 'TokenizedSplit':
    """From per-example id sequences (EOS included): example i is (inputs[i], targets[i])."""
    return cls._from_chunks({'inputs': [_flatten(inputs)], 'targets': [_flatten(targets)]})

  @classmethod
  def _from_chunks(cls, chunks: dict[str, list]) -> 'TokenizedSplit':
    arrays = {}
    for side, parts in chunks.items():
      lengths = np.concatenate([np.zeros((0,), np.int64)] + [length for length, _ in parts])
      arrays[f'{side}_offsets'] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
      arrays[f'{side}_flat'] = np.concatenate(
        [np.zeros((0,), np.int32)] + [flat for _, flat in parts]
      )
    return cls(arrays)


_TOKENIZE_CHUNK = 65_536


def _flatten(sequences: list) -> tuple[np.ndarray, np.ndarray]:
  """(lengths [n] int64, all ids concatenated [sum(lengths)] int32) of n id sequences."""
  lengths = np.fromiter((len(sequence) for sequence in sequences), np.int64, len(sequences))
  flat = np.fromiter(itertools.chain.from_iterable(sequences), np.int32, int(lengths.sum()))
  return lengths, flat


def tokenized_splits(
  sources: dict,
  tokenizer: Tokenizer,
  config: ml_collections.ConfigDict,
  workdir: Workdir,
  target_tokenizer: Tokenizer | None = None,
) -> dict[str, TokenizedSplit]:
  splits = {}
  for split in dict.fromkeys([config.train_split, config.eval_split, config.test_split]):
    splits[split] = TokenizedSplit.build(
      sources[split],
      tokenizer,
      config,
      workdir.token_cache_file(sources['name'], split),
      dataset_name=sources['name'],
      target_tokenizer=target_tokenizer,
    )
  return splits


def pad_batch(
  examples: list[dict],
  max_source_length: int,
  max_target_length: int,
  batch_size: int | None = None,
) -> Batch:
  """Stacks examples into right-padded int32 arrays; extra all-padding rows up to batch_size."""
  rows = batch_size or len(examples)
  inputs = np.zeros((rows, max_source_length), np.int32)
  targets = np.zeros((rows, max_target_length), np.int32)
  for row, example in enumerate(examples):
    source_ids = example['inputs'][:max_source_length]
    target_ids = example['targets'][:max_target_length]
    inputs[row, : len(source_ids)] = source_ids
    targets[row, : len(target_ids)] = target_ids
  return {'inputs': inputs, 'targets': targets}


class _Subset:
  """The examples of a split at `indices` (a random-access source for grain)."""

  def __init__(self, split, indices: np.ndarray):
    self._split, self._indices = split, indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int):
    return self._split[int(self._indices[index])]


def make_fixed_iterator(
  source: TokenizedSplit,
  config: ml_collections.ConfigDict,
  *,
  batch_size: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
) -> grain.DatasetIterator:
  """Endless, shuffled (a new order every epoch), fixed-shape batches of this process's shard.

  `batch_size` is this process's share of the global batch. Each process reads a disjoint slice
  of the data (every process_count-th example), so together they cover it once per epoch.
  Pairs longer than the maximum lengths are left out (decided up front from the lengths).
  """
  source_lengths, target_lengths = source.lengths()
  eligible = np.flatnonzero(
    (source_lengths <= config.max_source_length) & (target_lengths <= config.max_target_length)
  )
  # Each process needs one whole batch of its slice, or the iterator would end at once.
  if len(eligible) // process_count < batch_size:
    raise _too_few_pairs(config, len(eligible), len(source), batch_size * process_count)
  dataset = (
    grain.MapDataset.source(_Subset(source, eligible))
    .slice(slice(process_index, None, process_count))
    .shuffle(seed=seed)
    .repeat(None)
    .batch(
      batch_size,
      drop_remainder=True,
      batch_fn=lambda examples: pad_batch(
        list(examples), config.max_source_length, config.max_target_length
      ),
    )
  )
  # Whole batches are the unit of prefetching: per-example threads cost more in locking than
  # the work they parallelise (bench/README.md, "Optimisations tried").
  return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


class TrainIterator:
  """This process's endless training batches, resumable from `get_state()`.

  The state records the device layout the batch sequence depends on, and `set_state` refuses a
  different one: resuming on other devices would otherwise silently train on other batches
  than the interrupted run would have.
  """

  def __init__(self, iterator: grain.DatasetIterator, layout: dict[str, Any]):
    self._iterator = iterator
    self.layout = layout

  def __iter__(self) -> 'TrainIterator':
    return self

  def __next__(self) -> Batch:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return {'position': self._iterator.get_state(), 'layout': self.layout}

  def set_state(self, state: dict[str, Any]) -> None:
    if 'layout' not in state:  # Written before layouts were recorded: the position alone.
      self._iterator.set_state(state)
      return
    if state['layout'] != self.layout:
      saved, now = _describe_layout(state['layout']), _describe_layout(self.layout)
      raise UserInputError(
        f'the checkpoint was written by a run on {saved}, this one runs on {now}: its batches '
        'would differ from those the interrupted run was training on. Resume on the same '
        'devices, or start a new --workdir'
      )
    self._iterator.set_state(state['position'])


def _too_few_pairs(config, usable: int, total: int, batch: str | int) -> UserInputError:
  return UserInputError(
    f'only {usable:,} of the {total:,} training pairs fit max_source_length='
    f'{config.max_source_length} / max_target_length={config.max_target_length}, fewer than '
    f'one batch ({batch}): add data, raise the maximum lengths, or lower '
    f'config.per_device_batch_size / tokens_per_batch'
  )


def _describe_layout(layout: dict[str, Any]) -> str:
  if 'devices' in layout:
    return f'{layout["devices"]} devices'
  return f'{layout["process_count"]} process(es) x {layout["local_device_count"]} local devices'


def make_train_iterator(
  split: TokenizedSplit,
  config: ml_collections.ConfigDict,
  *,
  process_index: int = 0,
  process_count: int = 1,
  local_device_count: int = 1,
) -> TrainIterator:
  """The training batches of `config.batching`, for this process of the job.

  'fixed': `per_device_batch_size` pairs per device, padded to the maximum lengths; each
  process reads its own slice of the data, so the sequence depends on the process count and
  the devices per process. 'tokens' / 'packed': planned globally (`batching.py`), so the
  sequence depends only on the total device count; each process materialises its rows. With
  `grad_accum_steps` = k every batch is k micro-batches.
  """
  accumulation = config.grad_accum_steps
  max_length = max(config.max_source_length, config.max_target_length)
  planned = dict(
    tokens_per_batch=config.tokens_per_batch * accumulation,
    seed=config.seed,
    process_index=process_index,
    process_count=process_count,
    devices_per_process=local_device_count,
    micro_batches=accumulation,
  )
  if config.batching == 'fixed':
    iterator = make_fixed_iterator(
      split,
      config,
      batch_size=config.per_device_batch_size * local_device_count * accumulation,
      seed=config.seed,
      process_index=process_index,
      process_count=process_count,
    )
    return TrainIterator(
      iterator,
      {
        'batching': 'fixed',
        'process_count': process_count,
        'local_device_count': local_device_count,
      },
    )
  if config.batching == 'tokens':
    iterator, plan = batching.make_token_budget_iterator(
      split, max_length=max_length, bucket_growth=config.bucket_growth, **planned
    )
    if not plan.epoch(0):
      raise _too_few_pairs(config, len(plan.eligible), len(split), 'as planned')
    log(
      f'token-budget batches: buckets {plan.buckets}, rows {plan.rows}, '
      f'{len(plan.epoch(0))} batches per epoch, padding {plan.padding_fraction(0):.1%}, '
      f'{len(plan.eligible):,} of {len(split):,} pairs fit the maximum length'
    )
  elif config.batching == 'packed':
    iterator, plan = batching.make_packed_iterator(split, length=max_length, **planned)
    if not plan.epoch(0):
      raise _too_few_pairs(config, len(plan.eligible), len(split), 'as planned')
    log(
      f'packed batches: {plan.rows} rows of {max_length} tokens, {len(plan.epoch(0))} batches '
      f'per epoch, {plan.examples_per_row(0):.2f} pairs per row, padding '
      f'{plan.padding_fraction(0):.1%}, '
      f'{len(plan.eligible):,} of {len(split):,} pairs fit the maximum length'
    )
  else:
    raise UserInputError(
      f"config.batching must be 'fixed', 'tokens' or 'packed', got {config.batching!r}"
    )
  return TrainIterator(
    iterator, {'batching': config.batching, 'devices': process_count * local_device_count}
  )


def make_eval_batches(
  source: TokenizedSplit,
  config: ml_collections.ConfigDict,
  *,
  batch_size: int,
  max_examples: int | None = None,
) -> list[Batch]:
  """Every example of a split exactly once, in order; over-long ones truncated, never dropped.

  The last batch is filled up with all-padding rows (zero weight) so all batches share a shape.
  """
  count = len(source) if max_examples is None else min(len(source), max_examples)
  batches = []
  for start in range(0, count, batch_size):
    examples = [source[i] for i in range(start, min(start + batch_size, count))]
    batches.append(
      pad_batch(examples, config.max_source_length, config.max_target_length, batch_size)
    )
  return batches


def eval_texts(
  source, config: ml_collections.ConfigDict, max_examples: int | None = None
) -> tuple[list[str], list[str]]:
  """(sources, targets) as text, in split order (the first max_examples; None: all)."""
  examples = list(read_examples(source, 0, max_examples))
  return (
    [example_text(e, config.data.src_lang) for e in examples],
    [example_text(e, config.data.tgt_lang) for e in examples],
  )
