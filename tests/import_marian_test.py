"""import_marian: a Marian .npz imported here computes what Marian computes, by CTranslate2.

The reference is CTranslate2's own Marian converter (`MarianConverter`) on the same random
`.npz` (tests/marian_npz.py writes it as Marian does), made "Marian-exact" as in
tests/marian_npz_check.py: CTranslate2 stores another sinusoid frequency and uses layer norm
epsilon 1e-5; the patch gives it Marian's. Stock CTranslate2 differs measurably, so the
agreement below is Marian's function, not a near miss.

Random models repeat a token for ever (the residual stream copies the previous embedding), so
each variant's weights are larger than Marian's initialisation and its </s> bias is raised
until a fair share of the outputs end: the searches then have real decisions to agree on.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import types

import ctranslate2
import jax
import ml_collections
import numpy as np
import pytest
import sentencepiece

from transformer_jax.common.errors import UserInputError
from transformer_jax.common.paths import file_sha256
from transformer_jax.data import input_pipeline
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from transformer_jax.exporters import ctranslate2_runtime
from transformer_jax.importers import marian, workdir_writer
from transformer_jax.inference import decoding
from transformer_jax.inference import translator as inference_translator
from transformer_jax.model.transformer import Transformer
from transformer_jax.testing import marian_npz, marian_npz_check, marian_reference
from transformer_jax.workdir import imported
from transformer_jax.workdir.layout import Workdir

from conftest import REPO_ROOT

VOCAB = 60
SMALL = dict(d_model=32, d_ff=64, heads=4, encoder_layers=2, decoder_layers=2)
SENTENCES = 300  # Random token sequences per variant, for scores and for each search.
MAX_DECODE = 20  # Both sides' output cap: an output that never ends is cut at 20 tokens.
# name -> (random_marian_npz arguments, added to </s>'s logit bias).
VARIANTS = {
  'post-norm swish, tied-embeddings-all (Wemb), logits bias': (dict(seed=0, scale=0.3), 3.0),
  'pre-norm relu, tied-embeddings-all': (
    dict(seed=1, scale=0.5, pre_norm=True, activation='relu'),
    1.5,
  ),
  'tied-embeddings (encoder_Wemb, decoder_Wemb), gelu of Marian v1.11': (
    dict(seed=2, scale=0.3, tied_embeddings='target', activation='gelu'),
    4.5,
  ),
}
ENGLISH = (
  'the cat sat on the mat while two dogs ran quickly over green hills and into deep valleys '
  'where seven old farmers were singing songs about rain sun and wind'
).split()


def _write_vocab(directory, tokens):
  return marian_npz.write_vocab_yml(os.path.join(directory, 'vocab.yml'), tokens)


@pytest.fixture(scope='module')
def spm_model(tmp_path_factory):
  """A real SentencePiece model trained as Marian trains one (eos 0, unk 1, no BOS)."""
  rng = np.random.default_rng(0)
  text = [' '.join(rng.choice(ENGLISH, rng.integers(3, 12))) for _ in range(400)]
  prefix = str(tmp_path_factory.mktemp('spm') / 'source')
  pieces = marian_npz.train_sentencepiece(prefix, text, 80)
  os.rename(prefix + '.model', prefix + '.spm')
  return prefix + '.spm', pieces, text


def _random_ids(rng, count, low, max_length):
  return [list(rng.integers(low, VOCAB, rng.integers(1, max_length + 1))) for _ in range(count)]


def _padded(rows, length, start=()):
  """Rows of our ids, each after `start`, padded with PAD to [len(rows), length]."""
  out = np.full((len(rows), length), PAD_ID, np.int32)
  for r, row in enumerate(rows):
    out[r, : len(start) + len(row)] = [*start, *row]
  return out


def _tokens(our_row, pieces):
  """Our output ids (up to EOS) as Marian's pieces; pieces is our vocabulary in id order."""
  row = list(our_row)
  return [pieces[i] for i in row[: row.index(EOS_ID) if EOS_ID in row else len(row)]]


class Case(types.SimpleNamespace):
  """One variant: files, both CTranslate2 models, our import, and everything measured."""


def _raise_eos_bias(npz, arrays, offset):
  arrays['decoder_ff_logit_out_b'][0, marian.MARIAN_EOS] += offset
  np.savez(npz, **arrays)


