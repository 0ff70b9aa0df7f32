"""Tests for transformer_jax.data.number_words (number words + tfds builder)."""

import collections
import pathlib
import sys
import time

import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import number_words as nw

# (n, English, German). German follows standard orthography: one word below a
# million, 'eins' only at the very end, 'ein' before hundert/tausend/und.
CASES = [
  (0, 'zero', 'null'),
  (1, 'one', 'eins'),
  (5, 'five', 'fünf'),
  (7, 'seven', 'sieben'),
  (10, 'ten', 'zehn'),
  (11, 'eleven', 'elf'),
  (12, 'twelve', 'zwölf'),
  (13, 'thirteen', 'dreizehn'),
  (16, 'sixteen', 'sechzehn'),
  (17, 'seventeen', 'siebzehn'),
  (19, 'nineteen', 'neunzehn'),
  (20, 'twenty', 'zwanzig'),
  (21, 'twenty-one', 'einundzwanzig'),
  (30, 'thirty', 'dreißig'),
  (42, 'forty-two', 'zweiundvierzig'),
  (60, 'sixty', 'sechzig'),
  (66, 'sixty-six', 'sechsundsechzig'),
  (70, 'seventy', 'siebzig'),
  (71, 'seventy-one', 'einundsiebzig'),
  (77, 'seventy-seven', 'siebenundsiebzig'),
  (99, 'ninety-nine', 'neunundneunzig'),
  (100, 'one hundred', 'einhundert'),
  (101, 'one hundred one', 'einhunderteins'),
  (111, 'one hundred eleven', 'einhundertelf'),
  (115, 'one hundred fifteen', 'einhundertfünfzehn'),
  (200, 'two hundred', 'zweihundert'),
  (999, 'nine hundred ninety-nine', 'neunhundertneunundneunzig'),
  (1000, 'one thousand', 'eintausend'),
  (1001, 'one thousand one', 'eintausendeins'),
  (1100, 'one thousand one hundred', 'eintausendeinhundert'),
  (2021, 'two thousand twenty-one', 'zweitausendeinundzwanzig'),
  (10000, 'ten thousand', 'zehntausend'),
  (17017, 'seventeen thousand seventeen', 'siebzehntausendsiebzehn'),
  (100000, 'one hundred thousand', 'einhunderttausend'),
  (201000, 'two hundred one thousand', 'zweihunderteintausend'),
  (211000, 'two hundred eleven thousand', 'zweihundertelftausend'),
  (342005, 'three hundred forty-two thousand five', 'dreihundertzweiundvierzigtausendfünf'),
  (
    999999,
    'nine hundred ninety-nine thousand nine hundred ninety-nine',
    'neunhundertneunundneunzigtausendneunhundertneunundneunzig',
  ),
  (1000000, 'one million', 'eine Million'),
  (1000001, 'one million one', 'eine Million eins'),
  (1000100, 'one million one hundred', 'eine Million einhundert'),
  (2000000, 'two million', 'zwei Millionen'),
  (2300001, 'two million three hundred thousand one', 'zwei Millionen dreihunderttausendeins'),
  (
    3500021,
    'three million five hundred thousand twenty-one',
    'drei Millionen fünfhunderttausendeinundzwanzig',
  ),
  (16000000, 'sixteen million', 'sechzehn Millionen'),
  (21000000, 'twenty-one million', 'einundzwanzig Millionen'),
  (101000000, 'one hundred one million', 'einhunderteins Millionen'),
  (
    999999999,
    'nine hundred ninety-nine million nine hundred ninety-nine thousand nine hundred ninety-nine',
    'neunhundertneunundneunzig Millionen neunhundertneunundneunzigtausendneunhundertneunundneunzig',
  ),
]


@pytest.mark.parametrize('n,english,german', CASES)
def test_words_table(n, english, german):
  assert nw.english_words(n) == english
  assert nw.german_words(n) == german


@pytest.mark.parametrize('fn', [nw.english_words, nw.german_words])
@pytest.mark.parametrize('n', [-1, 1_000_000_000])
def test_out_of_range_raises(fn, n):
  with pytest.raises(ValueError):
    fn(n)


def test_words_are_injective_and_well_formed():
  # A translation dataset needs distinct sources and targets for distinct n.
  numbers = list(range(0, 20_000)) + nw.sample_numbers('train', 5_000, seed=1)
  english = [nw.english_words(n) for n in numbers]
  german = [nw.german_words(n) for n in numbers]
  assert len(set(english)) == len(set(german)) == len(set(numbers))
  for n, en, de in zip(numbers, english, german):
    assert en == en.lower() and ' and ' not in en and '  ' not in en
    # Always 'einhundert'/'eintausend', never a bare leading 'hundert'.
    assert not de.startswith(('hundert', 'tausend')), (n, de)
    if n < 1_000_000:
      assert ' ' not in de and de == de.lower()
    # 'eins' exactly when the number ends in 01 ('einundzwanzig', 'elf').
    assert de.endswith('eins') == (n % 100 == 1), (n, de)


