"""The translation server behind `python -m transformer_jax.serve`: HTTP on Starlette + uvicorn.

    POST /v1/translate  {"text": [...], "beam_size": 4, "alpha": 0.6} -> {"translations": [...]}
    POST /v1/attention  {"text": "...", ...} -> the translation and its cross-attention maps
    GET  /healthz, GET /metrics (JSON), GET / (a page: translation and attention heatmap)

Concurrent requests are batched (`serving_batcher.py`) and decoded by one worker thread, never
on the event loop. The JAX engine keeps one `Translator` per batch bucket (powers of two up to
--max_batch_size) over the same parameters: with `Translator`'s own length buckets, every
shape a request can need is compiled at start-up, once per served (beam_size, alpha) pair, and
/metrics counts XLA compilations (`jax.monitoring`) to show that none happen afterwards.
Errors are JSON, {"error": "..."}; SIGTERM (or Ctrl-C) stops accepting connections, answers
the requests already received, and returns (the command exits 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.resources
import json
import math
import signal
import socket
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

try:  # The optional [serve] extra; `serve` says what is missing.
  import uvicorn
  from starlette.applications import Starlette
  from starlette.exceptions import HTTPException
  from starlette.requests import Request
  from starlette.responses import HTMLResponse, JSONResponse
  from starlette.routing import Route
except ModuleNotFoundError as missing:
  _MISSING = missing.name
else:
  _MISSING = None

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.errors import (
  UserInputError,
  check_integer_at_least,
  check_number_at_least,
  check_positive_integer,
  is_integer,
  is_number,
)
from transformer_jax.inference import Translator, _bucket
from transformer_jax.serving_batcher import Batcher, Closed, DecodingKey, Engine, Metrics, QueueFull

ENGINES = ('jax', 'ctranslate2')
# Seconds a client is told to wait (Retry-After) when the queue is full.
_RETRY_AFTER_S = 1
# The page may run its own inline script and call this server, nothing else.
_PAGE_POLICY = (
  "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"
)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """The server's limits; `decoding` lists the (beam_size:alpha) pairs requests may ask for."""

  host: str = '127.0.0.1'
  port: int = 8000
  max_batch_size: int = 16
  max_wait_ms: float = 5.0
  max_queue: int = 64
  max_sentences: int = 64
  max_chars: int = 1000
  timeout_s: float = 30.0
  decoding: str = '4:0.6,1:0'

  def check(self) -> tuple[DecodingKey, ...]:
    """One-line errors for impossible settings; returns the served decoding options."""
    check_positive_integer('--max_batch_size', self.max_batch_size)
    check_number_at_least('--max_wait_ms', self.max_wait_ms, 0)
    check_positive_integer('--max_queue', self.max_queue)
    check_positive_integer('--max_sentences', self.max_sentences)
    check_positive_integer('--max_chars', self.max_chars)
    check_number_at_least('--timeout_s', self.timeout_s, 0, strict=True)
    check_integer_at_least('--port', self.port, 0)
    if self.port > 65535:
      raise UserInputError(f'--port must be at most 65535, got {self.port}')
    return parse_decoding(self.decoding)


def parse_decoding(text: str) -> tuple[DecodingKey, ...]:
  """'4:0.6,1:0' -> ((4, 0.6), (1, 0.0)); the first pair is the default. Beam 1 is greedy,
  which has no length penalty: its alpha is always 0."""
  options: list[DecodingKey] = []
  for part in text.split(','):
    beam, _, alpha = part.strip().partition(':')
    try:
      key = decoding_key(int(beam), float(alpha or 0))
    except ValueError:
      key = None
    if key is None or (key[0] > 1 and not alpha):
      raise UserInputError(
        f'--decoding must be comma-separated beam_size:alpha pairs like 4:0.6,1:0, got {text!r}'
      )
    if key not in options:
      options.append(key)
  return tuple(options)


def decoding_key(beam_size: int, alpha: float) -> DecodingKey | None:
  if beam_size < 1 or not math.isfinite(alpha) or alpha < 0:
    return None
  return (beam_size, 0.0 if beam_size == 1 else float(alpha))


def describe(key: DecodingKey) -> str:
  return 'beam_size=1 (greedy)' if key[0] == 1 else f'beam_size={key[0]} alpha={key[1]:g}'


