"""Subword regularisation at training time (`config.subword_sampling`, data/subword_sampling.py):
every epoch's segmentation is a fresh, reproducible sample that spells the same text; the batch
plans follow each epoch's lengths; a resumed iterator and a resumed run see what an uninterrupted
one sees."""

import json

import jax
import numpy as np
import pytest

from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common.errors import UserInputError
from transformer_jax.data import batching
from transformer_jax.data.subword_sampling import SampledSplit
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config

WORDS = 'the a young man woman dog runs jumps over under near outside bushes street water'.split()


@pytest.fixture(scope='module')
def corpus():
  rng = np.random.default_rng(0)
  sentences = [' '.join(rng.choice(WORDS, size=rng.integers(2, 9))) for _ in range(600)]
  targets = [' '.join(reversed(s.split())) for s in sentences]
  tokenizer = Tokenizer.train(sentences + targets, vocab_size=120)
  return sentences, targets, tokenizer


def _split(corpus, alpha=0.3, seed=7):
  sentences, targets, tokenizer = corpus
  return SampledSplit(sentences, targets, tokenizer, alpha=alpha, seed=seed)


def _sequences(split, side):
  return [split[i][side].tolist() for i in range(len(split))]


def test_each_epoch_is_a_fresh_reproducible_segmentation_of_the_same_text(corpus):
  sentences, targets, tokenizer = corpus
  split = _split(corpus)
  epoch0, epoch1 = split.for_epoch(0), split.for_epoch(1)
  again = _split(corpus).for_epoch(1)  # Another instance, epoch 1 first.
  assert _sequences(again, 'inputs') == _sequences(epoch1, 'inputs')
  assert _sequences(again, 'targets') == _sequences(epoch1, 'targets')
  assert _sequences(epoch0, 'inputs') != _sequences(epoch1, 'inputs')
  assert _sequences(_split(corpus, seed=8).for_epoch(1), 'inputs') != _sequences(epoch1, 'inputs')
  best = [tokenizer.encode(s) + [EOS_ID] for s in sentences]
  for epoch in (epoch0, epoch1):
    for side, texts in (('inputs', sentences), ('targets', targets)):
      sampled = _sequences(epoch, side)
      assert all(ids[-1] == EOS_ID for ids in sampled)
      assert [tokenizer.decode(ids) for ids in sampled] == texts
    # Dropping merges spells words in more, shorter pieces; most sentences change.
    lengths = epoch.lengths()[0]
    assert lengths.mean() > 1.2 * np.mean([len(ids) for ids in best])
    assert sum(a != b for a, b in zip(_sequences(epoch, 'inputs'), best)) > len(best) / 2
  # Source and target sides draw from their own seeds.
  assert split.segment_seed(1, 0) != split.segment_seed(1, 1) != split.segment_seed(2, 1)


def _batches(iterator, count):
  return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize('mode', ['tokens', 'packed'])
def test_batches_follow_each_epochs_segmentation_and_resume_exactly(corpus, mode):
  split = _split(corpus)
  if mode == 'tokens':
    make = lambda: batching.make_token_budget_iterator(  # noqa: E731
      split, tokens_per_batch=256, max_length=32, seed=3
    )
  else:
    make = lambda: batching.make_packed_iterator(  # noqa: E731
      split, tokens_per_batch=256, length=32, seed=3
    )
  iterator, plan = make()
  sizes = [len(plan.epoch(e)) for e in range(3)]
  # The plans are made from each epoch's own lengths.
  assert not np.array_equal(plan.lengths_of(1).source, plan.lengths_of(0).source)
  assert np.array_equal(plan.lengths_of(2).source, split.epoch_lengths(2)[0])
  seen = _batches(iterator, sum(sizes))
  for epoch in range(3):
    segmentation = split.for_epoch(epoch)
    start = sum(sizes[:epoch])
    for batch, members in zip(seen[start : start + sizes[epoch]], plan.epoch(epoch)):
      rows = members[1] if mode == 'tokens' else [m for row in members for m in row]
      # Every sampled source of the epoch appears whole in its batch, as that epoch spells it.
      flat = batch['inputs'].reshape(-1).tolist()
      for index in rows[:5]:
        ids = segmentation[int(index)]['inputs'].tolist()
        assert any(flat[i : i + len(ids)] == ids for i in range(len(flat) - len(ids) + 1))
  # Resume inside epoch 1: the same batches as the uninterrupted iterator's.
  position = sizes[0] + 3
  iterator, _ = make()
  _batches(iterator, position)
  state = json.loads(json.dumps(iterator.get_state()))
  fresh, _ = make()
  fresh.set_state(state)
  for ours, theirs in zip(_batches(fresh, sizes[1]), seen[position : position + sizes[1]]):
    assert ours.keys() == theirs.keys()
    for key in ours:
      np.testing.assert_array_equal(ours[key], theirs[key])


def _final_params(workdir):
  with Checkpointer(Workdir(str(workdir)).checkpoints, async_save=False) as checkpointer:
    assert checkpointer.latest_step() == 8
    return checkpointer.restore_params_to_host(8)


def _sampling_config(data_dir):
  config = tiny_config(data_dir)
  config.batching = 'tokens'
  config.tokens_per_batch = 512
  config.subword_sampling = 0.1
  return config


def test_a_run_with_subword_sampling_resumes_exactly_as_it_runs_uninterrupted(tmp_path, data_dir):
  config = _sampling_config(data_dir)
  config.num_train_steps = 8
  loop.train_and_evaluate(config, str(tmp_path / 'whole'))
  config.num_train_steps = 4
  loop.train_and_evaluate(config, str(tmp_path / 'halves'))
  config.num_train_steps = 8
  loop.train_and_evaluate(config, str(tmp_path / 'halves'))
  params = [_final_params(tmp_path / name) for name in ('whole', 'halves')]
  jax.tree_util.tree_map(np.testing.assert_array_equal, *params)
  # And sampling changed what was learned (the same run without it differs).
  config.subword_sampling = 0.0
  loop.train_and_evaluate(config, str(tmp_path / 'plain'))
  plain = _final_params(tmp_path / 'plain')
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(params[0]))
  )


@pytest.mark.parametrize(
  'changes, message',
  [
    ({'subword_sampling': 1.0}, r'^config\.subword_sampling must be in \[0, 1\), got 1\.0$'),
    ({'subword_sampling': -0.1}, r'^config\.subword_sampling must be in \[0, 1\), got -0\.1$'),
    ({'bucket_growth': 1.0}, r'^config\.bucket_growth must be a number in \(1, 4\], got 1\.0$'),
    ({'bucket_growth': float('nan')}, r'^config\.bucket_growth must be a number in \(1, 4\]'),
    (
      {'batching': 'fixed'},
      r"^config\.subword_sampling needs config\.batching='tokens' or 'packed'",
    ),
    (
      {'vocab_model_type': 'char'},
      r"^config\.subword_sampling samples 'bpe' or 'unigram' segmentations, not "
      r"config\.vocab_model_type='char'$",
    ),
  ],
)
def test_bad_settings_are_one_line_before_any_data_work(tmp_path, data_dir, changes, message):
  config = _sampling_config(data_dir)
  config.update(changes)
  with pytest.raises(UserInputError, match=message):
    loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run' / 'vocab.model').exists()