def test_split_of_fractions_and_stability():
  counts = collections.Counter(nw.split_of(n) for n in range(100_000))
  assert set(counts) == {'train', 'validation', 'test'}
  assert counts['train'] / 100_000 == pytest.approx(0.94, abs=0.01)
  assert counts['validation'] / 100_000 == pytest.approx(0.03, abs=0.005)
  assert counts['test'] / 100_000 == pytest.approx(0.03, abs=0.005)
  # A pure function of n (and so disjoint by construction), stable across calls.
  assert [nw.split_of(n) for n in range(1000)] == [nw.split_of(n) for n in range(1000)]


CATEGORY_CASES = [
  (0, 'zero'),
  (1, 'units'),
  (9, 'units'),
  (10, 'teens'),
  (19, 'teens'),
  (20, 'tens'),
  (21, 'tens'),
  (99, 'tens'),
  (100, 'round'),
  (120, 'round'),
  (1000, 'round'),
  (2000, 'round'),
  (10000, 'round'),
  (342000, 'round'),
  (21000000, 'round'),
  (999000000, 'round'),
  (3420000, 'round'),  # 342 x 10^4: three significant digits.
  (3421000, 'millions'),  # Four.
  (101, 'ends_in_one'),
  (121, 'ends_in_one'),
  (21000001, 'ends_in_one'),
  (111, 'other'),  # Ends in eleven, not in one.
  (1011, 'other'),
  (342005, 'other'),
  (999999, 'other'),
  (1000002, 'millions'),
  (999999999, 'millions'),
]


@pytest.mark.parametrize('n,category', CATEGORY_CASES)
def test_category_of(n, category):
  assert nw.category_of(n) == category
  assert nw.category_of_sentence(nw.english_words(n)) == category


def test_the_inputs_people_type_first_are_categorised():
  # The examples, which the old distribution almost never trained on.
  assert nw.category_of_sentence('one thousand') == 'round'
  assert nw.category_of_sentence('ten thousand') == 'round'
  assert nw.category_of_sentence('twenty-one million one') == 'ends_in_one'
  assert nw.category_of_sentence('one') == 'units'
  assert nw.category_of_sentence('zero') == 'zero'
  assert nw.category_of_sentence('  seven\n') == 'units'


def test_number_from_english_inverts_english_words():
  numbers = list(range(0, 3000)) + nw.sample_numbers('test', 2000, seed=3) + [nw.MAX_NUMBER]
  assert [nw.number_from_english(nw.english_words(n)) for n in numbers] == numbers


@pytest.mark.parametrize(
  'text',
  [
    '',
    'hundred',
    'two zero',
    'one one',
    'twenty-zero',
    'twenty-ten',
    'Seven',
    'seven  two',
    'thousand',
    'one hundred and one',
    'one thousand million',
    'dreihundert',
    'eleven-one',
  ],
)
def test_number_from_english_rejects_what_no_number_is_written_as(text):
  assert nw.number_from_english(text) is None
  assert nw.category_of_sentence(text) is None


def test_category_of_rejects_out_of_range():
  with pytest.raises(ValueError):
    nw.category_of(-1)


def _in_split(n: int, split: str) -> bool:
  # The lexicon numbers belong to every split; the others to the one `split_of` names.
  return n < nw.LEXICON_LIMIT or nw.split_of(n) == split


def test_numbers_below_100_are_in_every_split_and_the_rest_in_one():
  assert all(_in_split(n, split) for n in range(100) for split in nw.SPLITS)
  for n in range(100, 5000):
    assert [_in_split(n, split) for split in nw.SPLITS].count(True) == 1, n


def test_round_numbers_are_enumerated_exactly():
  pools = {split: nw._round_numbers(split) for split in nw.SPLITS}
  every = [n for pool in pools.values() for numbers in pool.values() for n in numbers]
  # 90 with 3 digits (9 + 81), then 900 for each digit count 4..9 (9 + 81 + 810).
  assert len(every) == len(set(every)) == 90 + 6 * 900
  assert all(nw.category_of(n) == 'round' for n in every)
  assert sorted(n for n in range(100, 100_000) if nw.category_of(n) == 'round') == sorted(
    n for n in every if n < 100_000
  )
  for split, pool in pools.items():
    assert all(nw.split_of(n) == split for numbers in pool.values() for n in numbers)


def test_training_draws_every_category_by_its_weight():
  numbers = nw.sample_numbers('train', 40_000, seed=0)
  assert numbers == nw.sample_numbers('train', 40_000, seed=0)
  assert numbers[:1000] == nw.sample_numbers('train', 1000, seed=0)  # A prefix.
  assert numbers != nw.sample_numbers('train', 40_000, seed=1)
  assert all(_in_split(n, 'train') for n in numbers)
  counts = collections.Counter(nw.category_of(n) for n in numbers)
  assert set(counts) == set(nw.CATEGORIES)
  for category, weight in nw.TRAIN_WEIGHTS.items():
    assert counts[category] / len(numbers) == pytest.approx(weight, abs=0.01), category
  assert set(range(100)) <= set(numbers)  # Every lexicon number, many times over.
  # Round numbers at every magnitude, from 100 to hundreds of millions.
  assert {len(str(n)) for n in numbers if counts and nw.category_of(n) == 'round'} == set(
    range(3, 10)
  )


