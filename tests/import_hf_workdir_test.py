"""What works on a transformers MarianMT import (issue 50 item 4), with sources that start with a
language tag (`>>deu<<`): fine-tuning with train.py from the imported weights; every option of
`translate` and `score`; the server with either engine; the CTranslate2 and StableHLO exports,
which tokenize as our `Tokenizer` does (MarianTokenizer's rules, tests/import_hf_tags_test.py)
and translate as our `Translator` does.

One import of helpers/hf_tiny's model (separate vocabularies of unequal sizes, untied output,
tags in vocab.json) is shared, with its translations of SOURCES (over 100 of them tagged),
decoded in one batch: every search compiles once, for that batch, and is reused. Everything
runs in this process: the commands through the functions they call, the server's ASGI app
(`serving.app.Service.app`) called directly.
"""

import asyncio
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
from helpers import hf_tiny

from transformer_jax.exporters import (
  ctranslate2_runtime,
  ctranslate2_spec,
  huggingface,
  stablehlo,
  stablehlo_runner,
)
from transformer_jax.importers import hf_marian
from transformer_jax.inference import text_files
from transformer_jax.inference.options import Hypothesis
from transformer_jax.inference.translator import Translator
from transformer_jax.serving import app, ctranslate2_engine
from transformer_jax.serving.jax_engine import JaxEngine
from transformer_jax.training import loop

from conftest import tiny_config

torch = pytest.importorskip('torch', reason='torch is not installed (pip install -e .[test])')
transformers = pytest.importorskip(
  'transformers', reason='transformers is not installed (pip install -e .[test])'
)
ctranslate2 = pytest.importorskip('ctranslate2')

TAGS = hf_tiny.TAGS
# 100 tagged, 20 not, and the forms MarianTokenizer treats apart (import_hf_tags_test).
SOURCES = hf_tiny.sources(100, seed=7, tagged=1.0) + hf_tiny.sources(20, seed=8, tagged=0.0)
SOURCES += [
  '>>xyz<< the cat sat',  # A tag vocab.json lacks: <unk>.
  '>>deu<<the cat sat',
  '>>fra<< >>deu<< the cat',
  'the cat >>deu<< sat',
  '>>deu<< the </s> cat',
  '>>fra<< the <pad> mat',
  '>>deu<< <unk> dogs ran',
  '',
]
BATCH = 128  # All of SOURCES in one batch.


@dataclasses.dataclass
class Imported:
  model: object  # The MarianMTModel.
  tokenizer: object  # Its MarianTokenizer.
  workdir: str
  copy: str  # Another copy of the workdir (an ensemble's second member; fine-tuned).
  root: str
  translator: Translator
  greedy: list[str]
  beam: list[str]

  @functools.cached_property
  def ctranslate2_n_best(self) -> list[list]:
    """Beam 4's 4 best with CTranslate2's search (ours with beam_rule='ctranslate2'), at alpha
    0: at alpha > 0 CTranslate2 keeps the 4 best ended hypotheses by log-prob, ours by score
    (`ctranslate2_runtime.hypotheses`). Random weights: the empty translation is often the
    best, the n-best lists say more."""
    return self.translator.hypotheses(SOURCES, 4, 0.0, num_hypotheses=4, beam_rule='ctranslate2')


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  root = tmp_path_factory.mktemp('hf_workdir')
  model = hf_tiny.make_model(str(root / 'hf'))
  workdir = str(root / 'workdir')
  hf_marian.import_hf_model(str(root / 'hf'), workdir)
  shutil.copytree(workdir, root / 'copy')
  tokenizer = transformers.MarianTokenizer.from_pretrained(str(root / 'hf'))
  translator = Translator.from_checkpoint(workdir, batch_size=BATCH)
  assert translator.tokenizer.marian_rules and translator.target_tokenizer.marian_rules
  greedy = translator.translate(SOURCES, beam_size=1)
  # Tags are read (the same text after the other tag translates otherwise), and outputs say
  # something: real decisions to compare.
  tagged = [i for i, s in enumerate(SOURCES[:100])]
  assert sum(bool(greedy[i]) for i in tagged) >= 50
  swapped = [
    (TAGS[1] if SOURCES[i].startswith(TAGS[0]) else TAGS[0]) + SOURCES[i][7:] for i in tagged
  ]
  assert sum(a != greedy[i] for a, i in zip(translator.translate(swapped, 1), tagged)) >= 10
  beam = translator.translate(SOURCES)
  return Imported(
    model, tokenizer, workdir, str(root / 'copy'), str(root), translator, greedy, beam
  )


