"""Output paths are checked before any work and written without damaging what they are.

Real files throughout: symlinks, named pipes, pipe file descriptors (what bash's `>(gzip ...)`
passes), directories, missing folders, and files and folders that may not be written.

Permissions: as root (as on the machine these tests were written on), `os.access` and the file
system say yes to a mode-0444 file or a mode-0555 folder. The permission cases therefore run in
a child process without root's two permission-bypassing capabilities (`capsh
--drop=cap_dac_override,cap_dac_read_search`), so modes 000/0444/0555 mean what they mean for
everyone else; as any other user they run directly. Where `os.access` itself is bypassed, the
immutable attribute (`chattr +i`), which root cannot write through either, stands in. Either is
skipped, with the reason, where the tool or the capability is missing.
"""

import io
import os
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from transformer_jax.common import errors, text_io
from transformer_jax.common.errors import UserInputError
from transformer_jax.evaluation import test_set
from transformer_jax.inference import attention_plots
from transformer_jax.inference.text_files import translate_text

from conftest import REPO_ROOT

IS_ROOT = os.geteuid() == 0


def _listing(folder) -> list[str]:
  return sorted(os.listdir(folder))


# --- write_lines: what the output path is stays what it is ---


def test_a_symlink_is_written_through_and_kept(tmp_path):
  (tmp_path / 'real').mkdir()
  target = tmp_path / 'real' / 'out.txt'
  target.write_text('old\n')
  os.chmod(target, 0o600)
  link = tmp_path / 'link.txt'
  os.symlink('real/out.txt', link)  # Relative, as `ln -s` makes them.
  chained = tmp_path / 'chained.txt'
  os.symlink('link.txt', chained)

  text_io.check_writable_output(str(chained), '--output')
  text_io.write_lines(['eins', 'zwei'], str(chained))

  assert os.path.islink(link) and os.readlink(link) == 'real/out.txt'
  assert os.path.islink(chained) and os.readlink(chained) == 'link.txt'
  assert target.read_text() == 'eins\nzwei\n'
  assert stat.S_IMODE(os.stat(target).st_mode) == 0o600  # Still private.
  assert _listing(tmp_path / 'real') == ['out.txt']  # Replaced whole: no temporary file left.
  assert _listing(tmp_path) == ['chained.txt', 'link.txt', 'real']

  dangling = tmp_path / 'dangling.txt'
  os.symlink('real/new.txt', dangling)  # Like `>`, a link to nothing yet creates its target.
  text_io.write_lines(['drei'], str(dangling))
  assert os.path.islink(dangling) and (tmp_path / 'real' / 'new.txt').read_text() == 'drei\n'


def test_a_named_pipe_is_written_in_place_and_its_reader_gets_the_lines(tmp_path):
  fifo = tmp_path / 'pipe'
  os.mkfifo(fifo)
  received = []

  def read():
    with open(fifo, 'rb') as f:
      received.append(f.read())

  reader = threading.Thread(target=read, daemon=True)  # Never blocks the exit if unfed.
  reader.start()
  text_io.check_writable_output(str(fifo), '--output')
  text_io.write_lines(['eins', 'zwei'], str(fifo))
  reader.join(timeout=10)
  assert not reader.is_alive(), 'the reader of the named pipe never got the lines'
  assert received == [b'eins\nzwei\n']
  assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # Still a pipe, not a file in its place.
  assert _listing(tmp_path) == ['pipe']


def test_a_pipe_file_descriptor_is_written_in_place():
  """What `--output=>(gzip > out.gz)` or `--output=/dev/stdout` in a pipeline passes."""
  read_end, write_end = os.pipe()
  with os.fdopen(read_end, 'rb') as reader, os.fdopen(write_end, 'wb') as writer:
    text_io.check_writable_output(f'/dev/fd/{write_end}', '--output')
    text_io.write_lines(['eins', 'zwei'], f'/dev/fd/{write_end}')
    text_io.write_lines(['drei'], f'/proc/self/fd/{write_end}')
    writer.close()
    assert reader.read() == b'eins\nzwei\ndrei\n'
    with pytest.raises(UserInputError, match=rf'^--output=/dev/fd/{read_end}: .*reading only$'):
      text_io.check_writable_output(f'/dev/fd/{read_end}', '--output')
  closed = next(number for number in range(1000, 2000) if not os.path.exists(f'/dev/fd/{number}'))
  with pytest.raises(UserInputError, match=rf'^--output=/dev/fd/{closed}: .* is not open$'):
    text_io.check_writable_output(f'/dev/fd/{closed}', '--output')


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-c', textwrap.dedent(code)],
    cwd=REPO_ROOT,
    timeout=120,
    env=dict(os.environ, PYTHONDONTWRITEBYTECODE='1'),
    **kwargs,
  )


