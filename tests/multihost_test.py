"""Two real processes on 127.0.0.1 (2 CPU devices each) train like one process with 4 devices,
stop together on a preemption notice sent to one of them, and their checkpoint restores into a
single process that continues to the same parameters."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np

from transformer_jax.inference.translator import Translator

from conftest import FAST_COMPILE_FLAGS, REPO_ROOT

STEPS = 40


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def _write_config(tmp_path, data_dir) -> str:
  path = tmp_path / 'multihost_config.py'
  path.write_text(f"""
import sys
sys.path.insert(0, {os.path.join(REPO_ROOT, 'tests')!r})
from conftest import tiny_config

def get_config():
  config = tiny_config({data_dir!r})
  # Token-budget batches are planned globally, so 2 processes x 2 devices see exactly the
  # batches of 1 process x 4 devices (each process materialises its own rows).
  config.batching = 'tokens'
  config.tokens_per_batch = 384
  config.num_train_steps = {STEPS}
  # A gentle learning rate: layouts differ in the order of float32 reductions, and a steep one
  # amplifies that noise into visibly different curves within ~50 steps.
  config.learning_rate_scale = 0.25
  config.log_every_steps = 4
  config.checkpoint_every_steps = 1000
  # Evaluations from step 8 (before the preemption notice) judged by process 0's loss
  # (broadcast), each better one saved at once by both processes together: neither may hang
  # or change the run.
  config.eval_every_steps = 8
  config.best_checkpoint_metric = 'loss'
  config.eval_decode_examples = 32  # Decoded across both processes at the final evaluation.
  config.eval_batch_size = 16
  # Never reached, but with two processes it is checked at every log step by a broadcast of
  # process 0's clock: the collective must neither hang nor change the run.
  config.train_time_limit_minutes = 1e6
  return config