def batch_buckets(max_batch_size: int) -> list[int]:
  """Powers of two below max_batch_size, then max_batch_size: at most 2x padding."""
  buckets = [1]
  while buckets[-1] * 2 < max_batch_size:
    buckets.append(buckets[-1] * 2)
  return sorted(set(buckets + [max_batch_size]))


class CompileCounter:
  """Counts XLA compilations in this process (each executable built, or loaded from JAX's
  persistent cache), through `jax.monitoring`'s backend-compile duration event."""

  EVENT = '/jax/core/compile/backend_compile_duration'
  CACHE_HIT = '/jax/compilation_cache/cache_hits'

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self.persistent_cache_hits = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event == self.EVENT:
      self.count += 1
      self.seconds += duration
      logging.info('compiled %s in %.2f s', kwargs.get('fun_name'), duration)

  def _on_event(self, event: str, **kwargs) -> None:
    if event == self.CACHE_HIT:
      self.persistent_cache_hits += 1

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)


class JaxEngine(Engine):
  """`Translator`s sharing one set of parameters, one per batch bucket: a batch of n sentences
  runs on the smallest bucket >= n, so its shapes are among those `warm_up` compiled."""

  name = 'jax'

  def __init__(self, translator: Translator, max_batch_size: int):
    self.max_batch_size = max_batch_size
    self.tokenizer = translator.tokenizer
    self.model_config = translator.model_config
    self.params = translator.params
    self.buckets = batch_buckets(max_batch_size)
    self._translators = {
      size: Translator(self.model_config, self.params, self.tokenizer, batch_size=size)
      for size in self.buckets
    }
    model = self._translators[self.buckets[0]].model
    # The attention maps run at one shape, (1, max_len) on both sides (see `attention`).
    self._attention_apply = jax.jit(
      lambda params, src, tgt_in: model.apply(
        {'params': params}, src, tgt_in, mutable=['intermediates']
      )[1]['intermediates']
    )

  @classmethod
  def load(cls, workdir: str, checkpoint: int | str | None, max_batch_size: int) -> 'JaxEngine':
    return cls(Translator.from_checkpoint(workdir, checkpoint, max_batch_size), max_batch_size)

  def length(self, sentence: str) -> int:
    return len(self.tokenizer.encode(sentence))

  def length_buckets(self) -> list[int]:
    max_len = self.model_config.max_len
    return sorted({_bucket(n, max_len) for n in range(1, max_len + 1)})

  def translate(self, sentences: Sequence[str], beam_size: int, alpha: float) -> list[str]:
    rows = sum(1 for sentence in sentences if sentence.strip())  # Blank ones are not decoded.
    if rows > self.max_batch_size:
      raise ValueError(f'{rows} sentences in one batch; at most {self.max_batch_size}')
    size = next(size for size in self.buckets if size >= rows)
    return self._translators[size].translate(list(sentences), beam_size=beam_size, alpha=alpha)

  def warm_up(self, options: Sequence[DecodingKey]) -> None:
    """Decodes one sentence per (decoding option, batch bucket, length bucket)."""
    sentences = [self._sentence_of(length) for length in self.length_buckets()]
    for beam_size, alpha in options:
      for size, translator in self._translators.items():
        for sentence in sentences:
          began = time.perf_counter()
          translator.translate([sentence], beam_size=beam_size, alpha=alpha)
          logging.info(
            'warmed up %s batch %d length %d in %.2f s',
            describe((beam_size, alpha)),
            size,
            self.length(sentence) + 1,
            time.perf_counter() - began,
          )
    self._cross_attention(sentences[0], sentences[0])

  def _sentence_of(self, length: int) -> str:
    """A sentence of `length` - 1 pieces (with EOS: `length` tokens), one word repeated."""
    for piece in range(EOS_ID + 1, self.tokenizer.vocab_size):
      word = self.tokenizer.decode([piece]).strip()
      if not word or any(char.isspace() for char in word):
        continue
      sentence = ' '.join([word] * (length - 1))
      if self.length(sentence) == length - 1:
        return sentence
    raise RuntimeError(f'no warm-up sentence of {length} tokens in this vocabulary')

  def attention(self, source: str, beam_size: int, alpha: float) -> dict[str, Any]:
    """The translation of `source` and its cross-attention, [layers][heads][target][source]."""
    (target,) = self._translators[self.buckets[0]].translate([source], beam_size, alpha)
    source_tokens, target_tokens, cross = self._cross_attention(source, target)
    return {
      'translation': target,
      'source_tokens': source_tokens,
      'target_tokens': target_tokens,
      'cross_attention': np.round(cross.astype(np.float64), 5).tolist(),
    }

  def _cross_attention(self, source: str, target: str) -> tuple[list[str], list[str], np.ndarray]:
    """`Translator.attention`'s cross-attention, padded to (1, max_len) so that one compiled
    program serves every sentence (padding is masked: it changes no weight of a real token)."""
    max_len = self.model_config.max_len
    source_ids = self.tokenizer.encode(source)[: max_len - 1] + [EOS_ID]
    target_ids = self.tokenizer.encode(target)[: max_len - 1] + [EOS_ID]
    src = np.full((1, max_len), PAD_ID, np.int32)
    src[0, : len(source_ids)] = source_ids
    tgt_in = np.full((1, max_len), PAD_ID, np.int32)
    tgt_in[0, : len(target_ids)] = [BOS_ID] + target_ids[:-1]
    weights = self._attention_apply(self.params, src, tgt_in)
    # Sown once per scanned call: [layers, batch=1, heads, queries, keys].
    (cross,) = weights['decoder_layers']['cross_attention']['attention_weights']
    cross = np.asarray(cross, np.float32)[:, 0, :, : len(target_ids), : len(source_ids)]
    source_tokens = self.tokenizer.pieces(source_ids[:-1]) + ['</s>']
    return source_tokens, self.tokenizer.pieces(target_ids[:-1]) + ['</s>'], cross


