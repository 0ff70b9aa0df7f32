"""Load on the translation server: throughput and latency with 1, 8 and 64 concurrent clients.

    python bench/serve_load.py --workdir=runs/multi30k-700 \
        --json=bench/results/serve-load-2026-12-01.json

For each engine (`--engines`, default jax and ctranslate2), starts `python -m
transformer_jax.serve` on 127.0.0.1 (a free port) with the server's defaults, sends it the same
`--requests` requests (one Multi30k English test sentence each, `--source`, sampled with a fixed
seed) from 1, 8 and 64 closed-loop clients (each sends its next request when its answer came,
over one kept-alive connection) and reads /metrics before and after each round. Then the same
requests are translated one at a time: one client, sent to a second server started with
--max_batch_size=1 --max_wait_ms=0, which decodes each request alone as it comes (no batching,
no waiting), in a round before the others and in one after them; the faster of the two is the
baseline each round's speed-up is measured against (the machine's load drifts). Every server
answers one untimed round of `--warmup` requests from 64 clients first (it has compiled all its
shapes at start-up; this also fills CPU caches and CTranslate2's buffers).

Columns: sentences/s over the round's wall time, the clients' latency percentiles, the mean
batch the server decoded (/metrics: sentences / batches), non-200 answers or failed requests,
programs compiled during the round (/metrics `compilations`: XLA's, 0 by construction for
CTranslate2), and translations that differ from the one-at-a-time ones (batching must not
change them). The load average is the machine's, read before and after: the server and the
clients share its cores with whatever else runs.
"""

import collections
import concurrent.futures
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from transformer_jax.data.tokenizer import Tokenizer  # noqa: E402
from transformer_jax.workdir.layout import Workdir  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_string('workdir', None, 'trained workdir to serve')
flags.DEFINE_list('engines', ['jax', 'ctranslate2'], 'engines to measure')
flags.DEFINE_list('clients', ['1', '8', '64'], 'concurrent clients per round')
flags.DEFINE_integer('requests', 256, 'requests per round (one sentence each)')
flags.DEFINE_integer('warmup', 64, 'untimed requests before the rounds (from 64 clients)')
flags.DEFINE_string(
  'source',
  os.path.join(REPO_ROOT, '..', 'shared', 'data', 'multi30k', 'test.en'),
  'sentences to send, one per line',
)
flags.DEFINE_integer('beam_size', 4, 'beam size of every request (1: greedy)')
flags.DEFINE_float('alpha', 0.6, 'length penalty of every request')
flags.DEFINE_list(
  'server_flags', [], 'extra flags for every server, e.g. --max_batch_size=32,--intra_threads=1'
)
flags.DEFINE_string('quantization', None, 'ctranslate2 weight type (default: the server default)')
flags.DEFINE_integer('intra_threads', None, 'ctranslate2 threads (default: the server default)')
flags.DEFINE_string('json', None, 'write the results here')
flags.mark_flags_as_required(['workdir'])
FLAGS = flags.FLAGS


def _ctranslate2_flags() -> list[str]:
  flags_ = [f'--quantization={FLAGS.quantization}'] if FLAGS.quantization else []
  return flags_ + ([f'--intra_threads={FLAGS.intra_threads}'] if FLAGS.intra_threads else [])


