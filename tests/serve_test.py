"""The translation server (`python -m transformer_jax.serve`), end to end: real servers in
subprocesses on 127.0.0.1, a workdir trained for 200 steps of a tiny model, answers compared
with `Translator.translate` run in a process of its own.

Three servers: `server` (batches of up to 4, beam 4 and alpha 0.6), `slow_server`, whose
requests wait 6 s for companions but time out after 2 s, with room for one waiting request: its
requests are still queued when the tests look (504, 503, SIGTERM while in flight), and
`ct2_server`, `server` on --engine=ctranslate2 with float32 weights (greedy served too). The
processes share a JAX persistent compilation cache, so programs compiled once load later.
"""

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import jax
import numpy as np
import pytest
from helpers.server_process import Server

from transformer_jax.common.errors import UserInputError
from transformer_jax.data import number_words
from transformer_jax.inference.translator import Translator
from transformer_jax.serving import app, ctranslate2_engine
from transformer_jax.serving.batcher import Batcher, Closed, Engine, Metrics, QueueFull
from transformer_jax.serving.decoding_modes import BeamEntry, parse_decoding
from transformer_jax.serving.jax_engine import batch_buckets
from transformer_jax.training import loop
from transformer_jax.workdir.layout import Workdir

from conftest import tiny_config

SENTENCES = [number_words.english_words(n) for n in (1, 701, 3412, 99, 200555, 999999)]
# A blank line (translated to '' without decoding) and one truncated to the model's 16 tokens.
SENTENCES += ['', ' '.join([number_words.english_words(888000)] * 6)]
GREEDY, BEAM = (1, 0.0), (4, 0.6)
SERVER_FLAGS = [
  '--max_batch_size=4',
  '--max_wait_ms=100',
  '--max_sentences=8',
  '--max_chars=300',
  '--decoding=4:0.6',
]
REFERENCE = """
import json, sys
from transformer_jax.inference import Translator
workdir, sentences, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
translator = Translator.from_checkpoint(workdir, None, batch_size=4)
maps = translator.attention(sentences[1])
with open(out, 'w') as f:
  json.dump({
    'beam': translator.translate(sentences, beam_size=4, alpha=0.6),
    'greedy': translator.translate(sentences, beam_size=1),
    'attention': {'source_tokens': maps.source_tokens, 'target_tokens': maps.target_tokens,
                  'cross_attention': maps.cross.tolist()},
  }, f)
"""


@pytest.fixture(scope='module')
def workdir(data_dir, tmp_path_factory):
  config = tiny_config(data_dir)
  # 200 steps: an undertrained model's beam-4 outputs are degenerate ('zwzwzw...'), and there
  # CTranslate2's beam search and ours part ways on ~1 sentence in 5 (0 greedy); here on ~1 in 50
  # random number words, on none of SENTENCES (tests/export_test.py: a trained model).
  config.num_train_steps = config.checkpoint_every_steps = 200
  # Two length buckets (8 and 16 tokens) rather than three: fewer programs to compile.
  config.model.max_len = config.max_source_length = config.max_target_length = 16
  path = str(tmp_path_factory.mktemp('serve') / 'workdir')
  loop.train_and_evaluate(config, path)
  return path


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  return dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp('jax_cache')),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )


@pytest.fixture(scope='module')
def reference(workdir, env, tmp_path_factory):
  """Translator.translate's answers for SENTENCES, beam 4 and greedy (batch size 4: it fills
  the cache with the programs of the server's largest batch bucket), and Translator.attention
  for SENTENCES[1]."""
  out = tmp_path_factory.mktemp('reference') / 'reference.json'
  command = [sys.executable, '-c', REFERENCE, workdir, json.dumps(SENTENCES), str(out)]
  subprocess.run(command, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)
  with open(out) as f:
    answers = json.load(f)
  answers[BEAM] = answers.pop('beam')
  answers[GREEDY] = answers.pop('greedy')
  return answers


@pytest.fixture(scope='module')
def server(workdir, env, reference, tmp_path_factory):
  running = Server(workdir, tmp_path_factory.mktemp('server') / 'log', *SERVER_FLAGS, env=env)
  yield running
  running.stop()


