"""The server is safe on a laptop (serving/guards.py): web pages of other origins, DNS rebinding,
stalled clients and malformed bodies get 4xx answers or closed connections, never the model.

One `python -m transformer_jax.serve` on 127.0.0.1 over the session's tiny workdir (greedy,
batches of 1: little to compile) with a bearer token, one more Host name and origin, and 0.5 s
header and body deadlines; every request goes over real sockets.
"""

import html
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import pytest
from helpers import server_process

from transformer_jax.common.errors import UserInputError
from transformer_jax.serving import app, guards

TOKEN = 'test-token-3f9a07'
EXTRA_HOST = 'translate.example'
EXTRA_ORIGIN = 'http://app.example:8080'
DEADLINE_S = 0.5
JSON = 'application/json'


class Server(server_process.Server):
  """The shared server process (tests/helpers/server_process.py), sending TOKEN by default."""

  def __init__(self, workdir, folder, *flags):
    super().__init__(workdir, folder / 'log', *flags, token=TOKEN)

  def translate(self, headers=None, **kwargs):
    return self.request('POST', '/v1/translate', {'text': ['one']}, headers, **kwargs)

  def responses(self) -> dict[str, int]:
    return self.metrics()['responses']


@pytest.fixture(scope='module')
def server(tiny_workdir, tmp_path_factory):
  folder = tmp_path_factory.mktemp('safe_server')
  (folder / 'token').write_text(f'{TOKEN}\n')
  running = Server(
    tiny_workdir,
    folder,
    '--max_batch_size=1',
    '--decoding=1:0',
    '--max_sentences=4',
    '--max_chars=100',
    f'--auth_token_file={folder / "token"}',
    f'--allowed_hosts={EXTRA_HOST}',
    f'--allowed_origins={EXTRA_ORIGIN}',
    f'--header_timeout_s={DEADLINE_S}',
    f'--body_timeout_s={DEADLINE_S}',
  )
  yield running
  running.stop()


ROUTES = [('GET', '/healthz'), ('GET', '/'), ('GET', '/metrics'), ('POST', '/v1/translate')]


def test_only_a_host_header_naming_the_server_is_served(server):
  port = server.port
  served = ['127.0.0.1', 'localhost', 'LocalHost', '[::1]', EXTRA_HOST]
  # DNS rebinding: the attacker's name, resolved to 127.0.0.1, is what the browser sends.
  refused = ['evil.example', '127.0.0.1.evil.example', 'localhost.evil.example', 'app.example']
  for name, expected in [(name, 200) for name in served] + [(name, 421) for name in refused]:
    for host in (f'{name}:{port}', name):
      for method, path in ROUTES:
        body = {'text': ['one']} if method == 'POST' else None
        status, _, answer = server.request(method, path, body, {'Host': host})
        assert status == expected, (host, path, answer)
        if expected == 421:
          error = f"Host '{host.lower()}' is not served here (--allowed_hosts adds names)"
          assert answer == {'error': error}


def test_pages_of_other_origins_are_refused(server):
  port = server.port
  own = f'127.0.0.1:{port}'
  for host, origin, expected in [
    (own, f'http://{own}', 200),  # The server's own page.
    (own, f'https://{own}', 200),  # The same, behind a TLS proxy.
    (f'localhost:{port}', f'http://localhost:{port}', 200),
    (own, EXTRA_ORIGIN, 200),  # --allowed_origins.
    (own, 'http://evil.example', 403),
    (own, 'null', 403),  # Sandboxed frames, file:// pages.
    (own, f'http://127.0.0.1:{port + 1}', 403),  # Another local web application.
    (own, f'http://localhost:{port}', 403),  # Another origin than the Host it sent to.
    (own, 'http://app.example', 403),  # EXTRA_ORIGIN has a port.
  ]:
    status, _, answer = server.translate({'Host': host, 'Origin': origin})
    assert status == expected, (origin, answer)
    if expected == 403:
      assert answer == {
        'error': f"Origin '{origin}' may not use this server (see --allowed_origins)"
      }
  for path in ('/metrics', '/healthz'):
    assert server.request('GET', path, headers={'Origin': 'http://evil.example'})[0] == 403