@pytest.fixture(scope='module', params=list(VARIANTS), ids=list(VARIANTS))
def case(request, tmp_path_factory, spm_model):
  kwargs, eos_offset = VARIANTS[request.param]
  directory = str(tmp_path_factory.mktemp('marian'))
  npz = os.path.join(directory, 'model.npz')
  arrays = marian_npz.write_random_marian_npz(
    npz, vocab_size=VOCAB, embedding_scale=0.3, **SMALL, **kwargs
  )
  _raise_eos_bias(npz, arrays, eos_offset)
  tokens = marian_npz.make_tokens(VOCAB)
  vocab = _write_vocab(directory, tokens)
  files = types.SimpleNamespace(npz=npz, vocabs=[vocab, vocab])
  exact, stock = (
    ctranslate2.Translator(
      marian_npz_check.convert(files, os.path.join(directory, name), marian_exact=name == 'exact'),
      device='cpu',
      intra_threads=1,
    )
    for name in ('exact', 'stock')
  )
  config, params, vocabulary, origin, _ = marian.read_model(npz, vocab, spm_model[0])
  ours = Tokenizer(vocabulary)
  pieces = [ours.pieces([i])[0] for i in range(config.vocab_size)]
  return Case(
    name=request.param,
    arrays=arrays,
    tokens=tokens,
    exact=exact,
    stock=stock,
    config=config,
    params=params,
    origin=origin,
    model=Transformer(config),
    pieces=pieces,
    ids=marian.our_ids(VOCAB),
    rng=np.random.default_rng(kwargs['seed']),
  )


def _log_probs(case, sources, targets):
  """Our teacher-forced log-probs of each target token and of the final EOS (Marian ids)."""
  ids = case.ids
  width = max(16, *(len(t) + 1 for t in [*sources, *targets]))
  src = _padded([[*ids[s], EOS_ID] for s in sources], width)
  tgt = _padded([ids[t] for t in targets], width, start=[BOS_ID])
  logits = jax.jit(case.model.apply)({'params': case.params}, src, tgt)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  our_targets = [[*ids[t], EOS_ID] for t in targets]
  return [log_probs[r, np.arange(len(t)), t] for r, t in enumerate(our_targets)], log_probs


def _largest_difference(results, mine):
  return max(float(np.max(np.abs(np.array(r.log_probs) - m))) for r, m in zip(results, mine))


def test_scores_equal_marian_exact_ctranslate2s_and_not_stock_ctranslate2s(case):
  sources = _random_ids(case.rng, SENTENCES, 1, 15)  # <unk> (1) included, </s> (0) not.
  targets = _random_ids(case.rng, SENTENCES, 1, 15)
  mine, log_probs = _log_probs(case, sources, targets)
  source_tokens = [[case.tokens[i] for i in s] for s in sources]
  target_tokens = [[case.tokens[i] for i in t] for t in targets]
  exact = _largest_difference(case.exact.score_batch(source_tokens, target_tokens), mine)
  stock = _largest_difference(case.stock.score_batch(source_tokens, target_tokens), mine)
  # And the whole distribution of a few rows against the NumPy forward pass of marian_npz.
  reference = max(
    float(
      np.max(
        np.abs(
          marian_reference.log_softmax(
            marian_reference.marian_reference_logits(case.arrays, [*s, 0], t)
          )
          - log_probs[r, : len(t) + 1][:, case.ids]
        )
      )
    )
    for r, (s, t) in enumerate(zip(sources[:8], targets[:8]))
  )
  tokens = sum(len(t) + 1 for t in targets)
  print(
    f'{case.name}: {SENTENCES} sentences, {tokens} target tokens: max |log-prob difference| '
    f'{exact:.2e} vs Marian-exact CTranslate2, {stock:.2e} vs stock CTranslate2, '
    f'{reference:.2e} vs marian_npz (8 full rows)'
  )
  assert exact < 1e-4 and reference < 1e-4
  assert stock > 1e-3