@pytest.fixture(scope='module')
def slow_server(workdir, env, reference, tmp_path_factory):
  flags = ['--max_batch_size=2', '--max_wait_ms=6000', '--timeout_s=2', '--max_queue=1']
  running = Server(
    workdir, tmp_path_factory.mktemp('slow') / 'log', *flags, '--decoding=4:0.6', env=env
  )
  yield running
  running.stop()


@pytest.fixture(scope='module')
def ct2_server(workdir, env, reference, tmp_path_factory):
  folder = tmp_path_factory.mktemp('ct2')
  # A longer wait than SERVER_FLAGS': CTranslate2 decodes a batch in milliseconds, so on a
  # loaded machine 16 concurrent requests could otherwise arrive one per batch.
  flags = [*SERVER_FLAGS[:-1], '--decoding=4:0.6,1:0', '--max_wait_ms=1000']
  running = Server(
    workdir,
    folder / 'log',
    '--engine=ctranslate2',
    '--quantization=float32',
    f'--ctranslate2_dir={folder / "model"}',
    *flags,
    env=env,
  )
  yield running
  running.stop()


class _RecordingEngine(Engine):
  """Uppercases; records each batch it was given."""

  def __init__(self):
    self.calls = []

  def decode(self, sentences, key, target_prefix, draw_positions):
    self.calls.append((list(sentences), *key))
    return [sentence.upper() for sentence in sentences]


def test_the_batcher_groups_by_options_sorts_by_length_and_answers_each_request():
  engine = _RecordingEngine()
  batcher = Batcher(engine, Metrics(), max_batch_size=3, max_wait_s=60, max_queue=5)
  tickets = [
    batcher.submit(['cccc', 'a'], BEAM),
    batcher.submit(['bb'], GREEDY),
    batcher.submit(['ddddd', 'eee'], BEAM),
    batcher.submit(['ff'], BEAM),
  ]
  gone = batcher.submit(['x'], BEAM)
  gone.abandon()  # A timed-out request leaves the queue and is never decoded.
  large = ['y' * n for n in (7, 1, 6, 2, 5, 3, 4)]
  tickets.append(batcher.submit(large, BEAM))
  with pytest.raises(QueueFull, match=r'the queue is full \(max_queue=5\)'):
    batcher.submit(['z'], BEAM)
  assert batcher.depth() == (5, 0)
  batcher.start()  # 13 sentences queued >= 3: no waiting.
  answers = [ticket.future.result(10) for ticket in tickets]
  assert answers == [['CCCC', 'A'], ['BB'], ['DDDDD', 'EEE'], ['FF'], [s.upper() for s in large]]
  assert batcher.close(timeout=10)
  assert engine.calls == [
    # Requests are taken while they fit in a batch; one call per decoding option, shortest first.
    (['a', 'cccc'], 4, 0.6),
    (['bb'], 1, 0.0),
    (['ff', 'eee', 'ddddd'], 4, 0.6),
    # A request larger than a batch is taken alone and decoded a batch at a time.
    (['y', 'yy', 'yyy'], 4, 0.6),
    (['yyyy', 'yyyyy', 'yyyyyy'], 4, 0.6),
    (['yyyyyyy'], 4, 0.6),
  ]
  assert gone.future.cancelled()
  with pytest.raises(Closed):
    batcher.submit(['z'], BEAM)


class _GatedEngine(_RecordingEngine):
  """Records each batch; each call signals `entered` and waits for one `release`."""

  def __init__(self):
    super().__init__()
    self.entered, self.permits = threading.Semaphore(0), threading.Semaphore(0)

  def decode(self, sentences, key, target_prefix, draw_positions):
    self.entered.release()
    assert self.permits.acquire(timeout=30)
    return super().decode(sentences, key, target_prefix, draw_positions)