def test_a_cross_site_text_or_form_post_is_refused(server):
  # What any page can send without a CORS preflight: text/plain, a form; its Origin is foreign.
  evil = {'Origin': 'http://evil.example'}
  assert server.translate(evil, content_type='text/plain;charset=UTF-8')[0] == 403
  for declared in (
    'text/plain;charset=UTF-8',
    'application/x-www-form-urlencoded',  # curl -d's default.
    'multipart/form-data; boundary=x',
    'application/jsonx',
    'application/json-seq',
  ):
    status, _, answer = server.translate(content_type=declared)
    assert (status, answer) == (
      415,
      {'error': f"Content-Type '{declared}' is not application/json (curl: --json)"},
    )
  for declared in ('application/json', 'application/json; charset=utf-8', 'Application/JSON'):
    assert server.translate(content_type=declared)[0] == 200
  # No declared type is refused too: only application/json bodies are read.
  assert server.translate(content_type=None)[:3:2] == (
    415,
    {'error': 'a POST must declare Content-Type: application/json (curl: --json)'},
  )


def test_the_token_is_needed_everywhere_but_the_page_and_the_health_check(server):
  error = (
    'missing or wrong bearer token: send "Authorization: Bearer <token>" (the page: open it as '
    '/#token=<token>)'
  )
  for authorization in (None, f'Bearer {TOKEN}x', f'Bearer {TOKEN[:-1]}', 'Bearer', TOKEN):
    headers = {'Authorization': authorization} if authorization else {}
    for method, path in [('POST', '/v1/translate'), ('POST', '/v1/attention'), ('GET', '/metrics')]:
      body = {'text': ['one']} if method == 'POST' else None
      status, response_headers, answer = server.request(method, path, body, headers, token=None)
      assert (status, answer) == (401, {'error': error}), (authorization, path)
      assert response_headers['www-authenticate'] == 'Bearer'
  assert server.request('GET', '/nope', token=None)[0] == 401  # Nothing is revealed, even 404s.
  assert server.translate({'Authorization': f'bearer {TOKEN}'})[0] == 200
  assert server.request('GET', '/healthz', token=None)[::2] == (
    200,
    {'status': 'ok', 'engine': 'jax'},
  )
  assert server.request('GET', '/', token=None)[0] == 200
  assert server.responses()['401'] >= 16


def _recv_until_closed(sock, timeout=15) -> tuple[bytes, float]:
  """Everything the server sends until it closes the connection, and when it closed it."""
  sock.settimeout(timeout)
  data = b''
  try:
    while chunk := sock.recv(65536):
      data += chunk
  except ConnectionResetError:
    pass
  return data, time.monotonic()


def test_stalled_clients_are_dropped_while_others_are_served(server):
  began = time.monotonic()
  stalled = []
  for _ in range(50):  # Half a request line, then nothing.
    sock = socket.create_connection(('127.0.0.1', server.port))
    sock.sendall(b'POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty')
    stalled.append(sock)
  stalled += [socket.create_connection(('127.0.0.1', server.port)) for _ in range(5)]  # Silent.
  # Answered meanwhile, and then half of a second request on the same (kept-alive) connection.
  kept = http.client.HTTPConnection('127.0.0.1', server.port, timeout=60)
  kept.request('GET', '/healthz')
  assert kept.getresponse().read() == b'{"status":"ok","engine":"jax"}'
  answered = time.monotonic()
  kept.sock.sendall(b'GET /heal')
  assert server.translate()[0] == 200
  closed = []
  for sock in stalled + [kept.sock]:
    data, when = _recv_until_closed(sock)
    assert data == b''  # Closed without an answer.
    closed.append(when)
    sock.close()
  # The deadline counts from a connection's opening (or from its last answer), 0.5 s; uvloop's
  # timers have millisecond resolution, hence the 10 ms.
  assert min(closed[:-1]) - began >= DEADLINE_S - 0.01
  assert closed[-1] - answered >= DEADLINE_S - 0.01
  assert max(closed) - began < 10
  assert server.request('GET', '/healthz')[0] == 200


