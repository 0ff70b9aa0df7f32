"""The translation server's front door, checked before any route runs: who may call it (Host,
Origin, an optional bearer token), what a POST may carry (JSON), how long a client may take.

A server on 127.0.0.1 is reachable from every web page its user opens: a page may POST to it
(a text/plain or typeless body needs no CORS preflight), and through DNS rebinding (a name of
the attacker's that starts resolving to 127.0.0.1) even read its answers. Hence, in this order:

- Host: a request must name the server: 127.0.0.1, localhost, [::1], the address it is bound to
  or one of --allowed_hosts, with any port (port forwarding changes it). Else 421. '*' turns the
  check off, which lets DNS rebinding through: only behind a proxy that checks Host itself.
- Origin, which browsers send with every cross-origin request and every POST: absent (curl,
  scripts) or the server's own (http:// or https:// and the request's Host) or one of
  --allowed_origins. Else 403.
- A bearer token, when the server has one (--auth_token_file, else $TRANSFORMER_JAX_SERVE_TOKEN):
  `Authorization: Bearer <token>` on every route but the page (`/`: static; its script sends the
  token it reads from its address's fragment, /#token=..., which browsers never send) and
  /healthz. Else 401.
- Content-Type: a POST must declare application/json; anything else (the forms and text/plain
  a page can send cross-site without a preflight) or nothing is a 415.
- Deadlines: a connection has --header_timeout_s, from its opening or from the previous
  response, to deliver a request's headers, else it is closed (`header_deadline_protocol`: uvicorn
  has no such timeout, and a client that sends half a request line would hold its connection
  forever); the body then has --body_timeout_s (app.py answers 408).
- Only HTTP is served: a WebSocket handshake is closed before its accept (403), and lifespan or
  any other scope type raises.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
import re
from typing import Any, Callable

from transformer_jax.common.errors import UserInputError

TOKEN_VARIABLE = 'TRANSFORMER_JAX_SERVE_TOKEN'
LOOPBACK_NAMES = ('127.0.0.1', 'localhost', '[::1]')
# Routes that need no token: the page (static) and the health check (a load balancer's probe).
PUBLIC_PATHS = frozenset({'/', '/healthz'})
EXPOSED_WARNING = (
  'serving beyond loopback without authentication: anyone who can reach this port can use it; '
  'set --auth_token_file'
)
_ORIGIN = re.compile(r'https?://[^/\s]+')
# Header values quoted in error messages are cut to this many characters.
_QUOTED_CHARS = 100


@dataclasses.dataclass(frozen=True)
class Policy:
  """Who may call the server: the Host names (None: any), the other origins allowed, the token."""

  hosts: frozenset[str] | None = frozenset(LOOPBACK_NAMES)
  origins: frozenset[str] = frozenset()
  token: str | None = None


def _entries(text: str) -> list[str]:
  return [entry.strip().lower() for entry in text.split(',') if entry.strip()]


def allowed_hosts(bound_host: str, extra: str) -> frozenset[str] | None:
  """The Host names served: the loopback ones, `bound_host` and the comma list `extra`
  (--allowed_hosts: names, IPv4 addresses or [IPv6] ones, no ports); None when it has '*'."""
  names = _entries(extra)
  if '*' in names:
    return None
  for name in names:
    bracketed = name.startswith('[') and name.endswith(']')
    if re.search(r'[/\s@]', name) or (':' in name and not bracketed):
      raise UserInputError(
        f'--allowed_hosts takes host names without scheme or port (example.org, 10.0.0.5, '
        f'[fd00::5], or *), got {name!r}'
      )
  bound = bound_host.strip().lower()
  if ':' in bound and not bound.startswith('['):  # An IPv6 address, as a Host header writes it.
    bound = f'[{bound}]'
  return frozenset({*LOOPBACK_NAMES, bound, *names})


def allowed_origins(extra: str) -> frozenset[str]:
  """The comma list --allowed_origins, each scheme://host[:port] (no path)."""
  origins = [entry.rstrip('/') for entry in _entries(extra)]
  for origin in origins:
    if not _ORIGIN.fullmatch(origin):
      raise UserInputError(
        f'--allowed_origins takes origins like http://example.org:8080, got {origin!r}'
      )
  return frozenset(origins)


def load_token(path: str | None, environ: dict[str, str] | None = None) -> str | None:
  """The bearer token: the contents of `path` (--auth_token_file, trimmed), else the variable
  TRANSFORMER_JAX_SERVE_TOKEN, else None (no authentication). A token on the command line
  would show in `ps`, hence a file."""
  if path:
    try:
      with open(path, encoding='utf-8') as f:
        token, where = f.read().strip(), f'--auth_token_file={path}'
    except (OSError, UnicodeDecodeError) as error:
      reason = getattr(error, 'strerror', None) or error
      raise UserInputError(f'--auth_token_file={path}: cannot read it: {reason}') from None
  else:
    token, where = (os.environ if environ is None else environ).get(TOKEN_VARIABLE), TOKEN_VARIABLE
    if token is None:
      return None
    token = token.strip()
  if not token:
    raise UserInputError(f'{where} is empty: the token is its one line')
  if not re.fullmatch(r'[\x21-\x7e]+', token):
    raise UserInputError(
      f'{where} must hold one token of printable ASCII without spaces (openssl rand -hex 32)'
    )
  return token


def exposure_warning(address: str, token: str | None) -> str | None:
  """The warning for a server bound to `address` (an IP) without a token, unless that is
  loopback only."""
  try:
    loopback = ipaddress.ip_address(address.split('%')[0]).is_loopback
  except ValueError:
    loopback = False
  return None if loopback or token else EXPOSED_WARNING


