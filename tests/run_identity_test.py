"""A training run's identity is fixed (issue 26): config.json records the vocabulary's and the
data's identity; a resume that would change either is refused naming what differs, before any
file in the workdir changes; a lost vocabulary is an error, never trained again under a
checkpoint. The same corpus at another path resumes; a config.json written before identities
were recorded resumes and records it."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from transformer_jax.checkpoints.checkpointer import list_steps
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.paths import file_sha256
from transformer_jax.data import number_words
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.importers import workdir_writer
from transformer_jax.inference.translator import Translator
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import random_weight_translator, tiny_config

# What tiny_workdir was trained on: the generated task's version and split sizes.
TINY_DATA = 'number_words/tiny 2.0.0 (test 200, train 2000, validation 200)'


def _listing(path) -> dict:
  """Every file under `path` with its size, mtime and hash; the lock file aside (each run
  takes it, writing its pid, before anything is checked)."""
  files = {}
  for folder, _, names in os.walk(path):
    for name in names:
      if name.startswith('.lock'):
        continue
      file = os.path.join(folder, name)
      stat = os.stat(file)
      files[os.path.relpath(file, path)] = (stat.st_size, stat.st_mtime_ns, file_sha256(file))
  return files


def _latest_step(workdir) -> int:
  return list_steps(os.path.join(workdir, 'checkpoints'))[0][-1]


def _copy(workdir, tmp_path, name='workdir') -> str:
  copy = str(tmp_path / name)
  shutil.copytree(workdir, copy)
  return copy


def _write_corpus(folder, numbers) -> str:
  """DIR/{train,valid,test}.{en,de}: number words, the last 40 numbers for valid and test."""
  os.makedirs(folder)
  splits = {'train': numbers[:-40], 'valid': numbers[-40:-20], 'test': numbers[-20:]}
  for split, chosen in splits.items():
    for lang, words in (('en', number_words.english_words), ('de', number_words.german_words)):
      with open(os.path.join(folder, f'{split}.{lang}'), 'w') as f:
        f.write(''.join(f'{words(int(n))}\n' for n in chosen))
  return str(folder)


def _text_config(corpus: str):
  config = tiny_config('')  # No data_dir: the corpus is prepared into the workdir's data/.
  config.dataset = 'text'
  config.data.dir = corpus
  config.num_train_steps = 4
  return config


@pytest.fixture(scope='module')
def text_run(tmp_path_factory):
  """(workdir trained 4 steps on a text corpus, the corpus's folder)."""
  root = tmp_path_factory.mktemp('text_run')
  numbers = np.random.default_rng(0).integers(0, 1_000_000, 400)
  corpus = _write_corpus(root / 'corpus', numbers)
  workdir = str(root / 'workdir')
  loop.train_and_evaluate(_text_config(corpus), workdir)
  return workdir, corpus


def test_a_lost_vocabulary_is_an_error_and_leaves_the_workdir_as_it_was(
  tiny_workdir, data_dir, tmp_path
):
  workdir = _copy(tiny_workdir, tmp_path)
  os.remove(os.path.join(workdir, 'vocab.model'))
  before = _listing(workdir)
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  with pytest.raises(
    UserInputError,
    match=r'vocab\.model is missing, but the parameters in \S+/checkpoints were trained with it',
  ) as error:
    loop.train_and_evaluate(config, workdir)
  assert '\n' not in str(error.value)
  assert _listing(workdir) == before  # No vocabulary trained, no checkpoint, no config written.
  assert len(before) > 5  # (There was something to change: config.json, 2 checkpoints, ...)


def test_an_imported_model_without_its_vocabulary_is_refused(data_dir, tmp_path):
  translator = random_weight_translator()
  workdir = str(tmp_path / 'imported')
  workdir_writer.write(
    workdir,
    translator.model_config,
    translator.params,
    translator.tokenizer.model_bytes,
    {'format': 'test'},
  )
  os.remove(os.path.join(workdir, 'vocab.model'))
  before = _listing(workdir)
  with pytest.raises(UserInputError, match=r'vocab\.model is missing, but the parameters in '):
    loop.train_and_evaluate(tiny_config(data_dir), workdir)
  assert _listing(workdir) == before


def test_a_replaced_vocabulary_is_refused_naming_it(tiny_workdir, data_dir, tmp_path):
  workdir = _copy(tiny_workdir, tmp_path)
  vocab = os.path.join(workdir, 'vocab.model')
  old = file_sha256(vocab)
  # As many pieces (so that no config field differs), cut from other sentences.
  other = Tokenizer.train(
    [number_words.english_words(n) + ' ' + number_words.german_words(n) for n in range(500)],
    vocab_size=96,
  )
  assert other.vocab_size == 96
  other.save(vocab)
  new = file_sha256(vocab)
  assert new != old
  before = _listing(workdir)
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  message = (
    f'resuming with changed fields (vocabulary vocab.model: sha256 {old[:12]} -> sha256 {new[:12]})'
  )
  with pytest.raises(UserInputError, match=re.escape(message)):
    loop.train_and_evaluate(config, workdir)
  assert _listing(workdir) == before
  # Translating with it (translate, evaluate, serve, export all restore through Translator)
  # would give every piece another id: refused too, naming the file and both hashes.
  message = f'vocabulary vocab.model: sha256 {old[:12]} -> sha256 {new[:12]} since the parameters'
  with pytest.raises(UserInputError, match=re.escape(message)) as error:
    Translator.from_checkpoint(workdir)
  assert '\n' not in str(error.value)


def test_another_training_split_is_refused_naming_it(tiny_workdir, data_dir, tmp_path):
  # The data's identity names the dataset and its split sizes, not which split trains: without
  # config.train_split among the fixed fields, a resume trained on other data in silence.
  workdir = _copy(tiny_workdir, tmp_path)
  before = _listing(workdir)
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  config.train_split = 'validation'
  message = "resuming with changed fields (train_split: 'train' -> 'validation'); use a new"
  with pytest.raises(UserInputError, match=re.escape(message)) as error:
    loop.train_and_evaluate(config, workdir)
  assert '\n' not in str(error.value)
  assert _listing(workdir) == before


def test_another_corpus_is_refused_naming_the_data(text_run, tmp_path):
  trained, _ = text_run
  workdir = _copy(trained, tmp_path)
  numbers = np.random.default_rng(1).integers(0, 1_000_000, 400)
  other = _write_corpus(tmp_path / 'other_corpus', numbers)
  before = _listing(workdir)
  config = _text_config(other)
  config.num_train_steps = 8
  fingerprinted = r'parallel_text/en_de_[0-9a-f]{12}'
  with pytest.raises(
    UserInputError,
    match=rf'resuming with changed fields \(data: {fingerprinted} -> {fingerprinted}\)',
  ) as error:
    loop.train_and_evaluate(config, workdir)
  assert _listing(workdir) == before  # The other corpus was not even prepared into data/.
  recorded = json.loads(Workdir(workdir).config_file.read_text())['identity']['data']
  assert f'(data: {recorded} -> ' in str(error.value)


def test_the_same_corpus_copied_elsewhere_resumes(text_run, tmp_path):
  trained, corpus = text_run
  workdir = _copy(trained, tmp_path)
  recorded = json.loads(Workdir(workdir).config_file.read_text())['identity']
  elsewhere = str(tmp_path / 'copied_corpus')
  shutil.copytree(corpus, elsewhere)
  config = _text_config(elsewhere)
  config.num_train_steps = 8
  loop.train_and_evaluate(config, workdir)
  assert _latest_step(workdir) == 8
  assert json.loads(Workdir(workdir).config_file.read_text())['identity'] == recorded


def test_a_config_without_identity_resumes_and_records_it(tiny_workdir, data_dir, tmp_path):
  workdir = _copy(tiny_workdir, tmp_path)
  config_file = Workdir(workdir).config_file
  saved = json.loads(config_file.read_text())
  del saved['identity']  # As written before identities were recorded.
  config_file.write_text(json.dumps(saved))
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  loop.train_and_evaluate(config, workdir)
  assert _latest_step(workdir) == 12
  identity = json.loads(config_file.read_text())['identity']
  vocab_sha256 = file_sha256(os.path.join(workdir, 'vocab.model'))
  assert identity == {'vocab_sha256': vocab_sha256, 'data': TINY_DATA}


def test_a_vocabulary_under_checkpoints_is_never_trained_again(tiny_workdir, data_dir, tmp_path):
  # config.json lost too, and the vocabulary of another size than the config's: without
  # checkpoints it would be a stale one, trained again (input_pipeline_test); here it is theirs.
  workdir = _copy(tiny_workdir, tmp_path)
  os.remove(Workdir(workdir).config_file)
  vocab = os.path.join(workdir, 'vocab.model')
  sentences = [
    number_words.english_words(n) + ' ' + number_words.german_words(n) for n in range(500)
  ]
  Tokenizer.train(sentences, vocab_size=60).save(vocab)
  kept = file_sha256(vocab)
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  with pytest.raises(UserInputError, match=r'has shape \(96, 32\), the model expects \(60, 32\)'):
    loop.train_and_evaluate(config, workdir)
  assert file_sha256(vocab) == kept