def _ids(tokenizer, texts):
  return [tokenizer.encode(text) for text in texts]


# --- Fine-tuning -------------------------------------------------------------------------------

STEPS = 4


def _training_config(corpus: str, data_dir: str):
  config = tiny_config(data_dir)
  config.dataset = 'text'
  config.data.dir = corpus
  config.max_source_length = config.max_target_length = hf_tiny.MAX_POSITIONS
  config.label_smoothing = 0.0  # The loss transformers computes.
  config.model.dropout_rate = 0.0
  config.learning_rate_schedule = 'constant'
  config.learning_rate = 3e-3
  config.warmup_steps = 1
  config.per_device_batch_size = 16  # The whole training set: step 1 sees every pair once.
  config.num_train_steps = config.checkpoint_every_steps = config.eval_every_steps = STEPS
  config.log_every_steps = 1
  return config


def _transformers_loss(model, tokenizer, sources, targets) -> float:
  """MarianMTModel's mean cross entropy per target token (</s> included) over the pairs;
  labels padded here (MarianTokenizer would pad them with vocab.json's <pad>, another piece's
  id in a target_vocab.json of another size)."""
  batch = tokenizer(sources, return_tensors='pt', padding=True)
  rows = tokenizer(text_target=targets).input_ids
  labels = np.full((len(rows), max(map(len, rows))), -100, np.int64)
  for i, row in enumerate(rows):
    labels[i, : len(row)] = row
  with torch.no_grad():
    return float(model(**batch, labels=torch.from_numpy(labels)).loss)


def test_train_py_fine_tunes_from_the_imported_weights(imported, tmp_path, caplog):
  """train.py's first step starts from the imported weights: its loss (before any update) is
  the loss MarianMTModel computes on the same pairs (label smoothing 0, no dropout; the
  training set is one batch, every pair once), whose sources start with a tag and whose
  targets the separate target vocabulary segments; then the loss falls."""
  workdir = str(tmp_path / 'workdir')
  shutil.copytree(imported.copy, workdir)
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  sources, targets = hf_tiny.sources(16, seed=3, tagged=0.9), hf_tiny.targets(16, seed=4)
  for split in ('train', 'valid', 'test'):
    (corpus / f'{split}.en').write_text('\n'.join(sources) + '\n')
    (corpus / f'{split}.de').write_text('\n'.join(targets) + '\n')
  config = _training_config(str(corpus), str(tmp_path / 'tfds'))
  with caplog.at_level(logging.INFO):
    tuned = loop.train_and_evaluate(config, workdir)['loss']
  assert f'fine-tuning the imported model in {os.path.join(workdir, "imported")}' in caplog.text
  losses = [float(x) for x in re.findall(rf'step \d+/{STEPS} \| loss ([0-9.]+)', caplog.text)]
  theirs = _transformers_loss(imported.model, imported.tokenizer, sources, targets)
  print(f'transformers {theirs:.4f}; training loss {losses}; validation loss then {tuned:.4f}')
  assert len(losses) == STEPS and abs(losses[0] - theirs) < 2e-4, (losses, theirs)
  assert tuned < theirs - 0.1 and losses[-1] < losses[0] - 0.1
  # The fine-tuned model exports back (the import's positions are our fixed sinusoids, which
  # training leaves alone as MarianMTModel leaves its own), and MarianMTModel computes the
  # validation loss we computed.
  out = str(tmp_path / 'exported')
  huggingface.export(workdir, out, checkpoint=STEPS)
  model = transformers.MarianMTModel.from_pretrained(out).eval()
  exported = _transformers_loss(
    model, transformers.MarianTokenizer.from_pretrained(out), sources, targets
  )
  print(f'the export, in transformers: {exported:.4f}')
  assert abs(exported - tuned) < 2e-4, (exported, tuned)


