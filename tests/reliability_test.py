"""Never lose a run: non-finite steps skipped, one run per workdir, SIGTERM saves and exits 0."""

import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.checkpoints.checkpointer import Checkpointer
from transformer_jax.common.errors import NonFiniteError, UserInputError
from transformer_jax.training import loop, trainer
from transformer_jax.training import step as training_step
from transformer_jax.workdir.layout import Workdir

from conftest import FAST_COMPILE_FLAGS, REPO_ROOT, TINY_FLAGS, tiny_config


class _ScaledModel:
  """Stand-in for the Transformer: logits = w * log(inputs[0, 0] - 5).

  A batch whose first source token is 5 gives log(0) = -inf, so its loss and gradients are
  non-finite; any other batch is an ordinary finite step.
  """

  def apply(self, variables, inputs, targets_in, deterministic=True, rngs=None):
    del deterministic, rngs
    w = variables['params']['w']  # [vocab]
    scale = jnp.log(inputs[0, 0].astype(jnp.float32) - 5.0)
    return jnp.broadcast_to(w * scale, (*targets_in.shape, w.shape[0]))


def _state():
  params = {'w': jnp.linspace(-1.0, 1.0, 8)}
  return training_step.TrainState.create(
    apply_fn=None,
    params=params,
    tx=optax.adam(1e-2),
    dropout_rng=jax.random.PRNGKey(0),
    skipped_steps=jnp.zeros((), jnp.int32),
    nonfinite_streak=jnp.zeros((), jnp.int32),
  )


def _batch(first_token):
  return {
    'inputs': jnp.array([[first_token, 7, 1]], jnp.int32),
    'targets': jnp.array([[4, 6, 1, 0]], jnp.int32),
  }


def test_nonfinite_step_is_skipped_and_counted():
  step = jax.jit(
    lambda s, b: training_step.train_step(
      s, b, model=_ScaledModel(), learning_rate_fn=lambda count: 1e-2, label_smoothing=0.1
    )
  )
  state = _state()
  state, metrics = step(state, _batch(9))  # Finite.
  assert int(metrics['nonfinite_streak']) == 0
  before = jax.device_get(state)

  for expected_streak in (1, 2):
    state, metrics = step(state, _batch(5))  # log(0): NaN/Inf loss and gradients.
    assert not np.isfinite(float(metrics['loss_sum']))
    assert int(metrics['nonfinite_streak']) == expected_streak
  after = jax.device_get(state)
  np.testing.assert_array_equal(after.params['w'], before.params['w'])  # Update skipped.
  for a, b in zip(
    jax.tree_util.tree_leaves(after.opt_state), jax.tree_util.tree_leaves(before.opt_state)
  ):
    np.testing.assert_array_equal(a, b)
  assert int(after.step) == 3 and int(after.skipped_steps) == 2

  state, metrics = step(state, _batch(9))  # Finite again: the streak resets, training goes on.
  assert int(metrics['nonfinite_streak']) == 0 and int(state.skipped_steps) == 2
  assert not np.array_equal(np.asarray(state.params['w']), before.params['w'])


