"""Ctrl-C (SIGINT) and SIGTERM with nothing to save yet: training's start-up (data, vocabulary,
tokenizing, compiling) and `translate` stop within seconds, with one line and exit status 130
(143 for SIGTERM), no traceback, and no file left half-written. Once training steps run, a
signal saves a checkpoint instead (reliability_test.py)."""

import json
import os
import pty
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common.errors import Interrupted
from transformer_jax.data import input_pipeline
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import COMPILATION_CACHE_VARIABLES, REPO_ROOT, TINY_FLAGS, tiny_config


def _message(signal_name: str) -> str:
  return (
    f'{signal_name} received during start-up: stopped before the first training step (the '
    'files written so far are complete); rerun the same command to go on'
  )


def _train_command(workdir, data_dir) -> list[str]:
  return [
    sys.executable,
    'train.py',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
    *TINY_FLAGS,
    '--config.num_train_steps=8',
    '--config.eval_every_steps=1000',
    '--config.eval_decode_examples=0',
    '--config.final_test_decode=False',
  ]


@pytest.fixture(autouse=True)
def _sigint_handled_as_in_a_terminal():
  """A shell that starts the suite in the background (`.ci/run &`) makes it and its children
  ignore SIGINT, and an ignored signal stays ignored across exec. Catching it here gives every
  child started in a test the default disposition back (exec resets caught signals)."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _signal_when_logged(command, text: str, signum: int) -> tuple[int, float, str]:
  """Starts `command`, sends `signum` once its log has a line containing `text`: (exit status,
  seconds from the signal to the exit, everything it wrote to stderr)."""
  # Without the suite's compilation cache: the signal must find the program compiling.
  env = {k: v for k, v in os.environ.items() if k not in COMPILATION_CACHE_VARIABLES}
  process = subprocess.Popen(
    command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
  )
  log = []
  for line in process.stderr:
    log.append(line)
    if text in line:
      break
  else:
    process.wait()
    pytest.fail(f'no line with {text!r}: ' + ''.join(log)[-3000:])
  sent = time.monotonic()
  process.send_signal(signum)
  _, rest = process.communicate(timeout=60)
  return process.returncode, time.monotonic() - sent, ''.join(log) + rest


def _unfinished(*folders) -> list[str]:
  """What an interrupted write leaves: temporary files (ours end in .tmp), tfds's incomplete
  dataset folders, orbax's temporary checkpoint folders."""
  found = []
  for folder in folders:
    for parent, names, files in os.walk(folder):
      found += [
        os.path.join(parent, name)
        for name in names + files
        if any(mark in name.lower() for mark in ('tmp', 'incomplete', 'temp'))
      ]
  return found


def _check_complete(workdir) -> None:
  """Every file a start-up writes is either absent or whole, and no checkpoint was saved."""
  workdir = Workdir(workdir)
  if workdir.vocab_file.exists():
    assert Tokenizer.load(workdir.vocab_file).vocab_size == 96
  if workdir.config_file.exists():
    assert json.loads(workdir.config_file.read_text())['model']['d_model'] == 32
  cache = workdir.path / 'token_cache'
  for name in os.listdir(cache) if cache.exists() else []:
    with np.load(cache / name) as arrays:
      assert len(arrays['inputs_offsets']) > 1
  checkpoints = workdir.checkpoints
  assert not checkpoints.exists() or os.listdir(checkpoints) == []
  workdir.lock().acquire().release()  # Released.


def test_ctrl_c_while_the_data_is_prepared_stops_at_once_and_a_rerun_trains(tmp_path):
  workdir, data_dir = tmp_path / 'run', tmp_path / 'data'  # A fresh data_dir: it is generated.
  command = _train_command(workdir, data_dir)
  code, seconds, log = _signal_when_logged(command, 'generating number_words', signal.SIGINT)
  print(f'SIGINT while preparing data: exit {code} after {seconds:.2f} s')
  assert code == 130, log[-3000:]
  assert log.splitlines()[-1] == _message('SIGINT')
  assert 'Traceback' not in log
  assert seconds < 5
  assert _unfinished(workdir, data_dir) == []
  _check_complete(workdir)

  rerun = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert 'prepared in' in rerun.stderr  # The dataset was made again, whole.
  with Checkpointer(workdir / 'checkpoints', keep=None) as checkpointer:
    assert checkpointer.all_steps() == [8]


