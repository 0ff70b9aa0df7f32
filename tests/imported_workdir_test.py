"""A workdir made from a pretrained model (`workdir.imported`): it translates as the model it
was written from, and train.py fine-tunes it (loss falls), checkpoints and resumes, keeping the
imported architecture whatever the command line says."""

import logging
import re

import ctranslate2
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece
import tensorflow_datasets as tfds

from transformer_jax.checkpoints import averaging
from transformer_jax.common.errors import UserInputError
from transformer_jax.data import input_pipeline, number_words
from transformer_jax.data.tokenizer import EOS_ID, Tokenizer
from transformer_jax.evaluation import test_set
from transformer_jax.exporters import ctranslate2_runtime, ctranslate2_spec
from transformer_jax.importers import workdir_writer
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config

SENTENCES = ['twenty-one', 'three hundred five', 'one thousand', 'ninety-nine']


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """A random Marian-variant model (biases drawn at random) and a 96-piece vocabulary."""
  numbers = number_words.sample_numbers('train', 2000, seed=0)
  sentences = [number_words.english_words(n) for n in numbers]
  sentences += [number_words.german_words(n) for n in numbers]
  tokenizer = Tokenizer.train(sentences, vocab_size=96)
  path = tmp_path_factory.mktemp('vocab') / 'vocab.model'
  tokenizer.save(path)
  config = TransformerConfig(
    vocab_size=tokenizer.vocab_size,
    d_model=32,
    d_ff=64,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=32,
    attention_bias=True,
    logits_bias=True,
    ffn_activation='swish',
    sinusoid_layout='concatenated',
  )
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(Transformer(config).init(jax.random.PRNGKey(3), dummy, dummy)['params'])
  rng = np.random.default_rng(0)

  def randomise_bias(path, leaf):
    leaf = np.asarray(leaf, np.float32)
    if 'bias' not in jax.tree_util.keystr(path):
      return leaf
    return leaf + 0.3 * rng.standard_normal(leaf.shape).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(randomise_bias, params)
  return config, params, path.read_bytes()


def _shuffled_scores(vocabulary: bytes) -> Tokenizer:
  from sentencepiece import sentencepiece_model_pb2

  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(vocabulary)
  normal = [p for p in proto.pieces if p.type == p.NORMAL]
  scores = np.random.default_rng(0).permutation([p.score for p in normal])
  for piece, score in zip(normal, scores):
    piece.score = float(score)
  return Tokenizer(proto.SerializeToString())


def _write(pretrained, workdir, **kwargs):
  config, params, vocabulary = pretrained
  workdir_writer.write(str(workdir), config, params, vocabulary, {'format': 'test'}, **kwargs)


def test_an_imported_workdir_translates_as_the_model_it_was_written_from(pretrained, tmp_path):
  config, params, vocabulary = pretrained
  _write(pretrained, tmp_path / 'imported')
  loaded = Translator.from_checkpoint(str(tmp_path / 'imported'), batch_size=4)
  assert loaded.model_config == config
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(got), want)
  direct = Translator(config, params, Tokenizer(vocabulary), batch_size=4)
  assert loaded.translate(SENTENCES) == direct.translate(SENTENCES)
  # Exported as any workdir: CTranslate2 translates it as ours (greedy).
  out = ctranslate2_spec.export(str(tmp_path / 'imported'), str(tmp_path / 'ct2'))
  ct2 = ctranslate2.Translator(out, intra_threads=1)
  processor = sentencepiece.SentencePieceProcessor(model_proto=vocabulary)
  greedy = ctranslate2_runtime.translate(ct2, processor, SENTENCES, max_len=32, beam_size=1)
  assert greedy == loaded.translate(SENTENCES, beam_size=1)
  # `evaluate` scores it: BLEU is reported (config.json's dataset is 'text'; these one-word
  # outputs have no 4-grams, so it is 0), its hypotheses are ours.
  (tmp_path / 'src.txt').write_text('\n'.join(SENTENCES) + '\n')
  (tmp_path / 'ref.txt').write_text('\n'.join(loaded.translate(SENTENCES)) + '\n')
  scores = test_set.evaluate_files(
    str(tmp_path / 'imported'), str(tmp_path / 'src.txt'), str(tmp_path / 'ref.txt')
  )
  assert (scores['exact_match'], scores['chrf']) == (1.0, 100.0) and 'bleu' in scores, scores
  saved = Workdir(tmp_path / 'imported').read_run_config()
  assert saved['imported_from'] == {'format': 'test'} and saved['config']['dataset'] == 'text'


def test_writing_refuses_what_it_would_damage(pretrained, tmp_path):
  busy = tmp_path / 'busy'
  busy.mkdir()
  (busy / 'notes.txt').write_text('mine')
  with pytest.raises(UserInputError, match='is not empty and holds no untrained imported model'):
    _write(pretrained, busy, force=True)
  assert (busy / 'notes.txt').read_text() == 'mine'
  _write(pretrained, tmp_path / 'again')
  with pytest.raises(UserInputError, match=r'holds an imported model already; --force replaces'):
    _write(pretrained, tmp_path / 'again')
  _write(pretrained, tmp_path / 'again', force=True)
  config, params, vocabulary = pretrained
  with pytest.raises(ValueError, match='missing'):
    workdir_writer.write(
      str(tmp_path / 'partial'),
      config,
      {'encoder_layers': params['encoder_layers']},
      vocabulary,
      {},
    )


