"""The translation server behind `python -m transformer_jax.serve`: HTTP on Starlette + uvicorn.

    POST /v1/translate  {"text": [...], "beam_size": 4, "alpha": 0.6} -> {"translations": [...]}
                        (and `DecodingOptions`' other fields, "target_prefix" and "scores":
                        n-best lists, sampling, MBR and prefixes, in the modes --decoding
                        serves: `decoding_modes.py`; with several hypotheses or "scores",
                        "hypotheses" too: per text, [{"text", "log_prob", "score", ...}])
    POST /v1/attention  {"text": "...", ...} -> the translation and its cross-attention maps
    GET  /healthz, GET /metrics (JSON), GET / (a page: translation and attention heatmap)

Every request first passes `guards.py`: its Host must name the server and its Origin (if any)
be the server's own, a POST body must be JSON, a token is needed if the server has one, and
clients that stall are dropped. Concurrent requests are batched (`batcher.py`) and decoded by
one worker thread, never on the event loop. The JAX engine (`jax_engine.py`) compiles every
shape a request can need at start-up, and /metrics counts XLA compilations to show that none
happen afterwards.
--engine=ctranslate2 exports the model at start-up (or reuses the export) and decodes through
CTranslate2 in the same batcher (`ctranslate2_engine.py`); it has no attention maps. Errors are
JSON, {"error": "..."}; SIGTERM (or Ctrl-C) stops accepting connections, answers
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
from typing import Any, Callable

from absl import logging

try:  # The optional [serve] extra; `serve` says what is missing.
  import uvicorn
  from starlette.applications import Starlette
  from starlette.exceptions import HTTPException
  from starlette.requests import ClientDisconnect, Request
  from starlette.responses import HTMLResponse, JSONResponse
  from starlette.routing import Route
except ModuleNotFoundError as missing:
  _MISSING = missing.name
else:
  _MISSING = None

from transformer_jax.common.errors import (
  UserInputError,
  check_integer_at_least,
  check_number_at_least,
  check_positive_integer,
  is_integer,
  is_number,
)
from transformer_jax.inference.options import check_dtype
from transformer_jax.serving import ctranslate2_engine, guards
from transformer_jax.serving.batcher import Batcher, Closed, Engine, Metrics, QueueFull
from transformer_jax.serving.decoding_modes import OPTION_FIELDS, Served
from transformer_jax.serving.jax_engine import CompileCounter, JaxEngine

ENGINES = ('jax', 'ctranslate2')
# Seconds a client is told to wait (Retry-After) when the queue is full.
_RETRY_AFTER_S = 1
# The page may run its own inline script and call this server, nothing else.
_PAGE_POLICY = (
  "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'"
)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """The server's limits; `decoding` lists the modes requests may ask for (`decoding_modes`)."""

  host: str = '127.0.0.1'
  port: int = 8000
  max_batch_size: int = 16
  max_wait_ms: float = 5.0
  max_queue: int = 64
  max_sentences: int = 64
  max_chars: int = 1000
  timeout_s: float = 30.0
  decoding: str = '4:0.6,1:0'
  # Most hypotheses a request may ask for per text (num_hypotheses), and MBR candidates (mbr).
  max_hypotheses: int = 8
  max_mbr: int = 16
  # Seconds a client has to send a request's headers, then its body (see guards.py).
  header_timeout_s: float = 10.0
  body_timeout_s: float = 30.0
  # Comma lists added to the Host names and origins allowed (guards.py), and the token's file.
  allowed_hosts: str = ''
  allowed_origins: str = ''
  auth_token_file: str | None = None
  # --engine=ctranslate2 only (ctranslate2_engine.py): weight type (None: int8), export folder
  # (None: inside the workdir), OpenMP threads (None: 1).
  quantization: str | None = None
  ctranslate2_dir: str | None = None
  intra_threads: int | None = None
  # --engine=jax: the inference dtype (`JaxEngine.load`; None: the model's own).
  dtype: str | None = None

  def check(self) -> Served:
    """One-line errors for impossible settings; returns the served decoding modes."""
    check_positive_integer('--max_batch_size', self.max_batch_size)
    check_number_at_least('--max_wait_ms', self.max_wait_ms, 0)
    check_positive_integer('--max_queue', self.max_queue)
    check_positive_integer('--max_sentences', self.max_sentences)
    check_positive_integer('--max_chars', self.max_chars)
    check_number_at_least('--timeout_s', self.timeout_s, 0, strict=True)
    check_number_at_least('--header_timeout_s', self.header_timeout_s, 0, strict=True)
    check_number_at_least('--body_timeout_s', self.body_timeout_s, 0, strict=True)
    guards.allowed_hosts(self.host, self.allowed_hosts)
    guards.allowed_origins(self.allowed_origins)
    check_integer_at_least('--port', self.port, 0)
    if self.intra_threads is not None:
      check_positive_integer('--intra_threads', self.intra_threads)
    check_dtype(self.dtype)
    if self.port > 65535:
      raise UserInputError(f'--port must be at most 65535, got {self.port}')
    return Served.parse(self.decoding, self.max_hypotheses, self.max_mbr)


