"""The server's issue-27 options (`serving/decoding_modes.py`): n-best lists, sampling, MBR and
target prefixes through /v1/translate, in the modes --decoding serves, with JSON errors naming
the field, and no compilation after start-up in any served mode.

One `python -m transformer_jax.serve` (batches of up to 2; beam 4 with prefixes, greedy, and
sampling of 1 or 3 draws) over a workdir trained here for 8 steps with max_len 8 (one length
bucket: few programs to compile); its outputs are garbage, which is all these tests need: they
compare the server with `Translator.hypotheses` run in this process, and with itself.
"""

import concurrent.futures
import dataclasses
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.server_process import Server

from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.options import DecodingOptions
from transformer_jax.inference.translator import Translator
from transformer_jax.serving import app, ctranslate2_engine
from transformer_jax.serving.decoding_modes import (
  BeamEntry,
  SamplingEntry,
  Served,
  parse_decoding,
)
from transformer_jax.serving.jax_engine import JaxEngine
from transformer_jax.training import loop

from conftest import tiny_config

DECODING = '4:0.6:prefix,1:0,sampling:draws=1+3'
FLAGS = [
  '--max_batch_size=2',
  '--max_wait_ms=1000',
  '--max_hypotheses=4',
  '--max_mbr=4',
  '--max_chars=100',
  f'--decoding={DECODING}',
]
SERVED = (
  'served: beam_size=4 alpha=0.6 with target_prefix; beam_size=1 (greedy); sampling '
  '(sampling_topk 0, 1/3 draws, sampling_temperature 1, sampling_topp 1)'
)
TEXTS = ['one hundred', '', 'seven']


@pytest.fixture(scope='module')
def workdir(data_dir, tmp_path_factory):
  config = tiny_config(data_dir)
  config.model.max_len = config.max_source_length = config.max_target_length = 8
  path = str(tmp_path_factory.mktemp('serve_options') / 'workdir')
  loop.train_and_evaluate(config, path)
  return path


@pytest.fixture(scope='module')
def server(workdir, tmp_path_factory):
  running = Server(workdir, tmp_path_factory.mktemp('server') / 'log', *FLAGS)
  yield running
  running.stop()


@pytest.fixture(scope='module')
def translator(workdir):
  # The server's batch size for two sentences (and for one sentence's three draws: one row).
  return Translator.from_checkpoint(workdir, batch_size=2)


def _hypotheses(translator, *args, **kwargs):
  found = translator.hypotheses(*args, **kwargs)
  return [[h.as_dict() for h in each] for each in found]


def _assert_same_hypotheses(answer, expected):
  assert [[h['text'] for h in each] for each in answer] == [
    [h['text'] for h in each] for each in expected
  ]
  for got, want in zip(answer, expected):
    assert [h.keys() for h in got] == [h.keys() for h in want]  # utility: with MBR only
    for name in got[0] if got else ():
      if name != 'text':
        np.testing.assert_allclose([h[name] for h in got], [h[name] for h in want], atol=2e-6)


def test_n_best_lists_equal_the_translators(server, translator):
  status, _, answer = server.post({'text': TEXTS, 'num_hypotheses': 3})
  assert status == 200
  expected = _hypotheses(translator, TEXTS, 4, 0.6, num_hypotheses=3)
  assert [len(each) for each in answer['hypotheses']] == [3, 0, 3]
  _assert_same_hypotheses(answer['hypotheses'], expected)
  assert answer['translations'] == [each[0]['text'] if each else '' for each in expected]
  # MBR over the beam's candidates: each with its utility, best first.
  status, _, answer = server.post({'text': TEXTS, 'mbr': 3, 'num_hypotheses': 2})
  expected = _hypotheses(translator, TEXTS, 4, 0.6, mbr=3, num_hypotheses=2)
  _assert_same_hypotheses(answer['hypotheses'], expected)
  # One hypothesis with its scores on request; without, translations only, as before.
  status, _, answer = server.post({'text': TEXTS, 'scores': True})
  expected = _hypotheses(translator, TEXTS, 4, 0.6)
  _assert_same_hypotheses(answer['hypotheses'], expected)
  assert server.post({'text': TEXTS})[2] == {'translations': answer['translations']}