class RequestError(Exception):
  """A request the server refuses: its HTTP status and a one-line reason."""

  def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.headers = headers


def _reject_constant(name: str):
  raise ValueError(f'{name} is not JSON')


class Service:
  """The HTTP application: request checks, the batcher, the metrics; `app` is the ASGI app."""

  def __init__(
    self,
    engine: Engine,
    options: ServerOptions,
    *,
    compile_counter: CompileCounter | None = None,
    warmup_s: float = 0.0,
  ):
    self.engine = engine
    self.options = options
    self.decoding = options.check()
    self.compile_counter = compile_counter
    self.compilations_at_ready = self._compilations()
    self.warmup_s = warmup_s
    self.metrics = Metrics()
    self.batcher = Batcher(
      engine,
      self.metrics,
      max_batch_size=options.max_batch_size,
      max_wait_s=options.max_wait_ms / 1000,
      max_queue=options.max_queue,
    )
    # JSON escapes take up to 12 bytes per character (a surrogate pair), plus quotes and commas.
    self.max_body_bytes = options.max_sentences * (12 * options.max_chars + 8) + 1024
    self.app = Starlette(
      routes=[
        Route('/', self.page, methods=['GET']),
        Route('/healthz', self.healthz, methods=['GET']),
        Route('/metrics', self.metrics_endpoint, methods=['GET']),
        Route('/v1/translate', self.translate, methods=['POST']),
        Route('/v1/attention', self.attention, methods=['POST']),
      ],
      exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )

  def _compilations(self) -> int:
    return self.compile_counter.count if self.compile_counter else self.engine.compilations()

  async def page(self, request: Request) -> HTMLResponse:
    return HTMLResponse(_page(), headers={'Content-Security-Policy': _PAGE_POLICY})

  async def healthz(self, request: Request) -> JSONResponse:
    return JSONResponse({'status': 'ok', 'engine': self.engine.name})

  async def metrics_endpoint(self, request: Request) -> JSONResponse:
    queued, in_flight = self.batcher.depth()
    compilations = self._compilations()
    snapshot = self.metrics.snapshot()
    snapshot.update(
      queue_depth=queued,
      in_flight=in_flight,
      compilations=compilations,
      compilations_since_ready=compilations - self.compilations_at_ready,
      persistent_cache_hits=getattr(self.compile_counter, 'persistent_cache_hits', 0),
      warmup_s=round(self.warmup_s, 3),
      engine=self.engine.name,
      max_batch_size=self.options.max_batch_size,
      batch_buckets=getattr(self.engine, 'buckets', None),
      decoding=[{'beam_size': beam, 'alpha': alpha} for beam, alpha in self.decoding],
    )
    return JSONResponse(snapshot)

  async def translate(self, request: Request) -> JSONResponse:
    async def work(payload: dict[str, Any]) -> dict[str, Any]:
      sentences = self._sentences(payload.get('text', None))
      if not sentences:
        return {'translations': []}
      ticket = self.batcher.submit(sentences, self._decoding(payload))
      return {'translations': await self._wait(ticket)}

    return await self._handle(request, work)

  async def attention(self, request: Request) -> JSONResponse:
    async def work(payload: dict[str, Any]) -> dict[str, Any]:
      text = payload.get('text')
      if not isinstance(text, str) or not text.strip():
        raise RequestError(400, f'"text" must be a non-blank string, got {_kind(text)}')
      (source,) = self._sentences([text])
      key = self._decoding(payload)
      ticket = self.batcher.submit_job(functools.partial(self.engine.attention, source, *key))
      return await self._wait(ticket)

    return await self._handle(request, work)

  async def _handle(self, request: Request, work: Callable) -> JSONResponse:
    """Parses the body, runs `work`, and answers: 200 with its result, or a JSON error."""
    began = time.perf_counter()
    try:
      payload = _json_object(await self._body(request))
      unknown = sorted(set(payload) - {'text', 'beam_size', 'alpha'})
      if unknown:
        raise RequestError(
          400, f'unknown field(s) {", ".join(unknown)}: expected text, beam_size, alpha'
        )
      if 'text' not in payload:
        raise RequestError(400, 'missing field "text"')
      result = await work(payload)
    except RequestError as error:
      self.metrics.response(error.status)
      return JSONResponse({'error': str(error)}, error.status, headers=error.headers)
    except QueueFull as error:
      self.metrics.response(503)
      headers = {'Retry-After': str(_RETRY_AFTER_S)}
      return JSONResponse({'error': f'{error}; retry later'}, 503, headers=headers)
    except Closed as error:
      self.metrics.response(503)
      return JSONResponse({'error': str(error)}, 503)
    except Exception:  # A bug: 500 with a JSON error (`_internal_error`), and its traceback.
      self.metrics.response(500)
      raise
    self.metrics.response(200, time.perf_counter() - began)
    return JSONResponse(result)

  async def _body(self, request: Request) -> bytes:
    declared = request.headers.get('content-length', '')
    if declared.isdigit() and int(declared) > self.max_body_bytes:
      raise RequestError(413, f'the body has {declared} bytes; at most {self.max_body_bytes}')
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > self.max_body_bytes:
        raise RequestError(413, f'the body is over {self.max_body_bytes} bytes')
      chunks.append(chunk)
    return b''.join(chunks)

  def _sentences(self, text: Any) -> list[str]:
    limit, max_chars = self.options.max_sentences, self.options.max_chars
    if not isinstance(text, list):
      raise RequestError(400, f'"text" must be a list of strings, got {_kind(text)}')
    if len(text) > limit:
      raise RequestError(413, f'"text" has {len(text)} sentences; at most {limit} per request')
    for index, sentence in enumerate(text):
      if not isinstance(sentence, str):
        raise RequestError(400, f'"text"[{index}] must be a string, got {_kind(sentence)}')
      if len(sentence) > max_chars:
        raise RequestError(
          413, f'"text"[{index}] has {len(sentence)} characters; at most {max_chars}'
        )
      try:
        sentence.encode('utf-8')
      except UnicodeEncodeError:
        raise RequestError(400, f'"text"[{index}] is not valid Unicode (a lone surrogate)')
    return text

  def _decoding(self, payload: dict[str, Any]) -> DecodingKey:
    beam_size = payload.get('beam_size', self.decoding[0][0])
    alpha = payload.get('alpha', self.decoding[0][1])
    if not is_integer(beam_size) or beam_size < 1:
      raise RequestError(400, f'"beam_size" must be a positive integer, got {_kind(beam_size)}')
    if not is_number(alpha) or not alpha >= 0:
      raise RequestError(400, f'"alpha" must be a number >= 0, got {_kind(alpha)}')
    key = decoding_key(beam_size, alpha)
    if key not in self.decoding:
      served = '; '.join(describe(option) for option in self.decoding)
      raise RequestError(400, f'{describe(key)} is not served here; served: {served}')
    return key

  async def _wait(self, ticket) -> Any:
    try:
      return await asyncio.wait_for(asyncio.wrap_future(ticket.future), self.options.timeout_s)
    except asyncio.TimeoutError:
      ticket.abandon()
      raise RequestError(504, f'not translated within {self.options.timeout_s:g} s') from None

  def close(self) -> bool:
    if self.compile_counter:
      self.compile_counter.close()
    return self.batcher.close(timeout=self.options.timeout_s)