def test_the_batcher_waits_for_as_many_sentences_as_the_last_round_brought():
  engine = _GatedEngine()
  batcher = Batcher(engine, Metrics(), max_batch_size=4, max_wait_s=0.2, max_queue=8)
  batcher.start()

  def submit(*sentences):
    return [batcher.submit([sentence], BEAM) for sentence in sentences]

  def decode(tickets):  # Lets the batch being decoded finish; returns its answers.
    engine.permits.release()
    return [ticket.future.result(10) for ticket in tickets]

  # Before any round a full batch is expected: a lone request goes after max_wait.
  first = submit('a')
  assert engine.entered.acquire(timeout=10)
  batcher.max_wait_s = 60  # From here on, a wait would outlast the test (changed mid-decode).
  arrived = submit('b', 'c', 'd')
  assert decode(first) == [['A']]
  # That round brought 1 + 3 sentences: the 3 wait for a fourth.
  assert not engine.entered.acquire(timeout=0.2)
  arrived += submit('e')
  assert engine.entered.acquire(timeout=10)
  batcher.max_wait_s = 0.2
  assert decode(arrived) == [['B'], ['C'], ['D'], ['E']]
  # Four, none arriving meanwhile: four expected, so a lone request waits out max_wait...
  lone = submit('f')
  assert engine.entered.acquire(timeout=10)
  batcher.max_wait_s = 60
  assert decode(lone) == [['F']]
  # ... after which one is expected: the next goes at once, as a lone client's always do.
  lone = submit('g')
  assert engine.entered.acquire(timeout=10)
  arrived = submit('h', 'i')
  assert decode(lone) == [['G']]
  # 1 + 2: three expected, fewer than a batch.
  assert not engine.entered.acquire(timeout=0.2)
  arrived += submit('j')
  assert engine.entered.acquire(timeout=10)
  # Two queue while those are decoded, and wait longer than max_wait meanwhile...
  batcher.max_wait_s = 1
  late = submit('k', 'l')
  time.sleep(1.2)
  assert decode(arrived) == [['H'], ['I'], ['J']]
  # ... but the third, which only comes now, is waited for (up to max_wait from now).
  late += submit('m')
  assert engine.entered.acquire(timeout=10)
  assert decode(late) == [['K'], ['L'], ['M']]
  assert [call[0] for call in engine.calls] == [
    ['a'],
    ['b', 'c', 'd', 'e'],
    ['f'],
    ['g'],
    ['h', 'i', 'j'],
    ['k', 'l', 'm'],
  ]
  assert batcher.close(timeout=10)


def test_decoding_options_and_batch_buckets():
  assert parse_decoding('4:0.6, 1, 1:0.6, 2:0') == (
    BeamEntry(4, 0.6),
    BeamEntry(1, 0.0),
    BeamEntry(2, 0.0),
  )
  for bad in ('4', '0:0.6', '4:-1', '4:nan', 'x', ''):
    with pytest.raises(UserInputError, match='--decoding must be comma-separated entries'):
      parse_decoding(bad)
  assert [batch_buckets(n) for n in (1, 4, 6, 16)] == [
    [1],
    [1, 2, 4],
    [1, 2, 4, 6],
    [1, 2, 4, 8, 16],
  ]


def _translate(server, sentences, key):
  return server.post({'text': sentences, 'beam_size': key[0], 'alpha': key[1]})


def test_translations_equal_the_translators(server, reference):
  assert _translate(server, SENTENCES, BEAM)[::2] == (200, {'translations': reference[BEAM]})
  assert server.post({'text': []})[::2] == (200, {'translations': []})
  # Without options a request gets the first of --decoding: beam 4, alpha 0.6.
  assert server.post({'text': SENTENCES[:3]})[2] == {'translations': reference[BEAM][:3]}


def _requests(count):
  """Requests of 1 to 3 of SENTENCES (mixed lengths): (indices, decoding options)."""
  return [([(i + 3 * j) % len(SENTENCES) for j in range(1 + i % 3)], BEAM) for i in range(count)]


def _mixed_requests(count):
  """`_requests`, every other one greedy."""
  return [(indices, GREEDY if i % 2 else BEAM) for i, (indices, _) in enumerate(_requests(count))]


def _answer_concurrently(server, reference, requests):
  barrier = threading.Barrier(len(requests))

  def send(request):
    indices, key = request
    barrier.wait()
    return _translate(server, [SENTENCES[i] for i in indices], key)

  with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
    answers = list(pool.map(send, requests))
  for (indices, key), (status, _, body) in zip(requests, answers):
    assert (status, body) == (200, {'translations': [reference[key][i] for i in indices]})


def test_concurrent_requests_are_batched_and_answered_separately(server, reference):
  before = server.metrics()
  _answer_concurrently(server, reference, _requests(16))
  after = server.metrics()
  assert after['requests'] - before['requests'] == 16
  # Alone, each request would be one batch (1 to 3 sentences of one decoding option).
  batches = after['batches'] - before['batches']
  assert 0 < batches < 16, (before, after)


