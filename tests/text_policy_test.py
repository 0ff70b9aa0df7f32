"""Text that is not text is handled one way everywhere (common/text_io.py's reading policy).

`translate` (a file, piped stdin, a terminal), `evaluate`, the StableHLO runner's copy of the
policy and `prepare_text_dataset` refuse the same inputs with the same one-line message naming
the file and line, and read the same lines from the rest; a byte order mark never changes a
score. One table of byte strings drives the readers; a few calls check each command's path.
"""

import bz2
import gzip
import io
import lzma
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile

import pytest

from transformer_jax.benchmark.decoding import suppress_eos
from transformer_jax.checkpoints import save_params
from transformer_jax.common import text_io
from transformer_jax.common.errors import UserInputError
from transformer_jax.data import text_dataset
from transformer_jax.evaluation import metrics, test_set
from transformer_jax.exporters import stablehlo_runner
from transformer_jax.inference.text_files import translate_text
from transformer_jax.inference.translator import Translator
from transformer_jax.workdir.layout import Workdir

from conftest import REPO_ROOT


def _zip(data: bytes) -> bytes:
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, 'w') as archive:
    archive.writestr('test.en', data)
  return buffer.getvalue()


BOM = b'\xef\xbb\xbf'
LONG_LINE = 'x' * 1_000_000

# (bytes, the lines read, or a regex the one-line refusal matches with {n} the name given).
CASES = {
  'plain': (b'eins\nzwei\n', ['eins', 'zwei']),
  'no final newline': (b'eins\nzwei', ['eins', 'zwei']),
  'empty lines kept': (b'eins\n\n\nzwei\n', ['eins', '', '', 'zwei']),
  'CRLF': (b'eins\r\nzwei\r\n', ['eins', 'zwei']),
  'CRLF, last line unterminated': (b'eins\r\nzwei\r', ['eins', 'zwei']),
  'a CR inside an LF line stays': (b'ei\rns\nzwei\n', ['ei\rns', 'zwei']),
  'UTF-8 BOM at the start': (BOM + 'größer\nzwei\n'.encode(), ['größer', 'zwei']),
  'UTF-8 BOM and CRLF': (BOM + b'eins\r\nzwei\r\n', ['eins', 'zwei']),
  'a BOM alone: no lines': (BOM, []),
  'a BOM and a newline: one empty line': (BOM + b'\n', ['']),
  'empty': (b'', []),
  'text starting like bzip2': (b'BZh9 ist kein bzip2\n', ['BZh9 ist kein bzip2']),
  'a very long line': (LONG_LINE.encode() + b'\nkurz\n', [LONG_LINE, 'kurz']),
  'a BOM in the middle (cat of two files)': (
    b'eins\n' + BOM + b'zwei\n',
    r'^{n} line 2: a byte order mark \(U\+FEFF\) after the start of the text',
  ),
  'two BOMs at the start': (BOM + BOM + b'eins\n', r'^{n} line 1: a byte order mark'),
  'a BOM inside a line': (b'eins\nzw' + BOM + b'ei\n', r'^{n} line 2: a byte order mark'),
  'CR-only line endings': (b'eins\rzwei\r', r'^{n} line 1: the file uses CR-only'),
  'NUL byte': (b'eins\nzw\x00ei\n', r'^{n} line 2: NUL byte; this looks like a binary file'),
  'NUL byte after a BOM': (BOM + b'\x00\n', r'^{n} line 1: NUL byte'),
  'invalid UTF-8': (
    b'eins\nzwei\n\xff drei\n',
    r'^{n} line 3: invalid UTF-8 \(byte 0xff at offset 10\); convert the file to UTF-8$',
  ),
  'Latin-1': (b'caf\xe9\n', r'^{n} line 1: invalid UTF-8 \(byte 0xe9 at offset 3\)'),
  'the first bad line is named (UTF-8 before NUL)': (
    b'a\n\xff\n\x00\n',
    r'^{n} line 2: invalid UTF-8',
  ),
  'the first bad line is named (BOM before NUL)': (
    b'a\n' + BOM + b'b\n\x00\n',
    r'^{n} line 2: a byte order mark',
  ),
  'UTF-16LE with its BOM': (
    '\ufeffeins\nzwei\n'.encode('utf-16-le'),
    r'^{n}: UTF-16LE text \(by its byte order mark\), not UTF-8 text; convert it to UTF-8 '
    r'first \(iconv -f UTF-16 -t UTF-8 ',
  ),
  'UTF-16BE with its BOM': ('\ufeffeins\n'.encode('utf-16-be'), r'^{n}: UTF-16BE text'),
  'UTF-32LE with its BOM': ('\ufeffeins\n'.encode('utf-32-le'), r'^{n}: UTF-32LE text'),
  'UTF-16 without a BOM': ('eins\nzwei\n'.encode('utf-16-le'), r'^{n} line 1: NUL byte'),
  'gzip': (
    gzip.compress(b'eins\nzwei\n'),
    r'^{n}: gzip-compressed, not UTF-8 text; decompress it first \(gunzip -c \S+ \| \.\.\.\)$',
  ),
  'bzip2': (bz2.compress(b'eins\nzwei\n'), r'^{n}: bzip2-compressed, .*bunzip2 -c'),
  'bzip2, empty': (bz2.compress(b''), r'^{n}: bzip2-compressed'),
  'xz': (lzma.compress(b'eins\nzwei\n'), r'^{n}: xz-compressed, .*xz -dc'),
  # A zstd frame of 'eins\n' (zstd -c): the stdlib has no zstd before Python 3.14.
  'zstd': (bytes.fromhex('28b52ffd0458290000656e696e730a'), r'^{n}: zstd-compressed'),
  'zip': (_zip(b'eins\nzwei\n'), r'^{n}: a zip archive, not UTF-8 text; .*unzip -p'),
}
IDS = sorted(CASES)


