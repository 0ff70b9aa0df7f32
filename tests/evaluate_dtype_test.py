"""evaluate --dtype (issue 49 item 4): the test set decoded in the inference dtype asked for,
named in the default hypotheses file and the summary, so that a float32 and a bfloat16
evaluation keep both outputs; the model's own dtype keeps the names evaluations had before."""

import os
import subprocess
import sys

import pytest

from transformer_jax.data import number_words
from transformer_jax.evaluation import test_set
from transformer_jax.inference.translator import Translator

from conftest import copied_workdir

NUMBERS = number_words.sample_numbers('test', 48, 0)
SOURCES = [number_words.english_words(n) for n in NUMBERS]
REFERENCES = [number_words.german_words(n) for n in NUMBERS]


@pytest.fixture(scope='module')
def workdir(number_words_workdir, tmp_path_factory):
  return copied_workdir(number_words_workdir, tmp_path_factory, 'evaluate_dtype')


@pytest.fixture(scope='module')
def test_files(tmp_path_factory):
  folder = tmp_path_factory.mktemp('evaluate_dtype_data')
  src, ref = folder / 'test.en', folder / 'test.de'
  src.write_text(''.join(s + '\n' for s in SOURCES))
  ref.write_text(''.join(r + '\n' for r in REFERENCES))
  return str(src), str(ref)


def test_each_dtype_its_own_default_file(workdir, test_files):
  src, ref = test_files
  default = test_set.evaluate_files(workdir, src, ref, beam_size=2)
  half = test_set.evaluate_files(workdir, src, ref, beam_size=2, dtype='bfloat16')
  assert default['hypotheses_file'].name == 'test.en.default.beam2.alpha0.6.txt'
  assert half['hypotheses_file'].name == 'test.en.default.beam2.alpha0.6.bfloat16.txt'
  assert (default['dtype'], half['dtype']) == ('float32', 'bfloat16')
  assert default['decoding'] == 'beam 2, alpha 0.6'
  assert half['decoding'] == 'beam 2, alpha 0.6, bfloat16'
  # Both outputs kept, each the Translator's in its dtype.
  written = half['hypotheses_file'].read_text().splitlines()
  assert written == Translator.from_checkpoint(workdir, dtype='bfloat16').translate(
    SOURCES, beam_size=2
  )
  assert default['hypotheses_file'].read_text().splitlines() == Translator.from_checkpoint(
    workdir
  ).translate(SOURCES, beam_size=2)
  # The model's own dtype, named or not, is the same computation: the same file.
  own = test_set.evaluate_files(workdir, src, ref, beam_size=2, dtype='float32')
  assert own['hypotheses_file'] == default['hypotheses_file']
  assert own['decoding'] == 'beam 2, alpha 0.6' and own['dtype'] == 'float32'
  # Sampling's name keeps its settings, the dtype after them.
  sampled = test_set.evaluate_files(
    workdir, src, ref, beam_size=1, sampling=True, seed=3, dtype='float16'
  )
  assert sampled['hypotheses_file'].name == (
    'test.en.default.beam1.alpha0.6.sampling.t1.k0.p1.seed3.float16.txt'
  )
  assert sampled['decoding'] == 'sampling, temperature 1, seed 3, float16'


def test_the_command_takes_a_dtype(workdir, test_files, tmp_path):
  src, ref = test_files
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  command = [sys.executable, '-m', 'transformer_jax.evaluate', f'--workdir={workdir}']
  command += [f'--src={src}', f'--ref={ref}', '--beam_size=1']
  result = subprocess.run([*command, '--dtype=bfloat16'], capture_output=True, env=env)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  out = os.path.join(workdir, 'hypotheses', 'test.en.default.beam1.alpha0.6.bfloat16.txt')
  summary = result.stdout.decode().splitlines()[-1]
  assert f'(beam 1, alpha 0.6, bfloat16); hypotheses: {out}' in summary
  expected = Translator.from_checkpoint(workdir, dtype='bfloat16').translate(SOURCES, beam_size=1)
  assert open(out).read().splitlines() == expected
  bad = subprocess.run([*command, '--dtype=int8'], capture_output=True, env=env)
  assert bad.returncode == 2
  assert 'int8' in bad.stderr.decode() and 'float32' in bad.stderr.decode()
