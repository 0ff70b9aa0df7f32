"""Times the data path at WMT14 size (4.5M pairs) on this machine; prints one line per stage.

    python bench/wmt_scale_data.py --pairs=4500000 --scratch=/tmp/wmt_scale \
        --multi30k=../shared/data/multi30k

WMT14 itself cannot be downloaded here, so the corpus is synthetic: each line joins two random
Multi30k sentences (~25 words, WMT14's average). Stages: preparing the text files as
array_record, training the paper's 37k BPE vocabulary on 1M sentences, tokenizing the whole
training split into the token cache, and planning the token-budget batches of an epoch (which
a run resumed in epoch e repeats e+1 times).
"""

import argparse
import os
import resource
import shutil
import time

import numpy as np

from transformer_jax.configs import base
from transformer_jax.data import batching, input_pipeline, text_dataset
from transformer_jax.data.tokenizer import Tokenizer


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _write_corpus(scratch: str, multi30k: str, pairs: int) -> str:
  text_dir = os.path.join(scratch, 'text')
  os.makedirs(text_dir, exist_ok=True)
  sides = {
    lang: open(os.path.join(multi30k, f'train.{lang}'), encoding='utf-8').read().splitlines()
    for lang in ('en', 'de')
  }
  rng = np.random.default_rng(0)
  for split, count in (('train', pairs), ('valid', 3000), ('test', 3003)):
    first = rng.integers(0, len(sides['en']), count)
    second = rng.integers(0, len(sides['en']), count)
    for lang, lines in sides.items():
      with open(os.path.join(text_dir, f'{split}.{lang}'), 'w', encoding='utf-8') as f:
        for chunk in range(0, count, 100_000):
          f.write(
            ''.join(
              f'{lines[a]} {lines[b]}\n'
              for a, b in zip(first[chunk : chunk + 100_000], second[chunk : chunk + 100_000])
            )
          )
  return text_dir


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--pairs', type=int, default=4_500_000)
  parser.add_argument('--scratch', default='/tmp/wmt_scale')
  parser.add_argument('--multi30k', default='../shared/data/multi30k')
  parser.add_argument('--epochs_to_plan', type=int, default=3)
  args = parser.parse_args()
  shutil.rmtree(args.scratch, ignore_errors=True)
  config = base.get_config()

  started = time.perf_counter()
  text_dir = _write_corpus(args.scratch, args.multi30k, args.pairs)
  size_mb = sum(os.path.getsize(os.path.join(text_dir, name)) for name in os.listdir(text_dir))
  print(
    f'corpus: {args.pairs:,} training pairs, {size_mb / 1e6:,.0f} MB of text, written in '
    f'{time.perf_counter() - started:.0f} s',
    flush=True,
  )

  started = time.perf_counter()
  src_paths, tgt_paths = text_dataset.text_paths(text_dir, 'en', 'de')
  name = text_dataset.prepare_text_dataset(
    src_path_by_split=src_paths,
    tgt_path_by_split=tgt_paths,
    data_dir=os.path.join(args.scratch, 'tfds'),
    src_lang='en',
    tgt_lang='de',
  )
  seconds = time.perf_counter() - started
  print(
    f'prepare (validate + write array_record): {seconds:.0f} s, '
    f'{args.pairs / seconds:,.0f} pairs/s, peak RSS {_peak_rss_gb():.1f} GB',
    flush=True,
  )

  config.dataset, config.data_dir = name, os.path.join(args.scratch, 'tfds')
  import tensorflow_datasets as tfds

  sources = tfds.data_source(name, data_dir=config.data_dir, try_gcs=False)
  started = time.perf_counter()
  tokenizer = Tokenizer.train(
    input_pipeline.training_sentences(sources['train'], config),
    vocab_size=config.vocab_size,
    model_type=config.vocab_model_type,
  )
  seconds = time.perf_counter() - started
  print(
    f'vocabulary ({config.vocab_size:,} BPE on {2 * config.vocab_max_examples:,} sentences):'
    f' {seconds:.0f} s, peak RSS {_peak_rss_gb():.1f} GB',
    flush=True,
  )

  started = time.perf_counter()
  split = input_pipeline.TokenizedSplit.build(
    sources['train'], tokenizer, config, os.path.join(args.scratch, 'token_cache.npz')
  )
  seconds = time.perf_counter() - started
  source_lengths, target_lengths = split.lengths()
  print(
    f'tokenize train split into the cache: {seconds:.0f} s, {len(split) / seconds:,.0f} '
    f'pairs/s, mean length {source_lengths.mean():.1f} / {target_lengths.mean():.1f} pieces,'
    f' cache {os.path.getsize(os.path.join(args.scratch, "token_cache.npz")) / 1e6:,.0f} MB,'
    f' peak RSS {_peak_rss_gb():.1f} GB',
    flush=True,
  )

  started = time.perf_counter()
  split = input_pipeline.TokenizedSplit.build(
    sources['train'], tokenizer, config, os.path.join(args.scratch, 'token_cache.npz')
  )
  print(f'load the token cache (a resumed run): {time.perf_counter() - started:.1f} s', flush=True)

  plan = batching.TokenBudgetPlan(
    source_lengths,
    target_lengths,
    tokens_per_batch=config.tokens_per_batch,
    max_length=config.max_source_length,
    seed=0,
  )
  started = time.perf_counter()
  sizes = [len(plan.epoch(epoch)) for epoch in range(args.epochs_to_plan)]
  seconds = (time.perf_counter() - started) / args.epochs_to_plan
  print(
    f'plan one epoch of token-budget batches: {seconds:.1f} s ({sizes[0]:,} batches of '
    f'{config.tokens_per_batch:,} tokens, padding {plan.padding_fraction():.1%}, '
    f'{plan.num_excluded:,} pairs over {config.max_source_length} pieces)',
    flush=True,
  )
  shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == '__main__':
  main()