def _searches(case):
  """Both sides' searches on the same random sources, as Marian's pieces: a namespace of
  sources, greedy / theirs_greedy (one output each), beam / theirs_beam (our rule
  'ctranslate2' without length penalty and CTranslate2 with length_penalty=0: 4 hypotheses
  and their log-probs each), exact (our default rule, GNMT 0.6: the best hypothesis) and
  theirs_gnmt (CTranslate2's 4 ranked by the same penalty)."""
  if not hasattr(case, 'searches'):
    sources = _random_ids(case.rng, SENTENCES, 1, 15)
    src = _padded([[*case.ids[s], EOS_ID] for s in sources], 16)
    model = case.model
    greedy = jax.jit(lambda p, s: decoding.greedy_decode(model, p, s, max_decode_len=MAX_DECODE))

    def beam(rule, alpha):
      return jax.jit(
        lambda p, s: decoding.beam_decode(
          model, p, s, beam_size=4, alpha=alpha, max_decode_len=MAX_DECODE, rule=rule
        )
      )(case.params, src)

    source_tokens = [[case.tokens[i] for i in s] for s in sources]
    options = dict(max_decoding_length=MAX_DECODE, min_decoding_length=0)
    theirs_greedy = case.exact.translate_batch(source_tokens, beam_size=1, **options)
    theirs_beam = case.exact.translate_batch(
      source_tokens,
      beam_size=4,
      num_hypotheses=4,
      length_penalty=0.0,
      return_scores=True,
      **options,
    )
    beam_ids, beam_scores = (np.asarray(x) for x in beam('ctranslate2', 0.0))
    exact_ids = np.asarray(beam('exact', 0.6)[0][:, 0])
    case.searches = types.SimpleNamespace(
      sources=source_tokens,
      greedy=[_tokens(row, case.pieces) for row in np.asarray(greedy(case.params, src))],
      theirs_greedy=[r.hypotheses[0] for r in theirs_greedy],
      beam=[[_tokens(row, case.pieces) for row in rows] for rows in beam_ids],
      beam_scores=beam_scores,
      theirs_beam=[r.hypotheses for r in theirs_beam],
      theirs_beam_scores=np.array([r.scores for r in theirs_beam]),
      exact=[_tokens(row, case.pieces) for row in exact_ids],
      theirs_gnmt=[ctranslate2_runtime.gnmt_best(r.hypotheses, r.scores, 0.6) for r in theirs_beam],
    )
  return case.searches


def _report(case, what, sources, mine, theirs):
  """Prints the agreement and every difference; returns the rows that differ. An output is a
  list of pieces, or a list of hypotheses (best first) that are."""
  differing = [r for r in range(len(sources)) if mine[r] != theirs[r]]
  for r in differing:
    print(f'  {what} differs on {sources[r]}: ours {mine[r]}, CTranslate2 {theirs[r]}')
  best = [m[0] if m and isinstance(m[0], list) else m for m in mine]
  ended = sum(len(m) < MAX_DECODE for m in best)
  print(
    f'{case.name}: {what}: {len(sources) - len(differing)}/{len(sources)} equal '
    f'({100 * (1 - len(differing) / len(sources)):.1f}%); {ended} best ended before the length '
    f'cap, {len(set(map(tuple, best)))} distinct best outputs'
  )
  return differing


def test_greedy_outputs_equal_ctranslate2s(case):
  run = _searches(case)
  assert not _report(case, 'greedy', run.sources, run.greedy, run.theirs_greedy)
  assert len(set(map(tuple, run.greedy))) >= 10  # Not one output for every source.


def test_beam_outputs_equal_ctranslate2s(case):
  """Beam 4 with decode's rule 'ctranslate2' (CTranslate2's ending and stopping) and no
  length penalty on either side: each sentence's 4 hypotheses, in order, and their log-probs."""
  run = _searches(case)
  differing = _report(case, 'beam 4 (4 hypotheses)', run.sources, run.beam, run.theirs_beam)
  assert not differing
  # Sums of up to 20 log-probs, each within 2.5e-5 (test_scores_equal_...).
  lengths = np.array([[len(h) + 1 for h in hypotheses] for hypotheses in run.beam])
  difference = np.abs(run.beam_scores - run.theirs_beam_scores)
  print(f'{case.name}: beam 4 log-probs: max |difference| {float(np.max(difference)):.2e}')
  assert np.all(difference <= 2.5e-5 * lengths)
  assert len({tuple(h[0]) for h in run.beam}) >= 10
  # Some hypotheses end only at the length cap, where both sides end the 4 best candidates.
  assert any(len(h) == MAX_DECODE for hypotheses in run.beam for h in hypotheses)


