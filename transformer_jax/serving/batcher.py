"""Dynamic batching for the translation server: the engine interface, the request queue and the
one worker thread that decodes, and the server's counters. No JAX here (see `jax_engine.py`).

Requests wait in a bounded FIFO queue. The worker takes the oldest as soon as the queue holds
the sentences it expects (below) or the oldest has waited `max_wait_s`, then more requests while
they fit in one batch; their sentences are grouped by decoding options (a request's key:
`DecodingOptions`, seed included), sorted by length, and decoded `max_batch_size` at a time:
one `Engine.decode` call per batch, each sentence with its own target prefix and its index in
its own request (which sampling keys its draws by: a request's draws never depend on what it
is batched with). Each request's future gets its own results, in its own order.

What the worker expects is what the last round brought: the sentences it decoded plus those that
arrived meanwhile (at most `max_batch_size`; `max_batch_size` before the first batch), and it
waits for them up to `max_wait_s` after it is free again, however long the oldest has waited
(during that round). Waiting pays only when companions are on their way: a lone client is
answered without waiting (after one wait at most, when traffic falls), while N clients that
send again as soon as they are answered are gathered into batches of N again, rather than of
the first one to come back and then of the N - 1 that queued while it was decoded.

One batch is kept in flight with an engine that `overlaps` (JAX's): batch i + 1 is launched
before batch i is read back and answered: the next batch of the round, or the first of the next
round when one would be taken at once anyway (a full batch queued, a flush, no max_wait: what
waiting expects is unchanged). Otherwise batch i is finished at once: no request waits for one
behind it. A round's requests are answered when its last batch is; a failure fails the whole
round's requests, and only theirs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from absl import logging

if TYPE_CHECKING:  # Annotations only: this module runs without JAX.
  from transformer_jax.inference.options import DecodingOptions
  from transformer_jax.serving.decoding_modes import Served

# A request's decoding options (`DecodingOptions`): sentences with different keys are never
# decoded together. The batcher only compares them; the engine reads them.
DecodingKey = Hashable


class Engine:
  """What the server needs from a translation backend (`jax_engine.JaxEngine`,
  `ctranslate2_engine.CTranslate2Engine`).

  `decode` is the one method an engine must have: at most `max_batch_size` sentences in, one
  result per sentence out, in order (a list of `Hypothesis`, best first; [] for a blank
  sentence). The others have defaults: `launch` and `finish`, decode's two halves (by default
  all the work is in `launch`), sorting by characters, no request checks, no warm-up, no
  compilation counter, no attention maps. `check` is called by the request handlers; every
  other method from the batcher's one worker thread.
  """

  name = 'engine'
  max_batch_size = 1
  # Whether `launch` returns before the batch is decoded (the device works while the batcher
  # launches the next batch); else each batch is finished before the next is launched.
  overlaps = False
  # Whether a sampling request's "seed" determines its draws (else a request giving one is a 400).
  seeded_sampling = True
  has_attention = False  # Whether `attention` is implemented (else /v1/attention is a 501).

  def decode(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    draw_positions: Sequence[int],
  ) -> list:
    """target_prefix: one text or None per sentence (None: no sentence has one);
    draw_positions: each sentence's index in its own request."""
    raise NotImplementedError

  def launch(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    draw_positions: Sequence[int],
  ) -> Any:
    """`decode`'s first half, returning what `finish` needs. An engine that `overlaps`
    dispatches the batch and returns; by default (an engine that cannot, as CTranslate2's) it
    decodes now."""
    return self.decode(sentences, options, target_prefix, draw_positions)

  def finish(self, launched: Any) -> list:
    """`decode`'s second half: the results of a `launch`ed batch."""
    return launched

  def check(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
  ) -> None:
    """A UserInputError for what this engine cannot decode (a prefix too long, a mode it lacks),
    before the request is queued: in a batch it would fail every request of the batch."""

  def length(self, sentence: str) -> int:
    """A sort key that groups sentences of similar decoding cost (tokens, ideally)."""
    return len(sentence)

  def warm_up(self, served: Served) -> None:
    """Compiles whatever `decode` with the served options may need, before serving."""

  def compilations(self) -> int:
    """Programs compiled so far (0 for an engine that never compiles)."""
    return 0

  def compilations_by_mode(self) -> dict[str, int]:
    """`compilations`, by the mode that compiled them ('beam', 'sampling', ...)."""
    return {}

  def attention(self, source: str, beam_size: int, alpha: float) -> dict[str, Any]:
    raise NotImplementedError(f'the {self.name} engine has no attention maps')


class QueueFull(Exception):
  """The queue holds `max_queue` requests already: answer 503 and let the client retry."""