def _kind(value: Any) -> str:
  """A short description of a wrong value for an error message: its JSON type and a preview."""
  if value is None:
    return 'null'
  names = {bool: 'boolean', int: 'number', float: 'number', str: 'string', list: 'array'}
  name = names.get(type(value), 'object')
  preview = json.dumps(value, ensure_ascii=False)
  return f'{name} {preview[:40]}{"..." if len(preview) > 40 else ""}'


def _json_object(body: bytes) -> dict[str, Any]:
  try:
    text = body.decode('utf-8')
  except UnicodeDecodeError as error:
    raise RequestError(400, f'the body is not valid UTF-8 (byte {error.start})') from None
  try:
    payload = json.loads(text, parse_constant=_reject_constant)
  except ValueError as error:
    raise RequestError(400, f'the body is not JSON: {error}') from None
  if not isinstance(payload, dict):
    raise RequestError(400, f'the body must be a JSON object, got {_kind(payload)}')
  return payload


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
  return JSONResponse({'error': error.detail}, error.status_code, headers=error.headers)


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
  logging.error('%s %s failed: %r', request.method, request.url.path, error)
  return JSONResponse({'error': f'internal error: {type(error).__name__}'}, 500)


@functools.lru_cache(maxsize=1)
def _page() -> str:
  return importlib.resources.files('transformer_jax').joinpath('serving_page.html').read_text()


