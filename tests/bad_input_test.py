"""Mistakes a new user makes, each a one-line error naming the file, line or field.

Entry points turn these exceptions (UserInputError, FileNotFoundError, CorruptCheckpointError)
into `error: <message>` and exit status 2. The tables:

* CASES: the library and the Python API, in-process (fast);
* FIELD_CASES: config fields, each refused before any data is prepared or anything written;
* API_CASES: Python API mistakes of inference/ and evaluation/;
* COMMAND_CASES: every command run as a user runs it (a subprocess each, so few): exit status
  2, one `error:` line, no traceback, nothing written.
"""

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax.benchmark import runner as benchmark_runner
from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.cli import checkpoint_flag_value
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.text_io import read_lines
from transformer_jax.configs import default
from transformer_jax.data import input_pipeline, text_dataset, tfds_prepare
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.evaluation import test_set
from transformer_jax.inference import attention_plots
from transformer_jax.inference.text_files import translate_text
from transformer_jax.inference.translator import Translator, check_decoding_options
from transformer_jax.model.config import TransformerConfig
from transformer_jax.search import decode
from transformer_jax.training import loop

from conftest import REPO_ROOT, random_weight_translator, tiny_config


def _write(path, data: bytes):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(data)
  return str(path)


def _prepare(tmp, src: bytes, tgt: bytes):
  return text_dataset.prepare_text_dataset(
    src_path_by_split={'train': _write(tmp / 'f' / 'train.en', src)},
    tgt_path_by_split={'train': _write(tmp / 'f' / 'train.de', tgt)},
    data_dir=str(tmp / 'data'),
    src_lang='en',
    tgt_lang='de',
  )


def _train(tmp, data_dir, **changes):
  loop.train_and_evaluate(_changed(tiny_config(data_dir), changes), str(tmp / 'workdir'))


def _translator_workdir(tmp, config_json: bytes | None = b'{}', vocab: bytes | None = None):
  workdir = tmp / 'w'
  os.makedirs(workdir, exist_ok=True)
  if config_json is not None:
    _write(workdir / 'config.json', config_json)
  if vocab is not None:
    _write(workdir / 'vocab.model', vocab)
  return Translator.from_checkpoint(str(workdir))


_VALID_MODEL = json.dumps(
  {'config': {}, 'model': TransformerConfig(vocab_size=8).to_dict()}
).encode()

