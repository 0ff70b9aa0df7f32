"""TokenizedSplit: chunked tokenization equals per-example encoding; the token cache."""

import os

import numpy as np

from conftest import tiny_config
from transformer_jax import input_pipeline
from transformer_jax.tokenizer import EOS_ID, Tokenizer


def _tokenizer_and_sources(config, data_dir, vocab_size=96):
  sources = input_pipeline.load_data_sources(config, data_dir)
  texts = [t for e in input_pipeline.read_examples(sources['train'], 0, 500)
           for t in (e['en'].decode(), e['de'].decode())]
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
    np.testing.assert_array_equal(split[index]['inputs'],
                                  tokenizer.encode(example['en'].decode()) + [EOS_ID])
    np.testing.assert_array_equal(split[index]['targets'],
                                  tokenizer.encode(example['de'].decode()) + [EOS_ID])
    assert split[index]['inputs'].dtype == np.int32
  input_lengths, target_lengths = split.lengths()
  assert input_lengths.sum() == sum(len(tokenizer.encode(source[i]['en'].decode())) + 1
                                    for i in range(200))


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
  np.testing.assert_array_equal(rebuilt[3]['inputs'],
                                other.encode(sources['test'][3]['en'].decode()) + [EOS_ID])