# --- translate's options and score -------------------------------------------------------------

# Prefixes for a few sources (one in the target's words, one after a tag the target vocabulary
# lacks, as MarianTokenizer reads it: <unk>).
PREFIXES = [''] * len(SOURCES)
PREFIXES[1], PREFIXES[4] = 'die katze', f'{TAGS[0]} der'
# Sources whose whitespace words are their pieces' words (a tag cut from the text that follows
# it, or a special token, is a word of its own there).
WORDED = [i for i, s in enumerate(SOURCES[:120]) if not re.search(r'>>\S*<<\S', s)]


def _translate(imported, **flags) -> list[str]:
  flags.setdefault('workdir', imported.workdir)
  if (path := os.path.join(imported.root, 'in.txt')) and not os.path.exists(path):
    with open(path, 'w') as f:
      f.write('\n'.join(SOURCES) + '\n')
  out = io.StringIO()
  text_files.translate_text(input_path=path, stdout=out, batch_size=BATCH, **flags)
  lines = out.getvalue().split('\n')
  assert lines[-1] == '' and len(lines) == len(SOURCES) + 1  # One line per input line.
  return lines[:-1]


def _records(lines, count=None) -> list[list[dict]]:
  """jsonl lines, checked: no hypothesis for the blank line, `count` (or up to the beam's) for
  the others, each with its fields, best first."""
  found = [json.loads(line)['hypotheses'] for line in lines]
  for source, hypotheses in zip(SOURCES, found):
    assert (hypotheses == []) == (not source.strip())
    if source.strip():
      assert 1 <= len(hypotheses) <= 4 if count is None else len(hypotheses) == count
    for h in hypotheses:
      assert {'text', 'log_prob', 'score', 'tokens'} <= set(h) and h['log_prob'] <= 0
    assert [h['score'] for h in hypotheses] == sorted([h['score'] for h in hypotheses])[::-1]
  return found


def _beam(imported, lines):
  assert lines == imported.beam


def _greedy(imported, lines):
  assert lines == imported.greedy


def _ctranslate2_rule(imported, lines):
  assert lines == [each[0].text if each else '' for each in imported.ctranslate2_n_best]


def _n_best_and_scores(imported, lines):
  """n-best's first is beam search's; every hypothesis' log-prob is `score`'s forced decoding
  of its text, where the text segments back into the pieces the search chose."""
  found = _records(lines, count=3)
  assert [h[0]['text'] if h else '' for h in found] == imported.beam
  segment = imported.translator.target_tokenizer.encode
  pairs = [(s, h) for s, hs in zip(SOURCES, found) for h in hs]
  pairs = [(s, h) for s, h in pairs if len(segment(h['text'])) + 1 == h['tokens']][:BATCH]
  assert len(pairs) == BATCH  # One batch of `score`.
  root = imported.root
  for name, texts in (
    ('src.txt', [s for s, _ in pairs]),
    ('tgt.txt', [h['text'] for _, h in pairs]),
  ):
    with open(os.path.join(root, name), 'w') as f:
      f.write(''.join(text + '\n' for text in texts))
  out = io.StringIO()
  text_files.score_files(
    imported.workdir,
    os.path.join(root, 'src.txt'),
    os.path.join(root, 'tgt.txt'),
    stdout=out,
    batch_size=BATCH,
  )
  scores = [line.split('\t') for line in out.getvalue().splitlines()]
  assert [int(s[2]) for s in scores] == [h['tokens'] for _, h in pairs]
  np.testing.assert_allclose(
    [float(s[0]) for s in scores], [h['log_prob'] for _, h in pairs], atol=1e-4
  )


