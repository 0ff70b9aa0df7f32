"""A disk that fails a write ends every command in one line, exit status 4, nothing lost.

The full disk is real: a small tmpfs mounted in a private mount namespace (`unshare --user
--map-root-user --mount`), filled but for a few KB before the command runs, its contents copied
out afterwards to be looked at. /dev/full stands for a full disk under an output file or stdout.
The other errnos of the same kind (EDQUOT, EFBIG, EROFS, EIO), and the ways orbax and
tensorstore wrap them, are checked in-process.
"""

import builtins
import errno
import functools
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.checkpointer import (
  Checkpointer,
  is_params_checkpoint,
  read_metadata,
)
from transformer_jax.common import errors, text_io
from transformer_jax.training import loop

from conftest import REPO_ROOT, TINY_FLAGS, tiny_config

# tiny_config as train.py flags, so that a rerun in-process continues the same run.
_TINY_CONFIG_FLAGS = [
  *TINY_FLAGS,
  '--config.warmup_steps=10',
  '--config.log_every_steps=4',
  '--config.eval_every_steps=1000',
  '--config.checkpoint_every_steps=4',
  '--config.eval_decode_examples=0',
  '--config.eval_batch_size=64',
  '--config.final_test_decode=False',
  '--config.reuse_host_memory=False',
]
_INFO_LINE = re.compile(r'^I\d{4} ')  # absl's progress lines; warnings and errors count.
_ONE_LINE = re.compile(
  r'error: no space left on device writing (?P<path>\S+) '
  r'\((?P<free>\d+\.\d) MB free on the file system at (?P<mount>\S+)\)'
)

# Runs "$@" with a tmpfs of 8 MB at $1 holding a copy of $2 (if not '-') and a filler leaving
# $3 KB free, then copies the tmpfs's contents (the filler left out) to $4.
_ON_A_SMALL_DISK = r"""
set -e
disk=$1 source=$2 free_kb=$3 copy_out=$4
shift 4
mount -t tmpfs -o size=8m none "$disk"
if [ "$source" != - ]; then cp -a "$source" "$disk/wd"; fi
avail=$(df -k --output=avail "$disk" | tail -1)
dd if=/dev/zero of="$disk/filler" bs=1k count=$((avail - free_kb)) 2>/dev/null
set +e
"$@"
status=$?
rm -f "$disk/filler"
cp -a "$disk/." "$copy_out"
exit $status
"""


@functools.cache
def _private_tmpfs_refusal() -> str | None:
  """Why a tmpfs cannot be mounted in a private namespace here (None: it can)."""
  if shutil.which('unshare') is None:
    return 'no unshare command'
  with tempfile.TemporaryDirectory() as folder:
    probe = subprocess.run(
      ['unshare', '--user', '--map-root-user', '--mount', 'mount', '-t', 'tmpfs', 'none', folder],
      capture_output=True,
      text=True,
      timeout=30,
    )
  if probe.returncode != 0:
    return f'cannot mount a tmpfs in a private namespace: {probe.stderr.strip()}'
  return None