def test_a_body_that_stalls_gets_408_and_its_connection_is_closed(server):
  sock = socket.create_connection(('127.0.0.1', server.port))
  sent = time.monotonic()
  sock.sendall(
    f'POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n'
    f'Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n'
    'Content-Length: 40\r\n\r\n{"text": ["one'.encode()
  )
  data, closed = _recv_until_closed(sock)
  sock.close()
  head, _, body = data.partition(b'\r\n\r\n')
  assert head.split(b'\r\n')[0] == b'HTTP/1.1 408 Request Timeout'
  assert b'connection: close' in head.lower()
  assert json.loads(body) == {'error': 'the body was not received within 0.5 s'}
  assert DEADLINE_S - 0.01 <= closed - sent < 10
  assert server.responses()['408'] == 1


NESTED_TEXT = '{"text": ' + '[' * 1500 + ']' * 1500 + '}'
NESTED_FIELD = '{"text": ["one"], "x": ' + '{"":' * 1001 + '0' + '}' * 1001 + '}'
INVALID_BODIES = [
  # (path, body, the error; '...' at the end: a prefix of it)
  ('/v1/translate', NESTED_TEXT, 'the body is nested too deeply'),
  ('/v1/translate', NESTED_FIELD, 'the body is nested too deeply'),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": 1e400}',
    'the body has a number out of range: 1e400',
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": -1e400}',
    'the body has a number out of range: -1e400',
  ),
  ('/v1/translate', '{"text": ["one", 1e999]}', 'the body has a number out of range: 1e999'),
  (
    '/v1/translate',
    '{"text": ["one"], "beam_size": 1' + '0' * 400 + '}',
    'the body has a number out of range: 1' + '0' * 39 + '...',
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": 1' + '0' * 30 + '}',
    'the body has a number out of range: 1' + '0' * 30,
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": Infinity}',
    'the body is not JSON: Infinity is not JSON',
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": -Infinity}',
    'the body is not JSON: -Infinity is not JSON',
  ),
  ('/v1/translate', '{"text": ["one"], "alpha": NaN}', 'the body is not JSON: NaN is not JSON'),
  ('/v1/translate', '', 'the body is not JSON: Expecting value: line 1 column 1 (char 0)'),
  ('/v1/translate', '{"text": ["one"]', "the body is not JSON: Expecting ',' delimiter..."),
  ('/v1/translate', '\ufeff{"text": ["one"]}', 'the body is not JSON: Unexpected UTF-8 BOM...'),
  ('/v1/translate', 'null', 'the body must be a JSON object, got null'),
  ('/v1/translate', '3', 'the body must be a JSON object, got number 3'),
  ('/v1/translate', '"text"', 'the body must be a JSON object, got string "text"'),
  ('/v1/translate', 'true', 'the body must be a JSON object, got boolean true'),
  ('/v1/translate', '[]', 'the body must be a JSON object, got array []'),
  ('/v1/translate', '{"text": {"a": 1}}', '"text" must be a list of strings, got object {"a": 1}'),
  ('/v1/translate', '{"text": [null]}', '"text"[0] must be a string, got null'),
  ('/v1/translate', '{"text": [["one"]]}', '"text"[0] must be a string, got array ["one"]'),
  (
    '/v1/translate',
    '{"text": ["one"], "beam_size": 1.0}',
    '"beam_size" must be a positive integer, got number 1.0',
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": "0"}',
    '"alpha" must be a number >= 0, got string "0"',
  ),
  (
    '/v1/translate',
    '{"text": ["one"], "alpha": {}}',
    '"alpha" must be a number >= 0, got object {}',
  ),
  ('/v1/attention', '{"text": 1e400}', 'the body has a number out of range: 1e400'),
  (
    '/v1/attention',
    '{"text": "one", "alpha": 1e400}',
    'the body has a number out of range: 1e400',
  ),
  ('/v1/attention', NESTED_TEXT, 'the body is nested too deeply'),
  ('/v1/attention', '{"text": [1]}', '"text" must be a non-blank string, got array [1]'),
]