def test_our_default_beam_search_finds_at_least_as_good_outputs(case):
  """Our default rule (hypotheses end among a step's 2k best candidates; stops once no beam can
  beat the k finished) with GNMT 0.6, against CTranslate2's hypotheses ranked by the same
  penalty: both searches keep the same alive beams, and ours ends a superset of hypotheses, so
  where the outputs differ ours scores at least as well (scored by both models alike), unless
  CTranslate2's is cut at the length cap without EOS: ours always end with EOS."""
  run = _searches(case)
  differing = _report(case, 'beam 4, GNMT 0.6', run.sources, run.exact, run.theirs_gnmt)
  assert len(differing) <= 0.4 * len(run.sources)
  differing = [r for r in differing if len(run.theirs_gnmt[r]) < MAX_DECODE]
  if not differing:
    return
  inverse = {piece: i for i, piece in enumerate(case.tokens)}
  source_ids = [[inverse[p] for p in run.sources[r]] for r in differing] * 2
  outputs = [run.exact[r] for r in differing] + [run.theirs_gnmt[r] for r in differing]
  mine, _ = _log_probs(case, source_ids, [[inverse[p] for p in o] for o in outputs])
  scores = case.exact.score_batch([run.sources[r] for r in differing] * 2, outputs)
  assert _largest_difference(scores, mine) < 1e-4
  gnmt = [float(np.sum(m)) / ((5 + len(m)) / 6) ** 0.6 for m in mine]
  ours, theirs = np.array(gnmt[: len(differing)]), np.array(gnmt[len(differing) :])
  print(
    f'{case.name}: beam 4, GNMT 0.6: ours better in {int(np.sum(ours > theirs))} of the '
    f'{len(differing)} differences where CTranslate2 ended before the cap, worse by at most '
    f'{float(np.max(theirs - ours)):.2e}'
  )
  assert np.all(ours >= theirs - 1e-4)


# --- The vocabulary ------------------------------------------------------------------------------


def _spm_vocab_npz(directory, size, seed=5):
  npz = os.path.join(directory, 'model.npz')
  marian_npz.write_random_marian_npz(
    npz, vocab_size=size, d_model=8, d_ff=16, heads=2, encoder_layers=1, decoder_layers=1, seed=seed
  )
  return npz


def test_a_spm_vocabulary_segments_as_the_spm_with_our_ids(spm_model, tmp_path):
  spm_path, spm_pieces, text = spm_model
  npz = _spm_vocab_npz(str(tmp_path), len(spm_pieces))
  config, params, vocabulary, origin, _ = marian.read_model(npz, spm_path)
  ours, theirs = Tokenizer(vocabulary), sentencepiece.SentencePieceProcessor(model_file=spm_path)
  assert ours.pieces(range(ours.vocab_size)) == ['<pad>', '</s>', '<s>', '<unk>'] + spm_pieces[2:]
  assert config.vocab_size == ours.vocab_size == len(spm_pieces) + 2
  assert origin['mapped']['pieces_appended_as_unk'] == 0
  for sentence in text[:50] + ['zebra quickly ran XYZ over 7 hills']:
    ids = theirs.encode(sentence)
    assert ours.pieces(ours.encode(sentence)) == [theirs.id_to_piece(i) for i in ids]
    assert ours.encode(sentence) == list(marian.our_ids(len(spm_pieces))[ids])
    assert ours.decode(ours.encode(sentence)) == theirs.decode(ids)


GERMAN = (
  'die katze sass auf der matte waehrend zwei hunde schnell ueber gruene huegel liefen und in '
  'tiefe taeler wo sieben alte bauern lieder ueber regen sonne und wind sangen'
).split()