def test_target_prefixes_are_honoured(server, translator):
  prefixes = ['hundert', None, '']
  status, _, answer = server.post({'text': TEXTS, 'target_prefix': prefixes, 'scores': True})
  assert status == 200
  expected = _hypotheses(translator, TEXTS, 4, 0.6, target_prefix=prefixes)
  _assert_same_hypotheses(answer['hypotheses'], expected)
  assert answer['translations'][0].startswith('hundert')
  # The unprefixed sentence is what it is without the other's prefix.
  assert answer['translations'][2] == server.post({'text': ['seven']})[2]['translations'][0]
  assert not server.post({'text': ['seven']})[2]['translations'][0].startswith('hundert')


def _sample(server, texts, seed, **fields):
  status, _, answer = server.post(
    {'text': texts, 'sampling': True, 'seed': seed, 'num_hypotheses': 3, **fields}
  )
  assert status == 200, answer
  return answer['hypotheses']


def test_sampling_is_reproducible_and_independent_of_batching(server, translator):
  alone = _sample(server, ['one hundred'], 7)
  expected = _hypotheses(translator, ['one hundred'], sampling=True, seed=7, num_hypotheses=3)
  _assert_same_hypotheses(alone, expected)
  assert _sample(server, ['one hundred'], 7) == alone
  assert _sample(server, ['one hundred'], 8) != alone
  scores = [h['score'] for h in alone[0]]
  assert scores == sorted(scores, reverse=True)
  other = _sample(server, ['seven'], 7)
  # Two sentences are decoded: the next round waits (1 s) for two, so the two requests below
  # share one batch (1 sentence each, the same options) and each is sampled as it is alone.
  assert server.post({'text': ['two', 'three'], 'sampling': True})[0] == 200
  before = server.metrics()
  barrier = threading.Barrier(2)

  def send(texts):
    barrier.wait()
    return _sample(server, texts, 7)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    together = list(pool.map(send, [['one hundred'], ['seven']]))
  after = server.metrics()
  assert after['batches'] - before['batches'] == 1, (before, after)
  assert together == [alone, other]
  # A sentence's draws are keyed by its index in its own request: second is another draw.
  assert _sample(server, ['seven', 'one hundred'], 7)[1] != alone[0]
  # MBR over three draws: the one of highest expected chrF, and its utility.
  (best,) = _sample(server, ['one hundred'], 7, mbr=3, num_hypotheses=1)[0]
  expected = _hypotheses(translator, ['one hundred'], sampling=True, seed=7, mbr=3)
  assert (best['text'], best['utility']) == (
    expected[0][0]['text'],
    pytest.approx(expected[0][0]['utility'], abs=1e-6),
  )