class Closed(Exception):
  """The batcher is shutting down and takes no new requests."""


@dataclasses.dataclass(eq=False)
class Ticket:
  """One queued request: `future` resolves to its results (or an engine's result)."""

  sentences: list[str]
  key: DecodingKey | None
  target_prefix: list[str | None] | None = None  # one per sentence, or None for none
  job: Callable[[], Any] | None = None
  future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  enqueued: float = dataclasses.field(default_factory=time.monotonic)
  abandoned: bool = False

  def abandon(self) -> None:
    """The client gave up (timeout): drop the request, or the rest of its batches."""
    self.abandoned = True
    self.future.cancel()  # False once the worker runs it; its results are then discarded.


class Metrics:
  """Counters the worker and the request handlers update; `snapshot()` is what /metrics shows."""

  _LATENCY_WINDOW = 1024  # The percentiles cover the latest requests.

  def __init__(self):
    self._lock = threading.Lock()
    self.started = time.time()
    self.responses: collections.Counter[int] = collections.Counter()
    self.sentences = 0
    self.batches = 0
    self.batch_sizes: collections.Counter[int] = collections.Counter()
    self.decode_seconds = 0.0
    self.latencies: collections.deque[float] = collections.deque(maxlen=self._LATENCY_WINDOW)

  def response(self, status: int, latency: float | None = None) -> None:
    with self._lock:
      self.responses[status] += 1
      if latency is not None:
        self.latencies.append(latency)

  def batch(self, size: int, seconds: float) -> None:
    with self._lock:
      self.batches += 1
      self.sentences += size
      self.batch_sizes[size] += 1
      self.decode_seconds += seconds

  def snapshot(self) -> dict[str, Any]:
    with self._lock:
      latencies = sorted(self.latencies)
      return {
        'uptime_s': round(time.time() - self.started, 3),
        'requests': sum(self.responses.values()),
        'responses': {str(code): n for code, n in sorted(self.responses.items())},
        'sentences': self.sentences,
        'batches': self.batches,
        'batch_size_mean': round(self.sentences / self.batches, 3) if self.batches else 0.0,
        'batch_sizes': {str(size): n for size, n in sorted(self.batch_sizes.items())},
        'decode_seconds': round(self.decode_seconds, 4),
        'latency_s': _latency_summary(latencies),
      }


def _latency_summary(latencies: list[float]) -> dict[str, float | int]:
  if not latencies:
    return {'count': 0}

  def quantile(q: float) -> float:
    return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4)

  return {
    'count': len(latencies),
    'mean': round(sum(latencies) / len(latencies), 4),
    'p50': quantile(0.5),
    'p90': quantile(0.9),
    'p99': quantile(0.99),
    'max': round(latencies[-1], 4),
  }


