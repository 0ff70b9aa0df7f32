"""Issue 27's options through the commands: translate's n-best JSON lines, sampling, prefixes,
alignments, MBR and ensembles (`inference.text_files`, `inference.models`), evaluate and score
with `--models`; each what `Translator.hypotheses` / `Translator.score` give, and each bad
input a one-line error before any parameters are read, nothing written."""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.evaluation import test_set
from transformer_jax.inference import models, text_files
from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.ensemble import Ensemble
from transformer_jax.inference.translator import Translator

from conftest import NUMBER_WORDS_STEPS as STEPS
from conftest import REPO_ROOT, copied_workdir

SOURCES = ['forty-two', 'three hundred twelve', '', 'one thousand seven', 'ninety-nine', 'seven']
REFERENCES = [
  'zweiundvierzig',
  'dreihundertzwölf',
  '',
  'eintausendsieben',
  'neunundneunzig',
  'sieben',
]


@pytest.fixture(scope='module')
def workdir(number_words_workdir, tmp_path_factory) -> str:
  """conftest's 150-step model: number words out, n-best lists that differ; checkpoints at
  steps 75 and 150, two different models to ensemble."""
  return copied_workdir(number_words_workdir, tmp_path_factory, 'options_workdir')


@pytest.fixture(scope='module', autouse=True)
def restored_once(workdir):
  """Each (workdir, checkpoint) restored once for the in-process calls: one Translator, so its
  searches compile once, not once per call (a command's process restores as usual: the flags'
  test runs two)."""
  restore, restored = Translator.from_checkpoint, {}

  def from_checkpoint(path, checkpoint=None, batch_size=64):
    key = (path, checkpoint, batch_size)
    if key not in restored:
      restored[key] = restore(path, checkpoint, batch_size)
    return restored[key]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(Translator, 'from_checkpoint', from_checkpoint)
    yield


@pytest.fixture(scope='module')
def translator(workdir) -> Translator:
  return Translator.from_checkpoint(workdir)


@pytest.fixture(scope='module')
def source_file(tmp_path_factory) -> str:
  return _write(tmp_path_factory.mktemp('inputs') / 'sources.en', SOURCES)


def _write(path, lines) -> str:
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path)


def _translate(workdir, source, **options) -> list[str]:
  out = io.StringIO()
  text_files.translate_text(workdir, input_path=source, stdout=out, **options)
  return out.getvalue().splitlines()


def _jsonl(workdir, source, **options) -> list[list[dict]]:
  lines = _translate(workdir, source, output_format='jsonl', **options)
  return [json.loads(line)['hypotheses'] for line in lines]


def _assert_same(records, found):
  """JSON records == Hypothesis lists: texts and token counts exactly, scores within 1e-6."""
  assert [[r['text'] for r in rs] for rs in records] == [[h.text for h in hs] for hs in found]
  for rs, hs in zip(records, found):
    for r, h in zip(rs, hs):
      assert r['tokens'] == h.tokens
      assert r['log_prob'] == pytest.approx(h.log_prob, abs=1e-6)
      assert r['score'] == pytest.approx(h.score, abs=1e-6)


def test_jsonl_n_best_lists_are_translator_hypotheses(workdir, translator, source_file):
  records = _jsonl(workdir, source_file, num_hypotheses=3)
  assert len(records) == len(SOURCES)
  assert records[2] == []  # A blank line: no hypothesis.
  assert [len(r) for i, r in enumerate(records) if i != 2] == [3] * (len(SOURCES) - 1)
  _assert_same(records, translator.hypotheses(SOURCES, num_hypotheses=3))
  assert records[0][0]['text'] == 'zweiundvierzig'  # Trained: the best is right.
  assert set(records[0][0]) == {'text', 'log_prob', 'score', 'tokens'}
  for rs in records:  # Best first, log_prob the sum, score normalised by ((5 + n) / 6)^0.6.
    assert [r['score'] for r in rs] == sorted((r['score'] for r in rs), reverse=True)
    for r in rs:
      assert r['score'] == pytest.approx(r['log_prob'] / ((5 + r['tokens']) / 6) ** 0.6, abs=1e-5)
  # One best translation per line is the text format's line.
  assert _translate(workdir, source_file) == [r[0]['text'] if r else '' for r in records]