def _sampled(imported, lines):
  found = _records(lines, count=2)
  assert len({h['text'] for hs in found for h in hs}) >= 50  # Draws, not one output.
  # Seeded: the same flags draw the same again.
  assert _translate(imported, **OPTIONS['sampling, 2 draws'][0]) == lines


def _mbr(imported, lines):
  candidates = imported.translator.hypotheses(SOURCES, num_hypotheses=3)
  for picked, beam in zip(_records(lines, count=1), candidates):
    if beam:
      assert picked[0]['text'] in [h.text for h in beam] and 'utility' in picked[0]


def _prefixed(imported, lines):
  assert lines[1].startswith(PREFIXES[1])
  prefixes = [p or None for p in PREFIXES]
  assert lines == imported.translator.translate(SOURCES, 1, target_prefix=prefixes)
  assert [line for line, p in zip(lines, PREFIXES) if not p] == [
    line for line, p in zip(imported.greedy, PREFIXES) if not p
  ]


def _aligned(imported, lines):
  found = _records(lines, count=3)
  for index in WORDED:
    for h in found[index]:
      for pair in h['alignment'].split():
        i, j = map(int, pair.split('-'))
        assert 0 <= i < len(SOURCES[index].split()) and 0 <= j < len(h['text'].split()), h


def _well_formed(imported, lines):
  assert lines[SOURCES.index('')] == ''
  assert sum(a == b for a, b in zip(lines, imported.greedy)) >= len(SOURCES) // 2


OPTIONS = {
  'beam 4 (default)': (dict(), _beam),
  'greedy': (dict(beam_size=1), _greedy),
  "beam_rule='ctranslate2'": (dict(beam_rule='ctranslate2', alpha=0.0), _ctranslate2_rule),
  'n-best, and score': (dict(output_format='jsonl', num_hypotheses=3), _n_best_and_scores),
  'sampling, 2 draws': (
    dict(
      output_format='jsonl',
      num_hypotheses=2,
      sampling=True,
      sampling_temperature=0.7,
      sampling_topp=0.9,
      seed=5,
    ),
    _sampled,
  ),
  'MBR over the beam': (dict(output_format='jsonl', mbr=3), _mbr),
  'target prefixes, greedy': (dict(beam_size=1, target_prefix_path='prefixes.txt'), _prefixed),
  'alignments': (dict(output_format='jsonl', alignments=True, num_hypotheses=3), _aligned),
  # A model with itself: the model (greedy: the ensemble's search is beam search's too).
  'ensemble with itself': (dict(models='copies', beam_size=1), _greedy),
  'bfloat16, greedy': (dict(dtype='bfloat16', beam_size=1), _well_formed),
}


@pytest.mark.parametrize('name', list(OPTIONS))
def test_each_translate_option_works_on_an_import(imported, name):
  flags, check = OPTIONS[name]
  flags = dict(flags)
  if 'target_prefix_path' in flags:
    flags['target_prefix_path'] = os.path.join(imported.root, flags['target_prefix_path'])
    with open(flags['target_prefix_path'], 'w') as f:
      f.write('\n'.join(PREFIXES) + '\n')
  if flags.get('models') == 'copies':
    flags.update(models=f'{imported.workdir},{imported.copy}', workdir=None)
  check(imported, _translate(imported, **flags))


# --- CTranslate2 ---------------------------------------------------------------------------------


