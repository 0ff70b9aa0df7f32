"""StableHLO export: the shipped translate.py, in a process that cannot import transformer_jax or
flax, translates exactly as `Translator` does (beam 4 and greedy), at other batch sizes.

One tiny workdir is trained for the module (a few dozen steps: equality needs no good model) and
exported once.
"""

import json
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax import export as jax_export

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import number_words
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.exporters import stablehlo, stablehlo_runner
from transformer_jax.inference import decoding
from transformer_jax.inference.translator import Translator
from transformer_jax.search import decode
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config

_BLOCKED = ('transformer_jax', 'flax')
# Run in `python -I` (no PYTHONPATH, no user site, no script folder on sys.path): refuses the
# blocked packages before anything imports them, proves they are unimportable, then runs
# translate.py as a script once per argument list (argv[2:], JSON), and finally proves that
# nothing blocked was loaded on the way.
_WRAPPER = """
import importlib.abc, json, runpy, sys

BLOCKED = {blocked!r}
loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)
assert not loaded, f'already imported at start-up: {{loaded}}'


class RefuseBlocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in BLOCKED:
      raise ModuleNotFoundError(f'No module named {{name!r}} (refused)', name=name)
    return None


sys.meta_path.insert(0, RefuseBlocked())
for name in BLOCKED:
  try:
    __import__(name)
  except ModuleNotFoundError:
    continue
  raise AssertionError(f'{{name}} is importable')
script = sys.argv[1]
for arguments in sys.argv[2:]:
  sys.argv = [script, *json.loads(arguments)]
  try:
    runpy.run_path(script, run_name='__main__')
  except SystemExit as exit:
    assert not exit.code, f'translate.py {{sys.argv[1:]}} exited with {{exit.code}}'
loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)
assert not loaded, f'imported: {{loaded}}'
print('refused and never loaded:', ', '.join(BLOCKED), file=sys.stderr)
""".format(blocked=_BLOCKED)

# The runner's batch sizes: neither the Translator's (64) nor each other's, and not dividing the
# 48 non-blank sentences, so batches differ in shape from the Translator's and a short last one
# is padded.
_BEAM_BATCH_SIZE = 13
_GREEDY_BATCH_SIZE = 20