class Batcher:
  """The bounded queue and the one worker thread that runs every engine call."""

  def __init__(
    self,
    engine: Engine,
    metrics: Metrics,
    *,
    max_batch_size: int,
    max_wait_s: float,
    max_queue: int,
  ):
    self.engine = engine
    self.metrics = metrics
    self.max_batch_size = max_batch_size
    self.max_wait_s = max_wait_s
    self.max_queue = max_queue
    self._queue: collections.deque[Ticket] = collections.deque()
    self._queued_sentences = 0
    self._in_flight = 0
    self._condition = threading.Condition()
    self._closing = False  # No new requests; the worker empties the queue, then ends.
    self._expected = max_batch_size  # Sentences the next batch waits for (see the docstring).
    self._free_since = 0.0  # time.monotonic() when the last round ended.
    self._flush = False  # Stop waiting for companions: nobody else is coming.
    self._thread = threading.Thread(target=self._work, name='decoder', daemon=True)

  def start(self) -> None:
    self._thread.start()

  def submit(
    self,
    sentences: list[str],
    key: DecodingKey,
    target_prefix: Sequence[str | None] | None = None,
  ) -> Ticket:
    """Queues sentences for translation; raises QueueFull or Closed."""
    prefixes = None if target_prefix is None else list(target_prefix)
    return self._put(Ticket(list(sentences), key, prefixes))

  def submit_job(self, job: Callable[[], Any]) -> Ticket:
    """Queues a call to run alone on the worker thread (e.g. attention maps)."""
    return self._put(Ticket([], None, job=job))

  def _put(self, ticket: Ticket) -> Ticket:
    with self._condition:
      if self._closing:
        raise Closed('the server is shutting down')
      if len(self._queue) >= self.max_queue:
        raise QueueFull(f'the queue is full (max_queue={self.max_queue})')
      self._queue.append(ticket)
      self._queued_sentences += len(ticket.sentences)
      self._condition.notify_all()
    ticket.future.add_done_callback(lambda future: future.cancelled() and self._discard(ticket))
    return ticket

  def _discard(self, ticket: Ticket) -> None:
    """A cancelled request leaves the queue at once: it no longer holds a place."""
    with self._condition:
      if ticket in self._queue:
        self._queue.remove(ticket)
        self._queued_sentences -= len(ticket.sentences)
        self._condition.notify_all()

  def depth(self) -> tuple[int, int]:
    """(requests waiting, requests being decoded)."""
    with self._condition:
      return len(self._queue), self._in_flight

  def flush(self) -> None:
    """Decode what is queued without waiting for more (called on SIGTERM)."""
    with self._condition:
      self._flush = True
      self._condition.notify_all()

  def close(self, timeout: float | None = None) -> bool:
    """Takes no more requests, decodes the queued ones, stops the worker; True if it ended."""
    with self._condition:
      self._closing = self._flush = True
      self._condition.notify_all()
    if self._thread.is_alive():
      self._thread.join(timeout)
    return not self._thread.is_alive()

  def _take(self, ending: _Round | None = None) -> list[Ticket] | None:
    """Waits for a batch's worth of requests (or max_wait); None when closed and empty.

    With `ending`, a round whose last batch is still being decoded, it waits for nothing: it
    takes the requests that would go at once if that round ended now (a full batch queued, a
    flush, no max_wait), else returns None, and the round is finished first. A job waits for it:
    it runs alone."""
    with self._condition:
      if ending is not None:
        if not self._queue or self._queue[0].job is not None:
          return None
        # What that round's end will expect (`_end`), its companions waited for from now.
        expected = min(self.max_batch_size, ending.sentences + self._queued_sentences)
        if not self._ready(expected, time.monotonic()):
          return None
      else:
        while True:
          while not self._queue and not self._closing:
            self._condition.wait()
          if not self._queue:
            return None
          if self._ready(self._expected, self._free_since):
            break
          self._condition.wait(self._deadline(self._free_since) - time.monotonic())
      taken, sentences = [], 0
      while self._queue and (not taken or self._fits(self._queue[0], sentences)):
        ticket = self._queue.popleft()
        self._queued_sentences -= len(ticket.sentences)
        taken.append(ticket)
        sentences += len(ticket.sentences)
        if ticket.job is not None:
          break
      self._in_flight += len(taken)
      return taken

  def _deadline(self, free_since: float) -> float:
    # Companions are waited for from when the worker was free: requests that queued during
    # the last decode have waited already, but their companions can only come now.
    return max(self._queue[0].enqueued, free_since) + self.max_wait_s

  def _ready(self, expected: int, free_since: float) -> bool:
    """Whether the queue's head goes now (called holding the lock, the queue not empty)."""
    return (
      self._queue[0].job is not None
      or self._queued_sentences >= expected
      or self._flush
      or time.monotonic() >= self._deadline(free_since)
    )

  def _fits(self, ticket: Ticket, sentences: int) -> bool:
    return ticket.job is None and sentences + len(ticket.sentences) <= self.max_batch_size

  def _work(self) -> None:
    """Rounds of requests, their batches launched one ahead: batch i + 1 (the round's next, or
    the next round's first when one is ready: `_take(ending=...)`) is dispatched before batch
    i is read back and answered, so that the host's work on i overlaps the device's on i + 1.
    With nothing ready the batch in flight is finished at once: no request waits for another."""
    pending: _Batch | None = None  # Launched, not finished yet.
    while True:
      taken = self._take(ending=pending.round if pending else None)
      if taken is not None:
        pending = self._run(taken, pending)
      elif pending is not None:
        self._finish(pending)
        pending = None
      else:
        return  # Closed, and nothing is queued.

  def _run(self, taken: list[Ticket], pending: _Batch | None) -> _Batch | None:
    """Starts a round: a job runs alone (never taken beside a batch in flight); sentences are
    launched a batch at a time, each before the one before it is finished. Returns the batch
    left in flight, if any."""
    tickets = [ticket for ticket in taken if ticket.future.set_running_or_notify_cancel()]
    round_ = _Round(
      len(taken), tickets, {id(ticket): [None] * len(ticket.sentences) for ticket in tickets}
    )
    batches: list = []
    try:
      if tickets and tickets[0].job is not None:
        tickets[0].future.set_result(tickets[0].job())
      else:
        batches = self._batches(tickets)
    except BaseException as error:  # pylint: disable=broad-except
      round_.error = error
    for key, chunk in batches:
      batch = [entry for entry in chunk if not entry[0].abandoned]  # Timed out meanwhile?
      if not batch:
        continue
      began = time.perf_counter()
      try:
        launched = _Batch(round_, batch, self._launch(key, batch))
      except BaseException as error:  # pylint: disable=broad-except
        if pending is not None:  # An earlier batch: its answers, or its error first.
          self._finish(pending)
          pending = None
        round_.error = round_.error or error
        break
      launched.seconds = time.perf_counter() - began
      round_.unfinished += 1
      if pending is not None:
        self._finish(pending)
      pending = launched
      if round_.error is not None:  # The batch before it failed: the round is lost.
        round_.unfinished -= 1
        pending = None
        break
      if not self.engine.overlaps:  # Its work is done already: answer before the next.
        self._finish(pending)
        pending = None
    round_.launched = True
    if not round_.unfinished:
      self._end(round_)
    return pending

  def _batches(self, tickets: list[Ticket]) -> list[tuple[DecodingKey, list]]:
    """A round's batches, in order: by decoding key, sorted by length, `max_batch_size`
    sentences each, as (key, [(ticket, index in the ticket, length)])."""
    groups: dict[DecodingKey, list[tuple[Ticket, int, int]]] = collections.defaultdict(list)
    for ticket in tickets:
      for index, sentence in enumerate(ticket.sentences):
        groups[ticket.key].append((ticket, index, self.engine.length(sentence)))
    found = []
    for key, entries in groups.items():
      entries.sort(key=lambda entry: entry[2])
      for start in range(0, len(entries), self.max_batch_size):
        found.append((key, entries[start : start + self.max_batch_size]))
    return found

  def _launch(self, key: DecodingKey, batch: list) -> Any:
    """One engine call per batch of one decoding key, each sentence with its own prefix."""
    prefixes = None
    if any(ticket.target_prefix is not None for ticket, _, _ in batch):
      prefixes = [
        None if ticket.target_prefix is None else ticket.target_prefix[index]
        for ticket, index, _ in batch
      ]
    return self.engine.launch(
      [ticket.sentences[index] for ticket, index, _ in batch],
      key,
      prefixes,
      [index for _, index, _ in batch],
    )

  def _finish(self, batch: _Batch) -> None:
    """Reads a launched batch back into its round's answers; ends the round after its last."""
    round_ = batch.round
    round_.unfinished -= 1
    if round_.error is None:  # Else the round is lost: its batch in flight is dropped.
      began = time.perf_counter()
      try:
        results = self.engine.finish(batch.handle)
        # The worker's time on this batch, launch and finish (not the others' in between).
        self.metrics.batch(len(batch.entries), batch.seconds + time.perf_counter() - began)
        for (ticket, index, _), result in zip(batch.entries, results, strict=True):
          round_.outputs[id(ticket)][index] = result
      except BaseException as error:  # pylint: disable=broad-except
        round_.error = error
    if round_.launched and not round_.unfinished:
      self._end(round_)

  def _end(self, round_: _Round) -> None:
    """Answers each request of a round (a failure fails them all, as one batch's failure did
    when the round was decoded in one go), then what the next round waits for."""
    try:
      if round_.error is not None:
        raise round_.error
      for ticket in round_.tickets:
        if not ticket.future.done():  # A job's is: it ran.
          ticket.future.set_result(round_.outputs[id(ticket)])
    except BaseException as error:  # pylint: disable=broad-except
      logging.exception('decoding failed')
      for ticket in round_.tickets:
        if not ticket.future.done():
          ticket.future.set_exception(error)
    finally:
      with self._condition:
        self._in_flight -= round_.taken
        if round_.sentences:  # A round of sentences (not a job): expect as many next time.
          self._expected = min(self.max_batch_size, round_.sentences + self._queued_sentences)
        self._free_since = time.monotonic()


@dataclasses.dataclass(eq=False)
class _Round:
  """Requests taken together (`Batcher._take`), answered together once their batches are."""

  taken: int  # Requests taken (`Batcher._in_flight`), cancelled ones included.
  tickets: list[Ticket]  # Those still wanted.
  outputs: dict[int, list]  # Each ticket's results, by id(ticket).
  unfinished: int = 0  # Batches launched and not finished.
  launched: bool = False  # Every batch of it launched (or given up).
  error: BaseException | None = None  # The first failure: every ticket's answer.

  @property
  def sentences(self) -> int:
    return sum(len(ticket.sentences) for ticket in self.tickets)


@dataclasses.dataclass(eq=False)
class _Batch:
  """A launched engine call: its entries, the engine's handle, the worker's time on it."""

  round: _Round
  entries: list  # (ticket, index in the ticket, length)
  handle: Any
  seconds: float = 0.0
