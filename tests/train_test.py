"""End to end through the command lines: train.py on a shrunken config, then translate."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, TINY_FLAGS

_TINY_FLAGS = [
  *TINY_FLAGS,
  '--config.num_train_steps=6',
  '--config.log_every_steps=3',
  '--config.eval_every_steps=6',
  '--config.checkpoint_every_steps=3',
  '--config.eval_decode_examples=20',
  '--config.eval_batch_size=32',
  '--config.final_test_decode=True',
]


def _run(args, stdin=None, timeout=300, cwd=REPO_ROOT):
  return subprocess.run(
    [sys.executable, *args], input=stdin, capture_output=True, cwd=cwd, timeout=timeout
  )


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp('workdir'))
  # Started from another directory: the default config is found without the checkout as cwd.
  elsewhere = tmp_path_factory.mktemp('elsewhere')
  result = _run(
    [
      os.path.join(REPO_ROOT, 'train.py'),
      f'--workdir={workdir}',
      f'--config.data_dir={data_dir}',
      *_TINY_FLAGS,
    ],
    cwd=elsewhere,
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  return workdir, result.stderr.decode()


def test_train_py_writes_everything_inference_needs(trained_workdir):
  workdir, log = trained_workdir
  for name in ('config.json', 'vocab.model', 'checkpoints', 'tensorboard'):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['3', '6']
  assert 'step 6/6 | loss' in log and 'tok/s' in log and 'ETA' in log
  # The silent seconds before the first step are said: vocabulary, tokenizing, compiling (the
  # dataset's generation is logged too: number_words_test).
  assert 'training the 96-piece vocabulary' in log and 'tokenizing number_words_tiny' in log
  assert log.index('compiling the training step') < log.index('training step compiled')
  assert log.index('training step compiled') < log.index('step 3/6 | loss')
  assert 'test exact match (greedy, 200 sentences): ' in log and 'chrF' in log
  # Number words: exact match per category, and no BLEU (one-word outputs have no 4-grams).
  assert 'test exact match by category:' in log
  for category in ('units', 'teens', 'tens', 'round', 'ends_in_one', 'millions', 'other'):
    assert f'] {category} ' in log.replace(']   ', '] '), category
  assert 'BLEU' not in log and 'bleu' not in log
  assert 'eval step 6: loss' in log and 'chrf' in log
  events = [
    os.path.join(workdir, 'tensorboard', f)
    for f in os.listdir(os.path.join(workdir, 'tensorboard'))
    if f.startswith('events.out.tfevents')
  ]
  assert events
  content = b''.join(pathlib.Path(f).read_bytes() for f in events)
  for tag in (
    b'train/loss',
    b'train/learning_rate',
    b'train/target_tokens_per_second',
    b'eval/loss',
    b'eval/chrf',
    b'eval/samples',
    b'test/exact_match',
    b'test/exact_match/round',
    b'test/exact_match/millions',
  ):
    assert tag in content, tag
  assert b'eval/bleu' not in content and b'test/bleu' not in content


def test_translate_keeps_one_line_per_input_line(trained_workdir):
  workdir, _ = trained_workdir
  lines = ['three hundred forty-two', '', 'seven', '   ', 'ünïcødé ✓ 数字', 'one ' * 40]
  stdin = ('\n'.join(lines) + '\n').encode()
  result = _run(['-m', 'transformer_jax.translate', f'--workdir={workdir}'], stdin=stdin)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  outputs = result.stdout.decode().split('\n')
  assert outputs[-1] == ''  # Trailing newline.
  outputs = outputs[:-1]
  assert len(outputs) == len(lines)
  assert outputs[1] == '' and outputs[3] == ''  # Empty in, empty out.
  # Piped bytes that are not UTF-8 are refused naming the line (common/text_io.py's policy),
  # before anything is translated: never a line silently changed.
  result = _run(
    ['-m', 'transformer_jax.translate', f'--workdir={workdir}'],
    stdin=stdin + b'\xff\xfe invalid utf-8\n',
  )
  assert result.returncode == 2 and result.stdout == b''
  assert result.stderr.decode().strip().startswith('error: stdin line 7: invalid UTF-8')


def test_translate_without_checkpoint_is_a_one_line_error(tmp_path):
  result = _run(['-m', 'transformer_jax.translate', f'--workdir={tmp_path}'], stdin=b'one\n')
  assert result.returncode == 2
  stderr = result.stderr.decode().strip()
  assert stderr.startswith('error: ') and 'config.json' in stderr and '\n' not in stderr


def test_train_py_invalid_size_is_a_one_line_error(tmp_path, data_dir):
  result = _run(
    [
      'train.py',
      f'--workdir={tmp_path}',
      f'--config.data_dir={data_dir}',
      *_TINY_FLAGS,
      '--config.model.d_ff=0',
    ]
  )
  assert result.returncode == 2
  error_lines = [line for line in result.stderr.decode().splitlines() if line.startswith('error: ')]
  assert error_lines == ['error: config.model.d_ff must be a positive integer, got 0']
  assert 'Traceback' not in result.stderr.decode()


@pytest.mark.parametrize(
  'flags, expected',
  [
    (
      ['--config.num_train_step=5'],
      'error: --config.*: the config has no field '
      '\'num_train_step\' (Did you mean "num_train_steps" instead of "num_train_step"?)',
    ),
    (
      ['--config=configs/multi30k.py', '--config.model.d_modle=8'],
      'error: --config.*: the config has no field \'d_modle\' (Did you mean "d_model" instead '
      'of "d_modle"?)',
    ),
    (
      ['--config=configs/missing.py'],
      "error: --config: [Errno 2] No such file or directory: 'configs/missing.py'",
    ),
    (['--config={dir}/notes.py'], 'error: --config: invalid syntax (notes.py, line 2)'),
  ],
  ids=['misspelt field, default file', 'misspelt field, named file', 'missing file', 'not python'],
)
def test_train_py_config_flag_mistakes_are_one_line_errors(tmp_path, flags, expected):
  """ml_collections reports these as tracebacks, the default file's overrides even before
  absl parses the command line."""
  (tmp_path / 'notes.py').write_text('# A config?\nnot python at all\n')
  workdir = tmp_path / 'workdir'
  result = _run(['train.py', f'--workdir={workdir}', *[f.format(dir=tmp_path) for f in flags]])
  stderr = result.stderr.decode()
  assert result.returncode == 2 and 'Traceback' not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == expected.format(dir=tmp_path)
  assert not workdir.exists()  # Nothing was started.


def test_averaged_checkpoint_is_loaded_by_name_and_by_default(trained_workdir):
  import jax
  import numpy as np

  from transformer_jax.inference.translator import Translator

  workdir, _ = trained_workdir
  result = _run(['-m', 'transformer_jax.average', f'--workdir={workdir}', '--last=2'])
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  step3 = Translator.from_checkpoint(workdir, 3).params
  step6 = Translator.from_checkpoint(workdir, 'latest').params
  averaged = Translator.from_checkpoint(workdir, 'averaged').params
  default = Translator.from_checkpoint(workdir).params  # Averaged from the latest: used.
  for a, b, mean, d in zip(
    *(jax.tree_util.tree_leaves(t) for t in (step3, step6, averaged, default))
  ):
    np.testing.assert_allclose(mean, (np.asarray(a, np.float64) + b) / 2, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(d, mean)
  # translate --checkpoint accepts the same names; a bad one is a one-line error.
  result = _run(
    ['-m', 'transformer_jax.translate', f'--workdir={workdir}', '--checkpoint=averaged'],
    stdin=b'seven\n',
  )
  assert result.returncode == 0 and len(result.stdout.decode().splitlines()) == 1
  result = _run(
    ['-m', 'transformer_jax.translate', f'--workdir={workdir}', '--checkpoint=best'],
    stdin=b'seven\n',
  )
  # A run trained without config.best_checkpoint_metric has no best to load: one line, exit 2.
  assert result.returncode == 2, result.stderr.decode()[-2000:]
  assert (
    'records no best checkpoint: train with config.best_checkpoint_metric'
    in (result.stderr.decode().strip().splitlines()[-1])
  )


def test_evaluate_and_translate_search_as_ctranslate2_with_beam_rule(trained_workdir, tmp_path):
  """--beam_rule=ctranslate2 reaches the search (Translator.translate's beam_rule) from both
  commands, and evaluate names its default hypotheses file by it."""
  from transformer_jax.data import number_words
  from transformer_jax.inference.translator import Translator

  workdir, _ = trained_workdir
  numbers = [7, 21, 342005, 1000001]
  sources = [number_words.english_words(n) for n in numbers]
  src, ref = tmp_path / 'test.en', tmp_path / 'test.de'
  src.write_text(''.join(s + '\n' for s in sources))
  ref.write_text(''.join(number_words.german_words(n) + '\n' for n in numbers))
  expected = Translator.from_checkpoint(workdir).translate(
    sources, beam_size=4, alpha=0.0, beam_rule='ctranslate2'
  )
  flags = ['--beam_rule=ctranslate2', '--alpha=0']
  result = _run(
    [
      '-m',
      'transformer_jax.evaluate',
      f'--workdir={workdir}',
      f'--src={src}',
      f'--ref={ref}',
      *flags,
    ]
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  written = os.path.join(workdir, 'hypotheses', 'test.en.default.beam4.ctranslate2.alpha0.txt')
  assert open(written).read().splitlines() == expected
  result = _run(
    ['-m', 'transformer_jax.translate', f'--workdir={workdir}', *flags], stdin=src.read_bytes()
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout.decode().splitlines() == expected


def test_evaluate_reports_exact_match_by_category_and_writes_hypotheses(trained_workdir, tmp_path):
  import sacrebleu

  from transformer_jax.data import number_words

  workdir, _ = trained_workdir
  numbers = [7, 21, 342005, 1000001, 90, 2000]
  src, ref = tmp_path / 'test.en', tmp_path / 'test.de'
  src.write_text(''.join(number_words.english_words(n) + '\n' for n in numbers))
  ref.write_text(''.join(number_words.german_words(n) + '\r\n' for n in numbers))  # CRLF.
  out = tmp_path / 'hyp.txt'
  result = _run(
    [
      '-m',
      'transformer_jax.evaluate',
      f'--workdir={workdir}',
      f'--src={src}',
      f'--ref={ref}',
      f'--out={out}',
      '--beam_size=2',
      '--checkpoint=latest',
    ]
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  stdout = result.stdout.decode()
  hypotheses = out.read_text().split('\n')[:-1]
  assert len(hypotheses) == len(numbers)
  references = [number_words.german_words(n) for n in numbers]
  hits = [h == r for h, r in zip(hypotheses, references)]
  lines = stdout.splitlines()
  assert lines[0] == f'exact match {100 * sum(hits) / 6:.2f}% ({sum(hits)}/6)'
  # One line per category present, in number_words.CATEGORIES order, with its own count.
  expected_rows = [('units', 0), ('tens', 1), ('tens', 4), ('round', 5), ('ends_in_one', 3)]
  expected_rows.append(('other', 2))
  by_category = {}
  for name, index in expected_rows:
    by_category.setdefault(name, []).append(hits[index])
  for line, name in zip(lines[1:6], ['units', 'tens', 'round', 'ends_in_one', 'other']):
    category_hits = by_category[name]
    assert line.split()[0] == name
    assert f'{sum(category_hits)}/{len(category_hits)}' in line, line
  assert 'BLEU not reported' in stdout and 'BLEU =' not in stdout
  expected_chrf = sacrebleu.corpus_chrf(hypotheses, [references]).score
  assert f'chrF2 = {expected_chrf:.2f}' in stdout
  assert 'nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:' in stdout

  ref.write_text('only one line\n')
  result = _run(
    ['-m', 'transformer_jax.evaluate', f'--workdir={workdir}', f'--src={src}', f'--ref={ref}']
  )
  assert result.returncode == 2
  assert f'error: {src} has 6 lines but {ref} has 1' in result.stderr.decode()


def test_translate_file_input_and_output(trained_workdir, tmp_path):
  workdir, _ = trained_workdir
  source, target = tmp_path / 'in.txt', tmp_path / 'out.txt'
  source.write_bytes(b'seven\r\n\nforty-two')  # CRLF, an empty line, no final newline.
  result = _run(
    [
      '-m',
      'transformer_jax.translate',
      f'--workdir={workdir}',
      '--beam_size=1',
      f'--input={source}',
      f'--output={target}',
    ]
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  lines = target.read_text(encoding='utf-8').split('\n')
  assert len(lines) == 4 and lines[1] == '' and lines[3] == ''  # 3 lines + final newline.
  result = _run(
    [
      '-m',
      'transformer_jax.translate',
      f'--workdir={workdir}',
      f'--input={tmp_path / "missing.txt"}',
    ]
  )
  assert result.returncode == 2 and 'missing.txt: no such file' in result.stderr.decode()


def test_bad_decoding_flags_are_one_line_errors_before_any_checkpoint_is_read(tmp_path):
  """Checked before the workdir is read (it does not even exist here), so a typo costs seconds."""
  workdir = tmp_path / 'no_such_workdir'
  result = _run(['-m', 'transformer_jax.translate', f'--workdir={workdir}', '--beam_size=0'])
  assert result.returncode == 2
  assert (
    result.stderr.decode().strip().splitlines()[-1]
    == 'error: beam_size must be a positive integer, got 0'
  )
  result = _run(
    [
      '-m',
      'transformer_jax.evaluate',
      f'--workdir={workdir}',
      '--alpha=-1',
      f'--src={tmp_path}',
      f'--ref={tmp_path}',
    ]
  )
  assert result.returncode == 2
  assert (
    result.stderr.decode().strip().splitlines()[-1]
    == 'error: alpha must be a finite number >= 0, got -1.0'
  )


def test_translate_is_interactive_on_a_terminal(trained_workdir):
  """A pseudo-terminal on stdin: each typed line is answered before the next is typed."""
  import pty
  import select

  workdir, _ = trained_workdir
  leader, follower = pty.openpty()
  process = subprocess.Popen(
    [sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}', '--beam_size=1'],
    cwd=REPO_ROOT,
    stdin=follower,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
  )
  os.close(follower)
  try:
    answers = []
    for sentence in (b'seven\n', b'twenty\n'):
      os.write(leader, sentence)
      ready, _, _ = select.select([process.stdout], [], [], 120)
      assert ready, 'no answer within 120 s'
      answers.append(process.stdout.readline())
    assert len(answers) == 2 and all(a.endswith(b'\n') for a in answers)
    os.write(leader, b'\x04')  # Ctrl-D ends the session.
    assert process.wait(timeout=60) == 0
  finally:
    if process.poll() is None:
      process.kill()
    process.stdout.close()
    os.close(leader)


def test_plot_attention_command_draws_a_png(trained_workdir, tmp_path):
  pytest.importorskip('matplotlib')
  workdir, _ = trained_workdir
  out = tmp_path / 'attention.png'
  result = _run(
    [
      '-m',
      'transformer_jax.plot_attention',
      f'--workdir={workdir}',
      '--text=seven hundred one',
      f'--out={out}',
      '--layers=1',
    ]
  )
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert 'cross attention, ' in result.stdout.decode() and str(out) in result.stdout.decode()
  bad = _run(
    [
      '-m',
      'transformer_jax.plot_attention',
      f'--workdir={workdir}',
      '--text=one',
      f'--out={out}',
      '--layers=7',
    ]
  )
  assert bad.returncode == 2
  assert bad.stderr.decode().strip().splitlines()[-1] == (
    'error: --layers: layer 7 does not exist (the model has 1, numbered from 1)'
  )


def test_resuming_on_a_different_device_count_is_refused(trained_workdir, tmp_path):
  # Fixed-size batches are this process's slice of the data, per_device_batch_size per
  # device: on 2 devices the resumed run would see other batches than the interrupted one.
  workdir = str(tmp_path / 'copy')
  shutil.copytree(trained_workdir[0], workdir)
  env = dict(
    os.environ,
    XLA_FLAGS=os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2',
  )
  result = subprocess.run(
    [
      sys.executable,
      'train.py',
      f'--workdir={workdir}',
      *_TINY_FLAGS,
      '--config.num_train_steps=9',
    ],
    capture_output=True,
    cwd=REPO_ROOT,
    env=env,
    timeout=300,
  )
  assert result.returncode == 2, result.stderr.decode()[-3000:]
  assert result.stderr.decode().strip().splitlines()[-1] == (
    'error: the checkpoint was written by a run on 1 process(es) x 1 local devices, this one '
    'runs on 1 process(es) x 2 local devices: its batches would differ from those the '
    'interrupted run was training on. Resume on the same devices, or start a new --workdir'
  )
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['3', '6']  # Untouched.


def test_help_lists_the_config_flag_and_exits_zero(tmp_path):
  result = _run([os.path.join(REPO_ROOT, 'train.py'), '--help'], cwd=tmp_path)
  assert result.returncode == 0, result.stderr.decode()[-2000:]
  help_text = result.stdout.decode()
  assert '--config: Training config file, default configs/default.py, which comments' in help_text
  assert '--workdir:' in help_text
