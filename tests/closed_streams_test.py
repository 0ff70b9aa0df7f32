"""Closed or gone standard streams end a command in one line, or quietly: never a traceback.

stdin or stdout closed (`<&-`, `>&-`) or open the wrong way: one `error:` line, exit 2. stdout a
pipe whose reader has gone (`translate ... | head -1`): nothing said, exit 141 as SIGPIPE would
give. stderr closed (`2>&-`): the error goes nowhere, not into stdout, with its exit status.
"""

import re
import subprocess
import sys

import pytest

from transformer_jax.common import errors

from conftest import REPO_ROOT

_INFO_LINE = re.compile(r'^I\d{4} ')  # absl's progress lines; warnings and errors count.


def _translate(workdir, redirections: str, *flags: str, **popen) -> subprocess.CompletedProcess:
  """translate run by sh with `redirections` (`<&-`, ...), as a user types it."""
  command = [sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}', *flags]
  return subprocess.run(
    ['sh', '-c', f'exec "$@" {redirections}', 'sh', *command],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    **popen,
  )


def _the_one_line(stderr: str) -> str:
  assert 'Traceback' not in stderr and 'Exception ignored' not in stderr, stderr[-3000:]
  lines = [line for line in stderr.splitlines() if not _INFO_LINE.match(line)]
  assert len(lines) == 1 and lines[0].startswith('error: '), stderr[-3000:]
  return lines[0]


@pytest.fixture(name='source')
def _source(tmp_path):
  path = tmp_path / 'source.txt'
  path.write_text('one\ntwo\n')
  return path


@pytest.mark.parametrize(
  'redirections, with_input, expected',
  [
    ('<&-', False, 'error: stdin is closed: give the input as a file'),
    ('>&-', True, 'error: stdout is closed: send it to a file'),
    ('1<{source}', True, 'error: stdout is not open for writing: send it to a file'),
  ],
)
def test_a_closed_stream_is_one_line(tiny_workdir, source, redirections, with_input, expected):
  flags = ['--beam_size=1'] + ([f'--input={source}'] if with_input else [])
  result = _translate(tiny_workdir, redirections.format(source=source), *flags)
  assert result.returncode == errors.EXIT_USER_ERROR, result.stderr[-3000:]
  assert _the_one_line(result.stderr).startswith(expected)


def test_stdout_whose_reader_has_gone_ends_quietly_with_141(tiny_workdir, source):
  command = [
    *(sys.executable, '-m', 'transformer_jax.translate', f'--workdir={tiny_workdir}'),
    *('--beam_size=1', f'--input={source}'),
  ]
  process = subprocess.Popen(
    command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  process.stdout.close()  # Gone before translate writes, as `| head -1` once it has a line.
  _, stderr = process.communicate(timeout=300)
  assert process.returncode == errors.EXIT_BROKEN_PIPE, stderr[-3000:]
  assert [line for line in stderr.splitlines() if not _INFO_LINE.match(line)] == [], stderr


def test_an_error_with_stderr_closed_is_not_written_to_stdout(tmp_path):
  result = _translate(tmp_path / 'no_such_workdir', '2>&-')
  assert result.returncode == errors.EXIT_USER_ERROR
  assert (result.stdout, result.stderr) == ('', '')