BAD_FIELDS = [
  ({'num_hypotheses': 0}, 'num_hypotheses must be a positive integer, got 0'),
  (
    {'num_hypotheses': 5},
    'num_hypotheses (5) must be <= beam_size (4): beam search keeps beam_size hypotheses',
  ),
  (
    {'sampling': True, 'num_hypotheses': 5},
    "num_hypotheses=5 is over this server's limit (--max_hypotheses=4)",
  ),
  ({'sampling': 'yes'}, "sampling must be true or false, got 'yes'"),
  (
    {'sampling': True, 'sampling_temperature': 0},
    'sampling_temperature must be a finite number > 0, got 0',
  ),
  ({'sampling_topk': -1}, 'sampling_topk must be an integer >= 0 (0: no top-k cut), got -1'),
  ({'sampling_topk': 2.0}, 'sampling_topk must be an integer >= 0 (0: no top-k cut), got 2.0'),
  ({'sampling_topp': 1.5}, 'sampling_topp must be a number in (0, 1] (1: no nucleus cut), got 1.5'),
  ({'seed': -1}, 'seed must be an integer in [0, 2^32), got -1'),
  ({'seed': 2**32}, 'seed must be an integer in [0, 2^32), got 4294967296'),
  ({'mbr': 1}, 'mbr must be at least 2 candidates to compare (0: off), got 1'),
  (
    {'mbr': 2, 'num_hypotheses': 3},
    'num_hypotheses (3) must be <= mbr (2): MBR returns the best of its candidates',
  ),
  ({'sampling': True, 'mbr': 5}, "mbr=5 is over this server's limit (--max_mbr=4)"),
  ({'scores': 1}, '"scores" must be true or false, got number 1'),
  ({'beam_size': 'four'}, '"beam_size" must be a positive integer, got string "four"'),
  ({'target_prefix': 'x'}, '"target_prefix" must be a list of strings or nulls, got string "x"'),
  ({'target_prefix': ['x', None]}, '"target_prefix" must have one entry per text (1), got 2'),
  ({'target_prefix': [3]}, '"target_prefix"[0] must be a string or null, got number 3'),
  ({'target_prefix': ['x' * 101]}, '"target_prefix"[0] has 101 characters; at most 100'),
  (
    {'target_prefix': [' '.join(['hundert'] * 8)]},
    '"target_prefix"[0] has 16 pieces; its source allows at most 7 before the EOS (the source '
    'length + 50, at most max_len)',
  ),
  # Modes --decoding does not serve: what is served is said.
  ({'beam_size': 2}, f'beam_size=2 alpha=0.6 is not served here; {SERVED}'),
  (
    {'sampling': True, 'sampling_topk': 5},
    f'sampling with sampling_topk=5 is not served here; {SERVED}',
  ),
  (
    {'sampling': True, 'sampling_temperature': 0.7},
    f'sampling with sampling_temperature=0.7 is not served here; {SERVED}',
  ),
  (
    {'sampling': True, 'sampling_topp': 0.9},
    f'sampling with sampling_topp=0.9 is not served here; {SERVED}',
  ),
  (
    {'sampling': True, 'num_hypotheses': 2},
    f'sampling with num_hypotheses=2 is not served here; {SERVED}',
  ),
  ({'sampling': True, 'mbr': 2}, f'sampling with mbr=2 is not served here; {SERVED}'),
  (
    {'beam_size': 1, 'target_prefix': ['x']},
    f'target_prefix is not served with beam_size=1 (greedy); {SERVED}',
  ),
]


def test_bad_fields_and_modes_not_served_get_400_naming_the_field(server):
  failed = []
  for fields, error in BAD_FIELDS:
    status = 413 if 'characters' in error else 400
    answer = server.post({'text': ['one'], **fields})
    if (answer[0], answer[2]) != (status, {'error': error}):
      failed.append((fields, answer[0], answer[2]))
  assert not failed
  answer = server.post({'text': 'one hundred', 'num_hypotheses': 2}, '/v1/attention')
  assert answer[2] == {'error': 'unknown field(s) num_hypotheses: expected text, beam_size, alpha'}
  assert server.metrics()['responses']['400'] >= len(BAD_FIELDS)


def test_no_compilation_after_warm_up_in_any_served_mode(server):
  before = server.metrics()
  assert {'beam', 'greedy', 'sampling', 'attention'} <= set(before['compilations_by_mode'])
  assert sum(before['compilations_by_mode'].values()) == before['compilations']
  requests = [
    {'num_hypotheses': 4},
    {'mbr': 4, 'num_hypotheses': 2},
    {'beam_size': 1, 'scores': True},
    {'sampling': True, 'seed': 3},
    {'sampling': True, 'num_hypotheses': 3},
    {'sampling': True, 'mbr': 3},
  ]
  for fields in requests:
    for texts in (['one'], ['one hundred', 'twenty-one'], TEXTS):  # 1, 2 and 2 + blank
      prefixed = [{}]
      if 'sampling' not in fields and 'beam_size' not in fields:
        prefixed.append({'target_prefix': [p for p, _ in zip(['hun', None, 'sie'], texts)]})
      for prefix in prefixed:
        assert server.post({'text': texts, **fields, **prefix})[0] == 200
  after = server.metrics()
  assert after['compilations_since_ready'] == 0
  assert after['compilations_by_mode'] == before['compilations_by_mode']
  assert after['decoding'] == [
    {'beam_size': 4, 'alpha': 0.6, 'target_prefix': True},
    {'beam_size': 1, 'alpha': 0.0},
    {
      'sampling': True,
      'sampling_topk': [0],
      'draws': [1, 3],
      'sampling_temperature': 1.0,
      'sampling_topp': 1.0,
    },
  ]
  assert (after['max_hypotheses'], after['max_mbr']) == (4, 4)