def test_a_target_spm_segments_targets_as_marian_s_training_did(spm_model, tmp_path):
  """OPUS-MT's layout with its two segmenters: one joint vocab.yml, source.spm for English,
  target.spm for German. The import writes both as SentencePiece models over the same ids; the
  target one segments German as target.spm does (source.spm would cut it otherwise), and
  training tokenizes targets with it (input_pipeline.load_target_tokenizer)."""
  source_spm, source_pieces, _ = spm_model
  rng = np.random.default_rng(4)
  german = [' '.join(rng.choice(GERMAN, rng.integers(3, 12))) for _ in range(400)]
  target_prefix = str(tmp_path / 'target')
  target_pieces = marian_npz.train_sentencepiece(target_prefix, german, 80)
  folder = tmp_path / 'opus'
  folder.mkdir()
  os.rename(target_prefix + '.model', folder / 'target.spm')
  shutil.copy(source_spm, folder / 'source.spm')
  joint = list(dict.fromkeys(source_pieces + target_pieces))  # </s>, <unk> first, as Marian's.
  marian_npz.write_vocab_yml(str(folder / 'opus.vocab.yml'), joint)
  _spm_vocab_npz(str(folder), len(joint))

  workdir = str(tmp_path / 'imported')
  workdir_writer.import_marian_model(str(folder), workdir)
  saved = Workdir(workdir)
  ours = Tokenizer.load(saved.vocab_file)
  targets = input_pipeline.load_target_tokenizer(saved)
  assert targets is not None and targets.vocab_size == ours.vocab_size == len(joint) + 2
  assert targets.pieces(range(targets.vocab_size)) == ours.pieces(range(ours.vocab_size))
  marian_target = sentencepiece.SentencePieceProcessor(model_file=str(folder / 'target.spm'))
  differ = 0
  for sentence in german[:50]:
    expected = marian_target.encode(sentence, out_type=str)
    assert targets.pieces(targets.encode(sentence)) == expected
    assert targets.decode(targets.encode(sentence)) == sentence
    differ += ours.pieces(ours.encode(sentence)) != expected
  assert differ >= 40  # source.spm segments German otherwise: the target model matters.
  origin = json.loads(saved.config_file.read_text())['imported_from']
  assert origin['target_spm'] == str(folder / 'target.spm')
  maps = inference_translator.Translator.from_checkpoint(workdir).attention(
    'the cat sat', german[0]
  )
  assert maps.target_tokens == marian_target.encode(german[0], out_type=str) + ['</s>']

  # Training's tokenization: targets through target.spm, sources through source.spm.
  config = ml_collections.ConfigDict({'data': {'src_lang': 'en', 'tgt_lang': 'de'}})
  english = [' '.join(rng.choice(ENGLISH, 5)) for _ in range(8)]
  source = _Examples([{'en': e, 'de': g} for e, g in zip(english, german)])
  split = input_pipeline.TokenizedSplit.build(source, ours, config, target_tokenizer=targets)
  for index, (e, g) in enumerate(zip(english, german[:8])):
    assert list(split[index]['inputs']) == [*ours.encode(e), EOS_ID]
    assert list(split[index]['targets']) == [*targets.encode(g), EOS_ID]
  plain = input_pipeline.TokenizedSplit.build(source, ours, config)
  assert any(list(plain[i]['targets']) != list(split[i]['targets']) for i in range(8))

  # A same-content target.spm is no second segmenter; --target_spm with a .spm vocabulary is
  # refused.
  shutil.copy(folder / 'source.spm', folder / 'target.spm')
  assert marian.read_model(str(folder))[4] is None
  with pytest.raises(UserInputError, match='a .spm vocabulary segments both sides'):
    marian.read_model(str(folder / 'model.npz'), source_spm, target_spm=str(folder / 'target.spm'))


class _Examples(list):
  """A list with the tfds data source's batch read (input_pipeline.read_examples)."""

  def __getitems__(self, indices):
    return [self[i] for i in indices]


def test_a_yml_vocabulary_with_the_source_spm(spm_model, tmp_path):
  """OPUS-MT's layout: ids from vocab.yml (another order than the .spm's, pieces the .spm lacks,
  .spm pieces missing), segmentation by source.spm; found through the folder's decoder.yml."""
  spm_path, spm_pieces, text = spm_model
  rng = np.random.default_rng(3)
  kept = list(rng.permutation(spm_pieces[2:]))
  dropped, kept = kept[:3], kept[3:]  # In the .spm only: Marian reads them as <unk>.
  yml_only = ['\u2581zzz', 'Q', 'true', '1']  # Never produced by segmentation.
  tokens = ['</s>', '<unk>', *kept[:10], *yml_only, *kept[10:]]
  directory = str(tmp_path / 'opus')
  os.makedirs(directory)
  npz = _spm_vocab_npz(directory, len(tokens))
  os.rename(npz, os.path.join(directory, 'opus.model1.npz'))
  marian_npz.write_vocab_yml(os.path.join(directory, 'opus.vocab.yml'), tokens)
  shutil.copy(spm_path, os.path.join(directory, 'source.spm'))
  shutil.copy(spm_path, os.path.join(directory, 'target.spm'))
  with pytest.raises(UserInputError, match='expected one .npz model, found 0'):
    marian.read_model(str(tmp_path))
  shutil.copy(os.path.join(directory, 'opus.model1.npz'), os.path.join(directory, 'other.npz'))
  with open(os.path.join(directory, 'decoder.yml'), 'w') as f:  # It names the model to use.
    f.write('models:\n  - opus.model1.npz\nvocabs:\n  - opus.vocab.yml\n  - opus.vocab.yml\n')
  config, params, vocabulary, origin, _ = marian.read_model(directory)
  assert origin['model'].endswith('opus.model1.npz')
  assert origin['vocab'].endswith('opus.vocab.yml') and origin['spm'].endswith('source.spm')
  ours, theirs = Tokenizer(vocabulary), sentencepiece.SentencePieceProcessor(model_file=spm_path)
  assert ours.pieces(range(ours.vocab_size)) == ['<pad>', '</s>', '<s>', '<unk>', *tokens[2:]] + [
    p for p in spm_pieces if p in dropped
  ]
  assert config.vocab_size == len(tokens) + 2 + 3
  for sentence in text[:50] + ['zebra Q true 1 zzz']:
    pieces = ours.pieces(ours.encode(sentence))
    assert pieces == [theirs.id_to_piece(i) for i in theirs.encode(sentence)]
    assert not set(pieces) & set(yml_only)
  yml_ids = [tokens.index(p) + 2 for p in yml_only]
  assert ours.decode(yml_ids) == 'zzzQtrue1'
  # The .spm-only pieces: <unk>'s embedding, and e^-30 of its probability.
  table = params['shared_embedding']['embedding']
  bias = params['logits_bias']
  for i in range(len(tokens) + 2, config.vocab_size):
    np.testing.assert_array_equal(table[i], table[UNK_ID])
    assert bias[i] == pytest.approx(bias[UNK_ID] + marian.MASKED_LOGIT_BIAS)
  assert not table[PAD_ID].any() and not table[BOS_ID].any()
  assert bias[PAD_ID] == bias[BOS_ID] == marian.MASKED_LOGIT_BIAS