def _assert_same_n_best(found, expected, cap: int = hf_tiny.MAX_POSITIONS):
  """The same hypotheses with the same log-probs (each list is best first: only ties may be
  ordered otherwise), wherever neither search reached the cap (`cap` tokens, EOS counted),
  where CTranslate2 ends its k best candidates and ours forces EOS
  (`ctranslate2_runtime.hypotheses`): there the lists differ."""
  assert len(found) == len(expected)
  compared = 0
  for got, want in zip(found, expected):
    if any(h.tokens >= cap for h in got + want):
      continue
    compared += 1
    got, want = (sorted(hs, key=lambda h: (h.text, h.log_prob)) for hs in (got, want))
    assert [(h.text, h.tokens) for h in got] == [(h.text, h.tokens) for h in want]
    np.testing.assert_allclose([h.log_prob for h in got], [h.log_prob for h in want], atol=1e-4)
  assert compared >= len(found) // 4, compared


@pytest.fixture(scope='module')
def ct2_export(imported, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('ct2') / 'model')
  return ctranslate2_spec.export(imported.workdir, out, quantization='float32')


def test_the_ctranslate2_export_tokenizes_and_translates_as_ours(imported, ct2_export):
  translator = imported.translator
  assert os.path.exists(os.path.join(ct2_export, ctranslate2_spec.TARGET_SENTENCEPIECE_FILE))
  source, target = ctranslate2_runtime.load_tokenizers(ct2_export)
  assert _ids(source, SOURCES) == _ids(translator.tokenizer, SOURCES)
  targets = hf_tiny.targets(50) + [f'{TAGS[0]} {t}' for t in hf_tiny.targets(10)]
  assert _ids(target, targets) == _ids(translator.target_tokenizer, targets)
  assert _ids(target, targets) != _ids(source, targets)  # Separate vocabularies: it tells.
  ct2 = ctranslate2.Translator(ct2_export, intra_threads=1)
  max_len = translator.model_config.max_len
  ours = ctranslate2_runtime.translate(ct2, source, SOURCES, max_len=max_len, beam_size=1)
  assert ours == imported.greedy
  found = ctranslate2_runtime.hypotheses(
    ct2, source, SOURCES, max_len=max_len, beam_size=4, alpha=0.0, num_hypotheses=4
  )
  _assert_same_n_best(found, imported.ctranslate2_n_best)
  # A prefix is segmented by the target side's vocabulary, and scores are the Translator's.
  prefixes = [PREFIXES[4]]
  found = ctranslate2_runtime.hypotheses(
    ct2, source, SOURCES[4:5], max_len=max_len, beam_size=1, target_prefix=prefixes,
    target_sentencepiece=target,
  )  # fmt: skip
  want = translator.hypotheses(SOURCES[4:5], 1, target_prefix=prefixes)
  assert [h.text for h in found[0]] == [h.text for h in want[0]]
  scored = ctranslate2_runtime.score(
    ct2, source, SOURCES[:60], targets, max_len=max_len, target_sentencepiece=target
  )
  expected = translator.score(SOURCES[:60], targets)
  assert [s['tokens'] for s in scored] == [s['tokens'] for s in expected]
  np.testing.assert_allclose(
    [s['log_prob'] for s in scored], [s['log_prob'] for s in expected], atol=1e-4
  )


def test_the_ctranslate2_readme_tokenizes_as_marian_tokenizer(imported, ct2_export):
  """The README's code, which needs only ctranslate2 and sentencepiece, run here: its
  `marian_encode` with marian_rules.json gives our ids, and it translates as ours."""
  with open(os.path.join(ct2_export, ctranslate2_spec.README_FILE), encoding='utf-8') as f:
    readme = f.read()
  assert ctranslate2_spec.MARIAN_RULES_FILE in readme and '>>deu<<' in readme
  (code,) = re.findall(r'```python\n(.*?)```', readme, re.S)
  namespace, printed = {}, io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(code, 'README.md', 'exec'), namespace)
  sp, rules, encode = namespace['sp'], namespace['rules'], namespace['marian_encode']
  assert [encode(sp, s, rules) for s in SOURCES] == _ids(imported.translator.tokenizer, SOURCES)
  example = re.search(r"for s in \['(.*)'\]", code).group(1)
  source, _ = ctranslate2_runtime.load_tokenizers(ct2_export)
  ct2 = ctranslate2.Translator(ct2_export, intra_threads=1)
  max_len = imported.translator.model_config.max_len
  expected = ctranslate2_runtime.translate(ct2, source, [example], max_len=max_len)
  assert printed.getvalue().strip() == repr(expected)