def _outcome(read, *args):
  """The lines `read(*args)` returns, or ('refused', message) for its one-line refusal."""
  try:
    return read(*args)
  except (UserInputError, ValueError) as error:
    assert '\n' not in str(error)
    return ('refused', str(error))


@pytest.mark.parametrize('case', IDS)
def test_each_reader_reads_or_refuses_by_the_one_policy(tmp_path, case):
  data, expected = CASES[case]
  path = tmp_path / 'test.en'
  path.write_bytes(data)
  name = f'--ref={path}'
  got = _outcome(text_io.read_lines, str(path), '--ref')
  if isinstance(expected, list):
    assert got == expected
  else:
    assert got[0] == 'refused', got
    assert re.search(expected.format(n=re.escape(name)), got[1]), got[1]
  # The runner's copy (a ValueError where text_io raises UserInputError), training's reader (it
  # names the file without a flag) and the line-by-line reader (no path for the advice): alike.
  assert _outcome(stablehlo_runner.decode_text, data, name, str(path)) == got
  assert _outcome(text_dataset._read_lines, str(path), data) == _outcome(
    text_io.decode_text, data, str(path), str(path)
  )
  assert _outcome(lambda: list(text_io.decode_lines(io.BytesIO(data), name))) == _outcome(
    text_io.decode_text, data, name
  )


def test_a_terminal_alone_turns_bytes_that_are_not_utf8_into_replacement_characters():
  typed = io.BytesIO(b'caf\xe9\nzwei\n')
  assert list(text_io.decode_lines(typed, 'stdin', replace_invalid=True)) == ['caf\ufffd', 'zwei']
  for refused in (b'\x00\n', b'eins\n' + BOM + b'zwei\n', gzip.compress(b'eins\n')):
    with pytest.raises(UserInputError):
      list(text_io.decode_lines(io.BytesIO(refused), 'stdin', replace_invalid=True))


def test_a_pipe_is_read_once_with_the_policy():
  """What bash's `--src=<(...)` passes: /dev/fd/N, a pipe that can be read only once."""
  read_end, write_end = os.pipe()
  writer = threading.Thread(
    target=lambda: (os.write(write_end, BOM + b'eins\r\nzwei\r\n'), os.close(write_end)),
    daemon=True,
  )
  writer.start()
  try:
    assert text_io.read_lines(f'/dev/fd/{read_end}', '--src') == ['eins', 'zwei']
  finally:
    writer.join(timeout=10)
    os.close(read_end)


def test_training_refuses_a_compressed_file_naming_it_and_writes_nothing(tmp_path):
  files = tmp_path / 'files'
  files.mkdir()
  (files / 'train.en').write_bytes(gzip.compress(b'one\ntwo\n'))
  (files / 'train.de').write_bytes(b'eins\nzwei\n')
  with pytest.raises(UserInputError, match=r'train\.en: gzip-compressed, .*gunzip -c .*train\.en'):
    text_dataset.prepare_text_dataset(
      src_path_by_split={'train': str(files / 'train.en')},
      tgt_path_by_split={'train': str(files / 'train.de')},
      data_dir=str(tmp_path / 'tfds'),
      src_lang='en',
      tgt_lang='de',
    )
  assert not (tmp_path / 'tfds').exists()


# --- translate ---