def test_sampling_is_reproducible_from_its_seed(workdir, translator, source_file):
  settings = dict(sampling=True, num_hypotheses=4, sampling_topk=10, sampling_temperature=0.8)
  first = _jsonl(workdir, source_file, seed=7, **settings)
  assert _jsonl(workdir, source_file, seed=7, **settings) == first
  _assert_same(first, translator.hypotheses(SOURCES, seed=7, **settings))
  other = _jsonl(workdir, source_file, seed=8, **settings)
  assert [[r['text'] for r in rs] for rs in other] != [[r['text'] for r in rs] for rs in first]
  assert [len(r) for r in first] == [0 if i == 2 else 4 for i in range(len(SOURCES))]


def test_target_prefixes_start_each_translation(workdir, translator, source_file, tmp_path):
  prefixes = ['dreiund', '', '', 'eintausend', 'neunzig', '']
  prefix_file = _write(tmp_path / 'prefixes.de', prefixes)
  records = _jsonl(workdir, source_file, target_prefix_path=prefix_file, num_hypotheses=2)
  for prefix, rs in zip(prefixes, records):
    assert all(r['text'].startswith(prefix) for r in rs), (prefix, rs)
  assert records[0][0]['text'] != 'zweiundvierzig'  # Forced away from the free best.
  expected = translator.hypotheses(
    SOURCES, target_prefix=[p or None for p in prefixes], num_hypotheses=2
  )
  _assert_same(records, expected)
  free = _jsonl(workdir, source_file, num_hypotheses=2)
  assert records[1] == free[1] and records[5] == free[5]  # An empty line: no prefix.
  assert _translate(workdir, source_file, target_prefix_path=prefix_file) == [
    r[0]['text'] if r else '' for r in records
  ]


def test_mbr_output_is_translator_hypotheses_with_mbr(workdir, translator, source_file):
  lines = _translate(workdir, source_file, mbr=4)
  found = translator.hypotheses(SOURCES, mbr=4)
  assert lines == [hs[0].text if hs else '' for hs in found]
  records = _jsonl(workdir, source_file, mbr=4, num_hypotheses=2)
  _assert_same(records, translator.hypotheses(SOURCES, mbr=4, num_hypotheses=2))
  for rs, hs in zip(records, translator.hypotheses(SOURCES, mbr=4, num_hypotheses=2)):
    assert [r['utility'] for r in rs] == pytest.approx([h.utility for h in hs], abs=1e-9)


def test_a_workdir_ensembled_with_itself_is_the_workdir(workdir, source_file):
  alone = _jsonl(workdir, source_file, num_hypotheses=3)
  # Weighted: a mixture of a model with itself is the model, whatever the weights.
  ensembled = _jsonl(
    None, source_file, models=f'{workdir},{workdir}@{STEPS}', weights='1,3', num_hypotheses=3
  )
  assert [[r['text'] for r in rs] for rs in ensembled] == [[r['text'] for r in rs] for rs in alone]
  for rs, expected in zip(ensembled, alone):
    for r, e in zip(rs, expected):
      assert r['log_prob'] == pytest.approx(e['log_prob'], abs=1e-5)
  sampled = dict(sampling=True, num_hypotheses=2, seed=3)
  ensembled = _jsonl(None, source_file, models=f'{workdir},{workdir}', **sampled)
  alone = _jsonl(workdir, source_file, **sampled)
  assert [[r['text'] for r in rs] for rs in ensembled] == [[r['text'] for r in rs] for rs in alone]


def test_alignments_are_translator_align_of_each_hypothesis(workdir, translator, source_file):
  records = _jsonl(workdir, source_file, num_hypotheses=2, alignments=True)
  sources = [s for s, rs in zip(SOURCES, records) for _ in rs]
  texts = [r['text'] for rs in records for r in rs]
  expected = [pharaoh for _, pharaoh in translator.align(sources, texts)]
  assert [r['alignment'] for rs in records for r in rs] == expected
  assert records[0][0]['alignment'] == '0-0'  # One word each side: forty-two, zweiundvierzig.
  assert any(' ' in pharaoh for pharaoh in expected)
  # An ensemble's: its first member's (the flags' test runs one).