def _on_a_small_disk(tmp_path, command, *, copy_in=None, free_kb=0):
  """(result of `command` run with a nearly full disk at tmp_path/disk, where its contents are
  copied to afterwards). `copy_in` goes to disk/wd first. Paths in `command` say {disk}."""
  refusal = _private_tmpfs_refusal()
  if refusal:
    pytest.skip(refusal)
  disk, copy_out = tmp_path / 'disk', tmp_path / 'after'
  disk.mkdir()
  copy_out.mkdir()
  result = subprocess.run(
    [
      *('unshare', '--user', '--map-root-user', '--mount', 'sh', '-c', _ON_A_SMALL_DISK, 'sh'),
      *(str(disk), str(copy_in or '-'), str(free_kb), str(copy_out)),
      *(part.format(disk=disk) for part in command),
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  return result, disk, copy_out


def _the_one_line(result) -> str:
  """stderr's only line that is not an absl INFO line, after checking there is exactly one."""
  assert 'Traceback' not in result.stderr and 'Exception ignored' not in result.stderr, (
    result.stderr[-3000:]
  )
  lines = [line for line in result.stderr.splitlines() if not _INFO_LINE.match(line)]
  assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-3000:]
  return lines[0]


def _full_disk_line(result, path, mount) -> re.Match:
  assert result.returncode == errors.EXIT_STORAGE_FAILED, result.stderr[-3000:]
  line = _the_one_line(result)
  match = _ONE_LINE.fullmatch(line)
  assert match, line
  assert (match['path'], match['mount']) == (str(path), str(mount)), line
  assert float(match['free']) < 0.5, line  # The filler left a few KB.
  return match


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_last_good_one(
  tiny_workdir, data_dir, tmp_path, caplog
):
  # tiny_workdir has steps 4 and 8 (~0.5 MB each): 100 KB free holds the config and the logs,
  # not step 12.
  result, disk, after = _on_a_small_disk(
    tmp_path,
    [sys.executable, 'train.py', '--workdir={disk}/wd', f'--config.data_dir={data_dir}']
    + _TINY_CONFIG_FLAGS
    + ['--config.num_train_steps=12'],
    copy_in=tiny_workdir,
    free_kb=100,
  )
  _full_disk_line(result, disk / 'wd' / 'checkpoints' / '12', disk)
  # Nothing half-written: no step 12, not even orbax's temporary folder of it.
  assert sorted(os.listdir(after / 'wd' / 'checkpoints')) == ['4', '8']

  # Once there is space, rerunning resumes from the last good step and saves step 12.
  config = tiny_config(data_dir)
  config.num_train_steps = 12
  with caplog.at_level(logging.INFO):
    loop.train_and_evaluate(config, str(after / 'wd'))
  assert f'resumed from {after / "wd" / "checkpoints"} at step 8' in caplog.text
  assert Checkpointer(str(after / 'wd' / 'checkpoints'), keep=None).all_steps() == [4, 8, 12]


def test_a_full_disk_while_averaging_keeps_the_previous_averaged_checkpoint(tiny_workdir, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_workdir, workdir)
  average_checkpoints(str(workdir), last=1)  # The previous average: step 8 alone.
  result, disk, after = _on_a_small_disk(
    tmp_path,
    [sys.executable, '-m', 'transformer_jax.average', '--workdir={disk}/wd', '--last=2'],
    copy_in=workdir,
  )
  _full_disk_line(result, disk / 'wd' / 'averaged', disk)
  assert is_params_checkpoint(after / 'wd' / 'averaged')
  assert read_metadata(str(after / 'wd' / 'averaged'))['averaged_steps'] == [8]
  leftovers = [name for name in os.listdir(after / 'wd') if name.startswith('.averaged.')]
  assert leftovers == []


def test_a_full_disk_during_an_export_leaves_no_half_written_folder(tiny_workdir, tmp_path):
  result, disk, after = _on_a_small_disk(
    tmp_path,
    [
      *(sys.executable, '-m', 'transformer_jax.export', '--format=stablehlo'),
      *(f'--workdir={tiny_workdir}', '--out={disk}/model'),
    ],
  )
  assert result.returncode == errors.EXIT_STORAGE_FAILED, result.stderr[-3000:]
  line = _the_one_line(result)
  # The staging folder's failure is named as the folder it was to become (paths.staged_folder).
  assert line.startswith(f'error: no space left on device writing {disk}/model ('), line
  assert line.endswith(f' MB free on the file system at {disk})'), line
  assert sorted(os.listdir(after)) == []  # Neither the export nor its staging folder.


@pytest.mark.parametrize('where', ['--output', 'stdout'])
def test_translations_to_a_full_device_are_one_line(tiny_workdir, tmp_path, where):
  source = tmp_path / 'source.txt'
  source.write_text('one\ntwo\n')
  command = [
    *(sys.executable, '-m', 'transformer_jax.translate', f'--workdir={tiny_workdir}'),
    *('--beam_size=1', f'--input={source}'),
  ]
  with open('/dev/full', 'w') as full:
    result = subprocess.run(
      command + (['--output=/dev/full'] if where == '--output' else []),
      cwd=REPO_ROOT,
      stdout=full if where == 'stdout' else subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
      timeout=300,
    )
  assert result.returncode == errors.EXIT_STORAGE_FAILED, result.stderr[-3000:]
  assert _the_one_line(result) == 'error: no space left on device writing /dev/full'


_FAILURES = {
  errno.ENOSPC: 'no space left on device writing /data/out.txt',
  errno.EDQUOT: 'disk quota exceeded writing /data/out.txt',
  errno.EFBIG: 'file too large writing /data/out.txt',
  errno.EROFS: 'read-only file system writing /data/out.txt',
  errno.EIO: 'input/output error on /data/out.txt',
}


def _wrapped(how: str, failure: OSError) -> BaseException:
  """`failure` as a library hands it on."""
  if how == 'cause':
    wrapper = RuntimeError('the save failed')
    wrapper.__cause__ = failure
    return wrapper
  if how == 'context':
    try:
      try:
        raise failure
      except OSError:
        raise ValueError('while writing')  # noqa: B904  The implicit context is the point.
    except ValueError as error:
      return error
  if how == 'group':
    group = vars(builtins).get('ExceptionGroup')  # Python 3.11+
    if group is None:
      pytest.skip('no ExceptionGroup before Python 3.11')
    return group('writes', [KeyError('x'), failure])
  if how == 'tensorstore':  # The errno in a ValueError's message only.
    return ValueError(
      f'RESOURCE_EXHAUSTED: Error writing "a/0.0" in OCDBT database at local file "/data/x/": '
      f'Failed writing: "{failure.filename}": Failed to write 9 bytes to file 16: '
      f"{failure.strerror} [os_error_code='{failure.errno}']"
    )
  return failure


@pytest.mark.parametrize('how', ['itself', 'cause', 'context', 'group', 'tensorstore'])
@pytest.mark.parametrize('code', sorted(_FAILURES))
def test_each_storage_failure_however_wrapped_is_exit_4_and_names_the_path(code, how):
  failure = OSError(code, os.strerror(code), '/data/out.txt')
  error = _wrapped(how, failure)
  assert errors.exit_code(error) == errors.EXIT_STORAGE_FAILED
  found = errors.storage_failure(error)
  assert (found.errno, found.filename) == (code, '/data/out.txt')
  assert errors.storage_failure_message(found).startswith(_FAILURES[code])


def test_what_is_not_a_storage_failure_keeps_its_exit_code():
  assert errors.exit_code(OSError(errno.ENOSPC, 'No space left on device')) == 4
  assert errors.exit_code(OSError(errno.EACCES, 'Permission denied', '/x')) is None  # A bug.
  assert errors.exit_code(FileNotFoundError(errno.ENOENT, 'No such file', '/x')) == 2
  try:
    try:
      raise OSError(errno.ENOSPC, 'No space left on device')
    except OSError:
      raise RuntimeError('handled, and said so') from None
  except RuntimeError as suppressed:  # `from None`: its context is not its cause.
    assert errors.exit_code(suppressed) is None


def test_the_free_space_named_is_the_file_systems(tmp_path):
  usage = shutil.disk_usage(tmp_path)
  note = errors.free_space_note(tmp_path / 'not' / 'yet' / 'made.txt')
  match = re.fullmatch(r' \((\d+\.\d) (MB|GB) free on the file system at (\S+)\)', note)
  assert match, note
  scale = {'MB': 1e6, 'GB': 1e9}[match[2]]
  assert abs(float(match[1]) * scale - usage.free) < 0.1 * scale + 1e8  # Others write too.
  assert os.path.ismount(match[3]) and str(tmp_path).startswith(match[3])
  assert errors.free_space_note('/dev/full') == ''  # A device: its "file system" is no help.


def test_write_output_gives_a_read_only_remount_exit_4(tmp_path, monkeypatch):
  def remounted_read_only(path, data):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))

  monkeypatch.setattr(text_io.paths, 'write_output', remounted_read_only)
  with pytest.raises(errors.StorageError) as raised:
    text_io.write_output(str(tmp_path / 'out.txt'), 'a\n', '--output')
  assert errors.exit_code(raised.value) == errors.EXIT_STORAGE_FAILED
  message = errors.storage_failure_message(raised.value)
  assert message.startswith(f'read-only file system writing {tmp_path / "out.txt"} ('), message