# The fields each route reads; any other is refused (a misspelt option would go unnoticed).
_ATTENTION_FIELDS = ('text', 'beam_size', 'alpha')
_TRANSLATE_FIELDS = ('text', *OPTION_FIELDS, 'target_prefix', 'scores')


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
    self.served = options.check()
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
      compilations_by_mode=self._compilations_by_mode(),
      persistent_cache_hits=getattr(self.compile_counter, 'persistent_cache_hits', 0),
      warmup_s=round(self.warmup_s, 3),
      engine=self.engine.name,
      max_batch_size=self.options.max_batch_size,
      batch_buckets=getattr(self.engine, 'buckets', None),
      decoding=[entry.as_dict() for entry in self.served.entries],
      max_hypotheses=self.served.max_hypotheses,
      max_mbr=self.served.max_mbr,
    )
    return JSONResponse(snapshot)

  def _compilations_by_mode(self) -> dict[str, int]:
    if self.compile_counter:
      return dict(sorted(self.compile_counter.by_mode.items()))
    return self.engine.compilations_by_mode()

  async def translate(self, request: Request) -> JSONResponse:
    async def work(payload: dict[str, Any]) -> dict[str, Any]:
      sentences = self._sentences(payload.get('text', None))
      prefixes = self._prefixes(payload.get('target_prefix'), len(sentences))
      scores = payload.get('scores', False)
      if not isinstance(scores, bool):
        raise RequestError(400, f'"scores" must be true or false, got {_kind(scores)}')
      self._check_beam_fields(payload)
      try:
        options = self.served.options_of(payload, prefixed=prefixes is not None)
        self.engine.check(sentences, options, prefixes)
      except UserInputError as error:
        raise RequestError(400, str(error)) from None
      check_seed(self.engine, options, payload)
      listed = scores or options.num_hypotheses > 1 or options.mbr > 0
      if not sentences:
        return dict(translations=[], hypotheses=[]) if listed else dict(translations=[])
      found = await self._wait(self.batcher.submit(sentences, options, prefixes))
      answer: dict[str, Any] = {'translations': [best[0].text if best else '' for best in found]}
      if listed:
        answer.update(hypotheses=[[_rounded(h.as_dict()) for h in each] for each in found])
      return answer

    return await self._handle(request, work, _TRANSLATE_FIELDS)

  async def attention(self, request: Request) -> JSONResponse:
    async def work(payload: dict[str, Any]) -> dict[str, Any]:
      text = payload.get('text')
      if not isinstance(text, str) or not text.strip():
        raise RequestError(400, f'"text" must be a non-blank string, got {_kind(text)}')
      (source,) = self._sentences([text])
      self._check_beam_fields(payload)
      try:
        options = self.served.options_of({**payload, 'sampling': False}, prefixed=False)
      except UserInputError as error:
        raise RequestError(400, str(error)) from None
      if not self.engine.has_attention:
        raise RequestError(501, f'the {self.engine.name} engine has no attention maps')
      attend = functools.partial(self.engine.attention, source, options.beam_size, options.alpha)
      return await self._wait(self.batcher.submit_job(attend))

    return await self._handle(request, work, _ATTENTION_FIELDS)

  async def _handle(
    self, request: Request, work: Callable, fields: tuple[str, ...]
  ) -> JSONResponse:
    """Parses the body, runs `work`, and answers: 200 with its result, or a JSON error."""
    began = time.perf_counter()
    try:
      payload = _json_object(await self._body(request))
      unknown = sorted(set(payload) - set(fields))
      if unknown:
        raise RequestError(
          400, f'unknown field(s) {", ".join(unknown)}: expected {", ".join(fields)}'
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
    seconds = self.options.body_timeout_s
    try:
      return await asyncio.wait_for(self._read_body(request), seconds)
    except asyncio.TimeoutError:
      # The rest of the body may still come: the connection cannot serve another request.
      headers = {'Connection': 'close'}
      raise RequestError(408, f'the body was not received within {seconds:g} s', headers) from None
    except ClientDisconnect:
      raise RequestError(400, 'the client disconnected before sending its whole body') from None

  async def _read_body(self, request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > self.max_body_bytes:
        raise RequestError(413, f'the body is over {self.max_body_bytes} bytes')
      chunks.append(chunk)
    return b''.join(chunks)

  def _sentences(self, text: Any) -> list[str]:
    limit = self.options.max_sentences
    if not isinstance(text, list):
      raise RequestError(400, f'"text" must be a list of strings, got {_kind(text)}')
    if len(text) > limit:
      raise RequestError(413, f'"text" has {len(text)} sentences; at most {limit} per request')
    for index, sentence in enumerate(text):
      if not isinstance(sentence, str):
        raise RequestError(400, f'"text"[{index}] must be a string, got {_kind(sentence)}')
      self._check_text(f'"text"[{index}]', sentence)
    return text

  def _check_text(self, name: str, text: str) -> None:
    max_chars = self.options.max_chars
    if len(text) > max_chars:
      raise RequestError(413, f'{name} has {len(text)} characters; at most {max_chars}')
    try:
      text.encode('utf-8')
    except UnicodeEncodeError:
      raise RequestError(400, f'{name} is not valid Unicode (a lone surrogate)') from None

  def _prefixes(self, prefixes: Any, count: int) -> list[str | None] | None:
    """The request's target prefixes, one text or null per text; None when none is given."""
    if prefixes is None:
      return None
    if not isinstance(prefixes, list):
      raise RequestError(
        400, f'"target_prefix" must be a list of strings or nulls, got {_kind(prefixes)}'
      )
    if len(prefixes) != count:
      raise RequestError(
        400, f'"target_prefix" must have one entry per text ({count}), got {len(prefixes)}'
      )
    for index, prefix in enumerate(prefixes):
      if prefix is not None and not isinstance(prefix, str):
        raise RequestError(
          400, f'"target_prefix"[{index}] must be a string or null, got {_kind(prefix)}'
        )
      self._check_text(f'"target_prefix"[{index}]', prefix or '')
    return prefixes if any(prefix and prefix.strip() for prefix in prefixes) else None

  def _check_beam_fields(self, payload: dict[str, Any]) -> None:
    """beam_size and alpha, as JSON types (`Served.options_of` checks the rest)."""
    beam_size, alpha = payload.get('beam_size', 1), payload.get('alpha', 0)
    if not is_integer(beam_size) or beam_size < 1:
      raise RequestError(400, f'"beam_size" must be a positive integer, got {_kind(beam_size)}')
    if not is_number(alpha) or not alpha >= 0:
      raise RequestError(400, f'"alpha" must be a number >= 0, got {_kind(alpha)}')

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


def check_seed(engine: Engine, options, payload: dict[str, Any]) -> None:
  """A sampling request's "seed" is refused by an engine whose draws it cannot determine."""
  if options.sampling and 'seed' in payload and not engine.seeded_sampling:
    raise RequestError(
      400,
      f'"seed" cannot be honoured by the {engine.name} engine: its draws are unseeded '
      '(leave "seed" out, or serve with --engine=jax)',
    )


def _rounded(fields: dict[str, Any]) -> dict[str, Any]:
  """A hypothesis' floats to 6 decimals: what float32 scores hold, and what people read."""
  return {k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()}


def _kind(value: Any) -> str:
  """A short description of a wrong value for an error message: its JSON type and a preview."""
  if value is None:
    return 'null'
  names = {bool: 'boolean', int: 'number', float: 'number', str: 'string', list: 'array'}
  name = names.get(type(value), 'object')
  try:
    preview = json.dumps(value, ensure_ascii=False)
  except RecursionError:  # Nested nearly as deep as json.loads allows: no preview.
    return name
  return f'{name} {preview[:40]}{"..." if len(preview) > 40 else ""}'


class _OutOfRange(ValueError):
  """A JSON number no field can hold: 1e400 (a float: inf), an integer of 19 digits or more."""


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise _OutOfRange(text)
  return value


def _bounded_int(text: str) -> int:
  if len(text.lstrip('-')) > 18:  # Beyond 64 bits (and before Python's 4300-digit limit).
    raise _OutOfRange(text)
  return int(text)


def _json_object(body: bytes) -> dict[str, Any]:
  try:
    text = body.decode('utf-8')
  except UnicodeDecodeError as error:
    raise RequestError(400, f'the body is not valid UTF-8 (byte {error.start})') from None
  try:
    payload = json.loads(
      text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int
    )
  except _OutOfRange as error:
    number = str(error)
    preview = number[:40] + ('...' if len(number) > 40 else '')
    raise RequestError(400, f'the body has a number out of range: {preview}') from None
  except RecursionError:
    raise RequestError(400, 'the body is nested too deeply') from None
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
  return importlib.resources.files('transformer_jax').joinpath('serving', 'page.html').read_text()


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
  if engine not in ENGINES:
    raise UserInputError(f'--engine must be one of {", ".join(ENGINES)}, got {engine!r}')
  if engine == 'ctranslate2':
    ctranslate2_engine.require()
    ctranslate2_engine.check_dtype(options.dtype, options.quantization)
  elif options.quantization or options.ctranslate2_dir or options.intra_threads is not None:
    raise UserInputError(
      '--quantization, --ctranslate2_dir and --intra_threads are for --engine=ctranslate2'
    )
  token = guards.load_token(options.auth_token_file)
  sock = bind(options.host, options.port)
  host, port = sock.getsockname()[:2]
  warning = guards.exposure_warning(host, token)
  if warning:  # Now rather than after warm-up: there is time to stop it before it serves.
    print(f'warning: {warning}', file=sys.stderr, flush=True)
  began = time.perf_counter()
  if engine == 'jax':
    counter = CompileCounter()
    loaded = JaxEngine.load(
      workdir, checkpoint, options.max_batch_size, counter, dtype=options.dtype
    )
  else:
    counter = None  # CTranslate2 compiles nothing; restoring for the export is not serving.
    loaded, how = ctranslate2_engine.load(
      workdir,
      checkpoint,
      max_batch_size=options.max_batch_size,
      quantization=options.quantization,
      directory=options.ctranslate2_dir,
      intra_threads=options.intra_threads,
    )
  loaded.warm_up(decoding)
  warmup_s = time.perf_counter() - began
  service = Service(loaded, options, compile_counter=counter, warmup_s=warmup_s)
  service.batcher.start()
  policy = guards.Policy(
    hosts=guards.allowed_hosts(options.host, options.allowed_hosts),
    origins=guards.allowed_origins(options.allowed_origins),
    token=token,
  )
  config = uvicorn.Config(
    guards.Guard(service.app, policy, on_refusal=service.metrics.response),
    # h11 with a header deadline, whatever else is installed (uvicorn would pick httptools).
    http=guards.header_deadline_protocol(options.header_timeout_s),
    ws='none',
    log_config=None,
    log_level='warning',
    access_log=False,
    lifespan='off',
    timeout_graceful_shutdown=math.ceil(options.timeout_s) + 5,
  )
  sock.listen(config.backlog)  # Clients that come before uvicorn runs wait in the backlog.
  how = f'{counter.count} programs compiled' if counter else how
  print(
    f'serving on http://{host}:{port} ({how} in {warmup_s:.1f} s; {decoding.describe()})',
    file=sys.stderr,
    flush=True,
  )
  with _signals_end_quietly():
    _server(config, on_exit=service.batcher.flush).run(sockets=[sock])
  drained = service.close()
  print(f'stopped{"" if drained else " (the decoder did not finish)"}', file=sys.stderr, flush=True)
