"""The server keeps one batch in flight (issue 49, item 2): the batcher dispatches batch i + 1
(the next chunk of a round, or the next round when one is waiting already) before it reads back
and answers batch i, through the real `JaxEngine` over the suite's model. The answers equal the
synchronous batcher's exactly, a failing batch fails only its own round's requests, and a batch
with nothing behind it is finished at once.

Events are recorded by wrapping `Translator._launch` (dispatch) and `Translator._finish` (fetch
and post-processing), so the order is the device's, whatever the engine's methods are called."""

import dataclasses

import pytest

from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.options import DecodingOptions
from transformer_jax.serving.batcher import Batcher, Engine, Metrics
from transformer_jax.serving.jax_engine import JaxEngine

BEAM = DecodingOptions(beam_size=4, alpha=0.6)
GREEDY = DecodingOptions(beam_size=1, alpha=0.0)
TEXTS = ['one hundred', 'seven', 'three thousand forty', 'ninety-nine']


@pytest.fixture(scope='module')
def engine(tiny_workdir):
  return JaxEngine.load(tiny_workdir, None, max_batch_size=2)


class _Synchronous(Engine):
  """The JAX engine seen through `decode` alone, as the batcher used it before batches
  overlapped: the answers to compare with."""

  def __init__(self, engine):
    self.engine, self.max_batch_size = engine, engine.max_batch_size

  def decode(self, sentences, options, target_prefix, draw_positions):
    return self.engine.decode(sentences, options, target_prefix, draw_positions)

  def length(self, sentence):
    return self.engine.length(sentence)


@dataclasses.dataclass
class _Recorder:
  """Wraps the Translator's dispatch and read-back: events, and optional failures."""

  events: list = dataclasses.field(default_factory=list)
  fail_launch: object = None  # A predicate on the batch's options, or None.
  fail_finish: object = None

  def install(self, monkeypatch):
    launch, finish = translator_module.Translator._launch, translator_module.Translator._finish

    def launched(translator, batch, rows, options, scored):
      self.events.append(('launch', options.mode))
      if self.fail_launch and self.fail_launch(options):
        raise RuntimeError('launch failed')
      return launch(translator, batch, rows, options, scored)

    def finished(translator, batch, arrays, outputs, options, scored):
      self.events.append(('finish', options.mode))
      if self.fail_finish and self.fail_finish(options):
        raise RuntimeError('finish failed')
      return finish(translator, batch, arrays, outputs, options, scored)

    monkeypatch.setattr(translator_module.Translator, '_launch', launched)
    monkeypatch.setattr(translator_module.Translator, '_finish', finished)
    return self


def _answers(engine, requests, *, max_wait_s=60.0):
  """Queues every request before the worker starts (so the rounds are known), then returns
  each one's answers (or its exception) and the batcher's metrics."""
  metrics = Metrics()
  batcher = Batcher(engine, metrics, max_batch_size=2, max_wait_s=max_wait_s, max_queue=8)
  tickets = [batcher.submit(sentences, key) for sentences, key in requests]
  batcher.start()
  answers = []
  for ticket in tickets:
    try:
      answers.append(ticket.future.result(120))
    except RuntimeError as error:
      answers.append(error)
  assert batcher.close(timeout=60)
  assert batcher.depth() == (0, 0)
  return answers, metrics.snapshot()


def _kinds(recorder):
  return [kind for kind, _ in recorder.events]


def test_the_next_chunk_of_a_round_is_dispatched_before_the_last_is_read_back(engine, monkeypatch):
  requests = [(TEXTS, BEAM)]  # One request of 4 sentences: two batches of 2.
  expected, _ = _answers(_Synchronous(engine), requests)
  recorder = _Recorder().install(monkeypatch)
  answers, metrics = _answers(engine, requests)
  assert _kinds(recorder) == ['launch', 'launch', 'finish', 'finish'], recorder.events
  assert answers == expected
  assert (metrics['batches'], metrics['sentences']) == (2, 4)


def test_the_next_round_is_dispatched_before_the_last_is_answered(engine, monkeypatch):
  # Two requests of a full batch each: two rounds, the second waiting while the first decodes.
  requests = [(TEXTS[:2], BEAM), (TEXTS[2:], GREEDY)]
  expected, _ = _answers(_Synchronous(engine), requests)
  recorder = _Recorder().install(monkeypatch)
  answers, metrics = _answers(engine, requests)
  assert recorder.events == [
    ('launch', 'beam'),
    ('launch', 'greedy'),
    ('finish', 'beam'),
    ('finish', 'greedy'),
  ]
  assert answers == expected
  assert (metrics['batches'], metrics['batch_sizes']) == (2, {'2': 2})


def test_a_batch_with_nothing_behind_it_is_finished_at_once(engine, monkeypatch):
  recorder = _Recorder().install(monkeypatch)
  # max_wait_s=60: a worker that waited for a next round before answering would time out here.
  (answer,), _ = _answers(engine, [(TEXTS[:2], BEAM)])
  assert len(answer) == 2 and _kinds(recorder) == ['launch', 'finish']


def test_a_failing_round_fails_only_its_own_requests(engine, monkeypatch):
  requests = [(TEXTS[:2], BEAM), (TEXTS[2:], GREEDY)]
  expected, _ = _answers(_Synchronous(engine), requests)
  # The second round's dispatch fails while the first is in flight: the first is answered.
  recorder = _Recorder(fail_launch=lambda options: options.mode == 'greedy').install(monkeypatch)
  answers, metrics = _answers(engine, requests)
  assert answers[0] == expected[0]
  assert str(answers[1]) == 'launch failed'
  assert metrics['batches'] == 1
  # The first round's read-back fails after the second was dispatched: the second is answered.
  recorder.events.clear()
  recorder.fail_launch, recorder.fail_finish = None, lambda options: options.mode == 'beam'
  answers, metrics = _answers(engine, requests)
  assert _kinds(recorder) == ['launch', 'launch', 'finish', 'finish'], recorder.events
  assert str(answers[0]) == 'finish failed'
  assert answers[1] == expected[1]
  assert metrics['batches'] == 1


def test_a_failing_chunk_fails_its_round_as_before(engine, monkeypatch):
  # One request of two chunks whose first chunk fails to read back: the whole request fails,
  # and the second chunk, dispatched already, is dropped (no batch counted).
  recorder = _Recorder(fail_finish=lambda options: True).install(monkeypatch)
  (answer,), metrics = _answers(engine, [(TEXTS, BEAM)])
  assert str(answer) == 'finish failed'
  assert metrics['batches'] == 0
  # Its second chunk failing to dispatch: the first was decoded (and counted), the request fails.
  recorder.events.clear()
  launches = iter([False, True])
  recorder.fail_finish, recorder.fail_launch = None, lambda options: next(launches)
  (answer,), metrics = _answers(engine, [(TEXTS, BEAM)])
  assert str(answer) == 'launch failed'
  assert metrics['batches'] == 1
