"""The batch loop does no device work per hypothesis (issue 49): under
`jax.transfer_guard('disallow')` every mode of `Translator` runs (an implicit transfer, such as a
NumPy array handed to a program or a `jnp` length penalty per hypothesis, is refused: only the
loop's explicit `device_put` / `device_get` pass), each batch is one XLA execution (counted
from a profiler trace, `benchmark.dispatches`), and batch i + 1 is dispatched before batch i is
read back."""

import jax
import pytest

from transformer_jax.benchmark.dispatches import count_dispatches
from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.ensemble import Ensemble

from conftest import random_weight_translator

SOURCES = ['seven hundred one', 'three thousand forty', 'nine', 'one', 'twenty-two', 'six']


@pytest.fixture(scope='module')
def translator():
  return random_weight_translator()  # batch_size 8


def _modes(translator):
  """Every decoding path of the batch loop, by name."""
  ensemble = Ensemble([translator, translator], weights=[1, 2], batch_size=translator.batch_size)
  prefixes = ['sieben', None, None, 'eins', None, None]
  return {
    'beam': lambda: translator.translate(SOURCES),
    'greedy': lambda: translator.translate(SOURCES, beam_size=1),
    'greedy_scored': lambda: translator.hypotheses(SOURCES, beam_size=1),
    'nbest': lambda: translator.hypotheses(SOURCES, beam_size=4, num_hypotheses=3),
    'sampling': lambda: translator.hypotheses(
      SOURCES, sampling=True, num_hypotheses=2, sampling_topp=0.9, sampling_temperature=0.7
    ),
    'mbr': lambda: translator.hypotheses(SOURCES, beam_size=4, mbr=3),
    'prefix': lambda: translator.hypotheses(SOURCES, beam_size=2, target_prefix=prefixes),
    'greedy_prefix': lambda: translator.hypotheses(SOURCES, beam_size=1, target_prefix=prefixes),
    'ensemble': lambda: ensemble.hypotheses(SOURCES, beam_size=2, num_hypotheses=2),
    'ensemble_sampling': lambda: ensemble.hypotheses(SOURCES, sampling=True, seed=3),
    'score': lambda: translator.score(SOURCES, SOURCES),
    'ensemble_score': lambda: ensemble.score(SOURCES, SOURCES),
    'align': lambda: translator.align(SOURCES[:2]),
  }


@pytest.mark.parametrize(
  'mode',
  [
    'beam',
    'greedy',
    'greedy_scored',
    'nbest',
    'sampling',
    'mbr',
    'prefix',
    'greedy_prefix',
    'ensemble',
    'ensemble_sampling',
    'score',
    'ensemble_score',
    'align',
  ],
)
def test_every_mode_runs_with_implicit_transfers_refused(translator, mode):
  run = _modes(translator)[mode]
  expected = run()  # Compiled outside the guard: the guard is about the loop, not tracing.
  with jax.transfer_guard('disallow'):
    assert run() == expected


def test_the_guard_refuses_what_the_old_loop_did(translator):
  # The test can fail: a NumPy batch handed to a program, and a jnp penalty per hypothesis.
  import numpy as np

  from transformer_jax.search import decode

  with jax.transfer_guard('disallow'):
    with pytest.raises(Exception, match='Disallowed host-to-device transfer'):
      translator._token_log_probs(
        translator.params, np.ones((1, 8), np.int32), np.ones((1, 8), np.int32)
      )
    with pytest.raises(Exception, match='Disallowed host-to-device transfer'):
      float(decode.length_penalty(7, 0.6))


@pytest.mark.parametrize(
  'mode, batches',
  [
    ('beam', 1),
    ('greedy_scored', 1),
    ('nbest', 1),
    ('sampling', 2),  # 2 draws each: 4 sentences per batch of 8 rows.
    ('mbr', 1),
    ('prefix', 1),
    ('ensemble', 1),
    ('score', 1),
  ],
)
def test_each_batch_is_one_dispatch(translator, mode, batches):
  run = _modes(translator)[mode]
  run()  # Compiled first: a compilation runs executables of its own.
  _, dispatches = count_dispatches(run)
  assert dispatches == batches, (mode, dispatches)


def test_the_dispatch_count_sees_eager_work():
  import jax.numpy as jnp

  from transformer_jax.search import decode

  values = jnp.arange(4)
  _, dispatches = count_dispatches(lambda: [decode.length_penalty(n, 0.6) for n in values])
  assert dispatches >= 4


def test_the_next_batch_is_dispatched_before_the_last_is_read_back(translator, monkeypatch):
  events = []
  launch, finish = translator_module.Translator._launch, translator_module.Translator._finish

  def launched(self, batch, *args):
    events.append(('launch', batch[0].index))
    return launch(self, batch, *args)

  def finished(self, batch, *args):
    events.append(('finish', batch[0].index))
    return finish(self, batch, *args)

  monkeypatch.setattr(translator_module.Translator, '_launch', launched)
  monkeypatch.setattr(translator_module.Translator, '_finish', finished)
  sources = [' '.join(['nine'] * n) for n in range(1, 25)]  # 24 sentences: 3 batches of 8.
  translator.translate(sources, beam_size=1)
  kinds = [kind for kind, _ in events]
  assert kinds == ['launch', 'launch', 'finish', 'launch', 'finish', 'finish'], events
  # Each batch is read back after the next one was dispatched, in order.
  assert [i for k, i in events if k == 'launch'] == [i for k, i in events if k == 'finish']