@pytest.mark.parametrize(
  'data, pattern',
  [
    (b'one\ntw\x00o\n', r'^--input=\S+in\.txt line 2: NUL byte'),
    (
      gzip.compress(b'one\ntwo\n'),
      r'^--input=\S+in\.txt: gzip-compressed, .*\(gunzip -c \S+in\.txt',
    ),
    (b'one\n\xff\n', r'^--input=\S+in\.txt line 2: invalid UTF-8'),
  ],
  ids=['NUL', 'gzip', 'invalid UTF-8'],
)
def test_translate_refuses_an_input_that_is_not_text_and_writes_nothing(
  tmp_path, tiny_workdir, data, pattern
):
  source, output = tmp_path / 'in.txt', tmp_path / 'out.txt'
  source.write_bytes(data)
  with pytest.raises(UserInputError, match=pattern):
    translate_text(tiny_workdir, input_path=str(source), output_path=str(output))
  assert sorted(os.listdir(tmp_path)) == ['in.txt']


def test_translate_refuses_piped_stdin_that_is_not_text(tiny_workdir):
  for data, pattern in [
    (b'one\n\x00\n', r'^stdin line 2: NUL byte'),
    (b'one\ncaf\xe9\n', r'^stdin line 2: invalid UTF-8 \(byte 0xe9 at offset 7\)'),
    (bz2.compress(b'one\n'), r'^stdin: bzip2-compressed, .*\(bunzip2 -c FILE \| \.\.\.\)$'),
    (b'one\rtwo\r', r'^stdin line 1: the file uses CR-only'),
  ]:
    stdout = io.StringIO()
    with pytest.raises(UserInputError, match=pattern):
      translate_text(tiny_workdir, stdin=io.BytesIO(data), stdout=stdout)
    assert stdout.getvalue() == ''


class _Terminal(io.BytesIO):
  def isatty(self) -> bool:
    return True


def test_translate_from_a_terminal_refuses_a_nul_line(tiny_workdir, capsys):
  stdout = io.StringIO()
  with pytest.raises(UserInputError, match=r'^stdin line 1: NUL byte'):
    translate_text(tiny_workdir, stdin=_Terminal(b'\x00\n'), stdout=stdout)
  assert stdout.getvalue() == ''


def test_translate_on_empty_input_writes_empty_output(tiny_workdir):
  for data in (b'', BOM):
    stdout = io.StringIO()
    translate_text(tiny_workdir, stdin=io.BytesIO(data), stdout=stdout)
    assert stdout.getvalue() == ''


SOURCES = ['one', 'twenty three', 'four hundred and five', 'sixty', 'seven thousand']


@pytest.fixture(scope='module')
def talking_workdir(tmp_path_factory, tiny_workdir):
  """A copy of the tiny workdir whose 'averaged' checkpoint never ends a sentence early (the
  8-step model's translations are all empty): outputs to match, not quality."""
  path = str(tmp_path_factory.mktemp('text_policy') / 'workdir')
  shutil.copytree(tiny_workdir, path)
  translator = Translator.from_checkpoint(path)
  params, suppressed = suppress_eos(translator.params, translator.model_config)
  assert suppressed
  save_params(str(Workdir(path).averaged), params, {'averaged_steps': [8], 'latest_step': 8})
  return path


@pytest.fixture(scope='module')
def hypotheses(talking_workdir):
  """The translations of SOURCES (beam 4, alpha 0.6): the references a perfect output matches."""
  translations = Translator.from_checkpoint(talking_workdir, 'averaged').translate(SOURCES)
  assert all(translations) and len(set(translations)) >= 2, translations
  return translations


def test_translate_reads_a_bom_crlf_file_and_a_long_line_as_plain_stdin(
  tmp_path, talking_workdir, hypotheses
):
  lines = SOURCES + [' '.join(['nine'] * 2000)]  # Truncated to max_len tokens, one line out.
  source, output = tmp_path / 'in.txt', tmp_path / 'out.txt'
  source.write_bytes(BOM + ''.join(line + '\r\n' for line in lines).encode())
  translate_text(
    talking_workdir, checkpoint='averaged', input_path=str(source), output_path=str(output)
  )
  stdout = io.StringIO()
  plain = ''.join(line + '\n' for line in lines).encode()
  translate_text(talking_workdir, checkpoint='averaged', stdin=io.BytesIO(plain), stdout=stdout)
  assert output.read_text(encoding='utf-8') == stdout.getvalue()
  assert output.read_text(encoding='utf-8').split('\n')[:-1][:5] == hypotheses
  assert len(stdout.getvalue().split('\n')) == len(lines) + 1


# --- evaluate ---


