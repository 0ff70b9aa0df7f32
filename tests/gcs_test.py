"""gs:// against a real Cloud Storage JSON API server on 127.0.0.1 (tests/gcs_emulator.py):
the workdir lock in a bucket, staging a prepared dataset to a local cache, and a training run
whose workdir and data live in the bucket."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from etils import epath
from helpers import gcs_emulator

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import input_pipeline, staging
from transformer_jax.workdir.gcs_lock import GcsLock

from conftest import REPO_ROOT, TINY_FLAGS, tiny_config

gcs = gcs_emulator.fixture(scope='module')


def _bucket_path(gcs, *parts) -> str:
  return '/'.join([f'gs://{gcs.bucket}', *parts])


def test_lock_refuses_a_live_holder_and_releases(gcs):
  path = _bucket_path(gcs, f'lock-{uuid.uuid4().hex[:6]}', '.lock')
  with GcsLock(path, expiry_seconds=60) as held:
    assert epath.Path(path).exists()
    with pytest.raises(
      UserInputError, match=rf'in use by a running training process \({held.holder}'
    ):
      GcsLock(path, expiry_seconds=60).acquire()
  assert not epath.Path(path).exists()  # Released: the object is gone.
  GcsLock(path, expiry_seconds=60).acquire().release()  # And it can be taken again.


def test_a_killed_holder_expires_and_is_taken_over(gcs, tmp_path):
  path = _bucket_path(gcs, f'lock-{uuid.uuid4().hex[:6]}', '.lock')
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys, time; from transformer_jax.workdir.gcs_lock import GcsLock; '
      'GcsLock(sys.argv[1], expiry_seconds=4).acquire(); print("held", flush=True); '
      'time.sleep(120)',
      path,
    ],
    env=dict(os.environ, **gcs.env),
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'held'
    time.sleep(1.5)  # Its heartbeat (every 1 s) keeps the lock alive.
    with pytest.raises(UserInputError, match=rf'pid {holder.pid} on .* last heartbeat'):
      GcsLock(path, expiry_seconds=4).acquire()
    holder.kill()  # SIGKILL: no release, no more heartbeats.
    holder.wait()
  finally:
    if holder.poll() is None:
      holder.kill()
    holder.stdout.close()
  deadline = time.monotonic() + 15
  while True:
    try:
      lock = GcsLock(path, expiry_seconds=4).acquire()
      break
    except UserInputError:
      assert time.monotonic() < deadline, 'the dead holder never expired'
      time.sleep(0.5)
  assert time.monotonic() < deadline
  lock.release()


def _upload(local: str, remote: str) -> None:
  import fsspec

  fsspec.filesystem('gcs').put(local, remote, recursive=True)


def test_staging_copies_verifies_reuses_and_refreshes(gcs, data_dir, tmp_path, monkeypatch):
  monkeypatch.setenv('TRANSFORMER_JAX_CACHE', str(tmp_path / 'cache'))
  remote = _bucket_path(gcs, f'data-{uuid.uuid4().hex[:6]}')
  _upload(os.path.join(data_dir, 'number_words'), f'{remote}/number_words')
  local = staging.stage(remote, 'number_words/tiny')
  originals = sorted(
    os.path.relpath(os.path.join(d, f), data_dir)
    for d, _, files in os.walk(os.path.join(data_dir, 'number_words', 'tiny'))
    for f in files
  )
  copies = sorted(
    os.path.relpath(os.path.join(d, f), local)
    for d, _, files in os.walk(local / 'number_words' / 'tiny')
    for f in files
    if not f.startswith('.')
  )
  assert copies == originals
  for name in originals:
    with open(os.path.join(data_dir, name), 'rb') as a, open(local / name, 'rb') as b:
      assert a.read() == b.read(), name
  manifest = local / 'number_words' / 'tiny' / '.staged.json'
  stamp = os.stat(manifest).st_mtime_ns
  assert staging.stage(remote, 'number_words/tiny') == local  # Current: nothing copied.
  assert os.stat(manifest).st_mtime_ns == stamp
  # Prepared again in the bucket (one file changes): that file is copied again.
  info = next(n for n in originals if n.endswith('dataset_info.json'))
  epath.Path(f'{remote}/{info}').write_text('{"changed": true}')
  staging.stage(remote, 'number_words/tiny')
  assert (local / info).read_text() == '{"changed": true}'
  assert os.stat(manifest).st_mtime_ns != stamp


def test_processes_of_one_host_stage_once_together(gcs, data_dir, tmp_path):
  remote = _bucket_path(gcs, f'data-{uuid.uuid4().hex[:6]}')
  _upload(os.path.join(data_dir, 'number_words'), f'{remote}/number_words')
  env = dict(os.environ, **gcs.env, TRANSFORMER_JAX_CACHE=str(tmp_path / 'cache'))
  code = (
    'import sys; from absl import logging; logging.set_verbosity(logging.INFO); '
    'from transformer_jax.data import staging; '
    'print(staging.stage(sys.argv[1], "number_words/tiny"))'
  )
  processes = [
    subprocess.Popen(
      [sys.executable, '-c', code, remote],
      env=env,
      text=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    for _ in range(3)
  ]
  outputs = [process.communicate(timeout=120) for process in processes]
  assert [process.returncode for process in processes] == [0, 0, 0], outputs
  assert len({out.strip() for out, _ in outputs}) == 1
  copied = [err for _, err in outputs if 'staged ' in err]
  assert len(copied) == 1, [err[-500:] for _, err in outputs]  # One copied; two found it current.


_TINY_FLAGS = [
  *TINY_FLAGS,
  '--config.num_train_steps=200',
  '--config.log_every_steps=1',
  '--config.eval_every_steps=1000',
  '--config.checkpoint_every_steps=50',
  '--config.eval_decode_examples=0',
  '--config.eval_batch_size=32',
  '--config.final_test_decode=False',
  '--config.reuse_host_memory=false',
]


def _command(*args, env):
  return subprocess.run(
    [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
  )


def _final_params(checkpoints: str, step: int) -> list:
  import jax

  from transformer_jax.checkpoints.checkpointer import Checkpointer

  with Checkpointer(checkpoints, keep=None) as checkpointer:
    return jax.tree.leaves(checkpointer.restore_params_to_host(step))


def test_the_whole_cycle_in_a_bucket_equals_the_local_one(gcs, data_dir, tmp_path):
  """train -> SIGTERM -> resume (bitwise the uninterrupted local run) -> average -> translate ->
  evaluate -> plot_attention, with the workdir, the prepared data, the test files and the
  hypotheses in the bucket."""
  env = dict(os.environ, **gcs.env, TRANSFORMER_JAX_CACHE=str(tmp_path / 'cache'))
  run = f'gs://{gcs.bucket}/run-{uuid.uuid4().hex[:6]}'
  tfds_dir = f'gs://{gcs.bucket}/tfds-{uuid.uuid4().hex[:6]}'
  _upload(os.path.join(data_dir, 'number_words'), f'{tfds_dir}/number_words')
  local = str(tmp_path / 'local')
  # Independent commands run side by side (the local reference alongside the bucket's run, the
  # two workdirs' averages and translations): each leaves a core idle much of the time
  # (start-up, compilation), and no result depends on the load.
  pool = ThreadPoolExecutor(max_workers=2)
  reference = pool.submit(
    _command,
    'train.py',
    f'--workdir={local}',
    f'--config.data_dir={data_dir}',
    *_TINY_FLAGS,
    env=env,
  )

  command = [
    sys.executable,
    'train.py',
    f'--workdir={run}',
    f'--config.data_dir={tfds_dir}',
    *_TINY_FLAGS,
  ]
  log_path = tmp_path / 'interrupted.log'
  with open(log_path, 'w') as log:
    process = subprocess.Popen(
      command, cwd=REPO_ROOT, env=env, stderr=log, stdout=subprocess.DEVNULL
    )
  deadline = time.monotonic() + 240
  while 'step 60/200' not in log_path.read_text():
    assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
  interrupted = log_path.read_text()
  assert 'SIGTERM received: checkpoint saved at step' in interrupted
  assert 'staged ' in interrupted  # The prepared dataset came from the bucket.
  stopped_at = int(interrupted.split('checkpoint saved at step ')[1].split(';')[0])
  assert stopped_at < 200
  resumed = _command(*command[1:], env=env)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'resumed from {run}/checkpoints at step {stopped_at}' in resumed.stderr
  reference = reference.result()
  assert reference.returncode == 0, reference.stderr[-3000:]
  for a, b in zip(
    _final_params(f'{local}/checkpoints', 200),
    _final_params(f'{run}/checkpoints', 200),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)  # Bitwise: the bucket changes nothing.

  averages = pool.map(
    lambda workdir: _command(
      '-m', 'transformer_jax.average', f'--workdir={workdir}', '--last=2', env=env
    ),
    (local, run),
  )
  for averaged in averages:
    assert averaged.returncode == 0, averaged.stderr[-3000:]
  lines = 'seven hundred one\n\nthree thousand forty-two\n'
  translations = list(
    pool.map(
      lambda workdir: subprocess.run(
        [sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}'],
        input=lines,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
      ),
      (local, run),
    )
  )
  assert [t.returncode for t in translations] == [0, 0], translations[1].stderr[-3000:]
  assert translations[0].stdout == translations[1].stdout
  assert len(translations[1].stdout.splitlines()) == 3

  epath.Path(f'{run}-files/test.en').write_text(lines)
  epath.Path(f'{run}-files/test.de').write_text('siebenhunderteins\n\ndreitausendzweiundvierzig\n')
  evaluated = pool.submit(
    _command,
    '-m',
    'transformer_jax.evaluate',
    f'--workdir={run}',
    f'--src={run}-files/test.en',
    f'--ref={run}-files/test.de',
    env=env,
  )
  plotted = pool.submit(
    _command,
    '-m',
    'transformer_jax.plot_attention',
    f'--workdir={run}',
    '--text=seven hundred one',
    f'--out={tmp_path / "attention.png"}',
    env=env,
  )
  evaluated, plotted = evaluated.result(), plotted.result()
  pool.shutdown()
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert 'BLEU' in evaluated.stdout and f'hypotheses: {run}/hypotheses/' in evaluated.stdout
  assert plotted.returncode == 0, plotted.stderr[-3000:]

  # Everything the workdir holds is in the bucket (and nothing in a local 'gs:' folder).
  held = {p.name for p in epath.Path(run).iterdir()}
  assert {
    'config.json',
    'vocab.model',
    'checkpoints',
    'tensorboard',
    'token_cache',
    'averaged',
    'hypotheses',
  } <= held, held
  events = list(epath.Path(f'{run}/tensorboard').glob('events.out.tfevents*'))
  assert events and b'train/loss' in events[0].read_bytes()
  assert not os.path.exists(os.path.join(REPO_ROOT, 'gs:'))


def test_two_processes_train_in_a_bucket(gcs, data_dir, tmp_path):
  """Two processes on 127.0.0.1 share a gs:// workdir: each takes its own lock object, they
  checkpoint collectively into the bucket, and one process resumes their run."""
  env = dict(
    os.environ, **gcs.env, TRANSFORMER_JAX_CACHE=str(tmp_path / 'cache'), JAX_PLATFORMS='cpu'
  )
  run = f'gs://{gcs.bucket}/pair-{uuid.uuid4().hex[:6]}'
  flags = [
    f'--workdir={run}',
    f'--config.data_dir={data_dir}',
    *_TINY_FLAGS,
    # Packed rows: one batch shape, so one training program to compile per run (token-budget
    # buckets compiled four here, ~6 s each); tests/multihost_test.py covers token batches
    # across processes.
    '--config.batching=packed',
    '--config.tokens_per_batch=384',
    '--config.num_train_steps=20',
    '--config.checkpoint_every_steps=10',
  ]
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        'train.py',
        *flags,
        f'--coordinator_address=127.0.0.1:{port}',
        '--num_processes=2',
        f'--process_id={i}',
      ],
      cwd=REPO_ROOT,
      env=env,
      text=True,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
    )
    for i in (0, 1)
  ]
  outputs = [process.communicate(timeout=300)[1] for process in processes]
  assert [process.returncode for process in processes] == [0, 0], outputs[0][-3000:]
  assert 'process 0 of 2' in outputs[0]
  held = {p.name for p in epath.Path(run).iterdir()}
  assert {'config.json', 'checkpoints'} <= held and not {'.lock', '.lock.process1'} & held
  resumed = _command(
    'train.py',
    *flags[:-2],
    '--config.num_train_steps=30',
    env=dict(
      env, XLA_FLAGS=os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'
    ),
  )
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'resumed from {run}/checkpoints at step 20' in resumed.stderr


def test_parallel_text_files_in_a_bucket(gcs, tmp_path, monkeypatch):
  monkeypatch.setenv('TRANSFORMER_JAX_CACHE', str(tmp_path / 'cache'))
  corpus = _bucket_path(gcs, f'corpus-{uuid.uuid4().hex[:6]}', 'en-de')
  for split, en, de in (
    ('train', 'a house\na tree\n', 'ein Haus\nein Baum\n'),
    ('valid', 'a dog\n', 'ein Hund\n'),
    ('test', 'a cat\n', 'eine Katze\n'),
  ):
    epath.Path(f'{corpus}/{split}.en').write_text(en)
    epath.Path(f'{corpus}/{split}.de').write_text(de)
  config = tiny_config(str(tmp_path / 'unused'))
  config.dataset, config.data.dir = 'text', corpus
  sources = input_pipeline.load_data_sources(config, _bucket_path(gcs, 'text-tfds'))
  assert [len(sources[s]) for s in ('train', 'validation', 'test')] == [2, 1, 1]
  assert sources['train'][1] == {'en': b'a tree', 'de': b'ein Baum'}