def _quoted(value: str) -> str:
  cut = value[:_QUOTED_CHARS] + ('...' if len(value) > _QUOTED_CHARS else '')
  return repr(cut)


def host_name(host: str) -> str:
  """A Host header's name, lower-cased, without its port: '[::1]:8000' -> '[::1]'."""
  host = host.strip().lower()
  if host.startswith('['):
    return host[: host.find(']') + 1] or host
  return host.partition(':')[0]


class Guard:
  """ASGI middleware that answers a JSON error, {"error": ...}, to a request the policy refuses,
  before the application (and its body) is touched; `on_refusal(status)` counts each."""

  def __init__(
    self, app: Callable, policy: Policy, on_refusal: Callable[[int], None] | None = None
  ):
    self.app = app
    self.policy = policy
    self.on_refusal = on_refusal

  async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    # Only HTTP is checked, so only HTTP is served: app.py runs uvicorn with ws='none' and
    # lifespan='off', and nothing may reach the application unchecked should that change.
    if scope['type'] == 'websocket':
      await receive()  # websocket.connect
      # A close before the accept: the server answers the handshake 403 (the ASGI spec).
      if self.on_refusal:
        self.on_refusal(403)
      await send({'type': 'websocket.close', 'code': 1008})  # 1008: policy violation.
      return
    if scope['type'] != 'http':
      # lifespan, or a type of a later ASGI version. Raising is how an application declines
      # lifespan: the server carries on without its events (the ASGI spec).
      raise RuntimeError(f"the server serves ASGI 'http' scopes only, not {scope['type']!r}")
    refusal = self.refusal(scope)
    if refusal is None:
      await self.app(scope, receive, send)
      return
    status, message, headers = refusal
    if self.on_refusal:
      self.on_refusal(status)
    body = json.dumps({'error': message}, ensure_ascii=False, separators=(',', ':')).encode()
    await send(
      {
        'type': 'http.response.start',
        'status': status,
        'headers': [
          (b'content-type', b'application/json'),
          (b'content-length', str(len(body)).encode()),
          *headers,
        ],
      }
    )
    await send({'type': 'http.response.body', 'body': body})

  def refusal(self, scope: dict[str, Any]) -> tuple[int, str, list] | None:
    """(status, message, extra headers) for a request the policy refuses; None for one it lets
    through."""
    headers: dict[str, list[str]] = {}
    for name, value in scope['headers']:
      headers.setdefault(name.decode('latin-1'), []).append(value.decode('latin-1'))
    hosts = headers.get('host', [])
    if len(hosts) != 1:
      return 400, f'a request needs one Host header, got {len(hosts)}', []
    host = hosts[0].strip().lower()
    if self.policy.hosts is not None and host_name(host) not in self.policy.hosts:
      return 421, f'Host {_quoted(host)} is not served here (--allowed_hosts adds names)', []
    own = {f'http://{host}', f'https://{host}'}
    for origin in headers.get('origin', []):
      origin = origin.strip().lower()
      if origin not in own and origin not in self.policy.origins:
        return 403, f'Origin {_quoted(origin)} may not use this server (see --allowed_origins)', []
    if self.policy.token and scope['path'] not in PUBLIC_PATHS:
      if not self._authorized(headers.get('authorization', [])):
        return (
          401,
          'missing or wrong bearer token: send "Authorization: Bearer <token>" (the page: '
          'open it as /#token=<token>)',
          [(b'www-authenticate', b'Bearer')],
        )
    if scope['method'] == 'POST':
      declared = headers.get('content-type', [])
      if not declared:
        return 415, 'a POST must declare Content-Type: application/json (curl: --json)', []
      for value in declared:
        if value.partition(';')[0].strip().lower() != 'application/json':
          # curl -d sends a form's type: the most likely way to get here.
          message = f'Content-Type {_quoted(value)} is not application/json (curl: --json)'
          return 415, message, []
    return None

  def _authorized(self, values: list[str]) -> bool:
    if len(values) != 1:
      return False
    scheme, _, credentials = values[0].strip().partition(' ')
    expected = self.policy.token.encode('ascii')
    given = credentials.strip().encode('latin-1')
    # compare_digest: the time taken does not tell how many leading characters were right.
    return scheme.lower() == 'bearer' and hmac.compare_digest(given, expected)


def header_deadline_protocol(header_timeout_s: float) -> type:
  """uvicorn's h11 protocol class, closing a connection that has not delivered a request's
  headers within `header_timeout_s` of its opening or of its previous response (also when the
  rest of an unread body never comes). Once a request's headers are in, the app's body deadline
  takes over; uvicorn's keep-alive timeout still closes idle connections sooner."""
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class HeaderDeadlineProtocol(H11Protocol):
    deadline = None

    def connection_made(self, transport) -> None:
      super().connection_made(transport)
      self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
      self._disarm()
      super().connection_lost(exc)

    def handle_events(self) -> None:
      cycle = self.cycle
      super().handle_events()
      if self.cycle is not cycle:  # A request's headers are complete.
        self._disarm()

    def on_response_complete(self) -> None:
      super().on_response_complete()  # May start a pipelined request (handle_events).
      if not self.transport.is_closing() and self.cycle.response_complete:
        self._arm()

    def _arm(self) -> None:
      self._disarm()
      self.deadline = self.loop.call_later(header_timeout_s, self.transport.close)

    def _disarm(self) -> None:
      if self.deadline is not None:
        self.deadline.cancel()
        self.deadline = None

  return HeaderDeadlineProtocol
