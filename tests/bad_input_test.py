"""A table of malformed inputs: each is a one-line error naming the file, line or field.

Entry points turn these exceptions (UserInputError, FileNotFoundError, CorruptCheckpointError)
into `error: <message>` and exit status 2 — checked once per command in train_test.py and
reliability_test.py; here every case is checked in-process, which is fast.
"""

import json
import os

import pytest

from transformer_jax import train_lib
from transformer_jax.cli import checkpoint_flag_value
from transformer_jax.config import TransformerConfig
from transformer_jax.data import text_dataset
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import UserInputError
from transformer_jax.inference import Translator, check_decoding_options
from transformer_jax.text_io import read_lines

from conftest import tiny_config


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
  config = tiny_config(data_dir)
  for name, value in changes.items():
    target = config
    *parents, leaf = name.split('.')
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  train_lib.train_and_evaluate(config, str(tmp / 'workdir'))


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
    r'config\.model\.layer_norm_epsilon must be a positive number, got -1\.0',
  ),
  (
    'workdir is a file',
    lambda t, d: train_lib.train_and_evaluate(
      tiny_config(d), _write(t / 'notes.txt', b'not a workdir')
    ),
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
    lambda t, d: checkpoint_flag_value('best'),
    UserInputError,
    r"--checkpoint must be a step number, 'averaged' or 'latest', got 'best'",
  ),
  (
    'evaluate: invalid utf-8 reference',
    lambda t, d: read_lines(_write(t / 'ref.de', b'gut\n\xc3\x28\n')),
    UserInputError,
    r'ref\.de:2: not valid UTF-8',
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
    r'alpha must be a number >= 0, got -0\.5',
  ),
  (
    'translate batch size 0',
    lambda t, d: Translator.from_checkpoint(str(t), batch_size=0),
    UserInputError,
    r'batch_size must be a positive integer, got 0',
  ),
]


@pytest.mark.parametrize('case, run, exception, pattern', CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_a_one_line_error(tmp_path, data_dir, case, run, exception, pattern):
  with pytest.raises(exception, match=pattern) as raised:
    run(tmp_path, data_dir)
  message = str(raised.value)
  assert '\n' not in message, f'{case}: multi-line message {message!r}'


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('model.dropout_rate', 1.5, r'config\.model\.dropout_rate must be in \[0, 1\), got 1\.5'),
    ('model.num_heads', 3, r'config\.model\.d_model=32 is not divisible by num_heads=3'),
    ('mesh_shape', (3, 1, 1), r'config\.mesh_shape: mesh_shape \(3, 1, 1\) needs 3 devices'),
    ('logical_axis_rules', (('heads', 'model'),), r"'heads' -> 'model' names no mesh axis"),
    ('eval_batch_size', 0, r'config\.eval_batch_size must be a positive integer, got 0'),
    (
      'per_device_batch_size',
      True,
      r'config\.per_device_batch_size must be a positive integer, '
      r'got True',
    ),
  ],
)
def test_a_bad_field_fails_before_any_data_work(tmp_path, field, value, message):
  # A fresh data_dir and workdir: nothing may be prepared, trained or written into either
  # (on WMT, preparing and training the vocabulary take many minutes).
  config = tiny_config(str(tmp_path / 'tfds'))
  target = config
  *parents, leaf = field.split('.')
  for parent in parents:
    target = target[parent]
  target[leaf] = value
  with pytest.raises(UserInputError, match=message):
    train_lib.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert not os.path.exists(tmp_path / 'tfds')
  assert not os.path.exists(tmp_path / 'workdir')


def test_the_table_has_at_least_twenty_cases():
  assert len(CASES) >= 20