def test_dev_stdout_is_written_where_the_shell_points_it(tmp_path):
  """`translate --output=/dev/stdout >> log`: appended to the log, which stays a file."""
  log = tmp_path / 'log.txt'
  log.write_text('earlier\n')
  code = """
    import sys
    from transformer_jax.common import text_io
    print('printed first', flush=True)
    text_io.check_writable_output('/dev/stdout', '--output')
    text_io.write_lines(['eins', 'zwei'], '/dev/stdout')
    """
  with open(log, 'ab') as stdout:
    result = _python(code, stdout=stdout, stderr=subprocess.PIPE)
  assert result.returncode == 0, result.stderr.decode()
  assert log.read_text() == 'earlier\nprinted first\neins\nzwei\n'
  assert _listing(tmp_path) == ['log.txt']
  assert os.path.islink('/dev/stdout')


def test_a_failed_write_leaves_no_temporary_file_and_the_old_file_whole(tmp_path, monkeypatch):
  target = tmp_path / 'out.txt'
  target.write_text('old\n')

  def fail(*args):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(os, 'replace', fail)
  with pytest.raises(errors.StorageError) as raised:  # Exit status 4, not a user error.
    text_io.write_lines(['new'], str(target))
  assert (raised.value.errno, raised.value.filename) == (28, str(target))
  assert target.read_text() == 'old\n'
  assert _listing(tmp_path) == ['out.txt']


def test_a_write_the_file_system_refuses_midway_leaves_no_temporary_file(tmp_path):
  """A real failure halfway through the data: the file size limit (EFBIG) at 4 KiB."""
  target = tmp_path / 'out.txt'
  target.write_text('old\n')
  code = f"""
    import resource, signal
    from transformer_jax.common import text_io
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed.
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    text_io.write_lines(['x' * 99] * 100, {str(target)!r})
    """
  result = _python(code, capture_output=True)
  assert result.returncode != 0
  assert (
    result.stderr.decode()
    .strip()
    .splitlines()[-1]
    .endswith(f"StorageError: [Errno 27] File too large: '{target}'")
  )
  assert target.read_text() == 'old\n'
  assert _listing(tmp_path) == ['out.txt']


# --- check_writable_output: refused before any work, in one line naming the flag ---


def _translate(workdir, out):
  translate_text(str(workdir), output_path=str(out), stdin=io.BytesIO(b'one\n'))


def _evaluate(workdir, out):
  src = workdir.parent / 'test.en'
  src.write_text('one\n')
  test_set.evaluate_files(str(workdir), str(src), str(src), out=str(out))


def _plot(workdir, out):
  pytest.importorskip('matplotlib')
  attention_plots.plot_translation(str(workdir), 'one', str(out))


COMMANDS = [
  ('translate', _translate, '--output'),
  ('evaluate', _evaluate, '--out'),
  ('plot_attention', _plot, '--out'),
]