def test_score_with_a_model_twice_is_the_model_alone(workdir, tmp_path):
  sources, targets = [s for s in SOURCES if s], [r for r in REFERENCES if r]
  src, tgt = _write(tmp_path / 'src.en', sources), _write(tmp_path / 'tgt.de', targets)

  def scores(**kwargs):
    out = io.StringIO()
    text_files.score_files(src_path=src, tgt_path=tgt, stdout=out, per_token=True, **kwargs)
    return [line.split('\t') for line in out.getvalue().splitlines()]

  alone = scores(workdir=workdir)
  twice = scores(workdir=None, models=f'{workdir},{workdir}@{STEPS}', weights='1,3')
  assert len(alone) == 5 and [row[2] for row in twice] == [row[2] for row in alone]  # tokens
  for a, t in zip(alone, twice):
    assert float(t[0]) == pytest.approx(float(a[0]), abs=1e-5) and float(a[0]) < 0
  # Two different models: the mixture's scores (Ensemble.score), neither member's.
  members = f'{workdir}@{STEPS // 2},{workdir}@{STEPS}'
  mixed = scores(workdir=None, models=members, weights='1,3')
  expected = Ensemble.from_checkpoints(
    [(workdir, STEPS // 2), (workdir, STEPS)], weights=(1, 3)
  ).score(sources, targets)
  assert [float(row[0]) for row in mixed] == pytest.approx(
    [e['log_prob'] for e in expected], abs=1e-5
  )
  assert max(abs(float(m[0]) - float(a[0])) for m, a in zip(mixed, alone)) > 0.1


def test_evaluate_takes_models_and_mbr(workdir, translator, tmp_path):
  src = _write(tmp_path / 'test.en', [s for s in SOURCES if s])
  ref = _write(tmp_path / 'test.de', [r for r in REFERENCES if r])
  out = tmp_path / 'hypotheses.de'
  result = test_set.evaluate_files(
    None, src, ref, models=f'{workdir},{workdir}', out=str(out), mbr=4
  )
  hypotheses = out.read_text().splitlines()
  expected = translator.translate([s for s in SOURCES if s], mbr=4)
  assert hypotheses == expected
  references = [r for r in REFERENCES if r]
  assert result['exact_matches'] == sum(h == r for h, r in zip(hypotheses, references)) > 0
  assert result['decoding'] == 'MBR over 4 candidates (beam 4, alpha 0.6)'
  assert any(line.startswith('chrF2 = ') for line in test_set.report_lines(result))
  # With one workdir the default hypotheses file says how they were made.
  default = test_set.evaluate_files(
    workdir, src, ref, sampling=True, seed=5, sampling_topk=3, beam_size=1
  )
  assert (
    default['hypotheses_file'].name == 'test.en.default.beam1.alpha0.6.sampling.t1.k3.p1.seed5.txt'
  )
  assert default['decoding'] == 'sampling, temperature 1, seed 5, top-k 3'


def _command(module, *flags):
  return subprocess.run(
    [sys.executable, '-m', f'transformer_jax.{module}', *flags],
    capture_output=True,
    text=True,
    cwd=REPO_ROOT,
    timeout=300,
  )


def test_the_commands_take_the_flags(workdir, translator, source_file, tmp_path):
  """One process per command: the flags reach the library (the rest is tested in-process)."""
  prefix_file = _write(tmp_path / 'prefixes.de', ['dreiund', '', '', '', '', ''])
  out = tmp_path / 'out.jsonl'
  result = _command(
    'translate',
    f'--models={workdir},{workdir}',
    '--weights=1,2',
    f'--input={source_file}',
    f'--output={out}',
    f'--target_prefix_file={prefix_file}',
    '--output_format=jsonl',
    '--sampling',
    '--num_hypotheses=2',
    '--seed=11',
    '--sampling_topp=0.9',
    '--sampling_temperature=0.7',
    '--alignments',
  )
  assert result.returncode == 0, result.stderr[-2000:]
  records = [json.loads(line)['hypotheses'] for line in out.read_text().splitlines()]
  expected = translator.hypotheses(
    SOURCES,
    target_prefix=['dreiund'] + [None] * 5,
    sampling=True,
    num_hypotheses=2,
    seed=11,
    sampling_topp=0.9,
    sampling_temperature=0.7,
  )
  _assert_same(records, expected)
  assert all('alignment' in r for rs in records for r in rs)
  src = _write(tmp_path / 'test.en', ['forty-two', 'seven'])
  result = _command(
    'evaluate', f'--models={workdir}', '--weights=1,2', f'--src={src}', f'--ref={src}', '--mbr=3'
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
    'error: --weights has 2 numbers for 1 --models entry: give one per entry'
  ]


def _bad_cases(workdir, tmp, source):
  two = _write(tmp / 'two.en', ['forty-two', 'seven'])
  other_vocab = tmp / 'other'
  if not other_vocab.exists():
    shutil.copytree(workdir, other_vocab)
    (other_vocab / 'vocab.model').write_bytes((other_vocab / 'vocab.model').read_bytes() + b'\0')
  other_shape = tmp / 'other_shape'
  if not other_shape.exists():
    shutil.copytree(workdir, other_shape)
    config = json.loads((other_shape / 'config.json').read_text())
    config['model']['d_ff'] *= 2
    (other_shape / 'config.json').write_text(json.dumps(config))
  long_prefix = _write(tmp / 'long.de', ['eins ' * 60, ''])
  short_prefix = _write(tmp / 'short.de', ['eins'])
  out = str(tmp / 'out.txt')
  translate = lambda **kw: text_files.translate_text(  # noqa: E731
    kw.pop('workdir', workdir), input_path=two, output_path=out, **kw
  )
  ensemble = dict(workdir=None, models=f'{workdir},{workdir}')
  return out, [
    (
      lambda: translate(num_hypotheses=5, output_format='jsonl'),
      r'num_hypotheses \(5\) must be <= beam_size \(4\)',
    ),
    (
      lambda: translate(sampling=True, sampling_topp=0.0),
      r'sampling_topp must be a number in \(0, 1\]',
    ),
    (
      lambda: translate(sampling=True, sampling_topp=1.5),
      r'sampling_topp must be a number in \(0, 1\]',
    ),
    (
      lambda: translate(sampling=True, sampling_topk=-1),
      r'sampling_topk must be an integer >= 0',
    ),
    (
      lambda: translate(sampling=True, sampling_temperature=0.0),
      r'sampling_temperature must be a finite number > 0, got 0\.0',
    ),
    (
      lambda: translate(sampling=True, sampling_temperature=float('nan')),
      r'sampling_temperature must be a finite number > 0, got nan',
    ),
    (
      lambda: translate(mbr=8),
      r'mbr \(8\) must be <= beam_size \(4\)',
    ),
    (
      lambda: translate(target_prefix_path=long_prefix),
      r'--target_prefix_file=.*long\.de line 1 has \d+ pieces; its source allows at most \d+',
    ),
    (
      lambda: translate(target_prefix_path=short_prefix),
      r'--target_prefix_file=.*short\.de has 1 lines but --input=.*two\.en has 2: line N',
    ),
    (
      lambda: translate(num_hypotheses=2),
      r'--output_format=text writes one translation per line; --num_hypotheses=2 needs '
      r'--output_format=jsonl',
    ),
    (
      lambda: translate(alignments=True),
      r'--alignments needs --output_format=jsonl',
    ),
    (
      lambda: translate(output_format='tsv'),
      r"--output_format must be one of \('text', 'jsonl'\), got 'tsv'",
    ),
    (
      lambda: translate(models=workdir),
      r'give --workdir=DIR \(one model\) or --models=DIR,DIR2,\.\.\. \(an ensemble\), not both',
    ),
    (
      lambda: translate(workdir=None),
      r'give --workdir=DIR \(one model\) or --models=DIR,DIR2,\.\.\. \(an ensemble\)$',
    ),
    (
      lambda: translate(workdir=None, models=f'{workdir},,{workdir}'),
      r'--models entry 2 is empty',
    ),
    (
      lambda: translate(workdir=None, models=f'{workdir}@newest'),
      r"--models entry 1 checkpoint must be a step number, 'averaged', 'best' or 'latest', "
      r"got 'newest'",
    ),
    (
      lambda: translate(**ensemble, weights='1,2,3'),
      r'--weights has 3 numbers for 2 --models entries: give one per entry',
    ),
    (
      lambda: translate(**ensemble, weights='1,x'),
      r"--weights must be numbers separated by commas, one per --models entry, got '1,x'",
    ),
    (
      lambda: translate(**ensemble, weights='1,-1'),
      r'--weights must be finite numbers > 0',
    ),
    (
      lambda: translate(weights='1'),
      r'--weights weighs the members of --models; --workdir is one model',
    ),
    (
      lambda: translate(workdir=None, models=f'{workdir},{other_vocab}'),
      r'ensemble members must share their vocabulary: .*vocab\.model \(sha256 \w+\) differs '
      r'from .*other/vocab\.model',
    ),
    (
      lambda: translate(workdir=None, models=f'{workdir},{other_shape}'),
      r'ensemble members must share their architecture: .* has d_ff=\d+, .*other_shape has '
      r'd_ff=\d+',
    ),
    (
      lambda: text_files.score_files(workdir, source, two, output_path=out),
      r'--src=.*sources\.en has 6 lines but --tgt=.*two\.en has 2',
    ),
    (
      lambda: text_files.score_files(
        None, two, two, models=ensemble['models'], weights='1', output_path=out
      ),
      r'--weights has 1 numbers for 2 --models entries',
    ),
    (
      lambda: test_set.evaluate_files(None, two, two, models=ensemble['models']),
      r"--models needs --out: an ensemble's hypotheses belong to no one workdir",
    ),
    (
      lambda: test_set.evaluate_files(workdir, two, two, out=out, sampling=True, sampling_topp=2.0),
      r'sampling_topp must be a number in \(0, 1\]',
    ),
  ]


def test_bad_input_is_one_line_before_any_parameters_and_writes_nothing(
  workdir, source_file, tmp_path, monkeypatch
):
  def restore(*args, **kwargs):
    raise AssertionError('parameters restored before the input was checked')

  monkeypatch.setattr(translator_module, 'restore_served_params', restore)
  monkeypatch.setattr(Translator, 'from_checkpoint', restore)  # Not the fixture's cache.
  out, cases = _bad_cases(workdir, tmp_path, source_file)
  for run, pattern in cases:
    with pytest.raises(UserInputError) as raised:
      run()
    message = str(raised.value)
    assert '\n' not in message, message
    assert re.search(pattern, message), (pattern, message)
    assert not os.path.exists(out)


def test_members_parse_as_the_checkpoint_flag_does():
  assert models.parse_members('a,b@7,c@averaged, d@latest ,e@best', 'latest') == [
    ('a', 'latest'),
    ('b', 7),
    ('c', 'averaged'),
    ('d', 'latest'),
    ('e', 'best'),
  ]
  assert models.parse_members('x@y@3') == [('x@y', 3)]  # The last @ splits.
  assert models.checkpoint_value('12') == 12 and models.checkpoint_value(None) is None
  with pytest.raises(UserInputError, match=r"^--checkpoint must be a step number, .*got 'bset'$"):
    models.checkpoint_value('bset')
  for text, message in (('', '--models is empty'), ('@3', 'entry 1 .* has no workdir')):
    with pytest.raises(UserInputError, match=message):
      models.parse_members(text)
  assert models.choose(models='a,b', weights='1,3').weights == (1.0, 3.0)
  assert not models.choose(models='a').ensemble and models.choose(models='a', weights='2').ensemble