@pytest.mark.parametrize(
  'path,body,error', INVALID_BODIES, ids=[f'{p[4:]}:{b[:30]}' for p, b, _ in INVALID_BODIES]
)
def test_an_invalid_body_is_a_400_never_a_500(server, path, body, error):
  status, headers, answer = server.request('POST', path, body.encode())
  assert status == 400, answer
  assert headers['content-type'] == JSON
  if error.endswith('...'):
    assert answer['error'].startswith(error[:-3]), answer
  else:
    assert answer == {'error': error}
  assert '500' not in server.responses()


def test_the_page_sends_the_token_it_reads_from_its_address(server):
  chromium = shutil.which('chromium') or '/usr/bin/chromium'
  if not os.path.exists(chromium):
    pytest.skip('no chromium (apt-get install chromium) to load the page in')
  status, _, maps = server.request('POST', '/v1/attention', {'text': 'one'})
  assert status == 200

  def dom(address):
    with tempfile.TemporaryDirectory() as profile:
      return subprocess.run(
        [chromium, '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic',
         '--no-first-run', '--disable-background-networking', '--disable-component-update',
         '--disable-sync', f'--user-data-dir={profile}', '--virtual-time-budget=30000',
         '--dump-dom', address],
        capture_output=True, text=True, timeout=120, check=True,
      ).stdout  # fmt: skip

  page = f'http://127.0.0.1:{server.port}/?q={urllib.parse.quote("one")}'
  with_token = dom(f'{page}#token={TOKEN}')
  assert '<body data-state="done">' in with_token
  assert '<p id="error"></p>' in with_token
  assert f'<p id="translation">{html.escape(maps["translation"])}</p>' in with_token
  assert with_token.count('<td ') == len(maps['source_tokens']) * len(maps['target_tokens'])
  without = dom(page)
  assert '<body data-state="done">' in without
  assert 'missing or wrong bearer token' in without and '<td ' not in without


def test_the_server_with_a_token_on_loopback_gives_no_warning(server):
  assert 'warning:' not in server.output()
  assert 'Traceback' not in server.output()


