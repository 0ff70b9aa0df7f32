"""TokenizedSplit: chunked tokenization equals per-example encoding; the token cache; the
training iterator's resumable state."""

import os

import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import batching, input_pipeline
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config


def _tokenizer_and_sources(config, data_dir, vocab_size=96):
  sources = input_pipeline.load_data_sources(config, data_dir)
  texts = [
    t
    for e in input_pipeline.read_examples(sources['train'], 0, 500)
    for t in (e['en'].decode(), e['de'].decode())
  ]
  return Tokenizer.train(texts, vocab_size=vocab_size), sources


def test_build_across_chunk_boundaries_equals_per_example_encoding(data_dir, monkeypatch):
  config = tiny_config(data_dir)
  tokenizer, sources = _tokenizer_and_sources(config, data_dir)
  source = sources['validation']  # 200 examples: 29 chunks of 7.
  monkeypatch.setattr(input_pipeline, '_TOKENIZE_CHUNK', 7)
  split = input_pipeline.TokenizedSplit.build(source, tokenizer, config)
  assert len(split) == len(source) == 200
  for index in (0, 6, 7, 8, 199):
    example = source[index]
    np.testing.assert_array_equal(
      split[index]['inputs'], tokenizer.encode(example['en'].decode()) + [EOS_ID]
    )
    np.testing.assert_array_equal(
      split[index]['targets'], tokenizer.encode(example['de'].decode()) + [EOS_ID]
    )
    assert split[index]['inputs'].dtype == np.int32
  input_lengths, target_lengths = split.lengths()
  assert input_lengths.sum() == sum(
    len(tokenizer.encode(source[i]['en'].decode())) + 1 for i in range(200)
  )


def test_token_cache_is_reused_only_for_the_same_vocabulary(data_dir, tmp_path, monkeypatch):
  config = tiny_config(data_dir)
  tokenizer, sources = _tokenizer_and_sources(config, data_dir)
  cache = str(tmp_path / 'cache.npz')
  first = input_pipeline.TokenizedSplit.build(sources['test'], tokenizer, config, cache)
  assert os.path.exists(cache)
  # Same vocabulary: read back from the cache without tokenizing anything.
  monkeypatch.setattr(Tokenizer, 'encode_batch', lambda *_: 1 / 0)
  again = input_pipeline.TokenizedSplit.build(sources['test'], tokenizer, config, cache)
  for name in input_pipeline.TokenizedSplit._FIELDS:
    np.testing.assert_array_equal(first._arrays[name], again._arrays[name])
  monkeypatch.undo()
  # Another vocabulary: the cache is stale and rebuilt with the new ids.
  other, _ = _tokenizer_and_sources(config, data_dir, vocab_size=80)
  rebuilt = input_pipeline.TokenizedSplit.build(sources['test'], other, config, cache)
  np.testing.assert_array_equal(
    rebuilt[3]['inputs'], other.encode(sources['test'][3]['en'].decode()) + [EOS_ID]
  )


def test_train_iterator_state_resumes_and_names_a_changed_device_layout(data_dir):
  config = tiny_config(data_dir)
  tokenizer, sources = _tokenizer_and_sources(config, data_dir)
  split = input_pipeline.TokenizedSplit.build(sources['train'], tokenizer, config)
  iterator = input_pipeline.make_train_iterator(split, config)
  next(iterator)
  state = iterator.get_state()
  assert state['layout'] == {'batching': 'fixed', 'process_count': 1, 'local_device_count': 1}
  expected = next(iterator)
  resumed = input_pipeline.make_train_iterator(split, config)
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed)['inputs'], expected['inputs'])
  # A checkpoint of an older run holds the position alone: still accepted.
  resumed = input_pipeline.make_train_iterator(split, config)
  resumed.set_state(state['position'])
  np.testing.assert_array_equal(next(resumed)['inputs'], expected['inputs'])
  on_two = input_pipeline.make_train_iterator(split, config, local_device_count=2)
  with pytest.raises(
    UserInputError,
    match=r'written by a run on 1 process\(es\) x 1 local '
    r'devices, this one runs on 1 process\(es\) x 2',
  ):
    on_two.set_state(state)
  # Planned batches depend on the total device count only: 2 processes x 1 device = 1 x 2.
  config.batching = 'tokens'
  one_by_two = input_pipeline.make_train_iterator(split, config, local_device_count=2)
  two_by_one = input_pipeline.make_train_iterator(split, config, process_count=2)
  two_by_one.set_state(one_by_two.get_state())
  with pytest.raises(UserInputError, match='written by a run on 2 devices, this one runs on 1'):
    input_pipeline.make_train_iterator(split, config).set_state(one_by_two.get_state())


def test_a_stale_vocabulary_is_trained_again_unless_its_run_was_saved(data_dir, tmp_path):
  # A vocab.model left by a run that failed before saving its config, with another size.
  config = tiny_config(data_dir)
  stale, sources = _tokenizer_and_sources(config, data_dir, vocab_size=60)
  workdir = Workdir(str(tmp_path))
  stale.save(workdir.vocab_file)
  tokenizer = input_pipeline.load_or_train_tokenizer(config, workdir, sources['train'])
  assert (stale.vocab_size, tokenizer.vocab_size) == (60, config.vocab_size)
  assert Tokenizer.load(workdir.vocab_file).vocab_size == config.vocab_size  # Replaced.
  # With the run saved, the workdir's vocabulary stays: resuming then names the changed field.
  stale.save(workdir.vocab_file)
  workdir.write_run_config({'config': {'vocab_size': 60}, 'model': {}})
  kept = input_pipeline.load_or_train_tokenizer(config, workdir, sources['train'])
  assert kept.vocab_size == 60


def test_bucket_growth_sets_the_token_batches_lengths(data_dir):
  config = tiny_config(data_dir)
  tokenizer, sources = _tokenizer_and_sources(config, data_dir)
  split = input_pipeline.TokenizedSplit.build(sources['train'], tokenizer, config)
  config.batching = 'tokens'
  max_length = max(config.max_source_length, config.max_target_length)
  seen = {}
  for growth in (1.5, 1.2):
    config.bucket_growth = growth
    iterator = input_pipeline.make_train_iterator(split, config)
    seen[growth] = {next(iterator)['inputs'].shape[1] for _ in range(40)}
    buckets = set(batching.bucket_lengths(max_length, growth=growth))
    assert seen[growth] <= buckets, (growth, seen[growth], buckets)
  # The finer buckets give batch lengths the coarse ones never do.
  assert seen[1.2] - set(batching.bucket_lengths(max_length))