# (case id, callable taking (tmp_path, data_dir), expected exception, regex the message matches)
CASES = [
  (
    'unaligned parallel files',
    lambda t, d: _prepare(t, b'a\nb\nc\n', b'x\ny\n'),
    UserInputError,
    r'train\.en has 3 lines, .*train\.de has 2',
  ),
  (
    'invalid utf-8',
    lambda t, d: _prepare(t, b'ok\n\xff\xfe bad\n', b'gut\nschlecht\n'),
    UserInputError,
    r'train\.en.*line 2',
  ),
  (
    'binary file',
    lambda t, d: _prepare(t, b'ok\n\x00\x01\x02\n', b'a\nb\n'),
    UserInputError,
    r'train\.en line 2: NUL byte',
  ),
  (
    'empty files',
    lambda t, d: _prepare(t, b'', b''),
    UserInputError,
    r'no usable train pairs in .*train\.en / .*train\.de: the files are empty',
  ),
  (
    'only empty pairs',
    lambda t, d: _prepare(t, b'\n \n', b'x\n\n'),
    UserInputError,
    r'no usable train pairs .*dropped 2 of 2 pairs: 2 with an empty side',
  ),
  (
    'CR-only line endings',
    lambda t, d: _prepare(t, b'a\rb\r', b'c\rd\r'),
    UserInputError,
    r'train\.en line 1: the file uses CR-only',
  ),
  (
    'missing train file',
    lambda t, d: text_dataset.text_paths(str(t), 'en', 'de'),
    UserInputError,
    r'missing train file .*train\.en',
  ),
  (
    'missing text directory',
    lambda t, d: text_dataset.text_paths(str(t / 'nope'), 'en', 'de'),
    UserInputError,
    r'nope does not exist',
  ),
  (
    'missing vocabulary',
    lambda t, d: Tokenizer.load(str(t / 'vocab.model')),
    FileNotFoundError,
    r'vocab\.model',
  ),
  (
    'garbage vocabulary',
    lambda t, d: Tokenizer.load(_write(t / 'vocab.model', b'\x00junk')),
    UserInputError,
    r'vocab\.model: not a valid SentencePiece model',
  ),
  (
    'mismatched vocabulary',
    lambda t, d: _translator_workdir(
      t,
      _VALID_MODEL,
      vocab=Tokenizer.train(
        ['a b c d e f g h'] * 50, vocab_size=20
      )._processor.serialized_model_proto(),
    ),
    UserInputError,
    r'vocab\.model: vocabulary has 20 pieces but the model .* expects 8',
  ),
  (
    'workdir without checkpoints, translate',
    lambda t, d: _translator_workdir(t, None),
    FileNotFoundError,
    r'config\.json not found',
  ),
  (
    'config.json an empty object',
    lambda t, d: _translator_workdir(t, b'{}'),
    UserInputError,
    r'config\.json: not a run config written by train\.py \(its "config" '
    r'section is missing\)',
  ),
  (
    'config.json a list',
    lambda t, d: _translator_workdir(t, b'[]'),
    UserInputError,
    r'config\.json: expected a JSON object, got list',
  ),
  (
    'config.json with a null model',
    lambda t, d: _translator_workdir(t, b'{"config": {}, "model": null}'),
    UserInputError,
    r'config\.json: not a run config written by train\.py \(its "model" section is None\)',
  ),
  (
    'config.json in UTF-16',
    lambda t, d: _translator_workdir(t, '{}'.encode('utf-16')),
    UserInputError,
    r'config\.json: not UTF-8 text',
  ),
  (
    'config.json a directory',
    lambda t, d: (os.makedirs(t / 'w' / 'config.json'), _translator_workdir(t, None)),
    UserInputError,
    r'config\.json: is a directory, not the saved run config',
  ),
  (
    'a corpus smaller than one batch',
    lambda t, d: _train(t, d, per_device_batch_size=4096),
    UserInputError,
    r'only [0-9,]+ of the 2,000 training pairs fit max_source_length=24 / '
    r'max_target_length=16, fewer than one batch \(4096\)',
  ),
  (
    'corrupt config.json',
    lambda t, d: _translator_workdir(t, b'{"model": '),
    UserInputError,
    r'config\.json: not valid JSON',
  ),
  (
    'cudnn attention without a GPU',
    lambda t, d: _train(t, d, **{'model.attention_impl': 'cudnn', 'model.dtype': 'bfloat16'}),
    UserInputError,
    r"attention_impl='cudnn' needs an NVIDIA GPU; this process runs on cpu",
  ),
  (
    'unknown model field',
    lambda t, d: TransformerConfig.from_dict({'vocab_size': 8, 'd_modle': 4}),
    UserInputError,
    r'unknown TransformerConfig field\(s\): d_modle',
  ),
  (
    'negative steps',
    lambda t, d: _train(t, d, num_train_steps=-5),
    UserInputError,
    r'config\.num_train_steps must be a positive integer, got -5',
  ),
  (
    'zero batch',
    lambda t, d: _train(t, d, per_device_batch_size=0),
    UserInputError,
    r'config\.per_device_batch_size must be a positive integer, got 0',
  ),
  (
    'zero model width',
    lambda t, d: _train(t, d, **{'model.d_ff': 0}),
    UserInputError,
    r'config\.model\.d_ff must be a positive integer, got 0',
  ),
  (
    'indivisible heads',
    lambda t, d: _train(t, d, **{'model.num_heads': 3}),
    UserInputError,
    r'd_model=32 is not divisible by num_heads=3',
  ),
  (
    'dropout 1.0',
    lambda t, d: _train(t, d, **{'model.dropout_rate': 1.0}),
    UserInputError,
    r'config\.model\.dropout_rate must be in \[0, 1\)',
  ),
  (
    'unknown dtype',
    lambda t, d: _train(t, d, **{'model.dtype': 'float8'}),
    UserInputError,
    r'config\.model\.dtype must be one of',
  ),
  (
    'label smoothing 1.5',
    lambda t, d: _train(t, d, label_smoothing=1.5),
    UserInputError,
    r'config\.label_smoothing must be in \[0, 1\)',
  ),
  (
    'negative learning-rate scale',
    lambda t, d: _train(t, d, learning_rate_scale=-1.0),
    UserInputError,
    r'config\.learning_rate_scale must be a positive number, got -1\.0',
  ),
  (
    'adam beta2 1.0',
    lambda t, d: _train(t, d, adam_b2=1.0),
    UserInputError,
    r'config\.adam_b2 must be in \[0, 1\), got 1\.0',
  ),
  (
    'negative clip norm',
    lambda t, d: _train(t, d, grad_clip_norm=-1.0),
    UserInputError,
    r'config\.grad_clip_norm must be a number >= 0, got -1\.0',
  ),
  (
    'zero token budget',
    lambda t, d: _train(t, d, batching='tokens', tokens_per_batch=0),
    UserInputError,
    r'config\.tokens_per_batch must be a positive integer, got 0',
  ),
  (
    'negative decode examples',
    lambda t, d: _train(t, d, eval_decode_examples=-1),
    UserInputError,
    r'config\.eval_decode_examples must be an integer >= 0, got -1',
  ),
  (
    'model shorter than the data',
    lambda t, d: _train(t, d, **{'model.max_len': 8}),
    UserInputError,
    r'config\.model\.max_len=8 is shorter than max_source_length=\d+ / '
    r'max_target_length=\d+; set it to at least \d+',
  ),
  (
    'negative layer-norm epsilon',
    lambda t, d: _train(t, d, **{'model.layer_norm_epsilon': -1.0}),
    UserInputError,
    r'config\.model\.layer_norm_epsilon must be a positive finite number, got -1\.0',
  ),
  (
    'workdir is a file',
    lambda t, d: loop.train_and_evaluate(tiny_config(d), _write(t / 'notes.txt', b'not a workdir')),
    UserInputError,
    r'--workdir=.*notes\.txt exists and is not a directory',
  ),
  (
    'unknown batching',
    lambda t, d: _train(t, d, batching='bogus'),
    UserInputError,
    r"config\.batching must be 'fixed', 'tokens' or 'packed'",
  ),
  (
    'unprepared tfds dataset',
    lambda t, d: _train(t, d, dataset='wmt14_translate/de-en'),
    UserInputError,
    r"dataset 'wmt14_translate/de-en' is not prepared in",
  ),
  (
    'text dataset without a directory',
    lambda t, d: _train(t, d, dataset='text'),
    UserInputError,
    r'config\.dataset=text needs config\.data\.dir',
  ),
  (
    'mesh of the wrong arity',
    lambda t, d: _train(t, d, mesh_shape=(-1,)),
    UserInputError,
    r'config\.mesh_shape: .*give one size per axis',
  ),
  (
    'vocabulary too big for the data',
    lambda t, d: _train(t, d, vocab_size=100_000),
    UserInputError,
    r'config\.vocab_size=100000 .*Vocabulary size too high',
  ),
  (
    'bad checkpoint name',
    lambda t, d: checkpoint_flag_value('newest'),
    UserInputError,
    r"--checkpoint must be a step number, 'averaged', 'best' or 'latest', got 'newest'",
  ),
  (
    'evaluate: invalid utf-8 reference',
    lambda t, d: read_lines(_write(t / 'ref.de', b'gut\n\xc3\x28\n')),
    UserInputError,
    r'ref\.de line 2: invalid UTF-8 \(byte 0xc3 at offset 4\)',
  ),
  (
    'evaluate: missing source',
    lambda t, d: read_lines(str(t / 'src.en')),
    FileNotFoundError,
    r'src\.en: no such file',
  ),
  (
    'evaluate: a directory as source',
    lambda t, d: read_lines(str(t)),
    UserInputError,
    r': is a directory, not a text file',
  ),
  (
    'beam size 0',
    lambda t, d: check_decoding_options(beam_size=0),
    UserInputError,
    r'beam_size must be a positive integer, got 0',
  ),
  (
    'negative length penalty',
    lambda t, d: check_decoding_options(alpha=-0.5),
    UserInputError,
    r'alpha must be a finite number >= 0, got -0\.5',
  ),
  (
    'translate batch size 0',
    lambda t, d: Translator.from_checkpoint(str(t), batch_size=0),
    UserInputError,
    r'batch_size must be a positive integer, got 0',
  ),
  # --- Found by trying mistakes as a new user (issue 16); "old:" is what they did before. ---
  (
    'config.json model without vocab_size',  # old: TypeError traceback in translate
    lambda t, d: _translator_workdir(t, b'{"config": {}, "model": {"d_model": 8}}'),
    UserInputError,
    r'TransformerConfig field\(s\) missing: vocab_size',
  ),
  (
    'vocab.model a directory',  # old: IsADirectoryError traceback
    lambda t, d: (os.makedirs(t / 'w' / 'vocab.model'), _translator_workdir(t, _VALID_MODEL)),
    UserInputError,
    r'vocab\.model: is a directory, not a SentencePiece model',
  ),
  (
    'model fields not a dict',  # old: TypeError (argument after ** must be a mapping)
    lambda t, d: TransformerConfig.from_dict(['vocab_size', 8]),
    UserInputError,
    r'TransformerConfig\.from_dict takes a dict of fields, got list',
  ),
  (
    'a string for a boolean model field',  # old: accepted, 'no' is true: embeddings shared
    lambda t, d: TransformerConfig(vocab_size=8, share_embeddings='no'),
    UserInputError,
    r"TransformerConfig\.share_embeddings must be True or False, got 'no'",
  ),
  (
    'vocabulary smaller than the reserved ids',  # old: accepted; BOS (id 2) read out of range
    lambda t, d: TransformerConfig(vocab_size=2),
    UserInputError,
    r'TransformerConfig\.vocab_size=2 is smaller than the 4 reserved ids \(pad, eos, bos, unk\)',
  ),
  (
    'NaN layer-norm epsilon',  # old: accepted; training ran on NaN losses and exited 0
    lambda t, d: TransformerConfig(vocab_size=8, layer_norm_epsilon=float('nan')),
    UserInputError,
    r'TransformerConfig\.layer_norm_epsilon must be a positive finite number, got nan',
  ),
  (
    'unknown vocabulary model type',  # old: ValueError from SentencePiece's trainer
    lambda t, d: Tokenizer.train(['a b c'] * 20, vocab_size=8, model_type='bpee'),
    UserInputError,
    r"vocabulary model_type must be one of bpe, unigram, word, char, got 'bpee'",
  ),
  (
    'workdir not a path',  # old: TypeError (expected str, bytes or os.PathLike object)
    lambda t, d: Translator.from_checkpoint(5),
    UserInputError,
    r'--workdir must be a path, got int 5',
  ),
  (
    'dataset a near miss of number_words',  # old: '... not found.', as if it needed preparing
    lambda t, d: _train(t, d, dataset='numbre_words'),
    UserInputError,
    r"dataset 'numbre_words' is not prepared in .*"
    r"\(did you mean config\.dataset='number_words'\?\)",
  ),
  (
    'a language the dataset does not have',  # old: KeyError: 'fr' (a tfds dataset, say WMT)
    lambda t, d: input_pipeline.load_data_sources(
      _changed(tiny_config(d), {'data.src_lang': 'fr'}), d
    ),
    UserInputError,
    r"config\.data\.src_lang='fr': dataset 'number_words/tiny' has no such feature "
    r'\(it has en, de\)',
  ),
  (
    'prepare_data: empty dataset name',  # old: ValueError traceback from tfds
    lambda t, d: tfds_prepare.prepare('', str(t)),
    UserInputError,
    r"--dataset must name a tfds dataset, e\.g\. 'wmt14_translate/de-en'",
  ),
  (
    'prepare_data: a number_words variant that does not exist',  # old: ValueError traceback
    lambda t, d: tfds_prepare.prepare('number_words/huge', str(t)),
    UserInputError,
    r"--dataset='number_words/huge': number_words has no variant 'huge' \(it has "
    r'number_words/default, number_words/tiny\)',
  ),
  (
    'prepare_data: the text dataset',  # old: "Dataset text not found."
    lambda t, d: tfds_prepare.prepare('text', str(t)),
    UserInputError,
    r"--dataset='text': your parallel files are prepared by train\.py itself",
  ),
  (
    'prepare_data: negative example limit',  # old: ValueError from islice, a traceback
    lambda t, d: tfds_prepare.prepare('number_words/tiny', str(t), max_examples_per_split=-3),
    UserInputError,
    r'--max_examples_per_split must be a positive integer, got -3',
  ),
  (
    'plot_attention: no text',  # old: AttributeError: 'NoneType' object has no attribute 'strip'
    lambda t, d: attention_plots.plot_translation(str(t), None, str(t / 'a.png')),
    UserInputError,
    r'--text must be a sentence \(str\), got NoneType',
  ),
  (
    'plot_attention: empty target',  # old: drew the attention of an empty translation
    lambda t, d: attention_plots.plot_translation(str(t), 'one', str(t / 'a.png'), target=' '),
    UserInputError,
    r'--target is empty: give the sentence to draw',
  ),
  (
    'benchmark: --json a directory',  # old: IsADirectoryError traceback after the whole run
    lambda t, d: benchmark_runner.run(
      default.get_config(), benchmark_runner.Options(), json_path=str(t)
    ),
    UserInputError,
    r'--json=.*: is a directory; name a file to write',
  ),
  (
    'benchmark: --json in a missing folder',  # old: written only after the run: a traceback
    lambda t, d: benchmark_runner.run(
      default.get_config(), benchmark_runner.Options(), json_path=str(t / 'nope' / 'b.json')
    ),
    UserInputError,
    r'--json=.*b\.json: folder .*nope does not exist \(create it first\)',
  ),
  (
    'benchmark: unknown pipeline size',  # old: refused only after timing and training
    lambda t, d: benchmark_runner.run(
      default.get_config(), benchmark_runner.Options(pipeline_size='huge')
    ),
    UserInputError,
    r"--pipeline_size: unknown size 'huge'; expected one of tiny, small, base, big",
  ),
  (
    'benchmark: --workdir not a training workdir',  # old: refused after training every size
    lambda t, d: benchmark_runner.run(
      default.get_config(), benchmark_runner.Options(workdir=str(t / 'nope'))
    ),
    FileNotFoundError,
    r'nope/config\.json not found: is .*nope a training workdir\?',
  ),
  (
    'benchmark: NaN length penalty',  # old: accepted
    lambda t, d: benchmark_runner.run(
      default.get_config(), benchmark_runner.Options(alpha=float('nan'))
    ),
    UserInputError,
    r'--alpha must be >= 0, got nan',
  ),
  # Mistakes that were already one-line errors, now in the table too.
  (
    'translate: missing --input',
    lambda t, d: translate_text(str(t), input_path=str(t / 'in.en')),
    FileNotFoundError,
    r'--input=.*in\.en: no such file',
  ),
  (
    'translate: --output a directory',
    lambda t, d: translate_text(
      str(t), input_path=_write(t / 'in.en', b'one\n'), output_path=str(t)
    ),
    UserInputError,
    r'--output=.*: is a directory; name a file to write',
  ),
  (
    'evaluate: source and reference of different lengths',
    lambda t, d: test_set.evaluate_files(
      str(t), _write(t / 's.en', b'one\ntwo\n'), _write(t / 'r.de', b'eins\n')
    ),
    UserInputError,
    r's\.en has 2 lines but .*r\.de has 1',
  ),
  (
    'evaluate: --out in a missing folder',
    lambda t, d: test_set.evaluate_files(
      str(t), _write(t / 's.en', b'one\n'), _write(t / 'r.de', b'eins\n'), out=str(t / 'x' / 'h')
    ),
    UserInputError,
    r'--out=.*h: folder .*x does not exist \(create it first\)',
  ),
  (
    'evaluate API: lists of different lengths',
    lambda t, d: test_set.evaluate(None, ['one'], ['eins', 'zwei']),
    UserInputError,
    r'1 source lines but 2 reference lines',
  ),
  (
    'average: --last=0',
    lambda t, d: average_checkpoints(str(t), 0),
    UserInputError,
    r'--last must be a positive number of checkpoints, got 0',
  ),
  (
    'average: --last as a string',
    lambda t, d: average_checkpoints(str(t), '5'),
    UserInputError,
    r"--last must be a positive number of checkpoints, got '5'",
  ),
  (
    'average: a workdir without checkpoints',
    lambda t, d: average_checkpoints(str(t), 5),
    UserInputError,
    r'no checkpoints in .*checkpoints',
  ),
  (
    'plot_attention: unknown kind',
    lambda t, d: attention_plots.plot_translation(str(t), 'one', str(t / 'a.png'), kind='self'),
    UserInputError,
    r"--kind='self': expected one of cross, encoder, decoder",
  ),
  (
    'plot_attention: an image format matplotlib cannot write',
    lambda t, d: attention_plots.plot_translation(str(t), 'one', str(t / 'a.docx')),
    UserInputError,
    r'--out=.*a\.docx: cannot draw \.docx images; use one of .*\.png',
  ),
  (
    'decode API: beam size 0',
    lambda t, d: decode.beam_search(
      None, None, batch_size=1, beam_size=0, max_decode_len=4, bos_id=2, eos_id=1, pad_id=0
    ),
    ValueError,
    r'beam_size \(0\) must be >= 1',
  ),
  (
    'unknown attention kernel',
    lambda t, d: TransformerConfig(vocab_size=8, attention_impl='flash'),
    UserInputError,
    r"TransformerConfig\.attention_impl must be one of einsum, xla, cudnn, got 'flash'",
  ),
]