def test_serving_beyond_loopback_without_a_token_warns_at_start_up(tmp_path):
  # Before the model loads (here: there is none, exit 2): time to stop it before it serves.
  env = {k: v for k, v in os.environ.items() if k != guards.TOKEN_VARIABLE}
  result = subprocess.run(
    [sys.executable, '-m', 'transformer_jax.serve', f'--workdir={tmp_path}', '--host=0.0.0.0']
    + ['--port=0'],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  lines = result.stderr.strip().splitlines()
  assert (result.returncode, lines[0], lines[-1]) == (
    2,
    'warning: serving beyond loopback without authentication: anyone who can reach this port '
    'can use it; set --auth_token_file',
    f'error: {tmp_path}/config.json not found: is {tmp_path} a training workdir?',
  )
  for address, token, warns in [
    ('127.0.0.1', None, False),
    ('127.0.0.2', None, False),
    ('::1', None, False),
    ('0.0.0.0', None, True),
    ('::', None, True),
    ('192.168.1.5', None, True),
    ('fe80::1%eth0', None, True),
    ('0.0.0.0', TOKEN, False),
  ]:
    assert (guards.exposure_warning(address, token) is not None) == warns, address


def test_the_token_comes_from_its_file_else_from_the_environment(tmp_path):
  path = tmp_path / 'token'
  path.write_text(f'  {TOKEN}\n')
  variable = guards.TOKEN_VARIABLE
  assert guards.load_token(str(path), {variable: 'other'}) == TOKEN
  assert guards.load_token(None, {variable: f'{TOKEN}\n'}) == TOKEN
  assert guards.load_token(None, {}) is None
  with pytest.raises(UserInputError, match=f'^{variable} is empty: the token is its one line$'):
    guards.load_token(None, {variable: ' '})


def test_the_new_flags_are_checked_before_the_model_is_restored(tmp_path):
  # tmp_path holds no workdir: an error about it would mean the options were checked too late.
  empty, spaced = tmp_path / 'empty', tmp_path / 'spaced'
  empty.write_text('\n')
  spaced.write_text('two words\n')
  for options, error in [
    ({'header_timeout_s': 0}, '--header_timeout_s must be a positive number, got 0'),
    ({'body_timeout_s': -1.0}, '--body_timeout_s must be a positive number, got -1.0'),
    (
      {'allowed_hosts': 'ok.example, http://x.example'},
      '--allowed_hosts takes host names without scheme or port (example.org, 10.0.0.5, '
      "[fd00::5], or *), got 'http://x.example'",
    ),
    (
      {'allowed_hosts': 'x.example:8080'},
      '--allowed_hosts takes host names without scheme or port (example.org, 10.0.0.5, '
      "[fd00::5], or *), got 'x.example:8080'",
    ),
    (
      {'allowed_origins': 'app.example'},
      "--allowed_origins takes origins like http://example.org:8080, got 'app.example'",
    ),
    (
      {'auth_token_file': str(tmp_path / 'missing')},
      f'--auth_token_file={tmp_path / "missing"}: cannot read it: No such file or directory',
    ),
    (
      {'auth_token_file': str(empty)},
      f'--auth_token_file={empty} is empty: the token is its one line',
    ),
    (
      {'auth_token_file': str(spaced)},
      f'--auth_token_file={spaced} must hold one token of printable ASCII without spaces '
      '(openssl rand -hex 32)',
    ),
  ]:
    with pytest.raises(UserInputError) as raised:
      app.serve(str(tmp_path), options=app.ServerOptions(port=0, **options))
    assert str(raised.value) == error
  assert guards.allowed_hosts('::', '*') is None  # Any Host: documented as unsafe.
  assert guards.allowed_hosts('::', 'A.example,[fd00::5]') == {
    '127.0.0.1',
    'localhost',
    '[::1]',
    '[::]',
    'a.example',
    '[fd00::5]',
  }


def test_the_guard_passes_only_http_scopes_to_the_application():
  # Issue 51 item 6b: uvicorn runs with ws='none' and lifespan='off', but the Guard let any
  # non-HTTP scope through unchecked. Called directly, no server: only 'http' reaches the app.
  import asyncio

  reached, refusals = [], []

  async def application(scope, receive, send):
    reached.append(scope['type'])

  guard = guards.Guard(application, guards.Policy(token=TOKEN), on_refusal=refusals.append)

  def call(scope, incoming=()):
    queue, sent = list(incoming), []

    async def receive():
      return queue.pop(0)

    async def send(message):
      sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent

  # A WebSocket handshake is refused: a close before the accept (the server answers 403).
  headers = [(b'host', b'127.0.0.1')]
  websocket = {'type': 'websocket', 'path': '/v1/translate', 'headers': headers}
  assert call(websocket, [{'type': 'websocket.connect'}]) == [
    {'type': 'websocket.close', 'code': 1008}
  ]
  # Lifespan, and any type of a later ASGI version, raise: the spec's way to decline lifespan
  # (the server carries on without its events).
  for kind in ('lifespan', 'telepathy'):
    with pytest.raises(RuntimeError, match=rf"serves ASGI 'http' scopes only, not '{kind}'"):
      call({'type': kind}, [{'type': 'lifespan.startup'}])
  assert reached == [] and refusals == [403]
  # HTTP is checked and served as before.
  http = {'type': 'http', 'method': 'GET', 'path': '/healthz', 'headers': headers}
  assert call(http) == [] and reached == ['http']
