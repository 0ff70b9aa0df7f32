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
  sentence). The others have defaults: sorting by characters, no request checks, no warm-up,
  no compilation counter, no attention maps. `check` is called by the request handlers; every
  other method from the batcher's one worker thread.
  """

  name = 'engine'
  max_batch_size = 1
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

  def _take(self) -> list[Ticket] | None:
    """Waits for a batch's worth of requests (or max_wait); None when closed and empty."""
    with self._condition:
      while True:
        while not self._queue and not self._closing:
          self._condition.wait()
        if not self._queue:
          return None
        head = self._queue[0]
        # Companions are waited for from when the worker was free: requests that queued during
        # the last decode have waited already, but their companions can only come now.
        deadline = max(head.enqueued, self._free_since) + self.max_wait_s
        if (
          head.job is not None
          or self._queued_sentences >= self._expected
          or self._flush
          or time.monotonic() >= deadline
        ):
          break
        self._condition.wait(deadline - time.monotonic())
      taken, sentences = [], 0
      while self._queue and (not taken or self._fits(self._queue[0], sentences)):
        ticket = self._queue.popleft()
        self._queued_sentences -= len(ticket.sentences)
        taken.append(ticket)
        sentences += len(ticket.sentences)
        if ticket.job is not None:
          break
      self._in_flight = len(taken)
      return taken

  def _fits(self, ticket: Ticket, sentences: int) -> bool:
    return ticket.job is None and sentences + len(ticket.sentences) <= self.max_batch_size

  def _work(self) -> None:
    while (taken := self._take()) is not None:
      taken = [ticket for ticket in taken if ticket.future.set_running_or_notify_cancel()]
      try:
        if taken and taken[0].job is not None:
          taken[0].future.set_result(taken[0].job())
        elif taken:
          self._decode(taken)
      except BaseException as error:  # pylint: disable=broad-except
        logging.exception('decoding failed')
        for ticket in taken:
          if not ticket.future.done():
            ticket.future.set_exception(error)
      finally:
        with self._condition:
          self._in_flight = 0
          decoded = sum(len(ticket.sentences) for ticket in taken)
          if decoded:  # A round of sentences (not a job): expect as many next time.
            self._expected = min(self.max_batch_size, decoded + self._queued_sentences)
          self._free_since = time.monotonic()

  def _decode(self, tickets: list[Ticket]) -> None:
    """One engine call per batch of one decoding key; each ticket gets its own answers."""
    outputs: dict[int, list] = {id(ticket): [None] * len(ticket.sentences) for ticket in tickets}
    groups: dict[DecodingKey, list[tuple[Ticket, int, int]]] = collections.defaultdict(list)
    for ticket in tickets:
      for index, sentence in enumerate(ticket.sentences):
        groups[ticket.key].append((ticket, index, self.engine.length(sentence)))
    for key, entries in groups.items():
      entries.sort(key=lambda entry: entry[2])
      for start in range(0, len(entries), self.max_batch_size):
        chunk = entries[start : start + self.max_batch_size]
        batch = [entry for entry in chunk if not entry[0].abandoned]  # Timed out meanwhile?
        if not batch:
          continue
        began = time.perf_counter()
        prefixes = None
        if any(ticket.target_prefix is not None for ticket, _, _ in batch):
          prefixes = [
            None if ticket.target_prefix is None else ticket.target_prefix[index]
            for ticket, index, _ in batch
          ]
        results = self.engine.decode(
          [ticket.sentences[index] for ticket, index, _ in batch],
          key,
          prefixes,
          [index for _, index, _ in batch],
        )
        self.metrics.batch(len(batch), time.perf_counter() - began)
        for (ticket, index, _), result in zip(batch, results, strict=True):
          outputs[id(ticket)][index] = result
    for ticket in tickets:
      ticket.future.set_result(outputs[id(ticket)])