def test_train_py_fine_tunes_the_imported_model_then_resumes(
  pretrained, data_dir, tmp_path, caplog
):
  workdir = tmp_path / 'fine-tuned'
  # A target side segmented by its own model over the same pieces (as OPUS-MT's target.spm):
  # the vocabulary's piece scores shuffled, so that it cuts words elsewhere.
  targets = _shuffled_scores(pretrained[2])
  _write(pretrained, workdir, target_vocabulary=targets.model_bytes)
  config = tiny_config(data_dir)
  config.model.d_model = 48  # Not the imported model's: replaced by its 32 (logged).
  config.model.dropout_rate = 0.1  # A training field: the command line's.
  config.learning_rate_schedule = 'constant'
  config.learning_rate = 3e-3
  config.warmup_steps = 5
  config.num_train_steps = config.checkpoint_every_steps = 40
  config.log_every_steps = 10
  with caplog.at_level(logging.INFO):
    loop.train_and_evaluate(config, str(workdir))
  text = caplog.text
  assert 'its architecture and vocabulary replace the config (model.d_model: 48 -> 32' in text
  assert f'fine-tuning the imported model in {workdir / "imported"}' in text
  losses = [float(x) for x in re.findall(r'step \d+/40 \| loss ([0-9.]+)', text)]
  # Measured 3.95, 3.10, 2.67, 2.42 (mean loss of steps 1-10, ..., 31-40).
  assert len(losses) == 4 and losses == sorted(losses, reverse=True), losses
  assert losses[-1] < 0.7 * losses[0], losses
  saved = Workdir(workdir).read_run_config()
  assert saved['imported_from'] == {'format': 'test'}
  assert (saved['model']['d_model'], saved['model']['dropout_rate']) == (32, 0.1)
  # Training read its targets through the target model, its sources through the vocabulary.
  source = tfds.data_source('number_words/tiny', data_dir=data_dir, try_gcs=False)['train']
  (cache,) = Workdir(workdir).path.glob('token_cache/*-train.npz')
  vocabulary = Tokenizer(pretrained[2])
  with np.load(cache, allow_pickle=False) as arrays:
    split = input_pipeline.TokenizedSplit(
      {k: arrays[k] for k in input_pipeline.TokenizedSplit._FIELDS}
    )
  differ = 0
  for index in range(20):
    german, english = source[index]['de'].decode(), source[index]['en'].decode()
    assert list(split[index]['targets']) == [*targets.encode(german), EOS_ID]
    assert list(split[index]['inputs']) == [*vocabulary.encode(english), EOS_ID]
    differ += targets.encode(german) != vocabulary.encode(german)
  assert differ >= 5
  assert saved['config']['dataset'] == 'number_words/tiny'
  # Resuming follows the usual rules now: the same command goes on from step 40...
  caplog.clear()
  config.num_train_steps = 44
  with caplog.at_level(logging.INFO):
    loop.train_and_evaluate(config, str(workdir))
  assert 'at step 40' in caplog.text and 'fine-tuning the imported model' not in caplog.text
  # ... and another dataset is refused, as for any trained workdir.
  config.dataset = 'number_words/default'
  with pytest.raises(UserInputError, match=r'resuming with changed fields \(dataset'):
    loop.train_and_evaluate(config, str(workdir))
  # `average` (nothing to average in a fresh import) works once fine-tuning has checkpoints.
  assert averaging.average_checkpoints(str(workdir), last=2)['averaged_steps'] == [40, 44]
  # Translation now loads the fine-tuned parameters, no longer the imported ones.
  tuned = Translator.from_checkpoint(str(workdir)).params['shared_embedding']['embedding']
  imported = pretrained[1]['shared_embedding']['embedding']
  assert np.abs(np.asarray(tuned) - imported).max() > 1e-3


def test_the_servers_attention_segments_targets_as_the_translator(pretrained, tmp_path):
  """/v1/attention (`JaxEngine.attention`) on a workdir with its own target segmentation (an
  OPUS-MT import's target.spm): the translation's pieces and maps are `Translator.attention`'s,
  not those of the source vocabulary's segmentation."""
  from transformer_jax.serving.jax_engine import JaxEngine

  targets = _shuffled_scores(pretrained[2])
  _write(pretrained, tmp_path / 'imported', target_vocabulary=targets.model_bytes)
  translator = Translator.from_checkpoint(str(tmp_path / 'imported'), batch_size=4)
  sentence = 'three hundred twenty-seven thousand'
  expected = translator.attention(sentence, beam_size=1, alpha=0.6)
  # The two segmentations differ on this translation, so the test can tell them apart.
  assert targets.encode(translator.translate([sentence], 1)[0]) != translator.tokenizer.encode(
    translator.translate([sentence], 1)[0]
  )
  served = JaxEngine(translator, max_batch_size=2).attention(sentence, beam_size=1, alpha=0.6)
  assert served['target_tokens'] == expected.target_tokens
  assert served['source_tokens'] == expected.source_tokens
  np.testing.assert_allclose(np.asarray(served['cross_attention']), expected.cross, atol=1e-5)


def test_a_forced_import_killed_while_writing_keeps_the_old_workdir(
  pretrained, tmp_path, monkeypatch
):
  # Issue 51: --force used to remove the old imported workdir before writing the new one.
  _write(pretrained, tmp_path / 'model')
  before = {p.name: p.read_bytes() for p in (tmp_path / 'model').rglob('*') if p.is_file()}

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C (or a kill) while the new parameters are written.

  monkeypatch.setattr(workdir_writer.checkpointer, 'save_params', interrupted)
  with pytest.raises(KeyboardInterrupt):
    _write(pretrained, tmp_path / 'model', force=True)
  after = {p.name: p.read_bytes() for p in (tmp_path / 'model').rglob('*') if p.is_file()}
  assert after == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ['model']  # No staging folder left.