# --- --decoding, without a server ---------------------------------------------------------------


def test_decoding_entries_and_what_they_compile():
  assert parse_decoding('4:0.6:prefix, sampling:topk=40+0:draws=4+1:temperature, 1') == (
    BeamEntry(4, 0.6, prefix=True),
    SamplingEntry(topk=(0, 40), draws=(1, 4), temperature=True),
    BeamEntry(1, 0.0),
  )
  assert parse_decoding('1:prefix,sampling:prefix:topp') == (
    BeamEntry(1, 0.0, prefix=True),
    SamplingEntry(topp=True, prefix=True),
  )
  for bad in ('sampling:topk', 'sampling:topk=-1', 'sampling:draws=0', 'sampling:x', '4:0.6:x'):
    with pytest.raises(UserInputError, match=f"^--decoding must be .* got '{bad}'$"):
      parse_decoding(bad)
  served = Served.parse('sampling:topk=0+40:draws=1+4:temperature:topp:prefix', 8, 16)
  compiled = served.warm_up_options()
  # 2 top-k values x 2 draw counts x temperature 1 or not x top-p 1 or not x prefix or not.
  assert len(compiled) == 32
  assert (
    len({(o.sampling_topk, o.candidates, o.sampling_temperature != 1) for o, _ in compiled}) == 8
  )
  # Sampling ignores the beam: the same options (one batch) whatever beam_size a request sends.
  first = served.options_of({'sampling': True, 'beam_size': 4, 'sampling_topp': 1}, False)
  assert first == served.options_of({'num_hypotheses': 1}, False)
  assert first == DecodingOptions(beam_size=1, sampling=True, alpha=0.6)
  with pytest.raises(UserInputError, match='^--max_mbr must be at most 256, got 300$'):
    Served.parse('4:0.6', 8, 300)


# --- --engine=ctranslate2 ------------------------------------------------------------------------


def test_ctranslate2_engine_n_best_scores_sampling_and_mbr(workdir, translator, tmp_path):
  engine, _ = ctranslate2_engine.load(
    workdir, None, max_batch_size=3, quantization='float32', directory=str(tmp_path / 'ct2')
  )
  n_best = DecodingOptions(beam_size=4, num_hypotheses=3)
  found = engine.decode(TEXTS, n_best, None, [0, 1, 2])
  # Ours with CTranslate2's beam rule: the same n-best list, the same scores (float32).
  expected = translator.hypotheses(TEXTS, 4, 0.6, num_hypotheses=3, beam_rule='ctranslate2')
  assert [[h.text for h in each] for each in found] == [[h.text for h in each] for each in expected]
  np.testing.assert_allclose(
    [h.log_prob for each in found for h in each],
    [h.log_prob for each in expected for h in each],
    atol=1e-4,
  )
  # Sampling: CTranslate2's own, unseeded (a "seed" is refused); MBR over its draws.
  sampling = DecodingOptions(beam_size=1, sampling=True, num_hypotheses=3)
  (draws,) = engine.decode(['one hundred'], sampling, None, [0])
  assert len(draws) == 3 and [h.score for h in draws] == sorted([h.score for h in draws])[::-1]
  app.check_seed(engine, sampling, {'sampling': True})
  with pytest.raises(app.RequestError, match='^"seed" cannot be honoured by the ctranslate2 '):
    app.check_seed(engine, sampling, {'sampling': True, 'seed': 1})
  mbr = dataclasses.replace(sampling, mbr=3)
  (ranked,) = engine.decode(['one hundred'], mbr, None, [0])
  utilities = [h.utility for h in ranked]
  assert len(ranked) == 3 and utilities == sorted(utilities, reverse=True)
  with pytest.raises(UserInputError, match=r'^"target_prefix"\[0\] has 16 pieces'):
    engine.check(['one'], n_best, [' '.join(['hundert'] * 8)])


# --- --dtype ---------------------------------------------------------------------------------