def test_diverging_run_stops_naming_the_steps_and_keeps_finite_checkpoints(tmp_path, data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps = 40
  config.learning_rate_scale = 1e30  # Parameters overflow after the first update.
  config.max_consecutive_nonfinite_steps = 3
  config.checkpoint_every_steps = 2
  with pytest.raises(NonFiniteError, match=r'NaN/Inf for 3 consecutive steps'):
    loop.train_and_evaluate(config, str(tmp_path))
  with Checkpointer(str(tmp_path / 'checkpoints'), async_save=False) as checkpointer:
    steps = checkpointer.all_steps()
  assert max(steps, default=0) < 40


def test_second_run_on_a_locked_workdir_is_refused(tmp_path, data_dir):
  with Workdir(str(tmp_path)).lock():
    with pytest.raises(UserInputError, match='is in use by a running training process'):
      loop.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  # Released: the same workdir trains now.
  config = tiny_config(data_dir)
  config.num_train_steps = 2
  loop.train_and_evaluate(config, str(tmp_path))


def test_lock_is_released_when_its_process_is_killed(tmp_path):
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys, time; sys.path.insert(0, sys.argv[1]);'
      'from transformer_jax.workdir.layout import Workdir;'
      'lock = Workdir(sys.argv[2]).lock().acquire(); print("held", flush=True); time.sleep(60)',
      REPO_ROOT,
      str(tmp_path),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'held'
    with pytest.raises(UserInputError, match=f'pid {holder.pid}'):
      Workdir(str(tmp_path)).lock().acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  Workdir(str(tmp_path)).lock().acquire().release()  # No stale lock after kill -9.


def _tiny_train_command(workdir, data_dir) -> list[str]:
  """train.py on the tiny task and model (seconds on one core); steps and intervals to add."""
  return [
    sys.executable,
    'train.py',
    f'--workdir={workdir}',
    f'--config.data_dir={data_dir}',
    *TINY_FLAGS,
    '--config.eval_every_steps=100000',
    '--config.eval_decode_examples=0',
    '--config.eval_batch_size=32',
    '--config.final_test_decode=False',
  ]


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path, data_dir):
  workdir = str(tmp_path / 'run')
  command = _tiny_train_command(workdir, data_dir) + [
    '--config.num_train_steps=100000',
    '--config.log_every_steps=5',
    '--config.checkpoint_every_steps=100000',
  ]
  process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
  log = []
  for line in process.stderr:
    log.append(line)
    if 'step 10/100000' in line:
      break
  sent = time.time()
  process.send_signal(signal.SIGTERM)
  log.extend(process.stderr)
  assert process.wait(timeout=60) == 0, ''.join(log)[-3000:]
  assert time.time() - sent < 30
  message = [line for line in log if 'SIGTERM received' in line]
  assert message, ''.join(log)[-3000:]
  saved_step = int(message[0].split('checkpoint saved at step ')[1].split(';')[0])
  assert saved_step >= 10
  with Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False) as checkpointer:
    assert checkpointer.all_steps() == [saved_step]