def test_the_command_writes_a_workdir_that_translates_as_ctranslate2(spm_model, tmp_path):
  """`python -m transformer_jax.import_marian`, then `Translator.from_checkpoint` on its workdir:
  text in, text out, against Marian-exact CTranslate2 given the source.spm's pieces."""
  spm_path, spm_pieces, text = spm_model
  directory = str(tmp_path / 'opus')
  os.makedirs(directory)
  npz = os.path.join(directory, 'model.npz')
  arrays = marian_npz.write_random_marian_npz(
    npz, vocab_size=len(spm_pieces), **SMALL, seed=7, scale=0.3, pad_meta=True
  )
  _raise_eos_bias(npz, arrays, 3.0)
  vocab = _write_vocab(directory, spm_pieces)
  shutil.copy(spm_path, os.path.join(directory, 'source.spm'))
  workdir = str(tmp_path / 'workdir')
  command = [sys.executable, '-m', 'transformer_jax.import_marian', f'--model={directory}']
  result = subprocess.run(
    [*command, f'--workdir={workdir}'], capture_output=True, text=True, cwd=REPO_ROOT
  )
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  assert saved[imported.IMPORTED_KEY]['model_sha256'] == file_sha256(npz)
  assert saved[imported.IMPORTED_KEY]['marian_version'] == marian_npz.MARIAN_VERSION
  assert saved['model']['sinusoid_layout'] == 'concatenated'
  again = subprocess.run(
    [*command, f'--workdir={workdir}'], capture_output=True, text=True, cwd=REPO_ROOT
  )
  assert again.returncode == 2 and again.stderr.startswith('error: ')
  assert len(again.stderr.strip().splitlines()) == 1 and '--force replaces it' in again.stderr

  # Stock CTranslate2 cannot read the NUL-padded special:model.yml of Marian >= 2025-05.
  unpadded = dict(arrays)
  unpadded['special:model.yml'] = marian_npz.marian_meta_array(
    marian_npz.marian_yaml(marian_npz.read_marian_config(arrays))
  )
  np.savez(os.path.join(str(tmp_path), 'unpadded.npz'), **unpadded)
  files = types.SimpleNamespace(npz=str(tmp_path / 'unpadded.npz'), vocabs=[vocab, vocab])
  reference = ctranslate2.Translator(
    marian_npz_check.convert(files, str(tmp_path / 'ct2'), marian_exact=True), intra_threads=1
  )
  processor = sentencepiece.SentencePieceProcessor(model_file=spm_path)
  sentences = text[:40]
  translator = inference_translator.Translator.from_checkpoint(workdir, batch_size=64)
  source = [processor.encode(s, out_type=str) for s in sentences]
  # Ours stop at the source length + 50 pieces (inference.Translator.translate); greedy's
  # output is a prefix of a longer one, so CTranslate2's is cut there.
  caps = [len(s) + 50 for s in source]
  mine = translator.translate(sentences, beam_size=1)
  options = ctranslate2_runtime.translation_options(max(caps) + 1, beam_size=1)
  results = reference.translate_batch(source, **options)
  theirs = [processor.decode(r.hypotheses[0][:cap]) for r, cap in zip(results, caps)]
  print(
    f'workdir translations, greedy: {sum(a == b for a, b in zip(mine, theirs))}/{len(mine)} '
    f'equal CTranslate2 ({len(set(mine))} distinct)'
  )
  assert mine == theirs and len(set(mine)) >= 5
  # Beam 4 (the searches differ: see test_beam_outputs_equal_ctranslate2s_where_...): reported.
  mine = translator.translate(sentences, beam_size=4, alpha=0.6)
  options = ctranslate2_runtime.translation_options(max(caps) + 1, beam_size=4)
  results = reference.translate_batch(source, **options)
  best = [ctranslate2_runtime.gnmt_best(r.hypotheses, r.scores, 0.6) for r in results]
  ended = [i for i, cap in enumerate(caps) if len(best[i]) < cap - 1]  # Ours force EOS there.
  equal = sum(mine[i] == processor.decode(best[i]) for i in ended)
  print(f'workdir translations, beam 4: {equal}/{len(ended)} equal where CTranslate2 ended')