@pytest.mark.parametrize('command, run, flag', COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_directory_is_refused_before_any_work(tmp_path, command, run, flag):
  """The workdir does not exist: had anything been restored first, that would be the error."""
  del command
  out = tmp_path / 'results.png'
  out.mkdir()
  with pytest.raises(UserInputError, match=rf'^{flag}={out}: is a directory; name a file'):
    run(tmp_path / 'no_workdir', out)
  assert set(_listing(tmp_path)) - {'test.en'} == {'results.png'}  # evaluate's source.
  assert _listing(out) == []


@pytest.mark.parametrize('command, run, flag', COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_missing_folder_is_refused_before_any_work_and_not_created(tmp_path, command, run, flag):
  del command
  out = tmp_path / 'typo' / 'results.png'
  with pytest.raises(
    UserInputError, match=rf'^{flag}={out}: folder {out.parent} does not exist \(create it first\)$'
  ):
    run(tmp_path / 'no_workdir', out)
  assert not out.parent.exists()


def test_evaluate_default_hypotheses_folders_may_be_missing_but_must_be_creatable(tmp_path):
  default = tmp_path / 'workdir' / 'hypotheses' / 'test.en.default.beam4.alpha0.6.txt'
  (tmp_path / 'workdir').mkdir()
  text_io.check_writable_output(str(default), '--out', make_folders=True)
  assert _listing(tmp_path / 'workdir') == []  # Checked, not made yet.
  text_io.write_lines(['eins'], str(default), flag='--out')
  assert default.read_text() == 'eins\n'
  blocked = tmp_path / 'file' / 'hypotheses' / 'x.txt'
  (tmp_path / 'file').write_text('')
  with pytest.raises(
    UserInputError, match=rf'^--out \(default {blocked}\): .*file is not a folder'
  ):
    text_io.check_writable_output(str(blocked), '--out', make_folders=True)


def test_gcs_outputs_are_only_checked_for_their_scheme():
  text_io.check_writable_output('gs://bucket/out.txt', '--output')  # No network needed.
  with pytest.raises(UserInputError, match=r'^--out=s3://b/x: s3:// paths are not supported'):
    text_io.check_writable_output('s3://b/x', '--out')


def test_a_plot_is_written_through_a_symlink_and_a_bad_extension_refused_before_work(tmp_path):
  pytest.importorskip('matplotlib')
  from conftest import random_weight_translator

  target = tmp_path / 'figure.png'
  target.write_bytes(b'old')
  link = tmp_path / 'attention.png'
  os.symlink('figure.png', link)
  maps = random_weight_translator().attention('one hundred', 'hundert')
  attention_plots.plot(maps, 'cross', str(link))
  assert os.path.islink(link) and target.read_bytes().startswith(b'\x89PNG')
  assert _listing(tmp_path) == ['attention.png', 'figure.png']
  with pytest.raises(UserInputError, match=r'^--out=.*attention\.pnj: cannot draw \.pnj images'):
    attention_plots.plot_translation(
      str(tmp_path / 'no_workdir'), 'one', str(tmp_path / 'attention.pnj')
    )


# --- permissions: one line naming the path, before any work ---


def _without_root_powers(code: str) -> subprocess.CompletedProcess:
  """Runs `code` in a child Python that file permissions apply to (see the module docstring)."""
  command = [sys.executable, '-c', textwrap.dedent(code)]
  if IS_ROOT:
    if shutil.which('capsh') is None:
      pytest.skip('running as root and capsh is missing: mode bits cannot be tested')
    probe = subprocess.run(
      ['capsh', '--drop=cap_dac_override,cap_dac_read_search', '--', '-c', 'true'],
      capture_output=True,
    )
    if probe.returncode != 0:
      pytest.skip(f'running as root and capsh cannot drop capabilities: {probe.stderr!r}')
    command = [
      'capsh',
      '--drop=cap_dac_override,cap_dac_read_search',
      '--',
      '-c',
      shlex.join(command),
    ]
  return subprocess.run(
    command,
    cwd=REPO_ROOT,
    timeout=120,
    capture_output=True,
    env=dict(os.environ, PYTHONDONTWRITEBYTECODE='1'),
  )


def test_permission_problems_are_one_line_errors_before_any_work(tmp_path):
  read_only_file = tmp_path / 'read_only.txt'
  read_only_file.write_text('keep\n')
  read_only_folder = tmp_path / 'read_only'
  read_only_folder.mkdir()
  (read_only_folder / 'writable.txt').write_text('keep\n')
  secret = tmp_path / 'secret.de'
  secret.write_text('eins\n')
  source = tmp_path / 'test.en'
  source.write_text('one\n')
  workdir = tmp_path / 'workdir'  # Read-only: evaluate's default hypotheses folder cannot be made.
  workdir.mkdir()
  os.chmod(read_only_file, 0o444)
  os.chmod(secret, 0)
  os.chmod(read_only_folder, 0o555)
  os.chmod(workdir, 0o555)
  code = f"""
    from transformer_jax.common import text_io
    from transformer_jax.evaluation import test_set
    from transformer_jax.common.errors import UserInputError
    def attempt(run):
      try:
        run()
        print('no error')
      except UserInputError as error:
        print(error)
    attempt(lambda: text_io.check_writable_output({str(read_only_file)!r}, '--output'))
    attempt(lambda: text_io.check_writable_output({str(read_only_folder / 'new.txt')!r}, '--out'))
    attempt(lambda: text_io.check_writable_output(
      {str(read_only_folder / 'writable.txt')!r}, '--out'))
    attempt(lambda: text_io.check_readable_file({str(secret)!r}, '--input'))
    attempt(lambda: test_set.evaluate_files({str(workdir)!r}, {str(source)!r}, {str(secret)!r}))
    attempt(lambda: test_set.evaluate_files({str(workdir)!r}, {str(source)!r}, {str(source)!r}))
    """
  try:
    result = _without_root_powers(code)
  finally:
    os.chmod(read_only_folder, 0o755)
    os.chmod(workdir, 0o755)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert result.stdout.decode().splitlines() == [
    f'--output={read_only_file}: cannot write to it (Permission denied)',
    f'--out={read_only_folder}/new.txt: cannot create files in {read_only_folder} '
    '(Permission denied)',
    f'--out={read_only_folder}/writable.txt: cannot create files in {read_only_folder} to '
    'replace it whole (Permission denied)',
    f'--input={secret}: cannot read it (Permission denied)',
    f'--ref={secret}: cannot read it (Permission denied)',
    f'--out (default {workdir}/hypotheses/test.en.default.beam4.alpha0.6.txt): cannot create '
    f'files in {workdir} (Permission denied)',
  ]
  assert read_only_file.read_text() == 'keep\n'
  assert _listing(read_only_folder) == ['writable.txt']
  assert _listing(workdir) == []


@pytest.fixture
def immutable():
  """Makes paths unwritable even for root (`chattr +i`; chmod as any other user); undone after."""
  made = []

  def make(path):
    if not IS_ROOT:
      os.chmod(path, 0o555 if os.path.isdir(path) else 0o444)
      made.append(path)
      return
    if shutil.which('chattr') is None:
      pytest.skip('running as root and chattr is missing')
    result = subprocess.run(['chattr', '+i', str(path)], capture_output=True)
    if result.returncode != 0:
      pytest.skip(f'running as root and chattr +i fails here: {result.stderr!r}')
    made.append(path)

  yield make
  for path in made:
    if IS_ROOT:
      subprocess.run(['chattr', '-i', str(path)], check=True)
    else:
      os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)


def test_a_real_attempt_decides_where_os_access_says_yes(tmp_path, immutable, monkeypatch):
  """As on NFS with root_squash: `os.access` answers from root's powers, the server says no."""
  folder = tmp_path / 'folder'
  folder.mkdir()
  existing = tmp_path / 'existing.txt'
  existing.write_text('keep\n')
  immutable(folder)
  immutable(existing)
  monkeypatch.setattr(os, 'access', lambda *args, **kwargs: True)
  with pytest.raises(
    UserInputError, match=rf'^--output={folder}/new\.txt: cannot create files in {folder} \('
  ):
    text_io.check_writable_output(str(folder / 'new.txt'), '--output')
  with pytest.raises(UserInputError, match=rf'^--output={existing}: cannot write to it \('):
    text_io.check_writable_output(str(existing), '--output')
  assert _listing(folder) == [] and existing.read_text() == 'keep\n'


# --- end to end: the translate command ---


def test_translate_command_writes_through_a_symlink_and_refuses_a_directory(tiny_workdir, tmp_path):
  source = tmp_path / 'in.txt'
  source.write_text('seven\nforty-two\n')
  (tmp_path / 'results').mkdir()
  target = tmp_path / 'results' / 'translations.txt'
  target.write_text('old\n')
  link = tmp_path / 'latest.txt'
  os.symlink(target, link)

  def translate(output):
    return subprocess.run(
      [
        sys.executable,
        '-m',
        'transformer_jax.translate',
        f'--workdir={tiny_workdir}',  # The session's shared workdir (conftest.py).
        '--beam_size=1',
        f'--input={source}',
        f'--output={output}',
      ],
      cwd=REPO_ROOT,
      capture_output=True,
      timeout=300,
    )

  result = translate(link)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  assert os.path.islink(link) and os.readlink(link) == str(target)
  assert len(target.read_text().split('\n')) == 3  # Two lines and the final newline.
  assert _listing(tmp_path / 'results') == ['translations.txt']

  result = translate(tmp_path / 'results')
  assert result.returncode == 2
  assert result.stderr.decode().strip().splitlines()[-1] == (
    f'error: --output={tmp_path / "results"}: is a directory; name a file to write'
  )
  assert _listing(tmp_path) == ['in.txt', 'latest.txt', 'results']
  assert _listing(tmp_path / 'results') == ['translations.txt']