def test_the_server_decodes_in_bfloat16_with_one_cast(
  workdir, translator, tmp_path_factory, monkeypatch
):
  reference = Translator.from_checkpoint(workdir, batch_size=2, dtype='bfloat16')
  expected = _hypotheses(reference, TEXTS, 1, 0.0)
  # The test can tell: float32's log-probs differ (by ~0.01 here, 2026-12-08).
  full = _hypotheses(translator, TEXTS, 1, 0.0)
  assert max(abs(a['log_prob'] - b['log_prob']) for a, b in zip(full[0], expected[0])) > 1e-4
  flags = ['--max_batch_size=2', '--max_wait_ms=1', '--decoding=1:0', '--dtype=bfloat16']
  running = Server(workdir, tmp_path_factory.mktemp('bfloat16') / 'log', *flags)
  try:
    status, _, answer = running.post({'text': TEXTS, 'scores': True})
  finally:
    running.stop()
  assert status == 200
  _assert_same_hypotheses(answer['hypotheses'], expected)
  # In this process: every batch size's Translator in bfloat16, over the one cast of the
  # parameters (JaxEngine.load's), shared.
  casts = []
  cast = translator_module.cast_params
  monkeypatch.setattr(
    translator_module, 'cast_params', lambda *args: casts.append(args[1]) or cast(*args)
  )
  engine = JaxEngine.load(workdir, None, 2, dtype='bfloat16')
  options = DecodingOptions(beam_size=1, alpha=0.0)
  found = engine.decode(TEXTS, options, None, [0, 1, 2])
  assert [[h.as_dict() for h in each] for each in found] == expected
  shared = jax.tree.leaves(engine.params)
  for size in engine.buckets:
    sized = engine._translator(size)
    assert sized.model_config.dtype == 'bfloat16'
    leaves = jax.tree.leaves(sized.params)
    assert all(a is b for a, b in zip(leaves, shared, strict=True))  # Shared, not cast again.
    # The matrices in bfloat16; biases and norm scales stay float32 (`cast_params`).
    by_name = {
      getattr(path[-1], 'key', None): leaf.dtype
      for path, leaf in jax.tree_util.tree_leaves_with_path(sized.params)
    }
    assert by_name['kernel'] == jnp.dtype(jnp.bfloat16)
    assert by_name['embedding'] == jnp.dtype(jnp.bfloat16)
    assert by_name['scale'] == jnp.dtype(jnp.float32)
  assert casts == ['bfloat16']


def test_a_bad_dtype_is_refused_before_the_model_loads(tmp_path):
  # tmp_path holds no model: an error about it would mean the model was being loaded.
  result = subprocess.run(
    [sys.executable, '-m', 'transformer_jax.serve', f'--workdir={tmp_path}', '--dtype=int8'],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert (result.returncode, result.stderr.strip().splitlines()) == (
    2,
    [
      'error: flag --dtype=int8: value should be one of <float32|bfloat16|float16> '
      '(--helpfull lists every flag)'
    ],
  )
  with pytest.raises(
    UserInputError, match="^dtype must be one of float32, bfloat16, float16, got 'int8'$"
  ):
    app.serve(str(tmp_path), options=app.ServerOptions(dtype='int8'))


def test_ctranslate2_refuses_a_dtype_it_does_not_compute_in(tmp_path):
  # Not mapped to a compute_type: on the CPU CTranslate2 has no bfloat16 or float16. What it
  # does have depends on the CPU (int16 needs Intel MKL: a Xeon lists it, an AMD EPYC not).
  supported = ctranslate2_engine.require().get_supported_compute_types('cpu')
  assert not {'bfloat16', 'float16'} & supported
  assert {'float32', 'int8'} <= supported
  listed = re.escape(', '.join(sorted(supported)))
  for dtype, quantization in [('bfloat16', None), ('float16', 'float32'), ('float32', 'int8')]:
    with pytest.raises(
      UserInputError,
      match=rf'^--dtype={dtype} is for --engine=jax: CTranslate2 computes in its --quantization '
      rf'type \({quantization or "int8"}; on the CPU it has {listed}\)$',
    ):
      app.serve(
        str(tmp_path),
        engine='ctranslate2',
        options=app.ServerOptions(dtype=dtype, quantization=quantization),
      )
  ctranslate2_engine.check_dtype('float32', 'float32')  # What it computes in: allowed.
  ctranslate2_engine.check_dtype(None, None)