def test_a_bom_changes_no_score():
  hypotheses = ['ein Hund läuft im Park', 'zwei Katzen schlafen']
  plain = metrics.score(hypotheses, hypotheses)
  assert (plain['chrf'], plain['bleu']) == (pytest.approx(100), pytest.approx(100))
  with_bom = ['\ufeff' + hypotheses[0], hypotheses[1]]
  assert metrics.score(hypotheses, with_bom) == plain
  assert metrics.score(with_bom, hypotheses) == plain
  scores = metrics.translation_metrics(with_bom, hypotheses)
  assert scores == {'exact_match': 1.0, 'chrf': plain['chrf'], 'bleu': plain['bleu']}


def test_evaluate_api_scores_a_perfect_output_100_with_a_bom_in_the_first_reference(
  talking_workdir, hypotheses
):
  translator = Translator.from_checkpoint(talking_workdir, 'averaged')
  references = ['\ufeff' + hypotheses[0], *hypotheses[1:]]
  _, result = test_set.evaluate(translator, ['\ufeff' + SOURCES[0], *SOURCES[1:]], references)
  assert (result['exact_matches'], result['exact_match']) == (len(SOURCES), 1.0)
  assert result['chrf'] == pytest.approx(100)


@pytest.mark.parametrize('empty', ['--src', '--ref', 'both'])
def test_evaluate_refuses_an_empty_file_in_one_line_and_writes_nothing(
  tmp_path, tiny_workdir, empty
):
  src, ref, out = tmp_path / 'test.en', tmp_path / 'test.de', tmp_path / 'hyp.txt'
  src.write_bytes(b'' if empty in ('--src', 'both') else b'one\n')
  ref.write_bytes(BOM if empty in ('--ref', 'both') else b'eins\n')  # A BOM alone is empty.
  named = {'--src': src, '--ref': ref, 'both': src}[empty]
  flag = '--ref' if empty == '--ref' else '--src'
  with pytest.raises(UserInputError, match=rf'^{flag}={re.escape(str(named))} is empty: nothing'):
    test_set.evaluate_files(tiny_workdir, str(src), str(ref), out=str(out))
  assert not out.exists()


def test_the_evaluate_api_refuses_no_sentences_in_one_line():
  with pytest.raises(UserInputError, match=r'^no sentences: nothing to evaluate$'):
    test_set.evaluate(None, [], [])


def test_evaluate_command_scores_a_perfect_output_100_with_a_bom_and_src_through_a_pipe(
  tmp_path, talking_workdir, hypotheses
):
  ref, out = tmp_path / 'test.de', tmp_path / 'hyp.txt'
  ref.write_bytes(BOM + ''.join(line + '\n' for line in hypotheses).encode())
  read_end, write_end = os.pipe()  # --src=/dev/fd/N, as bash's <(...) passes it: read once.
  os.write(write_end, ''.join(line + '\n' for line in SOURCES).encode())
  os.close(write_end)
  try:
    result = subprocess.run(
      [sys.executable, '-m', 'transformer_jax.evaluate', f'--workdir={talking_workdir}']
      + ['--checkpoint=averaged', f'--src=/dev/fd/{read_end}', f'--ref={ref}', f'--out={out}'],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=REPO_ROOT,
      pass_fds=(read_end,),
    )
  finally:
    os.close(read_end)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'exact match 100.00% ({len(SOURCES)}/{len(SOURCES)})' in result.stdout
  assert re.search(r'^chrF2 = 100\.00\b', result.stdout, re.MULTILINE), result.stdout
  assert out.read_text(encoding='utf-8') == ''.join(line + '\n' for line in hypotheses)


# --- the StableHLO runner (its main reads before it loads: no export needed to refuse) ---


def test_the_runner_refuses_an_input_that_is_not_text_in_one_line(tmp_path, capsys, monkeypatch):
  source = tmp_path / 'in.txt'
  source.write_bytes(gzip.compress(b'one\n'))
  missing_export = str(tmp_path / 'no_export')
  assert stablehlo_runner.main([f'--input={source}', f'--model_dir={missing_export}']) == 2
  assert capsys.readouterr().err == (
    f'error: --input={source}: gzip-compressed, not UTF-8 text; decompress it first '
    f'(gunzip -c {source} | ...)\n'
  )
  monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO(b'one\n\x00\n')))
  assert stablehlo_runner.main([f'--model_dir={missing_export}']) == 2
  assert capsys.readouterr().err.startswith('error: stdin line 2: NUL byte; ')
  assert stablehlo_runner.main([f'--input={tmp_path / "none.txt"}']) == 2
  assert (
    capsys.readouterr().err
    == f'error: --input={tmp_path / "none.txt"}: No such file or directory\n'
  )