@pytest.fixture(scope='module')
def workdir(tmp_path_factory, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 30  # Past the first steps' constant outputs; still seconds.
  # Short sources then have their own output cap (source + 50 < max_len) below the batch's
  # decode length, and that length, min(bucket + 50, 64), stays symbolic in the artifact.
  config.model.max_len = 64
  config.checkpoint_every_steps = 30
  path = str(tmp_path_factory.mktemp('stablehlo') / 'workdir')
  loop.train_and_evaluate(config, path)
  return path


@pytest.fixture(scope='module')
def exported(workdir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('stablehlo') / 'model')
  assert stablehlo.export(workdir, out) == out
  return out


@pytest.fixture(scope='module')
def sentences():
  """50 lines: numbers of 1 to 9 digits, two blank lines, an unknown character and one source
  longer than max_len=64 tokens (cut as the Translator cuts it): length buckets 8 to 64."""
  rng = random.Random(17)
  lines = [number_words.english_words(rng.randrange(10 ** rng.randint(1, 9))) for _ in range(45)]
  lines += [
    '',
    '  ',
    'seven ✓ hundred',
    'one',
    ' and '.join([number_words.english_words(987654321)] * 3),
  ]
  rng.shuffle(lines)
  return lines


@pytest.fixture(scope='module')
def translator(workdir):
  return Translator.from_checkpoint(workdir)  # batch_size 64: one batch, bucket 64.


@pytest.fixture(scope='module')
def ours(translator, sentences):
  return {
    'beam': translator.translate(sentences, beam_size=4, alpha=0.6),
    'greedy': translator.translate(sentences, beam_size=1),
  }


@pytest.fixture(scope='module')
def theirs(exported, sentences, tmp_path_factory):
  """translate.py's outputs, beam 4 (default) and greedy, from one blocked process."""
  folder = tmp_path_factory.mktemp('runner')
  source = folder / 'in.txt'
  source.write_text(''.join(line + '\n' for line in sentences), encoding='utf-8')
  beam_out, greedy_out = folder / 'beam.txt', folder / 'greedy.txt'
  runs = [
    [f'--input={source}', f'--output={beam_out}', f'--batch_size={_BEAM_BATCH_SIZE}'],
    [f'--input={source}', f'--output={greedy_out}', '--beam_size=1', '--alpha=0.6']
    + [f'--batch_size={_GREEDY_BATCH_SIZE}'],
  ]
  # The suite's XLA_FLAGS (conftest.py) carry over: the same compiler settings as ours.
  result = subprocess.run(
    [sys.executable, '-I', '-c', _WRAPPER, os.path.join(exported, 'translate.py')]
    + [json.dumps(run) for run in runs],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=str(folder),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'refused and never loaded: transformer_jax, flax' in result.stderr
  return {
    'beam': beam_out.read_text(encoding='utf-8').split('\n')[:-1],
    'greedy': greedy_out.read_text(encoding='utf-8').split('\n')[:-1],
  }


def _differing(sentences, ours, theirs):
  differing = [(s, a, b) for s, a, b in zip(sentences, ours, theirs) if a != b]
  for source, a, b in differing:
    print(f'{source!r}: Translator {a!r}, translate.py {b!r}')
  return differing


@pytest.mark.parametrize('search', ['beam', 'greedy'])
def test_the_runner_translates_as_the_translator_without_transformer_jax(
  search, ours, theirs, sentences
):
  assert len(theirs[search]) == len(sentences)
  assert not _differing(sentences, ours[search], theirs[search])
  # Not a vacuous equality: varied non-empty translations, and blank lines stay blank.
  assert len(set(ours[search])) >= 10
  assert [t for s, t in zip(sentences, ours[search]) if not s.strip()] == ['', '']


def test_beam_search_and_greedy_search_differ_somewhere(ours):
  # Else the greedy test would also pass with a runner that ignores --beam_size.
  assert ours['beam'] != ours['greedy']


def test_the_artifact_has_symbolic_batch_and_length(exported):
  for beam_size in (1, 4):
    path = os.path.join(exported, stablehlo.search_file(beam_size))
    with open(path, 'rb') as f:
      search = jax_export.deserialize(bytearray(f.read()))
    *parameters, source_ids, max_lengths, alpha = search.in_avals
    assert [str(d) for d in source_ids.shape] == ['b', 's']
    assert all(jax_export.is_symbolic_dim(d) for d in source_ids.shape)
    assert [str(d) for d in max_lengths.shape] == ['b']
    assert alpha.shape == ()
    assert [str(d) for d in search.out_avals[0].shape] == ['b', 'min(s + 50, 64)']
    assert not any(jax_export.is_symbolic_dim(d) for p in parameters for d in p.shape)
    assert search.platforms == ('cpu', 'cuda')


def test_the_decode_length_is_symbolic_where_max_len_does_not_decide_it():
  batch, source_length = stablehlo.symbolic_source_shape(256)
  length = stablehlo.decode_length(source_length, 256)
  assert str(length) == 'min(s + 50, 256)'
  # Decided at export where s >= 1 settles it: s + 50 > 32.
  assert stablehlo.decode_length(source_length, 32) == 32
  assert stablehlo.decode_length(14, 256) == 64  # Concrete: the Translator's min().


def test_the_directory_holds_parameters_vocabulary_manifest_and_runner(
  exported, workdir, translator
):
  with open(os.path.join(exported, 'manifest.json'), encoding='utf-8') as f:
    manifest = json.load(f)
  assert manifest['format'] == 'transformer_jax.stablehlo' and manifest['version'] == 1
  assert manifest['jax_version'] == jax.__version__
  assert manifest['special_ids'] == {'pad': PAD_ID, 'eos': EOS_ID, 'bos': BOS_ID, 'unk': UNK_ID}
  assert manifest['defaults'] == {'beam_size': 4, 'alpha': 0.6, 'batch_size': 64}
  assert (manifest['max_len'], manifest['extra_decode_length']) == (64, 50)
  assert manifest['model'] == translator.model_config.to_dict()
  assert manifest['searches']['4']['inputs']['source_ids'] == 'int32[b, s]'
  assert manifest['searches']['1']['output'] == 'int32[b, min(s + 50, 64)]'
  assert sorted(manifest['searches']) == ['1', '4']

  flat = stablehlo.flatten_parameters(translator.params)
  with np.load(os.path.join(exported, 'parameters.npz'), allow_pickle=False) as stored:
    assert sorted(stored.files) == sorted(flat) == sorted(manifest['parameters']['shapes'])
    for name, value in flat.items():
      np.testing.assert_array_equal(stored[name], value)
      assert stored[name].dtype == value.dtype
      assert list(value.shape) == manifest['parameters']['shapes'][name]
  assert 'encoder_layers/ffn/wi/kernel' in flat
  with open(os.path.join(exported, 'sentencepiece.model'), 'rb') as f:
    assert f.read() == Workdir(workdir).vocab_file.read_bytes()

  with open(os.path.join(exported, 'translate.py'), encoding='utf-8') as f:
    runner = f.read()
  with open(stablehlo_runner.__file__, encoding='utf-8') as f:
    assert runner.startswith(f.read().rstrip('\n'))
  assert runner.endswith('\n\n\nif __name__ == "__main__":\n  sys.exit(main())\n')
  with open(os.path.join(exported, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  assert f'python {exported}/translate.py' in readme and 'flatbuffers' in readme


def test_parameters_nest_back_to_the_translators_tree(translator):
  flat = stablehlo.flatten_parameters(translator.params)
  nested = stablehlo.nest_parameters(flat)
  assert jax.tree_util.tree_structure(nested) == jax.tree_util.tree_structure(translator.params)


def test_the_runner_buckets_and_strips_as_the_translator():
  for limit in (32, 100, 256):
    assert [
      stablehlo_runner.source_bucket(n, limit, decoding.MIN_SOURCE_BUCKET) for n in range(1, 300)
    ] == [decoding.source_bucket(n, limit) for n in range(1, 300)]
  tokens = np.array([[5, 6, EOS_ID, 7, PAD_ID], [PAD_ID, 5, PAD_ID, 8, 9], [EOS_ID, 4, 4, 4, 4]])
  assert stablehlo_runner.strip_after_eos(tokens, EOS_ID, PAD_ID) == decode.strip_after_eos(
    tokens, EOS_ID, pad_id=PAD_ID
  )


def test_the_runner_refuses_a_beam_size_that_was_not_exported(exported):
  runner = stablehlo_runner.ExportedTranslator(exported)
  assert runner.beam_sizes == [1, 4]
  with pytest.raises(ValueError, match=r'^beam_size=3 was not exported; .* beam sizes 1, 4'):
    runner.translate(['one'], beam_size=3)


def test_a_variant_that_cannot_be_exported_is_refused_in_one_line(translator):
  cudnn = translator.model_config.replace(attention_impl='cudnn', dtype='bfloat16')
  with pytest.raises(UserInputError, match=r"^TransformerConfig\.attention_impl='cudnn' exports"):
    stablehlo.check_exportable(cudnn, ('cpu', 'cuda'))
  stablehlo.check_exportable(cudnn, ('cuda',))  # The one platform it runs on.
  stablehlo.check_exportable(translator.model_config, ('cpu', 'cuda'))


@pytest.mark.parametrize(
  'options, message',
  [
    (dict(platforms=('cpu', 'metal')), r'^platforms must be distinct names among cpu, cuda'),
    (dict(platforms='cpu'), r'^platforms must be a list'),
    (dict(beam_sizes=(1, 0)), r'^beam_sizes must be positive integers, got 0$'),
    (dict(beam_sizes=(4, 4)), r'^beam_sizes must be distinct'),
    (dict(quantization='int8'), r'^--quantization=int8: --format=stablehlo exports float32'),
    (dict(alpha=-1.0), r'^alpha must be a finite number >= 0'),
  ],
)
def test_impossible_options_are_refused_before_anything_is_written(
  options, message, workdir, tmp_path
):
  out = tmp_path / 'model'
  with pytest.raises(UserInputError, match=message) as error:
    stablehlo.export(workdir, str(out), **options)
  assert '\n' not in str(error.value)
  assert list(tmp_path.iterdir()) == []


def test_an_existing_out_is_kept_unless_forced(exported, workdir):
  with pytest.raises(UserInputError, match=r'already there \(pass --force to replace it\)$'):
    stablehlo.export(workdir, exported)
  assert os.path.exists(os.path.join(exported, 'manifest.json'))


def test_the_export_command_writes_stablehlo_and_refuses_quantization(workdir, tmp_path):
  out = tmp_path / 'cmd'
  command = [sys.executable, '-m', 'transformer_jax.export', f'--workdir={workdir}']
  command += ['--format=stablehlo', f'--out={out}']
  result = subprocess.run(command, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == str(out)
  manifest = json.loads((out / 'manifest.json').read_text())
  assert manifest['platforms'] and (out / 'translate.py').exists()
  result = subprocess.run(
    [*command[:-1], f'--out={tmp_path / "q"}', '--quantization=int8'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2
  assert result.stderr.strip().startswith('error: ') and '\n' not in result.stderr.strip()
  assert not (tmp_path / 'q').exists()


# --- --dtype (issue 49 item 4) -------------------------------------------------------------------


@pytest.fixture(scope='module')
def exported_bfloat16(workdir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('stablehlo') / 'model_bfloat16')
  assert stablehlo.export(workdir, out, dtype='bfloat16') == out
  return out


@pytest.mark.parametrize('beam_size', [4, 1])
def test_a_bfloat16_export_translates_as_the_bfloat16_translator(
  beam_size, exported_bfloat16, workdir, sentences, ours
):
  # In the same batches: in bfloat16 a batch's shape and length bucket change roundings that
  # decide this 30-step model's near ties, for the Translator itself too (11 of these 50
  # differ between its batch sizes 64 and 13, 2026-12-07), which float32's do not.
  batch_size = _BEAM_BATCH_SIZE if beam_size > 1 else _GREEDY_BATCH_SIZE
  reference = Translator.from_checkpoint(workdir, batch_size=batch_size, dtype='bfloat16')
  expected = reference.translate(sentences, beam_size=beam_size, alpha=0.6)
  runner = stablehlo_runner.ExportedTranslator(exported_bfloat16)
  found = runner.translate(sentences, beam_size=beam_size, alpha=0.6, batch_size=batch_size)
  assert not _differing(sentences, expected, found)
  assert len(set(expected)) >= 10
  # The runner computes in bfloat16: not float32's outputs by another route (this model has
  # 30 steps, so its near ties tell the dtypes apart).
  assert expected != ours['beam' if beam_size > 1 else 'greedy']


def test_a_bfloat16_export_stores_its_matrices_in_bfloat16(exported_bfloat16, workdir):
  with open(os.path.join(exported_bfloat16, 'manifest.json'), encoding='utf-8') as f:
    manifest = json.load(f)
  assert manifest['dtype'] == 'bfloat16' and manifest['model']['dtype'] == 'bfloat16'
  by_name = manifest['parameters']['dtypes_by_name']
  assert 'bfloat16' in manifest['parameters']['dtypes']
  # The Translator's parameters in bfloat16 (`cast_params`), name by name.
  reference = Translator.from_checkpoint(workdir, dtype='bfloat16')
  flat = stablehlo.flatten_parameters(reference.params)
  assert by_name == {name: str(value.dtype) for name, value in flat.items()}
  assert by_name['shared_embedding/embedding'] == 'bfloat16'
  assert by_name['encoder_layers/ffn/wi/kernel'] == 'bfloat16'
  with np.load(os.path.join(exported_bfloat16, 'parameters.npz'), allow_pickle=False) as stored:
    for name, value in flat.items():
      # bfloat16 as its uint16 bit patterns (2 bytes each): NumPy has no bfloat16 to name.
      assert stored[name].dtype == (np.uint16 if value.dtype == jax.numpy.bfloat16 else value.dtype)
  loaded = stablehlo_runner.load_parameters(
    os.path.join(exported_bfloat16, 'parameters.npz'), manifest['parameters']
  )
  for name, value in flat.items():
    assert loaded[name].dtype == value.dtype
    np.testing.assert_array_equal(loaded[name].astype(np.float32), value.astype(np.float32))
  with open(os.path.join(exported_bfloat16, 'greedy.jax_export'), 'rb') as f:
    search = jax_export.deserialize(bytearray(f.read()))
  # The program takes the parameters as stored: the matrices in bfloat16, the vectors (biases,
  # norm scales, [layers, d] in the stacked layers) in float32.
  taken = [str(aval.dtype) for aval in search.in_avals[:-3]]
  assert sorted(taken) == sorted(by_name.values())
  assert by_name['encoder_layers/ffn_block/norm/scale'] == 'float32'
  with open(os.path.join(exported_bfloat16, 'README.md'), encoding='utf-8') as f:
    assert 'computing in bfloat16' in f.read()


def test_the_export_command_takes_a_dtype_for_stablehlo_only(workdir, tmp_path):
  command = [sys.executable, '-m', 'transformer_jax.export', f'--workdir={workdir}']
  result = subprocess.run(
    [*command, '--format=stablehlo', f'--out={tmp_path / "half"}', '--dtype=float16'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  manifest = json.loads((tmp_path / 'half' / 'manifest.json').read_text())
  assert manifest['dtype'] == 'float16' and 'float16' in manifest['parameters']['dtypes']
  result = subprocess.run(
    [*command, '--format=ctranslate2', f'--out={tmp_path / "ct2"}', '--dtype=bfloat16'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2
  assert result.stderr.strip() == (
    'error: --dtype=bfloat16 is for --format=stablehlo; with --format=ctranslate2 give '
    '--quantization=bfloat16 (the weights are stored in it; CTranslate2 chooses the type it '
    'computes in when it loads the model, compute_type=)'
  )
  assert not (tmp_path / 'ct2').exists()