# --- StableHLO -----------------------------------------------------------------------------------


def test_the_stablehlo_export_tokenizes_and_translates_as_ours(imported, tmp_path):
  translator = imported.translator
  out = stablehlo.export(
    imported.workdir, str(tmp_path / 'shlo'), beam_sizes=(1,), platforms=('cpu',)
  )
  with open(os.path.join(out, stablehlo_runner.MANIFEST_FILE), encoding='utf-8') as f:
    manifest = json.load(f)
  assert manifest['marian_rules'] == translator.tokenizer.marian_record()
  with open(os.path.join(out, stablehlo.RUNNER_FILE), encoding='utf-8') as f:
    assert 'def marian_encode(' in f.read()  # The shipped copy applies it too.
  runner = stablehlo_runner.ExportedTranslator(out)
  assert [runner.encode(s) for s in SOURCES] == _ids(translator.tokenizer, SOURCES)
  assert runner.translate(SOURCES, beam_size=1, batch_size=BATCH) == imported.greedy


# --- The server ----------------------------------------------------------------------------------


def _post(service, payload: dict) -> tuple[int, dict]:
  """POST /v1/translate to the service's ASGI app, in this process."""
  body = json.dumps(payload).encode()
  sent = []

  async def receive():
    return {'type': 'http.request', 'body': body, 'more_body': False}

  async def send(message):
    sent.append(message)

  scope = {
    'type': 'http',
    'asgi': {'version': '3.0'},
    'http_version': '1.1',
    'method': 'POST',
    'scheme': 'http',
    'path': '/v1/translate',
    'raw_path': b'/v1/translate',
    'query_string': b'',
    'root_path': '',
    'headers': [(b'content-type', b'application/json'), (b'content-length', b'%d' % len(body))],
    'client': ('127.0.0.1', 1),
    'server': ('127.0.0.1', 8000),
  }
  asyncio.run(service.app(scope, receive, send))
  return sent[0]['status'], json.loads(b''.join(m.get('body', b'') for m in sent[1:]))


@contextlib.contextmanager
def _serving(engine):
  # All of SOURCES in one request and one batch: the JAX engine's batch is the Translator's.
  options = app.ServerOptions(max_batch_size=BATCH, max_sentences=BATCH, decoding='4:0,1:0')
  service = app.Service(engine, options)
  service.batcher.start()
  try:
    yield service
  finally:
    service.close()


def test_the_server_translates_tagged_sources_as_ours_with_either_engine(
  imported, ct2_export, tmp_path
):
  greedy = {'text': SOURCES, 'beam_size': 1, 'alpha': 0}
  with _serving(JaxEngine(imported.translator, max_batch_size=BATCH)) as service:
    status, answer = _post(service, greedy)
    assert status == 200, answer
    assert answer['translations'] == imported.greedy
  # --engine=ctranslate2: the server's own export of the workdir, float32.
  engine, _ = ctranslate2_engine.load(
    imported.workdir, None, max_batch_size=BATCH, quantization='float32', directory=str(tmp_path)
  )
  assert [engine.length(s) for s in SOURCES] == [
    len(i) for i in _ids(imported.translator.tokenizer, SOURCES)
  ]
  with _serving(engine) as service:
    status, answer = _post(service, greedy)
    assert status == 200, answer
    assert answer['translations'] == imported.greedy
    status, answer = _post(service, {'text': SOURCES, 'beam_size': 4, 'num_hypotheses': 4})
    assert status == 200, answer
    found = [[Hypothesis(**h) for h in each] for each in answer['hypotheses']]
    _assert_same_n_best(found, imported.ctranslate2_n_best)