@pytest.mark.parametrize('case, run, exception, pattern', CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_a_one_line_error(tmp_path, data_dir, case, run, exception, pattern):
  with pytest.raises(exception, match=pattern) as raised:
    run(tmp_path, data_dir)
  message = str(raised.value)
  assert '\n' not in message, f'{case}: multi-line message {message!r}'


def _changed(config, changes: dict):
  for name, value in changes.items():
    target = config
    *parents, leaf = name.split('.')
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


# (changes to tiny_config, regex of the message); "old:" is what the mistake did before.
FIELD_CASES = [
  ({'cooldown_fraction': 1.0}, r'config\.cooldown_fraction must be in \[0, 1\), got 1\.0'),
  ({'cooldown_fraction': -0.1}, r'config\.cooldown_fraction must be in \[0, 1\), got -0\.1'),
  ({'model.dropout_rate': 1.5}, r'config\.model\.dropout_rate must be in \[0, 1\), got 1\.5'),
  ({'model.num_heads': 3}, r'config\.model\.d_model=32 is not divisible by num_heads=3'),
  ({'mesh_shape': (3, 1, 1)}, r'config\.mesh_shape: mesh_shape \(3, 1, 1\) needs 3 devices'),
  ({'logical_axis_rules': (('heads', 'model'),)}, r"'heads' -> 'model' names no mesh axis"),
  ({'eval_batch_size': 0}, r'config\.eval_batch_size must be a positive integer, got 0'),
  (
    {'per_device_batch_size': True},
    r'config\.per_device_batch_size must be a positive integer, got True',
  ),
  # old: a ValueError traceback from tfds's name parser.
  ({'dataset': ''}, r"config\.dataset must name a dataset \('number_words', 'text' or a "),
  # old: AttributeError: 'NoneType' object has no attribute 'split'.
  ({'dataset': None}, r'config\.dataset must name a dataset .*, got None'),
  # old: a ValueError traceback from tfds (BuilderConfig huge not found).
  (
    {'dataset': 'number_words/huge'},
    r"config\.dataset='number_words/huge': number_words has no variant 'huge' \(it has "
    r'number_words/default, number_words/tiny\)',
  ),
  # old: KeyError: "''" after preparing the data.
  ({'data.src_lang': ''}, r"config\.data\.src_lang='' is not a language code"),
  # old: KeyError: 'fr' after preparing the data.
  (
    {'data.src_lang': 'fr'},
    r"config\.data\.src_lang='fr': number_words has the languages en and de",
  ),
  # old: trained English -> English, silently, and exited 0.
  (
    {'data.tgt_lang': 'en'},
    r"config\.data\.src_lang and config\.data\.tgt_lang are both 'en'; they must differ",
  ),
  # old: ignored: trained on number_words instead of the user's files, exit 0.
  (
    {'data.dir': '/data/my_corpus'},
    r'config\.data\.dir=/data/my_corpus is only read with config\.dataset=text, but '
    r"config\.dataset='number_words/tiny': add --config\.dataset=text",
  ),
  # old: every pair dropped, said only after reading and preparing the files.
  ({'data.max_chars': 0}, r'config\.data\.max_chars must be a positive integer, got 0'),
  # old: the same one line, but only after the data was generated.
  ({'train_split': ''}, r"config\.train_split must name a split of the dataset, got ''"),
  (
    {'eval_split': 'valid'},
    r"config\.eval_split='valid': number_words has the splits train, validation, test",
  ),
  # old: a ValueError traceback from SentencePiece after preparing the data.
  (
    {'vocab_model_type': 'bpee'},
    r"config\.vocab_model_type must be one of bpe, unigram, word, char, got 'bpee'",
  ),
  # old: SentencePiece's 'INTERNAL: src/trainer_interface.cc(827) ...' after preparing the data.
  (
    {'vocab_size': 3},
    r'config\.vocab_size=3 leaves no pieces besides the 4 reserved ones \(pad, eos, bos, unk\)',
  ),
  # The fine-tuning schedule (issue 19): its rate must be given, and finite.
  (
    {'learning_rate_schedule': 'cosine'},
    r"config\.learning_rate_schedule must be one of rsqrt, constant, got 'cosine'",
  ),
  (
    {'learning_rate_schedule': 'constant'},
    r'config\.learning_rate must be a positive number, got 0\.0',
  ),
  (
    {'learning_rate_schedule': 'constant', 'learning_rate': float('inf')},
    r'config\.learning_rate must be finite, got inf',
  ),
  # Marian's switches (issue 19): a misspelt choice is named with the allowed ones.
  (
    {'model.ffn_activation': 'tanh'},
    r'config\.model\.ffn_activation must be one of relu, swish, silu, gelu, gelu_sigmoid, '
    r"got 'tanh'",
  ),
  (
    {'model.sinusoid_layout': 'halves'},
    r"config\.model\.sinusoid_layout must be one of interleaved, concatenated, got 'halves'",
  ),
  # old: a ValueError traceback from grain's shuffle after the vocabulary was trained.
  ({'seed': -1}, r'config\.seed must be an integer in \[0, 2\*\*32 - 1\], got -1'),
  ({'seed': 2**32}, r'config\.seed must be an integer in \[0, 2\*\*32 - 1\], got 4294967296'),
  # old: compiled, then stopped on non-finite parameters (exit 3).
  (
    {'learning_rate_scale': float('inf')},
    r'config\.learning_rate_scale must be a finite number, got inf',
  ),
  # old: compiled, then stopped on NaN parameters (0 / 0 where a gradient is zero; exit 3).
  ({'adam_eps': 0.0}, r'config\.adam_eps must be a positive number, got 0\.0'),
  # old: trained without learning anything (every update ~0), exit 0.
  ({'adam_eps': float('inf')}, r'config\.adam_eps must be a finite number, got inf'),
  # old: trained on NaN losses and exited 0.
  (
    {'model.layer_norm_epsilon': float('nan')},
    r'config\.model\.layer_norm_epsilon must be a positive finite number, got nan',
  ),
  # old: trained a model whose LayerNorms output zeros, exit 0.
  (
    {'model.layer_norm_epsilon': float('inf')},
    r'config\.model\.layer_norm_epsilon must be a positive finite number, got inf',
  ),
  # old: every batch silently exceeded the budget (one row of 24 tokens).
  (
    {'batching': 'tokens', 'tokens_per_batch': 10},
    r'config\.tokens_per_batch=10 is less than one row of 24 tokens .* set it to at least 24',
  ),
  # old: None is false: the embeddings were silently not shared.
  (
    {'model.share_embeddings': None},
    r'config\.model\.share_embeddings must be True or False, got None',
  ),
  # Already one line before any data work; here so that every field kind is covered.
  (
    {'model.dtype': 'bfloat'},
    r"config\.model\.dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'bfloat'",
  ),
  (
    {'model.attention_impl': 'flash'},
    r"config\.model\.attention_impl must be one of einsum, xla, cudnn, got 'flash'",
  ),
  (
    {'model.attention_impl': 'xla', 'model.attention_dropout_rate': 0.1},
    r"config\.model\.attention_impl='xla' has no attention dropout",
  ),
  ({'model.qk_dim': 0}, r'config\.model\.qk_dim must be a positive integer or None, got 0'),
  ({'mesh_shape': (-1, -1, 1)}, r'config\.mesh_shape: mesh_shape \(-1, -1, 1\) has more than one'),
  (
    {'dataset': 'text', 'data.dir': 'http://host/corpus'},
    r'config\.data\.dir=http://host/corpus: http:// paths are not supported',
  ),
  ({'grad_accum_steps': 0}, r'config\.grad_accum_steps must be a positive integer, got 0'),
  (
    {'lock_expiry_seconds': 0.0},
    r'config\.lock_expiry_seconds must be a positive number, got 0\.0',
  ),
  ({'max_target_length': 0}, r'config\.max_target_length must be a positive integer, got 0'),
  ({'warmup_steps': 0}, r'config\.warmup_steps must be a positive integer, got 0'),
  (
    {'train_time_limit_minutes': -1.0},
    r'config\.train_time_limit_minutes must be a number >= 0, got -1\.0',
  ),
  (
    {'train_time_limit_minutes': float('inf')},
    r'config\.train_time_limit_minutes must be finite, got inf',
  ),
]


@pytest.mark.parametrize(
  'changes, message',
  FIELD_CASES,
  ids=[','.join(c[0]) + f'={list(c[0].values())[-1]!r}' for c in FIELD_CASES],
)
def test_a_bad_field_fails_before_any_data_work(tmp_path, changes, message):
  # A fresh data_dir and workdir: nothing may be prepared, trained or written into either
  # (on WMT, preparing and training the vocabulary take many minutes).
  config = _changed(tiny_config(str(tmp_path / 'tfds')), changes)
  with pytest.raises(UserInputError, match=message) as raised:
    loop.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert '\n' not in str(raised.value)
  assert not os.path.exists(tmp_path / 'tfds')
  assert not os.path.exists(tmp_path / 'workdir')


def test_numpy_numbers_are_model_sizes_too():
  # Before, TransformerConfig(vocab_size=np.int64(8)) was refused with 'vocab_size must be a
  # positive integer, got np.int64(8)'. They are kept as Python numbers: config.json is JSON.
  config = TransformerConfig(vocab_size=np.int64(8), dropout_rate=np.float32(0.5), remat=np.True_)
  assert (
    json.loads(json.dumps(config.to_dict()))
    == TransformerConfig(vocab_size=8, dropout_rate=0.5, remat=True).to_dict()
  )
  assert type(config.vocab_size) is int and type(config.remat) is bool


_SMALL_MODEL = dict(d_model=8, d_ff=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1)


def _vocabulary_workdir(tmp) -> str:
  """A workdir with a config.json and a vocab.model that fit each other, and no checkpoint."""
  tokenizer = Tokenizer.train(['a b c d e f g h'] * 50, vocab_size=20)
  model = TransformerConfig(vocab_size=tokenizer.vocab_size, max_len=16, **_SMALL_MODEL)
  workdir = tmp / 'w'
  _write(workdir / 'config.json', json.dumps({'config': {}, 'model': model.to_dict()}).encode())
  tokenizer.save(str(workdir / 'vocab.model'))
  return str(workdir)


@functools.lru_cache(maxsize=1)
def _translator() -> Translator:
  return random_weight_translator()


# Python API mistakes that were tracebacks or silently wrong (inference/, evaluation/).
API_CASES = [
  pytest.param(
    # Old: ValueError: invalid literal for int() with base 10: 'newest' (a traceback).
    lambda t: Translator.from_checkpoint(_vocabulary_workdir(t), 'newest'),
    r"checkpoint must be a step number, 'averaged', 'best' or 'latest', got 'newest'",
    id='Translator: checkpoint name',
  ),
  pytest.param(
    # Old: int(1.5): step 1 is loaded, silently.
    lambda t: Translator.from_checkpoint(_vocabulary_workdir(t), 1.5),
    r"checkpoint must be a step number, 'averaged', 'best' or 'latest', got 1\.5",
    id='Translator: fractional checkpoint step',
  ),
  pytest.param(
    # Old: AttributeError: 'int' object has no attribute 'strip'.
    lambda t: _translator().translate([1, 2]),
    r'sentence 0 is int, not str',
    id='translate: numbers for sentences',
  ),
  pytest.param(
    # Old: AttributeError: 'NoneType' object has no attribute 'strip'.
    lambda t: _translator().translate(['one', None]),
    r'sentence 1 is NoneType, not str',
    id='translate: None among the sentences',
  ),
  pytest.param(
    # Old: accepted; every hypothesis longer than one token scores -0.
    lambda t: check_decoding_options(alpha=float('inf')),
    r'alpha must be a finite number >= 0, got inf',
    id='infinite length penalty',
  ),
  pytest.param(
    # Old: '3 source lines but 4 reference lines': the strings are read letter by letter.
    lambda t: test_set.evaluate(None, 'one', 'eins'),
    r'takes lists of sentences, got a single str',
    id='evaluate API: a string for the sentences',
  ),
]


@pytest.mark.parametrize('run, pattern', API_CASES)
def test_an_api_mistake_is_a_one_line_error(tmp_path, run, pattern):
  with pytest.raises(UserInputError, match=pattern) as raised:
    run(tmp_path)
  assert '\n' not in str(raised.value)


def _command(tmp_path, *argv):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['PYTHONPATH'] = REPO_ROOT + os.pathsep + env.get('PYTHONPATH', '')
  return subprocess.run(
    [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
  )


_TRAIN = os.path.join(REPO_ROOT, 'train.py')

# (argv run in an empty folder, with W a workdir there that does not exist; regex of the
# `error:` line). Each exits 2 with that one line, no traceback, and writes nothing.
COMMAND_CASES = [
  pytest.param(
    [_TRAIN, '--workdir=W', '--config.seed=-1'],
    r'error: config\.seed must be an integer in \[0, 2\*\*32 - 1\], got -1',
    id='train: negative seed',
  ),
  pytest.param(
    [_TRAIN, '--workdir=W', '--config.data.dir=corpus'],
    r'error: config\.data\.dir=corpus is only read with config\.dataset=text',
    id='train: data.dir without dataset=text',
  ),
  pytest.param(
    [_TRAIN, '--workdir=W', '--config.model.dtype=bfloat'],
    r"error: config\.model\.dtype must be one of \['bfloat16', 'float16', 'float32'\], "
    r"got 'bfloat'",
    id='train: misspelt dtype',
  ),
  pytest.param(
    ['-m', 'transformer_jax.translate', '--workdir=W', '--checkpoint=newest'],
    r"error: --checkpoint must be a step number, 'averaged', 'best' or 'latest', got 'newest'",
    id='translate: checkpoint name',
  ),
  pytest.param(
    ['-m', 'transformer_jax.evaluate', '--workdir=W', '--src=test.en', '--ref=test.de'],
    r'error: --src=test\.en: no such file',
    id='evaluate: missing source',
  ),
  pytest.param(
    ['-m', 'transformer_jax.average', '--workdir=W', '--last=0'],
    r'error: --last must be a positive number of checkpoints, got 0',
    id='average: --last=0',
  ),
  pytest.param(
    ['-m', 'transformer_jax.plot_attention', '--workdir=W', '--text='],
    r'error: --text is empty: give the sentence to draw',
    id='plot_attention: empty --text',  # old: drew a plot of '</s>' alone, exit 0
  ),
  pytest.param(
    ['-m', 'transformer_jax.prepare_data', '--dataset=number_words/huge', '--data_dir=D'],
    r"error: --dataset='number_words/huge': number_words has no variant 'huge'",
    id='prepare_data: unknown variant',  # old: a ValueError traceback, exit 1
  ),
  pytest.param(
    ['-m', 'transformer_jax.prepare_data', '--dataset=number_words/tiny', '--data_dir='],
    r'error: --data_dir is empty: name a directory or file',
    id='prepare_data: empty --data_dir',  # old: prepared into the current folder, exit 0
  ),
  pytest.param(
    ['-m', 'transformer_jax.benchmark', '--sections=pipeline', '--json=.'],
    r'error: --json=\.: is a directory; name a file to write',
    id='benchmark: --json a directory',  # old: a traceback after the whole benchmark
  ),
  pytest.param(
    ['-m', 'transformer_jax.evaluate', '--workdir=W', '--src=a', '--ref=b', '--beam_rule=marian'],
    r'error: .*--beam_rule',
    id='evaluate: an unknown beam rule',
  ),
  pytest.param(
    ['-m', 'transformer_jax.translate', '--workdir=W', '--beam_size=abc'],
    r'error: .*--beam_size',
    id='translate: a word for a number',  # old: "FATAL Flags parsing error", exit 1
  ),
  pytest.param(
    [_TRAIN, '--config.num_train_steps=100'],
    r'error: .*--workdir',
    id='train: no --workdir',  # old: "FATAL Flags parsing error", exit 1
  ),
  pytest.param(
    [_TRAIN, '--workdir=W', '--config.num_train_steps=1e3'],
    r'error: .*config\.num_train_steps',
    id='train: a float for an integer field',  # old: "FATAL Flags parsing error", exit 1
  ),
]


@pytest.mark.parametrize('argv, pattern', COMMAND_CASES)
def test_a_command_mistake_exits_2_with_one_line(tmp_path, argv, pattern):
  result = _command(tmp_path, *argv)
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert (result.returncode, len(errors)) == (2, 1), result.stderr[-2000:]
  assert re.fullmatch(pattern + '.*', errors[0]), errors[0]
  assert 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert os.listdir(tmp_path) == [], 'the command wrote into its folder'


def test_the_tables_have_at_least_eighty_cases():
  assert len(CASES) + len(FIELD_CASES) + len(API_CASES) + len(COMMAND_CASES) >= 80