# --- Refusals ----------------------------------------------------------------------------------


def _tiny(path, **kwargs):
  """A tiny random Marian model (and its vocabulary) for the refusal tests; returns its arrays."""
  arrays = marian_npz.write_random_marian_npz(
    path,
    vocab_size=10,
    d_model=8,
    d_ff=16,
    heads=2,
    encoder_layers=1,
    decoder_layers=1,
    seed=0,
    **kwargs,
  )
  _write_vocab(os.path.dirname(path), marian_npz.make_tokens(10))
  return arrays


def _rewritten(path, arrays, drop=(), **changes):
  arrays = {k: v for k, v in arrays.items() if k not in drop}
  np.savez(path, **{**arrays, **changes})


def _with_pickle(path, arrays):
  np.savez(path, **arrays, oops=np.array([{'a': 1}], dtype=object))


def _meta_with(arrays, **changes):
  config = {**marian_npz.read_marian_config(arrays), **changes}
  return marian_npz.marian_meta_array(marian_npz.marian_yaml(config))


REFUSALS = {
  'missing tensor': (
    {},
    lambda p, a: _rewritten(p, a, drop=['decoder_l1_ffn_W2']),
    r'tensor decoder_l1_ffn_W2 \[16, 8\] is missing',
  ),
  'unknown tensor': (
    {},
    lambda p, a: _rewritten(p, a, decoder_l1_context_enc2_Wq=a['decoder_l1_context_Wq']),
    r'unknown tensor decoder_l1_context_enc2_Wq\[8, 8\]',
  ),
  'learned positions': (
    {},
    lambda p, a: _rewritten(p, a, Wpos=np.zeros((32, 8), np.float32)),
    r'unknown tensor Wpos\[32, 8\] \(learned positions\)',
  ),
  'shape mismatch': (
    {},
    lambda p, a: _rewritten(p, a, encoder_l1_ffn_W1=a['encoder_l1_ffn_W1'].T),
    r'tensor encoder_l1_ffn_W1 has shape \[16, 8\], expected \[8, 16\]',
  ),
  'average attention': (
    {'extra_config': {'transformer-decoder-autoreg': 'average-attention'}},
    None,
    r"option transformer-decoder-autoreg='average-attention' is not supported",
  ),
  'ffn depth 3': ({'ffn_depth': 3}, None, r'option transformer-ffn-depth=3 is not supported'),
  'right-left': (
    {'extra_config': {'right-left': True}},
    None,
    r'option right-left=True is not supported: the model writes its output reversed',
  ),
  'tied layers': (
    {'extra_config': {'transformer-tied-layers': [1]}},
    None,
    r'option transformer-tied-layers=\[1\] is not supported',
  ),
  'layer norm after embeddings': (
    {'layernorm_embedding': True},
    None,
    r"option transformer-postprocess-emb='n' is not supported",
  ),
  'other pre/post-processing': (
    {'extra_config': {'transformer-preprocess': 'n', 'transformer-postprocess-top': ''}},
    None,
    r'transformer-preprocess/postprocess/postprocess-top = n/dan/ is not supported',
  ),
  'unknown option': (
    {'extra_config': {'transformer-new-thing': 1}},
    None,
    r'unknown option\(s\) transformer-new-thing in special:model.yml',
  ),
  'not a transformer': (
    {'extra_config': {'type': 'amun'}},
    None,
    r"option type='amun' is not supported",
  ),
  'multi-source': (
    {},
    lambda p, a: _rewritten(
      p, a, **{'special:model.yml': _meta_with(a, **{'dim-vocabs': [10, 10, 10]})}
    ),
    r'option dim-vocabs=\[10, 10, 10\] is not supported',
  ),
  'gelu of an unknown Marian': (
    {'activation': 'gelu', 'extra_config': {'version': 'dev'}},
    None,
    r"option version='dev': cannot tell which gelu",
  ),
  'separate vocabularies': (
    {'tied_embeddings': 'none', 'target_vocab_size': 9},
    None,
    r'separate source \(10\) and target \(9\) vocabularies are not supported',
  ),
  'pickled object array': (
    {},
    _with_pickle,
    r'tensor oops: Object arrays cannot be loaded when allow_pickle=False',
  ),
  'no options': (
    {},
    lambda p, a: _rewritten(p, a, drop=['special:model.yml']),
    r'no special:model.yml',
  ),
}