""")
  return str(path)


def _launch(workdir, config_path, devices, process_id=None, port=None):
  # Compiling dominates these runs (conftest.py's FAST_COMPILE_FLAGS). Every run here uses the
  # same flags, so the comparisons are unaffected.
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}',
  )
  command = [sys.executable, 'train.py', f'--workdir={workdir}', f'--config={config_path}']
  if process_id is not None:
    command += [
      f'--coordinator_address=127.0.0.1:{port}',
      '--num_processes=2',
      f'--process_id={process_id}',
    ]
  return subprocess.Popen(
    command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def _run_pair(workdir, config_path, preempt_after_step=None, limit_s=360):
  """Runs the two processes; optionally SIGTERMs process 1 once process 0 logs that step. Both
  outputs are read as they come (threads): an unread pipe would fill and stop its writer in the
  middle of a collective, and a silent hang would block a plain read forever. Past `limit_s`
  both are killed and the test fails with their last lines."""
  port = _free_port()
  processes = [_launch(workdir, config_path, 2, i, port) for i in (0, 1)]
  outputs: list[list[str]] = [[], []]
  readers = [
    threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)
    for p, out in zip(processes, outputs)
  ]
  for reader in readers:
    reader.start()
  deadline = time.monotonic() + limit_s
  while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
    if preempt_after_step and any(f'step {preempt_after_step}/' in x for x in outputs[0][:]):
      processes[1].send_signal(signal.SIGTERM)
      preempt_after_step = None
    time.sleep(0.2)
  hung = [i for i, p in enumerate(processes) if p.poll() is None]
  for i in hung:
    processes[i].kill()
  codes = [p.wait() for p in processes]
  for reader in readers:
    reader.join(timeout=10)
  log_0, log_1 = (''.join(out) for out in outputs)
  assert not hung, (
    f'processes {hung} still running after {limit_s} s:\n{_failure(log_0)}{_failure(log_1)}'
  )
  assert codes == [0, 0], _failure(log_0) + _failure(log_1)
  return log_0, log_1


def _failure(log: str) -> str:
  """What a dead process said: its fatal lines (absl's F-lines and Python's 'Fatal Python error',
  which a faulthandler dump of every thread would push out of a plain tail) and its last lines."""
  fatal = [
    line
    for line in log.splitlines()
    if line.startswith('F') and line[1:5].isdigit() or 'Fatal Python error' in line
  ]
  return '\n'.join(fatal[:10]) + '\n...\n' + log[-3000:]


def _final_eval_line(log: str) -> str:
  return [line for line in log.splitlines() if f'eval step {STEPS}:' in line][-1]


def test_two_processes_equal_one_stop_together_and_resume_in_one(tmp_path, data_dir):
  config_path = _write_config(tmp_path, data_dir)
  # The uninterrupted single process runs alongside the pair: these runs leave a core idle
  # much of the time (start-up, compilation), and the results do not depend on the load.
  reference = _launch(tmp_path / 'one', config_path, 4)
  workdir = tmp_path / 'two'
  try:
    log_0, log_1 = _run_pair(workdir, config_path, preempt_after_step=8)
    reference_log = reference.communicate(timeout=300)[0]
  finally:
    if reference.poll() is None:
      reference.kill()
  assert reference.returncode == 0, _failure(reference_log)
  assert 'process 0 of 2: 2 local of 4 devices' in log_0
  saved = [line for line in log_0.splitlines() if 'preemption received: checkpoint saved' in line]
  assert saved, log_0[-3000:]  # Process 0 stopped too, though only process 1 got the signal.
  stopped_at = int(saved[0].split('saved at step ')[1].split(';')[0])
  assert 'new best validation loss' in log_0 and 'at step 8' in log_0, log_0[-3000:]
  assert 8 <= stopped_at < STEPS
  assert 'step ' not in log_1  # Only process 0 logs ...
  assert len(os.listdir(workdir / 'tensorboard')) == 1  # ... and writes TensorBoard.

  # One process (4 devices) restores the checkpoint the two wrote collectively and continues.
  resumed = _launch(workdir, config_path, 4)
  resumed_log = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0, resumed_log[-3000:]
  assert f'resumed from {workdir}/checkpoints at step {stopped_at}' in resumed_log

  # The loss at every logged step (the two processes' steps, then the one's) and the final
  # evaluation (loss, token accuracy, greedy decoding, BLEU, chrF) are the uninterrupted
  # single process's, to the printed digits.
  def losses(log):  # {step: the loss printed for the steps since the previous log line}
    return {
      int(line.split('step ')[1].split('/')[0]): line.split('| loss ')[1].split(' ')[0]
      for line in log.splitlines()
      if '| loss ' in line
    }

  before, after, reference = losses(log_0), losses(resumed_log), losses(reference_log)
  del after[min(after)]  # It averages only the steps since the restore.
  assert max(before) <= stopped_at < min(after) and len(before) >= 2 and len(after) >= 2
  assert {**before, **after} == {step: reference[step] for step in {**before, **after}}
  assert (
    _final_eval_line(resumed_log).split('eval step')[1]
    == _final_eval_line(reference_log).split('eval step')[1]
  )

  params_one = Translator.from_checkpoint(str(tmp_path / 'one')).params
  params_two = Translator.from_checkpoint(str(workdir)).params
  assert jax.tree.structure(params_one) == jax.tree.structure(params_two)
  # Equal but for the order of float32 reductions (gradients all-reduced across processes).
  # Adam normalises every update, so where a gradient is near zero that rounding noise becomes
  # an update of up to the learning rate (~1e-2 here): measured max |difference| 1.6e-4 in a
  # handful of such coordinates, ~1e-6 elsewhere. A wrong batch or shard would move every
  # coordinate by ~lr and change the logged losses above.
  worst = 0.0
  for a, b in zip(jax.tree.leaves(params_one), jax.tree.leaves(params_two)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-3)
    worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
  print(f'max |parameter difference|, 2 processes vs 1: {worst:.2g}')