def _server(config: uvicorn.Config, on_exit: Callable[[], None]) -> uvicorn.Server:
  """uvicorn's server, whose signal handler also tells the batcher to stop waiting."""

  class Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame) -> None:
      logging.info('signal %d: draining in-flight requests', sig)
      on_exit()
      super().handle_exit(sig, frame)

  return Server(config)


def bind(host: str, port: int) -> socket.socket:
  """The address, taken before the model loads (a busy port fails at once); it starts listening
  once warm, so that until then clients are refused rather than kept waiting."""
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
  except OSError as error:
    raise UserInputError(f'cannot listen on {host}:{port}: {error.strerror or error}') from None
  sock.set_inheritable(True)
  return sock


@contextlib.contextmanager
def _signals_end_quietly():
  """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; this makes that re-raise a
  no-op, so that a drained server returns normally (exit 0)."""
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def serve(
  workdir: str,
  *,
  checkpoint: int | str | None = None,
  engine: str = 'jax',
  options: ServerOptions = ServerOptions(),
) -> None:
  """Loads the model, compiles every shape, serves until SIGTERM/SIGINT, drains, returns."""
  decoding = options.check()
  if _MISSING:
    raise UserInputError(
      f"the server needs {_MISSING}: pip install 'transformer_jax[serve]' (Starlette, uvicorn)"
    )
  if engine == 'ctranslate2':
    raise UserInputError('--engine=ctranslate2 is not available yet; use --engine=jax')
  if engine not in ENGINES:
    raise UserInputError(f'--engine must be one of {", ".join(ENGINES)}, got {engine!r}')
  sock = bind(options.host, options.port)
  counter = CompileCounter()
  began = time.perf_counter()
  jax_engine = JaxEngine.load(workdir, checkpoint, options.max_batch_size)
  jax_engine.warm_up(decoding)
  warmup_s = time.perf_counter() - began
  service = Service(jax_engine, options, compile_counter=counter, warmup_s=warmup_s)
  service.batcher.start()
  config = uvicorn.Config(
    service.app,
    log_config=None,
    log_level='warning',
    access_log=False,
    lifespan='off',
    timeout_graceful_shutdown=math.ceil(options.timeout_s) + 5,
  )
  sock.listen(config.backlog)  # Clients that come before uvicorn runs wait in the backlog.
  host, port = sock.getsockname()[:2]
  print(
    f'serving on http://{host}:{port} ({counter.count} programs compiled in {warmup_s:.1f} s; '
    f'{", ".join(describe(key) for key in decoding)})',
    file=sys.stderr,
    flush=True,
  )
  with _signals_end_quietly():
    _server(config, on_exit=service.batcher.flush).run(sockets=[sock])
  drained = service.close()
  print(f'stopped{"" if drained else " (the decoder did not finish)"}', file=sys.stderr, flush=True)