class Server:
  """`python -m transformer_jax.serve` in a subprocess; its address read from its start-up line."""

  def __init__(self, engine: str, extra: list[str], log_dir: str):
    self.engine = engine
    self.log_path = os.path.join(log_dir, f'{engine}-{len(os.listdir(log_dir))}.log')
    self.log = open(self.log_path, 'w')
    command = [
      sys.executable,
      '-m',
      'transformer_jax.serve',
      f'--workdir={FLAGS.workdir}',
      f'--engine={engine}',
      '--port=0',
      f'--decoding={FLAGS.beam_size}:{FLAGS.alpha if FLAGS.beam_size > 1 else 0}',
      *(_ctranslate2_flags() if engine == 'ctranslate2' else []),
      *FLAGS.server_flags,
      *extra,
    ]
    self.command = ' '.join(command[1:])
    began = time.monotonic()
    self.process = subprocess.Popen(
      command, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
    )
    while not (found := re.search(r'serving on http://127\.0\.0\.1:(\d+) \((.*)\)', self.output())):
      if self.process.poll() is not None:
        raise SystemExit(f'the server exited:\n{self.output()[-3000:]}')
      time.sleep(0.5)
    self.port = int(found.group(1))
    self.ready_line = found.group(2)
    self.start_seconds = time.monotonic() - began

  def output(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def metrics(self) -> dict:
    connection = http.client.HTTPConnection('127.0.0.1', self.port, timeout=60)
    try:
      connection.request('GET', '/metrics')
      return json.loads(connection.getresponse().read())
    finally:
      connection.close()

  def stop(self) -> int:
    self.process.send_signal(signal.SIGTERM)
    code = self.process.wait(timeout=120)
    self.log.close()
    return code


def _quantile(values: list[float], q: float) -> float:
  values = sorted(values)
  return values[min(len(values) - 1, int(q * len(values)))]


def run_round(server: Server, sentences: list[str], clients: int) -> dict:
  """Every sentence once, from `clients` closed-loop clients; returns the round's figures."""
  work = iter(enumerate(sentences))
  lock = threading.Lock()
  translations: list[str | None] = [None] * len(sentences)
  latencies, errors = [], collections.Counter()

  def client():
    connection = http.client.HTTPConnection('127.0.0.1', server.port, timeout=120)
    while True:
      with lock:
        index, sentence = next(work, (None, None))
      if index is None:
        break
      body = {'text': [sentence], 'beam_size': FLAGS.beam_size, 'alpha': FLAGS.alpha}
      began = time.perf_counter()
      try:
        connection.request(
          'POST', '/v1/translate', json.dumps(body), {'Content-Type': 'application/json'}
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
        status = response.status
      except (OSError, http.client.HTTPException, ValueError) as error:
        status, answer = type(error).__name__, None
        connection.close()
        connection = http.client.HTTPConnection('127.0.0.1', server.port, timeout=120)
      with lock:
        latencies.append(time.perf_counter() - began)
        if status == 200:
          (translations[index],) = answer['translations']
        else:
          errors[str(status)] += 1
    connection.close()

  before = server.metrics()
  began = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for future in [pool.submit(client) for _ in range(clients)]:
      future.result()
  seconds = time.perf_counter() - began
  after = server.metrics()
  batches = after['batches'] - before['batches']
  return {
    'clients': clients,
    'requests': len(sentences),
    'seconds': round(seconds, 3),
    'sentences_per_second': round(len(sentences) / seconds, 2),
    'latency_p50_s': round(_quantile(latencies, 0.5), 4),
    'latency_p99_s': round(_quantile(latencies, 0.99), 4),
    'errors': sum(errors.values()),
    'error_kinds': dict(errors),
    'batches': batches,
    'mean_batch': round((after['sentences'] - before['sentences']) / max(batches, 1), 2),
    'batch_sizes': _difference(after['batch_sizes'], before['batch_sizes']),
    'decode_seconds': round(after['decode_seconds'] - before['decode_seconds'], 3),
    'compilations': after['compilations'] - before['compilations'],
    'compilations_since_ready': after['compilations_since_ready'],
    '_translations': translations,
  }


def _difference(after: dict, before: dict) -> dict:
  sizes = {size: n - before.get(size, 0) for size, n in after.items()}
  return {size: n for size, n in sorted(sizes.items(), key=lambda kv: int(kv[0])) if n}


def measure(engine: str, sentences: list[str], log_dir: str) -> dict:
  """The one-at-a-time rounds come first and last (both servers stay up, one is sent to at a
  time): the machine's load drifts, and the faster of the two is the baseline."""
  warm = [sentences[i % len(sentences)] for i in range(FLAGS.warmup)]
  servers = {
    'one at a time': Server(engine, ['--max_batch_size=1', '--max_wait_ms=0'], log_dir),
    'batched': Server(engine, [], log_dir),
  }
  for server in servers.values():
    print(
      f'{engine}: {server.command}\n  ready in {server.start_seconds:.1f} s: {server.ready_line}'
    )
    if warm:
      run_round(server, warm, 64)
  plan = [('one at a time', 1)] + [('batched', int(c)) for c in FLAGS.clients]
  rows = []
  for kind, clients in plan + [('one at a time', 1)]:
    row = run_round(servers[kind], sentences, clients)
    row.update(kind=kind, server=servers[kind].command, ready=servers[kind].ready_line)
    rows.append(row)
    print(
      f'  {kind}, {clients} clients: {row["sentences_per_second"]} sentences/s, '
      f'mean batch {row["mean_batch"]}, errors {row["errors"]}, '
      f'compilations {row["compilations"]}'
    )
  exit_codes = {kind: server.stop() for kind, server in servers.items()}
  print(f'  SIGTERM: exit codes {exit_codes}')
  baseline = max(rows[0], rows[-1], key=lambda row: row['sentences_per_second'])
  for row in rows:
    row['server_exit_code'] = exit_codes[row['kind']]
    row['speedup'] = round(row['sentences_per_second'] / baseline['sentences_per_second'], 2)
    row['differing_translations'] = sum(
      a != b for a, b in zip(row['_translations'], rows[0]['_translations'])
    )
  tokenizer = Tokenizer.load(Workdir(FLAGS.workdir).vocab_file)
  outputs = [len(tokenizer.encode(t)) + 1 for t in rows[0]['_translations'] if t is not None]
  return {
    'engine': engine,
    'mean_output_tokens': round(sum(outputs) / max(len(outputs), 1), 2),
    'max_output_tokens': max(outputs, default=0),
    'rows': rows,
  }


def table(results: list[dict]) -> str:
  lines = [
    '| engine | clients | sentences/s | vs one at a time | p50 latency | p99 latency | mean batch'
    ' | errors | compilations | differing |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for result in results:
    for row in result['rows']:
      clients = row['kind'] if row['kind'] == 'one at a time' else row['clients']
      lines.append(
        f'| {result["engine"]} | {clients} | {row["sentences_per_second"]:.1f} | '
        f'{row["speedup"]:.2f}x | {row["latency_p50_s"] * 1000:.0f} ms | '
        f'{row["latency_p99_s"] * 1000:.0f} ms | {row["mean_batch"]:.1f} | {row["errors"]} | '
        f'{row["compilations"]} | {row["differing_translations"]} |'
      )
  return '\n'.join(lines)


def main(argv):
  del argv
  with open(FLAGS.source, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  sentences = random.Random(0).sample(lines, min(FLAGS.requests, len(lines)))
  load_before = os.getloadavg()
  results = []
  with tempfile.TemporaryDirectory() as log_dir:
    for engine in FLAGS.engines:
      results.append(measure(engine, sentences, log_dir))
  load_after = os.getloadavg()
  print(table(results))
  print(
    f'load average before {", ".join(f"{x:.2f}" for x in load_before)}; '
    f'after {", ".join(f"{x:.2f}" for x in load_after)} ({os.cpu_count()} CPUs)'
  )
  if FLAGS.json:
    for result in results:
      for row in result['rows']:
        row.pop('_translations')
    tokenizer = Tokenizer.load(Workdir(FLAGS.workdir).vocab_file)
    source_tokens = [len(tokenizer.encode(s)) + 1 for s in sentences]
    report = {
      'workdir': FLAGS.workdir,
      'source': FLAGS.source,
      'requests': len(sentences),
      'mean_source_tokens': round(sum(source_tokens) / len(sentences), 2),
      'beam_size': FLAGS.beam_size,
      'alpha': FLAGS.alpha,
      'load_average_before': load_before,
      'load_average_after': load_after,
      'cpus': os.cpu_count(),
      'date': time.strftime('%Y-%m-%d %H:%M'),
      'results': results,
    }
    with open(FLAGS.json, 'w') as f:
      json.dump(report, f, indent=2)


if __name__ == '__main__':
  app.run(main)