@pytest.mark.parametrize('name', list(REFUSALS))
def test_unsupported_models_are_one_line_errors(name, tmp_path):
  kwargs, change, message = REFUSALS[name]
  npz = str(tmp_path / 'model.npz')
  arrays = _tiny(npz, **kwargs)
  if change is not None:
    change(npz, arrays)
  with pytest.raises(UserInputError, match=f'^{re.escape(npz)}: {message}') as error:
    marian.read_model(npz, str(tmp_path / 'vocab.yml'), str(tmp_path / 'none.spm'))
  assert '\n' not in str(error.value)


def test_nul_padded_options_and_legacy_layouts_are_read(spm_model, tmp_path):
  """special:model.yml NUL-padded to 256 bytes (Marian >= 2025-05); an untied legacy output
  layer `decoder_ff_logit_out_W` without logits bias; gelu's two meanings by Marian version."""
  spm_path = spm_model[0]
  npz = str(tmp_path / 'model.npz')
  vocab = str(tmp_path / 'vocab.yml')
  arrays = _tiny(
    npz, pad_meta=True, tied_embeddings='none', legacy_output_w=True, logits_bias=False
  )
  assert arrays['special:model.yml'].size % 256 == 0
  config, params, _, origin, _ = marian.read_model(npz, vocab, spm_path)
  assert not config.share_embeddings and origin['mapped']['embeddings'] == 'none'
  assert config.vocab_size == 12 + origin['mapped']['pieces_appended_as_unk']
  ids = marian.our_ids(10)
  np.testing.assert_array_equal(
    params['output_projection']['kernel'][:, ids], arrays['decoder_ff_logit_out_W']
  )
  assert not params['logits_bias'][ids].any()
  for version, activation in (('v1.12.2 ab 2023-02-27', 'gelu_sigmoid'), ('v1.12.3 cd', 'gelu')):
    _tiny(npz, activation='gelu', extra_config={'version': version})
    assert marian.read_model(npz, vocab, spm_path)[0].ffn_activation == activation


def test_vocabulary_mistakes_are_one_line_errors(spm_model, tmp_path):
  spm_path = spm_model[0]
  npz = str(tmp_path / 'model.npz')
  vocab = str(tmp_path / 'vocab.yml')
  _tiny(npz)
  with pytest.raises(UserInputError, match='needs --spm=source.spm'):
    marian.read_model(npz, vocab)
  marian_npz.write_vocab_yml(vocab, marian_npz.make_tokens(11))
  with pytest.raises(UserInputError, match=f'^{vocab}: 11 pieces, but the model {npz} has 10$'):
    marian.read_model(npz, vocab, spm_path)
  with open(vocab, 'w') as f:
    f.write('</s>: 0\n<unk>: 1\na: 2\nb: 2\n')
  with pytest.raises(UserInputError, match=f"^{vocab}: line 4: bad or repeated id '2'$"):
    marian.read_model(npz, vocab, spm_path)
  other = tmp_path / 'other'
  other.mkdir()
  _tiny(str(other / 'model.npz'), tied_embeddings='target')
  marian_npz.write_vocab_yml(str(other / 'source.vocab.yml'), marian_npz.make_tokens(10))
  marian_npz.write_vocab_yml(
    str(other / 'target.vocab.yml'), marian_npz.make_tokens(10, style='upper')
  )
  os.remove(other / 'vocab.yml')
  with pytest.raises(UserInputError, match='separate source and target vocabularies'):
    marian.read_model(str(other))