def _damage(checkpoint_dir, step, how):
  """Damages every array chunk of a step: truncates it, or flips one byte in its middle.

  (OCDBT packs several arrays per chunk file; damaging all of them makes sure the parameters
  are hit, not only the optimiser state.)
  """
  import glob

  chunks = [
    f
    for f in glob.glob(os.path.join(checkpoint_dir, str(step), 'state', '**', '*'), recursive=True)
    if os.path.isfile(f) and os.sep + 'd' + os.sep in f
  ]
  assert chunks
  for target in chunks:
    data = bytearray(pathlib.Path(target).read_bytes())
    if how == 'truncate':
      data = data[: len(data) // 3]
    else:
      data[len(data) // 2] ^= 0xFF
    with open(target, 'wb') as f:
      f.write(bytes(data))


@pytest.fixture(scope='module')
def straight_run(tiny_workdir):
  """8 uninterrupted steps of the tiny config (checkpoints at 4 and 8): the session's shared
  workdir (conftest.py), only read or copied here."""
  return tiny_workdir


def _resumed_config(data_dir):
  config = tiny_config(data_dir)
  config.num_train_steps, config.log_every_steps = 8, 2
  return config


@pytest.fixture(scope='module')
def stopped_and_resumed_run(tmp_path_factory, data_dir):
  """Stopped at step 4, then resumed to 8 with changed safe fields (steps, logging): allowed."""
  workdir = str(tmp_path_factory.mktemp('resumed'))
  config = tiny_config(data_dir)
  config.num_train_steps = 4
  loop.train_and_evaluate(config, workdir)
  loop.train_and_evaluate(_resumed_config(data_dir), workdir)
  return workdir


@pytest.mark.parametrize('how', ['truncate', 'flip'])
def test_damaged_checkpoint_is_named_and_training_falls_back(
  tmp_path, data_dir, straight_run, stopped_and_resumed_run, how
):
  from transformer_jax.common.errors import CorruptCheckpointError
  from transformer_jax.inference.translator import Translator

  config = _resumed_config(data_dir)
  damaged = str(tmp_path / 'damaged')
  shutil.copytree(stopped_and_resumed_run, damaged)  # Each case damages its own copy.
  _damage(os.path.join(damaged, 'checkpoints'), 8, how)

  with pytest.raises(
    CorruptCheckpointError, match=f'checkpoint step 8 at {damaged}/checkpoints/8 is damaged'
  ):
    Translator.from_checkpoint(damaged, 'latest')

  # Training again falls back to step 4 and retrains steps 5..8: the resumed run, twice over,
  # is bitwise the uninterrupted one.
  loop.train_and_evaluate(config, damaged)
  a = Translator.from_checkpoint(straight_run, 8).params
  b = Translator.from_checkpoint(damaged, 8).params
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_translate_reports_a_damaged_checkpoint_in_one_line(tmp_path, straight_run):
  workdir = str(tmp_path / 'damaged')
  shutil.copytree(straight_run, workdir)
  _damage(os.path.join(workdir, 'checkpoints'), 8, 'flip')
  result = subprocess.run(
    [sys.executable, '-m', 'transformer_jax.translate', f'--workdir={workdir}'],
    input=b'seven\n',
    capture_output=True,
    cwd=REPO_ROOT,
    timeout=120,
  )
  assert result.returncode == 2
  errors = [line for line in result.stderr.decode().splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and 'checkpoint step 8' in errors[0] and 'damaged' in errors[0]


def _as_an_ordinary_user(code: str) -> subprocess.CompletedProcess:
  """Runs `code` in a child Python that file modes apply to: as root (as these tests usually
  run), without the two capabilities that bypass them (`capsh`, as in text_io_test.py)."""
  command = [sys.executable, '-c', textwrap.dedent(code)]
  if os.geteuid() == 0:
    drop = ['capsh', '--drop=cap_dac_override,cap_dac_read_search', '--', '-c']
    if shutil.which('capsh') is None or subprocess.run([*drop, 'true']).returncode != 0:
      pytest.skip('running as root, and capsh cannot drop the capabilities that ignore modes')
    command = [*drop, shlex.join(command)]
  return subprocess.run(command, cwd=REPO_ROOT, timeout=300, capture_output=True, text=True)


def test_read_only_places_are_one_line_errors_before_any_data_work(
  tmp_path, data_dir, straight_run
):
  read_only = tmp_path / 'read_only'  # An empty folder nobody may write in.
  read_only.mkdir()
  trained = tmp_path / 'trained'  # A trained workdir, read-only all through.
  shutil.copytree(straight_run, trained)
  shared_data = tmp_path / 'shared_data'  # A prepared dataset on a read-only share.
  shutil.copytree(data_dir, shared_data)
  for path in (read_only, trained, shared_data):
    subprocess.run(['chmod', '-R', 'a-w', str(path)], check=True)
  code = f"""
    import io, sys
    sys.path.insert(0, 'tests')
    from conftest import tiny_config
    from transformer_jax.checkpoints import averaging
    from transformer_jax.inference import text_files
    from transformer_jax.training import loop
    from transformer_jax.common.errors import UserInputError

    def attempt(run):
      try:
        run()
        print('no error')
      except UserInputError as error:
        print(error)

    def train(workdir, data_dir):
      loop.train_and_evaluate(tiny_config(data_dir), workdir)

    attempt(lambda: train({str(read_only)!r}, {data_dir!r}))
    attempt(lambda: train({str(read_only / 'new_run')!r}, {data_dir!r}))
    attempt(lambda: train({str(tmp_path / 'run')!r}, {str(read_only / 'data')!r}))
    attempt(lambda: train({str(tmp_path / 'run')!r}, {str(read_only)!r}))  # Nothing prepared.
    attempt(lambda: averaging.average_checkpoints({str(trained)!r}, 2))
    # Reading is all translate does in a workdir.
    out = io.StringIO()
    typed = io.BytesIO(b'seven\\n')
    text_files.translate_text({str(trained)!r}, beam_size=1, stdin=typed, stdout=out)
    print('translated', len(out.getvalue().splitlines()))
    # A prepared dataset is only read: a read-only data_dir holding it is fine (up to the loop).
    loop._loop = lambda *args: print('ready to train')
    attempt(lambda: train({str(tmp_path / 'shared')!r}, {str(shared_data)!r}))
    """
  try:
    result = _as_an_ordinary_user(code)
  finally:
    for path in (read_only, trained, shared_data):
      subprocess.run(['chmod', '-R', 'u+w', str(path)], check=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == [
    f'--workdir={read_only}: cannot create files in {read_only} (Permission denied)',
    f'--workdir={read_only}/new_run: cannot create files in {read_only} (Permission denied)',
    f'config.data_dir={read_only}/data: cannot create files in {read_only} (Permission denied)',
    f'cannot use {read_only}/downloads: Permission denied',
    f'--workdir={trained}: cannot create files in {trained} (Permission denied)',
    'translated 1',
    'ready to train',
    'no error',
  ]
  assert os.listdir(read_only) == []
  assert sorted(os.listdir(trained)) == sorted(os.listdir(straight_run))  # No averaged/.


def _latest_completed_step(checkpoint_dir) -> int:
  """The newest step orbax has finalised (renamed from its temporary directory), or 0."""
  names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
  return max([int(name) for name in names if name.isdigit()], default=0)


def test_kill_9_at_random_moments_then_resume_equals_uninterrupted(tmp_path, data_dir):
  """SIGKILL at random moments (start-up, mid-step, mid-save), restarting each time: the run
  always resumes from its latest complete checkpoint and ends bitwise equal to an
  uninterrupted run with the same seed."""
  # Enough steps that no attempt can finish within the 2 s before its kill: a tiny step takes
  # milliseconds, so at 100 a quick machine finished the third attempt before it was killed.
  steps = 300
  # A checkpoint every 10 steps (written asynchronously while training goes on, each taking
  # longer than the 10 steps), so most kills land during a save; 3 kept, so old ones are
  # being deleted too.
  flags = [
    f'--config.num_train_steps={steps}',
    '--config.checkpoint_every_steps=10',
    '--config.keep_checkpoints=3',
    '--config.log_every_steps=5',
    # Mostly compilation, which one malloc arena slows (host_memory.py).
    '--config.reuse_host_memory=false',
  ]
  # Compiling dominates each start (conftest.py's FAST_COMPILE_FLAGS), and every run here uses
  # the same flags, so bitwise equality is unaffected.
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE_FLAGS)
  # The uninterrupted reference runs alongside the killed attempts: these runs leave a core
  # idle much of the time (start-up, compilation), and bitwise results do not depend on the
  # load. Its log goes to a file: nothing can block on it.
  reference_log = tmp_path / 'reference.log'
  with open(reference_log, 'w') as log:
    reference = subprocess.Popen(
      _tiny_train_command(tmp_path / 'reference', data_dir) + flags,
      cwd=REPO_ROOT,
      stdout=subprocess.DEVNULL,
      stderr=log,
      env=env,
    )

  try:
    workdir = tmp_path / 'killed'
    checkpoints = workdir / 'checkpoints'
    rng = np.random.default_rng(20261130)
    kills, steps_at_kill, cut_saves = 0, [], 0
    for attempt in range(5):
      log_path = tmp_path / f'attempt{attempt}.log'
      with open(log_path, 'w') as log:  # A file, not a pipe: nothing can block on it.
        process = subprocess.Popen(
          _tiny_train_command(workdir, data_dir) + flags,
          cwd=REPO_ROOT,
          stdout=subprocess.DEVNULL,
          stderr=log,
          env=env,
        )
      if attempt == 0:  # The first kill lands in start-up (data, vocabulary, compilation).
        time.sleep(float(rng.uniform(1.0, 3.0)))
      elif attempt < 4:
        # Three more at a random moment once this attempt has completed a checkpoint of its own
        # (so each makes progress): mid-step, mid-save or mid-deletion of an old checkpoint.
        done_before = _latest_completed_step(checkpoints)
        deadline = time.time() + 120
        while _latest_completed_step(checkpoints) <= done_before and process.poll() is None:
          assert time.time() < deadline, 'no checkpoint completed within 120 s'
          time.sleep(0.05)
        time.sleep(float(rng.uniform(0.0, 2.0)))
      else:  # Then it may finish.
        assert process.wait(timeout=300) == 0, log_path.read_text()[-3000:]
        break
      if process.poll() is None:
        process.kill()  # SIGKILL: no handler runs, a save in flight is cut off.
        kills += 1
      process.wait()
      cut_saves += (
        any('tmp' in name for name in os.listdir(checkpoints)) if checkpoints.is_dir() else 0
      )
      with Checkpointer(str(checkpoints), keep=None) as checkpointer:
        steps_at_kill.append(checkpointer.latest_step())
    assert kills == 4, steps_at_kill
    # Kills came after checkpoints existed, at different steps: resuming was tested each time.
    assert len({step for step in steps_at_kill if step}) == 3, steps_at_kill
    print(
      f'{kills} kills ({cut_saves} left a save unfinished); latest complete checkpoint at '
      f'each kill: {steps_at_kill}'
    )

    assert reference.wait(timeout=300) == 0, reference_log.read_text()[-3000:]
  finally:
    if reference.poll() is None:
      reference.kill()
      reference.wait()
  final = {}
  for name in ('reference', 'killed'):
    with Checkpointer(str(tmp_path / name / 'checkpoints'), keep=None) as checkpointer:
      assert checkpointer.latest_step() == steps
      final[name] = checkpointer.restore_params_to_host(steps)
  for got, want in zip(jax.tree.leaves(final['killed']), jax.tree.leaves(final['reference'])):
    np.testing.assert_array_equal(got, want)


# Resuming with dropout on: every test above trains with the default dropout 0, where a
# dropout key that resumed wrongly (not restored, re-seeded, folded with the wrong step) could
# not change a single bit. These train their own runs with dropout on (straight_run keeps 0).


def _dropout_config(data_dir):
  """The tiny config (8 steps, checkpoints at 4 and 8) with residual and attention dropout."""
  config = tiny_config(data_dir)
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.1
  return config


def _final_params(workdir, step=8):
  with Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as checkpointer:
    assert checkpointer.latest_step() == step, checkpointer.all_steps()
    return checkpointer.restore_params_to_host(step)


def _wrap_train_step(monkeypatch, before=None, after=None):
  """Calls before(state) -> state ahead of every training step and after(state) behind it.

  Patches the Trainer class for this test only (monkeypatch undoes it).
  """
  original = trainer.Trainer.step

  def step(self, state, local_batch):
    if before is not None:
      state = before(state)
    state, metrics = original(self, state, local_batch)
    if after is not None:
      after(state)
    return state, metrics

  monkeypatch.setattr(trainer.Trainer, 'step', step)


@pytest.fixture(scope='module')
def dropout_straight_run(tmp_path_factory, data_dir):
  """8 uninterrupted steps with dropout on."""
  workdir = str(tmp_path_factory.mktemp('dropout_straight'))
  loop.train_and_evaluate(_dropout_config(data_dir), workdir)
  return workdir


@pytest.fixture(scope='module')
def dropout_stopped_run(tmp_path_factory, data_dir):
  """The same run stopped twice: at its checkpoint step 4 (num_train_steps 4), then, resumed
  with num_train_steps 8, by SIGTERM after step 6 (not a checkpoint step), which checkpoints
  step 6. Tests resume copies of it."""
  workdir = str(tmp_path_factory.mktemp('dropout_stopped'))
  config = _dropout_config(data_dir)
  config.num_train_steps = 4
  loop.train_and_evaluate(config, workdir)

  steps = []

  def sigterm_after_step_6(state):
    steps.append(int(state.step))
    if steps[-1] == 6:
      # With no handler installed, SIGTERM would end pytest itself: fail instead.
      assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None), (
        'train_and_evaluate installed no SIGTERM handler'
      )
      signal.raise_signal(signal.SIGTERM)

  with pytest.MonkeyPatch.context() as monkeypatch:
    _wrap_train_step(monkeypatch, after=sigterm_after_step_6)
    result = loop.train_and_evaluate(_dropout_config(data_dir), workdir)
  assert steps == [5, 6], steps  # Resumed from 4; stopped after 6.
  assert result.get('preempted') == 1.0 and result.get('step') == 6.0, result
  _final_params(workdir, 6)  # Checkpointed at step 6, where it stopped.
  return workdir


def test_resume_with_dropout_is_bitwise_the_uninterrupted_run(
  tmp_path, data_dir, dropout_straight_run, dropout_stopped_run
):
  """Resumed from step 4 and then from the SIGTERM checkpoint at step 6, every step draws the
  uninterrupted run's dropout masks: the parameters end bitwise equal."""
  workdir = str(tmp_path / 'resumed')
  shutil.copytree(dropout_stopped_run, workdir)
  loop.train_and_evaluate(_dropout_config(data_dir), workdir)
  want, got = _final_params(dropout_straight_run), _final_params(workdir)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(y, x, err_msg=jax.tree_util.keystr(path))


def test_resume_with_another_dropout_key_is_not_the_uninterrupted_run(
  tmp_path, monkeypatch, data_dir, dropout_straight_run, dropout_stopped_run
):
  """The check above can fail: resumed from step 6 with any other dropout key (as a resume
  that re-seeded it would), steps 7 and 8 draw other masks and the parameters end elsewhere;
  with dropout ignored they would not."""
  workdir = str(tmp_path / 'rekeyed')
  shutil.copytree(dropout_stopped_run, workdir)
  rekeyed = []

  def other_key_on_resume(state):
    if not rekeyed:
      rekeyed.append(int(state.step))
      state = state.replace(dropout_rng=jax.random.fold_in(state.dropout_rng, 1))
    return state

  _wrap_train_step(monkeypatch, before=other_key_on_resume)
  loop.train_and_evaluate(_dropout_config(data_dir), workdir)
  assert rekeyed == [6]
  want, got = _final_params(dropout_straight_run), _final_params(workdir)
  differing = [
    jax.tree_util.keystr(path)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got))
    if not np.array_equal(x, y)
  ]
  # Dropout reaches every gradient, so nearly every tensor moves, not one or two.
  total = len(jax.tree.leaves(want))
  assert len(differing) > total // 2, f'{len(differing)} of {total} tensors differ: {differing}'


def test_a_checkpoint_of_another_model_is_refused_not_moved_aside(tmp_path, data_dir, straight_run):
  # The saved config that would refuse the change is gone (deleted by hand, or a checkpoint
  # copied in): the checkpoints are intact but hold another model's parameters.
  workdir = str(tmp_path / 'other')
  shutil.copytree(straight_run, workdir)
  os.remove(os.path.join(workdir, 'config.json'))
  config = tiny_config(data_dir)
  config.model.d_ff = 128
  config.num_train_steps = 12
  with pytest.raises(UserInputError) as raised:
    loop.train_and_evaluate(config, workdir)
  message = str(raised.value)
  assert (
    message.startswith(
      f'checkpoint step 8 at {workdir}/checkpoints/8: its parameters do not match this model: '
    )
    and '\n' not in message
  ), message
  assert message.endswith(
    'decoder_layers/ffn/wi/bias has shape (1, 64), the model expects (1, 128)'
  )
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4', '8']  # Kept.
  assert not os.path.exists(os.path.join(workdir, 'damaged_checkpoints'))
