"""A `python -m transformer_jax.serve` subprocess on a free port of 127.0.0.1, and its requests
over real sockets (tests/serve_test.py, serve_safety_test.py, serve_options_test.py)."""

import http.client
import json
import os
import re
import subprocess
import sys
import time

from transformer_jax.serving import guards

JSON = 'application/json'


class Server:
  """The server, started with `flags`, up once it prints its address (or an AssertionError
  with its output). The environment's bearer token is never passed on: `token` is sent instead
  (None: no Authorization header)."""

  def __init__(self, workdir, log_path, *flags, env=None, token=None):
    self.log_path = log_path
    self.token = token
    self.log = open(log_path, 'w')
    env = {k: v for k, v in (env or os.environ).items() if k != guards.TOKEN_VARIABLE}
    self.process = subprocess.Popen(
      [sys.executable, '-m', 'transformer_jax.serve', f'--workdir={workdir}', '--port=0', *flags],
      stdout=self.log,
      stderr=subprocess.STDOUT,
      env=env,
    )
    deadline = time.monotonic() + 300
    try:
      while not (found := re.search(r'serving on http://127\.0\.0\.1:(\d+)', self.output())):
        assert self.process.poll() is None, f'the server exited:\n{self.output()[-3000:]}'
        assert time.monotonic() < deadline, f'no server:\n{self.output()[-3000:]}'
        time.sleep(0.2)
    except AssertionError:
      self.stop()
      raise
    self.port = int(found.group(1))

  def output(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def request(self, method, path, body=None, headers=None, *, token=..., content_type=JSON):
    """-> (status, headers, parsed JSON or text). `body`: bytes as they are, else JSON; a
    Content-Type of None sends none; `headers` may set Host (http.client's is 127.0.0.1:port);
    `token`: the bearer token to send instead of the server's (None: none)."""
    headers = dict(headers or {})
    token = self.token if token is ... else token
    if token:
      headers.setdefault('Authorization', f'Bearer {token}')
    if body is not None:
      body = body if isinstance(body, bytes) else json.dumps(body).encode()
      if content_type:  # As a client must (serving/guards.py).
        headers.setdefault('Content-Type', content_type)
    connection = http.client.HTTPConnection('127.0.0.1', self.port, timeout=120)
    try:
      connection.request(method, path, body=body, headers=headers)
      response = connection.getresponse()
      data = response.read().decode()
      is_json = response.headers.get('content-type', '').startswith(JSON)
      return response.status, response.headers, json.loads(data) if is_json else data
    finally:
      connection.close()

  def post(self, body, path='/v1/translate'):
    return self.request('POST', path, body)

  def metrics(self):
    status, _, metrics = self.request('GET', '/metrics')
    assert status == 200
    return metrics

  def wait_for_queue(self, depth, timeout=10):
    deadline = time.monotonic() + timeout
    while self.metrics()['queue_depth'] != depth:
      assert time.monotonic() < deadline, f'the queue never held {depth} request(s)'
      time.sleep(0.01)

  def stop(self):
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    self.log.close()