def test_sigterm_while_compiling_stops_at_once(tmp_path, data_dir):
  workdir = tmp_path / 'run'
  code, seconds, log = _signal_when_logged(
    _train_command(workdir, data_dir), 'compiling the training step', signal.SIGTERM
  )
  print(f'SIGTERM while compiling: exit {code} after {seconds:.2f} s')
  assert code == 143, log[-3000:]
  assert log.splitlines()[-1] == _message('SIGTERM')
  assert 'Traceback' not in log and 'checkpoint saved' not in log
  assert seconds < 5
  assert _unfinished(workdir) == []
  _check_complete(workdir)
  assert Workdir(workdir).vocab_file.exists()  # Written before compiling, and whole.


def test_ctrl_c_while_the_vocabulary_reads_sentences(tmp_path, data_dir, monkeypatch):
  """SentencePiece turns an exception raised in the iterator it reads into a RuntimeError (and
  training, into 'cannot train this vocabulary'): it is still the interruption."""
  sentences = input_pipeline.training_sentences

  def interrupted_at_the_100th(source, config):
    for index, sentence in enumerate(sentences(source, config)):
      if index == 100:
        os.kill(os.getpid(), signal.SIGINT)  # As Ctrl-C does; the handler runs right here.
      yield sentence

  monkeypatch.setattr(input_pipeline, 'training_sentences', interrupted_at_the_100th)
  with pytest.raises(Interrupted) as raised:
    loop.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  assert str(raised.value) == _message('SIGINT') and raised.value.signum == signal.SIGINT
  assert sorted(os.listdir(tmp_path)) == ['.lock']  # No vocabulary, config or cache.
  _check_complete(tmp_path)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Restored.


_LONG_C_CALL = """
import hashlib, threading
from transformer_jax.training.preemption import PreemptionFlag
with PreemptionFlag(grace_seconds=1.0):
  # Said from another thread once the main one is well inside the call.
  threading.Timer(0.5, print, ['computing'], {'flush': True}).start()
  hashlib.pbkdf2_hmac('sha256', b'x', b'salt', 100_000_000)  # Minutes in C, without the GIL.
print('not interrupted')
"""


def test_a_signal_during_a_long_c_call_ends_the_process_after_the_grace():
  """Python runs a signal handler only between bytecodes: inside one long C call (XLA compiling,
  SentencePiece training) the watchdog ends the process instead."""
  process = subprocess.Popen(
    [sys.executable, '-c', _LONG_C_CALL],
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  assert process.stdout.readline() == 'computing\n'
  sent = time.monotonic()
  process.send_signal(signal.SIGINT)
  out, err = process.communicate(timeout=30)
  seconds = time.monotonic() - sent
  print(f'SIGINT inside a C call: exit {process.returncode} after {seconds:.2f} s')
  assert process.returncode == 130 and out == ''
  assert err.splitlines()[-1] == _message('SIGINT')
  assert 1.0 <= seconds < 4


@pytest.fixture(scope='module')
def trained(tiny_workdir):
  return tiny_workdir  # The session's shared workdir (conftest.py): translate only reads it.


def _translate(workdir, stdin):
  return subprocess.Popen(
    [sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}', '--beam_size=1'],
    cwd=REPO_ROOT,
    stdin=stdin,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )


def test_ctrl_c_in_interactive_translate_ends_quietly(trained):
  terminal, typed_on = pty.openpty()
  process = _translate(trained, typed_on)
  os.close(typed_on)
  try:
    log = b''
    while b'Type a sentence' not in log:
      line = process.stderr.readline()
      assert line, log.decode()[-3000:]
      log += line
    os.write(terminal, b'seven\n')
    # Translated as typed (an 8-step model's translation: maybe empty, but a line).
    assert process.stdout.readline().endswith(b'\n')
    process.send_signal(signal.SIGINT)  # What Ctrl-C sends to the foreground process.
    _, rest = process.communicate(timeout=60)
  finally:
    os.close(terminal)
  assert process.returncode == 130, rest.decode()[-3000:]
  assert rest.decode().splitlines()[-1] == 'interrupted' and b'Traceback' not in rest


def _reading_stdin(pid: int) -> bool:
  """Whether the process's main thread waits in read(2) on file descriptor 0."""
  with open(f'/proc/{pid}/syscall') as f:
    return f.read().split()[:2] == ['0', '0x0']


def test_ctrl_c_in_translate_reading_a_pipe_ends_quietly(trained):
  if not os.access('/proc/self/syscall', os.R_OK):
    pytest.skip('/proc/PID/syscall is not readable here')
  process = _translate(trained, subprocess.PIPE)
  process.stdin.write(b'seven\n')
  process.stdin.flush()  # ... and the pipe stays open: it waits for more.
  deadline = time.monotonic() + 120
  while not _reading_stdin(process.pid):
    assert process.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  out, err = process.communicate(timeout=60)
  assert process.returncode == 130, err.decode()[-3000:]
  assert out == b'' and err.decode().splitlines()[-1] == 'interrupted'
  assert b'Traceback' not in err