def test_no_compilation_after_warm_up(server, reference):
  metrics = server.metrics()
  # 3 batch buckets x 2 length buckets, and the attention maps, at least.
  assert metrics['compilations'] >= 7
  assert metrics['batch_buckets'] == [1, 2, 4]
  before = metrics['compilations']
  _answer_concurrently(server, reference, _requests(24))  # Batches of every size.
  for size in range(1, len(SENTENCES) + 1):  # One request at a time: 1 to 8 sentences.
    answer = _translate(server, SENTENCES[-size:], BEAM)
    assert answer[2] == {'translations': reference[BEAM][-size:]}
  for text in (SENTENCES[0], SENTENCES[-1]):
    assert server.post({'text': text}, '/v1/attention')[0] == 200
  after = server.metrics()
  assert set(after['batch_sizes']) == {'1', '2', '3', '4'}
  assert after['compilations'] == before
  assert after['compilations_since_ready'] == 0


BAD_REQUESTS = [
  (b'not json', 400, 'the body is not JSON: Expecting value: line 1 column 1 (char 0)'),
  (b'{"text": ["\xff"]}', 400, 'the body is not valid UTF-8 (byte 11)'),
  (b'{"text": ["one"], "alpha": NaN}', 400, 'the body is not JSON: NaN is not JSON'),
  ([1, 2], 400, 'the body must be a JSON object, got array [1, 2]'),
  ({}, 400, 'missing field "text"'),
  (
    {'text': ['one'], 'beam': 4},
    400,
    'unknown field(s) beam: expected text, beam_size, alpha, num_hypotheses, sampling, '
    'sampling_temperature, sampling_topk, sampling_topp, seed, mbr, target_prefix, scores',
  ),
  ({'text': 'one'}, 400, '"text" must be a list of strings, got string "one"'),
  ({'text': ['one', 3]}, 400, '"text"[1] must be a string, got number 3'),
  (b'{"text": ["\\ud800"]}', 400, '"text"[0] is not valid Unicode (a lone surrogate)'),
  (
    {'text': ['one'], 'beam_size': '4'},
    400,
    '"beam_size" must be a positive integer, got string "4"',
  ),
  (
    {'text': ['one'], 'beam_size': True},
    400,
    '"beam_size" must be a positive integer, got boolean true',
  ),
  ({'text': ['one'], 'beam_size': 0}, 400, '"beam_size" must be a positive integer, got number 0'),
  ({'text': ['one'], 'alpha': -1}, 400, '"alpha" must be a number >= 0, got number -1'),
  ({'text': ['one'], 'alpha': None}, 400, '"alpha" must be a number >= 0, got null'),
  (
    {'text': ['one'], 'beam_size': 5},
    400,
    'beam_size=5 alpha=0.6 is not served here; served: beam_size=4 alpha=0.6',
  ),
  ({'text': ['one'] * 9}, 413, '"text" has 9 sentences; at most 8 per request'),
  ({'text': ['one', 'x' * 301]}, 413, '"text"[1] has 301 characters; at most 300'),
  (b' ' * 50000, 413, 'the body has 50000 bytes; at most 29888'),
]


@pytest.mark.parametrize('body,status,error', BAD_REQUESTS, ids=[e[:40] for *_, e in BAD_REQUESTS])
def test_bad_requests_get_json_errors(server, body, status, error):
  before = server.metrics()['responses'].get(str(status), 0)
  answer = server.post(body)
  assert (answer[0], answer[2]) == (status, {'error': error})
  assert server.metrics()['responses'][str(status)] == before + 1


def test_other_errors_are_json_too(server):
  assert server.request('GET', '/nope')[::2] == (404, {'error': 'Not Found'})
  assert server.request('GET', '/v1/translate')[::2] == (405, {'error': 'Method Not Allowed'})
  assert server.post({'text': ['one']}, '/v1/attention')[::2] == (
    400,
    {'error': '"text" must be a non-blank string, got array ["one"]'},
  )


def test_health_and_page(server):
  assert server.request('GET', '/healthz')[::2] == (200, {'status': 'ok', 'engine': 'jax'})
  status, headers, page = server.request('GET', '/')
  assert status == 200 and headers['content-type'].startswith('text/html')
  assert "connect-src 'self'" in headers['content-security-policy']
  assert '<form id="form">' in page and "fetch('/v1/attention'" in page
  assert not re.search(r'(https?:)?//[a-z]', page)  # Nothing loaded from elsewhere.