@pytest.mark.parametrize('split', ['validation', 'test'])
def test_evaluation_splits_hold_distinct_numbers_of_every_category(split):
  numbers = nw.sample_numbers(split, 2_000, seed=0)
  assert numbers == nw.sample_numbers(split, 2_000, seed=0)
  assert len(numbers) == len(set(numbers)) == 2_000
  assert all(_in_split(n, split) for n in numbers)
  counts = collections.Counter(nw.category_of(n) for n in numbers)
  # All of 0..99, every round number the split owns (fewer than its 10% share), then shares.
  round_owned = sum(len(pool) for pool in nw._round_numbers(split).values())
  assert round_owned < 200
  assert {k: counts[k] for k in ('zero', 'units', 'teens', 'tens', 'round')} == {
    'zero': 1,
    'units': 9,
    'teens': 10,
    'tens': 80,
    'round': round_owned,
  }
  assert counts['ends_in_one'] == 400 and counts['millions'] == 600
  assert counts['other'] == 2_000 - 100 - round_owned - 1000
  # Shuffled: the first 100 (eval_decode_examples) already mix the categories.
  assert len({nw.category_of(n) for n in numbers[:100]}) >= 5


def test_the_default_test_split_sizes():
  # What docs/training.md's per-category table rests on (seed 0, 2,000 test sentences).
  counts = collections.Counter(nw.category_of(n) for n in nw.sample_numbers('test', 2000, 0))
  assert dict(counts) == {
    'zero': 1,
    'units': 9,
    'teens': 10,
    'tens': 80,
    'round': 151,
    'ends_in_one': 400,
    'millions': 600,
    'other': 749,
  }


def test_sample_numbers_rejects_bad_split():
  with pytest.raises(ValueError):
    nw.sample_numbers('dev', 10, seed=0)


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  nw.prepare(data_dir, 'tiny')
  return data_dir


def test_prepare_twice_reuses(tiny_dir):
  files = sorted(pathlib.Path(tiny_dir).rglob('*.array_record-*'))
  assert len(files) == 3  # One shard per split.
  mtimes = [p.stat().st_mtime_ns for p in files]
  start = time.perf_counter()
  nw.prepare(tiny_dir, 'tiny')
  assert time.perf_counter() - start < 2.0
  assert [p.stat().st_mtime_ns for p in files] == mtimes


def test_tiny_data_source(tiny_dir):
  sources = tfds.data_source('number_words/tiny', data_dir=tiny_dir, try_gcs=False)
  config = nw.NumberWords.builder_configs['tiny']
  sizes = {
    'train': config.train_size,
    'validation': config.validation_size,
    'test': config.test_size,
  }
  assert {split: len(source) for split, source in sources.items()} == sizes

  pairs = {}
  for split, source in sources.items():
    records = [source[i] for i in range(len(source))]
    assert all(isinstance(r['en'], bytes) and isinstance(r['de'], bytes) for r in records)
    pairs[split] = {(r['en'].decode(), r['de'].decode()) for r in records}
    # The builder's keys are the numbers sample_numbers draws (seed 0).
    expected = {
      (nw.english_words(n), nw.german_words(n))
      for n in nw.sample_numbers(split, sizes[split], seed=0)
    }
    assert pairs[split] == expected
  # Disjoint but for 0..99, the task's words, which every split holds.
  lexicon = {nw.english_words(n) for n in range(100)}
  english = {split: {en for en, _ in p} - lexicon for split, p in pairs.items()}
  assert not english['test'] & english['train']
  assert not english['validation'] & english['train']
  assert not english['test'] & english['validation']


def test_builder_metadata(tiny_dir):
  builder = nw.NumberWords(config='tiny', data_dir=tiny_dir)
  assert builder.name == 'number_words'
  assert str(builder.version) == '2.0.0'
  assert builder.info.supervised_keys == ('en', 'de')
  assert str(builder.info.file_format.value) == 'array_record'


def test_tensorflow_not_imported(tiny_dir):
  del tiny_dir  # Ensures preparation has run in this process.
  assert 'tensorflow' not in sys.modules


def test_preparing_says_it_generates_and_prints_no_download_line(tmp_path, capsys, caplog):
  caplog.set_level('INFO')
  nw.prepare(str(tmp_path), 'tiny')
  assert 'Downloading' not in capsys.readouterr().out
  assert 'generating number_words/tiny: 2,000/200/200 train/validation/test pairs' in caplog.text