def test_attention_equals_the_translators(server, reference):
  status, _, maps = server.post({'text': SENTENCES[1]}, '/v1/attention')
  assert status == 200
  expected = reference['attention']
  assert maps['translation'] == reference[BEAM][1]
  assert maps['source_tokens'] == expected['source_tokens']
  assert maps['target_tokens'] == expected['target_tokens']
  cross = np.asarray(maps['cross_attention'])
  np.testing.assert_allclose(cross, expected['cross_attention'], atol=1e-5)
  np.testing.assert_allclose(cross.sum(-1), 1, atol=1e-4)  # Rows are distributions.


def test_the_page_shows_the_translation_in_a_headless_browser(server, reference):
  chromium = shutil.which('chromium') or '/usr/bin/chromium'
  if not os.path.exists(chromium):
    pytest.skip('no chromium (apt-get install chromium) to load the page in')
  query = urllib.parse.quote(SENTENCES[1])
  with tempfile.TemporaryDirectory() as profile:
    # The page translates ?q= as it loads; the DOM is dumped once its fetch has answered.
    dom = subprocess.run(
      [chromium, '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic',
       '--no-first-run', '--disable-background-networking', '--disable-component-update',
       '--disable-sync', f'--user-data-dir={profile}', '--virtual-time-budget=30000',
       '--dump-dom', f'http://127.0.0.1:{server.port}/?q={query}'],
      capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
  assert '<body data-state="done">' in dom
  assert f'<p id="translation">{reference[BEAM][1]}</p>' in dom
  assert '<p id="error"></p>' in dom
  assert dom.count('<td ') == len(reference['attention']['cross_attention'][0][0][0]) * len(
    reference['attention']['target_tokens']
  )


def test_a_request_past_its_timeout_gets_504(slow_server, reference):
  began = time.monotonic()
  answer = _translate(slow_server, SENTENCES[:1], BEAM)
  assert (answer[0], answer[2]) == (504, {'error': 'not translated within 2 s'})
  assert 2 <= time.monotonic() - began < 6  # It waited for companions (6 s): never decoded.
  assert slow_server.metrics()['queue_depth'] == 0  # It gave its place back.


def test_a_full_queue_gets_503_with_retry_after(slow_server):
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(_translate, slow_server, SENTENCES[:1], BEAM)
    slow_server.wait_for_queue(1)
    status, headers, body = _translate(slow_server, SENTENCES[1:2], BEAM)
    assert (status, headers['retry-after']) == (503, '1')
    assert body == {'error': 'the queue is full (max_queue=1); retry later'}
    assert waiting.result()[0] == 504
  assert slow_server.metrics()['responses']['503'] == 1


def test_sigterm_answers_the_request_in_flight_then_exits_0(slow_server, reference):
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    in_flight = pool.submit(lambda: (_translate(slow_server, SENTENCES[1:2], BEAM), time.time()))
    slow_server.wait_for_queue(1)  # Queued, and would wait 6 s for companions.
    signalled = time.time()
    slow_server.process.send_signal(signal.SIGTERM)
    (status, _, body), answered = in_flight.result()
  # Decoded at once (nobody else can come) rather than after 6 s, hence before the 2 s timeout.
  assert (status, body) == (200, {'translations': reference[BEAM][1:2]})
  assert answered > signalled
  assert slow_server.process.wait(timeout=60) == 0
  assert 'signal 15: draining in-flight requests' in slow_server.output()
  assert slow_server.output().rstrip().endswith('stopped')


# --- --engine=ctranslate2 ------------------------------------------------------------------------


def test_ctranslate2_translations_equal_the_jax_engines(ct2_server, reference):
  assert re.search(r'float32 CTranslate2 model exported to \S+/model, loaded', ct2_server.output())
  for key in (BEAM, GREEDY):
    assert _translate(ct2_server, SENTENCES, key)[::2] == (200, {'translations': reference[key]})
    for size in range(1, len(SENTENCES) + 1):  # One request at a time: 1 to 8 sentences.
      answer = _translate(ct2_server, SENTENCES[-size:], key)
      assert answer[2] == {'translations': reference[key][-size:]}
  before = ct2_server.metrics()
  _answer_concurrently(ct2_server, reference, _mixed_requests(16))
  after = ct2_server.metrics()
  assert after['requests'] - before['requests'] == 16
  assert 0 < after['batches'] - before['batches'] < 16, (before, after)


def test_ctranslate2_metrics_health_and_no_attention(ct2_server):
  status, _, body = ct2_server.post({'text': SENTENCES[1]}, '/v1/attention')
  assert (status, body) == (501, {'error': 'the ctranslate2 engine has no attention maps'})
  assert ct2_server.request('GET', '/healthz')[::2] == (
    200,
    {'status': 'ok', 'engine': 'ctranslate2'},
  )
  metrics = ct2_server.metrics()
  assert (metrics['engine'], metrics['compilations'], metrics['compilations_since_ready']) == (
    'ctranslate2',
    0,
    0,
  )
  assert metrics['batch_buckets'] is None
  assert metrics['decoding'] == [{'beam_size': 4, 'alpha': 0.6}, {'beam_size': 1, 'alpha': 0.0}]


def test_the_ctranslate2_export_is_reused_only_for_the_same_checkpoint(workdir, tmp_path):
  default = os.fspath(Workdir(workdir).ctranslate2_export)
  folder, restored, reused = ctranslate2_engine.prepare(workdir, None, 'int8')
  assert (folder, reused) == (default, False)
  assert {'model.bin', 'sentencepiece.model', ctranslate2_engine.SOURCE_FILE} <= set(
    os.listdir(folder)
  )
  record = ctranslate2_engine.read_source(folder)
  assert (record['quantization'], record['checkpoint']) == (
    'int8',
    'default (averaged if current, else latest)',
  )
  assert ctranslate2_engine.prepare(workdir, 'latest', 'int8', default)[::2] == (default, True)
  # Another weight type, or other parameters (another checkpoint), is another export.
  assert ctranslate2_engine.prepare(workdir, None, 'float32')[2] is False
  assert ctranslate2_engine.read_source(default)['quantization'] == 'float32'
  digest = ctranslate2_engine.source_digest(restored, 'float32', '4.8.5')
  params = jax.tree.map(np.array, restored.params)
  params['shared_embedding']['embedding'][5, 3] += 1e-6
  other = Translator(restored.model_config, params, restored.tokenizer, batch_size=1)
  assert ctranslate2_engine.source_digest(other, 'float32', '4.8.5') != digest
  assert ctranslate2_engine.source_digest(restored, 'int8', '4.8.5') != digest
  assert ctranslate2_engine.source_digest(restored, 'float32', '4.8.6') != digest
  # A folder the server did not write is never replaced; nothing is left beside the export.
  foreign = tmp_path / 'mine'
  foreign.mkdir()
  (foreign / 'notes.txt').write_text('keep me')
  with pytest.raises(
    UserInputError, match=rf'--ctranslate2_dir={foreign} holds files the server did not write'
  ):
    ctranslate2_engine.prepare(workdir, None, 'int8', str(foreign))
  assert (foreign / 'notes.txt').read_text() == 'keep me'
  assert not [name for name in os.listdir(workdir) if name.startswith('.ctranslate2_export')]


def test_ctranslate2_only_options_are_refused_with_the_jax_engine(tmp_path):
  for options in (
    app.ServerOptions(quantization='int8'),
    app.ServerOptions(ctranslate2_dir=str(tmp_path)),
    app.ServerOptions(intra_threads=2),
  ):
    only = '--quantization, --ctranslate2_dir and --intra_threads are for --engine=ctranslate2'
    with pytest.raises(UserInputError, match=f'^{only}$'):
      app.serve(str(tmp_path), options=options)


def test_without_ctranslate2_the_engine_is_a_one_line_error(tmp_path):
  # A `ctranslate2` that cannot be imported, ahead of the installed one on the path.
  (tmp_path / 'ctranslate2.py').write_text(
    "raise ModuleNotFoundError('No module named ctranslate2')\n"
  )
  env = dict(os.environ, PYTHONPATH=f'{tmp_path}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'transformer_jax.serve',
      f'--workdir={tmp_path}',
      '--engine=ctranslate2',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (
    2,
    "error: --engine=ctranslate2 needs the ctranslate2 package: pip install -e '.[export]'",
  )
