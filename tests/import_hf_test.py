"""import_marian --model=<a transformers MarianMT folder or Hub repo id>, verified against
transformers itself: random tiny `MarianMTModel`s of each config variant, saved as transformers
saves them, imported, then compared with their own forward pass, `generate` and
`MarianTokenizer`.

Random models repeat a token for ever, so each variant's weights are drawn larger than
transformers' initialisation and </s>'s final_logits_bias is raised until most outputs end.
Both sides cap an output at MAX_POSITIONS tokens, EOS counted (ours: min(source + 50, max_len)
with max_len = max_position_embeddings; transformers: max_new_tokens).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.importers import hf_files, hf_marian
from transformer_jax.inference.translator import Translator
from transformer_jax.testing import marian_npz

from conftest import REPO_ROOT

torch = pytest.importorskip('torch', reason='torch is not installed (pip install -e .[test])')
transformers = pytest.importorskip(
  'transformers', reason='transformers is not installed (pip install -e .[test])'
)

MAX_POSITIONS = 40
CROSS_GAIN = 4.0
SENTENCES = 200
WORDS = (
  'the cat sat on the mat while two dogs ran quickly over green hills and into deep valleys '
  'where seven old farmers were singing songs about rain sun and wind'
).split()
GERMAN = 'die katze sass auf der matte und zwei hunde liefen schnell ueber gruene huegel'.split()
# name -> (MarianConfig fields, how it is saved, </s> bias, weight std).
VARIANTS = {
  'Helsinki-NLP default: shared tied, swish, scaled, safetensors': (
    dict(activation_function='swish'),
    'safetensors',
    7.0,
    0.3,
  ),
  'untied output, relu, pytorch_model.bin': (
    dict(activation_function='relu', tie_word_embeddings=False),
    'bin',
    7.0,
    0.3,
  ),
  'separate embeddings, gelu, unscaled, sharded safetensors, target.spm apart': (
    dict(activation_function='gelu', share_encoder_decoder_embeddings=False, scale_embedding=False),
    'sharded',
    26.0,
    0.3,
  ),
}


def _tokenizer_files(folder, separate_target, tags=(), vocabs=None):
  """source.spm, target.spm (another model if separate_target) and vocab.json (Marian's joint
  ids: the source's pieces, then the target's it lacks, then `tags`, then <pad>); returns the
  (source, target) vocabulary sizes.

  vocabs 'equal' or 'unequal': separate vocabularies (tokenizer_config.json separate_vocabs) as
  transformers' Marian conversion writes them: vocab.json the source's pieces, target_vocab.json
  the target's, each with <pad> last; 'equal' pads the smaller with pieces no .spm makes (the
  conversion requires equal sizes; a MarianMTModel does not)."""
  rng = np.random.default_rng(0)
  text = [' '.join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(300)]
  pieces = marian_npz.train_sentencepiece(os.path.join(folder, 'source'), text, 80)
  os.rename(os.path.join(folder, 'source.model'), os.path.join(folder, 'source.spm'))
  if separate_target:
    # Every character of both: MarianTokenizer looks a character its .spm lacks up in
    # vocab.json by its text (another .spm's piece there gets its id); ours reads it as <unk>.
    german = [' '.join(rng.choice(GERMAN * 3 + WORDS, rng.integers(3, 12))) for _ in range(300)]
    target = marian_npz.train_sentencepiece(os.path.join(folder, 'target'), german, 60)
    os.rename(os.path.join(folder, 'target.model'), os.path.join(folder, 'target.spm'))
    if vocabs:
      target = target + [f'unused{i}' for i in range(len(pieces) - len(target))]
      pieces = pieces + list(tags)
      if vocabs == 'equal':
        pieces += [f'filler{i}' for i in range(len(target) - len(pieces))]
      with open(os.path.join(folder, 'target_vocab.json'), 'w') as f:
        json.dump({p: i for i, p in enumerate(target + ['<pad>'])}, f)
      with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
        json.dump({'separate_vocabs': True}, f)
      tags = ()
    else:
      pieces += [p for p in target if p not in pieces]
  else:
    shutil.copy(os.path.join(folder, 'source.spm'), os.path.join(folder, 'target.spm'))
    target = None
  vocab = {p: i for i, p in enumerate(pieces + list(tags) + ['<pad>'])}
  with open(os.path.join(folder, 'vocab.json'), 'w') as f:
    json.dump(vocab, f)
  return len(vocab), len(target) + 1 if vocabs else len(vocab)


def make_folder(folder, fields, saved, eos_bias, std, seed=0, tags=()):
  """A random MarianMTModel saved into `folder` as transformers saves one (vocab.json with
  language `tags`, as multilingual OPUS-MT models have); returns it."""
  os.makedirs(folder)
  fields = dict(fields)
  vocabs = fields.pop('vocabs', None)
  separate = fields.get('share_encoder_decoder_embeddings') is False
  vocab_size, target_size = _tokenizer_files(folder, separate, tags, vocabs)
  sizes = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=MAX_POSITIONS,
  )  # `fields` may set others (a smaller model).
  config = transformers.MarianConfig(
    vocab_size=vocab_size,
    decoder_vocab_size=target_size,
    pad_token_id=vocab_size - 1,
    decoder_start_token_id=target_size - 1,
    eos_token_id=0,
    forced_eos_token_id=None,
    init_std=std,
    **{**sizes, 'scale_embedding': True, **fields},
  )
  torch.manual_seed(seed)
  model = transformers.MarianMTModel(config).eval()
  with torch.no_grad():
    model.final_logits_bias.normal_(0, 1.0)
    model.final_logits_bias[0, 0] += eos_bias
    # Never <unk>: transformers' skip_special_tokens drops it, our decoding shows it as ' ⁇ '.
    model.final_logits_bias[0, 1] -= 100
    for module in model.modules():  # Biases and layer norms too, not only their init values.
      if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is not None:
        module.bias.normal_(0, 0.1)
    if not config.scale_embedding:  # Tables as large as scaled ones would be: positions aside.
      for table in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
        table.weight.mul_(config.d_model**0.5)
    for layer in model.model.decoder.layers:  # The source's say in each step, so outputs differ.
      layer.encoder_attn.out_proj.weight.mul_(CROSS_GAIN)
  if saved == 'bin':  # transformers 4's format; 5 saves safetensors only.
    config.save_pretrained(folder)
    torch.save(model.state_dict(), os.path.join(folder, 'pytorch_model.bin'))
  else:
    model.save_pretrained(folder, max_shard_size='20KB' if saved == 'sharded' else '5GB')
  return model


@pytest.fixture(scope='module', params=list(VARIANTS))
def imported(request, tmp_path_factory):
  """(variant, HF model, MarianTokenizer, our Translator) of one variant, imported."""
  root = tmp_path_factory.mktemp('hf')
  fields, saved, eos_bias, std = VARIANTS[request.param]
  model = make_folder(str(root / 'hf'), fields, saved, eos_bias, std)
  if saved == 'sharded':
    assert os.path.exists(root / 'hf' / 'model.safetensors.index.json')
  hf_marian.import_hf_model(str(root / 'hf'), str(root / 'workdir'))
  tokenizer = transformers.MarianTokenizer.from_pretrained(str(root / 'hf'))
  return request.param, model, tokenizer, Translator.from_checkpoint(str(root / 'workdir'))


def _sources(seed=1, count=SENTENCES):
  rng = np.random.default_rng(seed)
  return [' '.join(rng.choice(WORDS, rng.integers(1, 10))) for _ in range(count)]


def _id_maps(tokenizer, translator):
  """(source, target) arrays of HF id -> ours, by piece name (what the ids mean, not how the
  importer maps them); <pad> -> our PAD 0."""

  def table(vocab, ours):
    out = np.zeros(len(vocab), np.int64)
    for piece, i in vocab.items():
      out[i] = 0 if piece == '<pad>' else ours._processor.piece_to_id(piece)
    return out

  target_vocab = tokenizer.target_encoder if tokenizer.separate_vocabs else tokenizer.encoder
  return (
    table(tokenizer.encoder, translator.tokenizer),
    table(target_vocab, translator.target_tokenizer),
  )


def _padded(rows, pad):
  """Lists of ids as one [n, longest] array, `pad` after each."""
  out = np.full((len(rows), max(map(len, rows))), pad, np.int64)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def logits_and_scores_agree(name, model, tokenizer, translator):
  """Logits within 1e-4 of MarianMTModel's, and Translator.score's log-probs its forced
  decoding's, over 64 pairs. Batches padded here, each side with its own <pad>: MarianTokenizer
  pads labels with vocab.json's, another piece's id in target_vocab.json of another size."""
  sources = _sources(count=64)
  rng = np.random.default_rng(2)  # Both languages' words, within the positions there are.
  targets = [' '.join(rng.choice(WORDS + GERMAN, rng.integers(1, 5))) for _ in range(64)]
  pairs = zip(targets, tokenizer(text_target=targets).input_ids)
  targets, labels = zip(*[(t, ids) for t, ids in pairs if len(ids) < MAX_POSITIONS])
  sources = sources[: len(targets)]
  source_pad, target_pad = model.config.pad_token_id, model.config.decoder_start_token_id
  src = _padded(tokenizer(sources).input_ids, source_pad)
  keep = np.zeros((len(labels), max(map(len, labels))), bool)  # Real targets, </s> included.
  for i, ids in enumerate(labels):
    keep[i, : len(ids)] = True
  labels = _padded(labels, target_pad)
  decoder_in = np.concatenate([np.full((len(sources), 1), target_pad), labels[:, :-1]], 1)
  with torch.no_grad():
    theirs = model(
      input_ids=torch.from_numpy(src),
      attention_mask=torch.from_numpy((src != source_pad).astype(np.int64)),
      decoder_input_ids=torch.from_numpy(decoder_in),
    ).logits.numpy()
  source_ids, target_ids = _id_maps(tokenizer, translator)
  tgt_in = target_ids[decoder_in]
  tgt_in[:, 0] = 2  # Our BOS, whose row is <pad>'s.
  ours = translator.model.apply({'params': translator.params}, source_ids[src], tgt_in)
  diff = np.abs(np.asarray(ours)[..., target_ids] - theirs)[keep]
  assert diff.max() < 1e-4, (name, diff.max())
  # Forced decoding: transformers' log-softmax without <pad> (never a prediction, as our
  # scores and the Helsinki-NLP generation configs have it) against Translator.score.
  theirs[..., target_pad] = -np.inf
  logp = theirs - np.logaddexp.reduce(theirs, axis=-1, keepdims=True)
  want = [logp[i, keep[i], labels[i, keep[i]]].sum() for i in range(len(sources))]
  got = [s['log_prob'] for s in translator.score(sources, list(targets))]
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-5, err_msg=name)


def test_logits_and_forced_scores_equal_transformers(imported):
  logits_and_scores_agree(*imported)


def _generate(model, tokenizer, sources, **options):
  """generate's outputs (texts as MarianTokenizer decodes them, and ids), never the target's
  <pad>; finished rows padded with it."""
  target_pad = model.config.decoder_start_token_id
  batch = tokenizer(sources, return_tensors='pt', padding=True)
  with torch.no_grad():
    out = model.generate(
      **batch,
      do_sample=False,
      max_new_tokens=MAX_POSITIONS - 1,
      bad_words_ids=[[target_pad]],
      pad_token_id=target_pad,
      **options,
    )
  return [tokenizer.decode(row, skip_special_tokens=True) for row in out], out


def test_greedy_and_beam_equal_generate(imported):
  name, model, tokenizer, translator = imported
  sources = _sources()
  theirs, rows = _generate(model, tokenizer, sources, num_beams=1)
  ended = sum(int((row[1:] == 0).any()) for row in rows)
  length = np.mean([len(t.split()) for t in theirs])
  ours = translator.translate(sources, beam_size=1)
  greedy = sum(a == b for a, b in zip(ours, theirs))
  theirs, _ = _generate(model, tokenizer, sources, num_beams=4, length_penalty=0.0)
  ours = translator.translate(sources, beam_size=4, alpha=0.0)
  equal = sum(a == b for a, b in zip(ours, theirs))
  print(
    f'{name}: ended {ended}, greedy {length:.1f} words, greedy {greedy}/{SENTENCES}, '
    f'beam 4 {equal}/{SENTENCES}'
  )
  assert ended >= SENTENCES // 2, (name, ended)  # Real decisions: most outputs end.
  assert greedy == SENTENCES, name
  assert equal >= 0.98 * SENTENCES, (name, equal)


def test_tokenizer_ids_equal_marian_tokenizer(tmp_path):
  """Sources by source.spm, targets by target.spm (another model), ids as MarianTokenizer's."""
  folder = str(tmp_path / 'hf')
  fields, saved, eos_bias, std = VARIANTS[list(VARIANTS)[2]]
  make_folder(folder, fields, saved, eos_bias, std)
  hf_marian.import_hf_model(folder, str(tmp_path / 'workdir'))
  tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
  translator = Translator.from_checkpoint(str(tmp_path / 'workdir'))
  source_ids, target_ids = _id_maps(tokenizer, translator)
  rng = np.random.default_rng(3)
  # Each side's text in characters its .spm knows (what MarianTokenizer does with the others:
  # _tokenizer_files).
  sources = [' '.join(rng.choice(WORDS, rng.integers(1, 8))) for _ in range(100)]
  targets = [' '.join(rng.choice(WORDS + GERMAN, rng.integers(1, 8))) for _ in range(100)]
  for theirs, ours, texts, table in (
    (tokenizer(sources).input_ids, translator.tokenizer, sources, source_ids),
    (tokenizer(text_target=targets).input_ids, translator.target_tokenizer, targets, target_ids),
  ):
    for text, ids in zip(texts, theirs):
      assert list(table[ids[:-1]]) == ours.encode(text), text
  assert translator.tokenizer.model_bytes != translator.target_tokenizer.model_bytes


def _folder(tmp_path, **changes):
  """A small valid MarianMT folder (the first variant), with config.json fields changed."""
  folder = str(tmp_path / 'hf')
  fields, saved, eos_bias, std = VARIANTS[list(VARIANTS)[0]]
  make_folder(folder, fields, saved, eos_bias, std)
  if changes:
    with open(os.path.join(folder, 'config.json')) as f:
      config = json.load(f)
    config.update(changes)
    with open(os.path.join(folder, 'config.json'), 'w') as f:
      json.dump(config, f)
  return folder


@pytest.mark.parametrize(
  'changes, words',
  [
    (dict(model_type='bart'), 'model_type'),
    (dict(normalize_before=True), 'normalize_before'),
    (dict(static_position_embeddings=False), 'static_position_embeddings'),
    (dict(activation_function='gelu_new'), 'activation_function'),
    # Separate sizes need separate vocabularies (target_vocab.json); these have one.
    (
      dict(
        share_encoder_decoder_embeddings=False, decoder_vocab_size=50, decoder_start_token_id=49
      ),
      'decoder_vocab_size=50 is not vocab_size=.* needs a target_vocab.json',
    ),
    (dict(decoder_start_token_id=3), 'decoder_start_token_id'),
    (dict(decoder_ffn_dim=128), 'decoder_ffn_dim'),
    (dict(d_model=64), 'has shape'),
  ],
)
def test_config_refused_in_one_line(tmp_path, changes, words):
  folder = _folder(tmp_path, **changes)
  with pytest.raises(UserInputError, match=words) as error:
    hf_marian.read_model(folder)
  assert '\n' not in str(error.value)


def test_bad_folders_refused(tmp_path):
  folder = _folder(tmp_path)
  weights = os.path.join(folder, 'model.safetensors')
  arrays = hf_files.read_safetensors(weights)
  name = 'model.encoder.layers.0.fc1.weight'
  arrays[name] = arrays[name].copy()
  arrays[name][0, 0] = np.nan
  from safetensors.numpy import save_file

  save_file(arrays, weights)
  with pytest.raises(UserInputError, match=f'{name} holds NaN'):
    hf_marian.read_model(folder)
  os.remove(weights)
  with pytest.raises(UserInputError, match='no weights'):
    hf_marian.read_model(folder)
  os.remove(os.path.join(folder, 'target.spm'))
  with pytest.raises(UserInputError, match='target.spm is missing'):
    hf_marian.read_model(folder)
  os.remove(os.path.join(folder, 'config.json'))
  assert not hf_marian.is_hf_model(folder)  # import_marian then reads it as Marian's .npz.
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    f.write('[' * 100_000)
  with pytest.raises(UserInputError, match='nests 100000 deep'):
    hf_marian.read_model(folder)


class _WritesAFile:
  def __init__(self, path):
    self.path = path

  def __reduce__(self):  # Unpickling would call open(path, 'w').
    return (open, (self.path, 'w'))


def test_bin_with_a_pickled_object_is_refused_and_never_run(tmp_path):
  folder = _folder(tmp_path)
  state = {k: torch.from_numpy(v) for k, v in hf_files.read_safetensors(
    os.path.join(folder, 'model.safetensors')).items()}  # fmt: skip
  os.remove(os.path.join(folder, 'model.safetensors'))
  torch.save(state, os.path.join(folder, 'pytorch_model.bin'))
  assert hf_files.read_torch_bin(os.path.join(folder, 'pytorch_model.bin')).keys() == state.keys()
  marker = tmp_path / 'written'
  state['payload'] = _WritesAFile(str(marker))
  torch.save(state, os.path.join(folder, 'pytorch_model.bin'))
  with pytest.raises(
    UserInputError, match=r'pickled (io|builtins)\.open, not only tensors'
  ) as error:
    hf_marian.read_model(folder)
  assert '\n' not in str(error.value) and not marker.exists()


def _command(args, env):
  return subprocess.run(
    [sys.executable, '-m', 'transformer_jax.import_marian', *args],
    cwd=REPO_ROOT,
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_hub_repo_id_from_the_cache_offline(tmp_path):
  """A repo id resolved by huggingface_hub from a cache folder laid out as it lays one out
  (models--owner--name/snapshots/<commit>, refs/main); offline, one missing is one line."""
  folder = _folder(tmp_path)
  repo = tmp_path / 'cache' / 'models--Helsinki-NLP--opus-mt-xx-yy'
  commit = '0123456789abcdef0123456789abcdef01234567'
  shutil.copytree(folder, repo / 'snapshots' / commit)
  (repo / 'refs').mkdir()
  (repo / 'refs' / 'main').write_text(commit)
  env = {'HF_HUB_OFFLINE': '1', 'HF_HUB_CACHE': str(tmp_path / 'cache'), 'JAX_PLATFORMS': 'cpu'}
  workdir = str(tmp_path / 'workdir')
  done = _command(['--model=Helsinki-NLP/opus-mt-xx-yy', f'--workdir={workdir}'], env)
  assert done.returncode == 0, done.stderr
  translator = Translator.from_checkpoint(workdir)
  assert translator.model_config.vocab_size > 4  # The cache's model, read and written.
  done = _command(['--model=Helsinki-NLP/opus-mt-en-zz', f'--workdir={workdir}2'], env)
  assert done.returncode == 2
  error = done.stderr.strip().splitlines()[-1]
  assert 'opus-mt-en-zz' in error and 'HF_HUB_OFFLINE=1' in error, done.stderr
  assert not os.path.exists(workdir + '2')


def _foreign_spm(folder, name):
  """A real .spm of another script (Greek): its pieces are in no vocab.json here."""
  rng = np.random.default_rng(7)
  words = ['καλη', 'μερα', 'σπιτι', 'θαλασσα', 'ψωμι', 'νερο', 'ηλιος', 'φιλος']
  text = [' '.join(rng.choice(words, rng.integers(3, 9))) for _ in range(200)]
  marian_npz.train_sentencepiece(os.path.join(folder, 'foreign'), text, 30)
  os.replace(os.path.join(folder, 'foreign.model'), os.path.join(folder, name))


def test_a_vocab_json_of_another_model_is_refused(tmp_path):
  """vocab.json whose pieces are not the .spm's (issue 50, bad input): one line naming both, exit
  2, nothing written; a target.spm of another model too."""
  folder = _folder(tmp_path)
  with open(os.path.join(folder, 'vocab.json')) as f:
    size = len(json.load(f))
  _foreign_spm(str(tmp_path), 'foreign.spm')
  import sentencepiece

  foreign = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / 'foreign.spm'))
  others = [foreign.id_to_piece(i) for i in range(2, foreign.get_piece_size())]
  others += [f'filler{i}' for i in range(size - 3 - len(others))]
  # Ids 0..size-1, </s> and <unk> first, <pad> last: all MarianTokenizer and config.json ask.
  with open(os.path.join(folder, 'vocab.json'), 'w') as f:
    json.dump({p: i for i, p in enumerate(['</s>', '<unk>', *others, '<pad>'])}, f)
  workdir = str(tmp_path / 'workdir')
  done = _command([f'--model={folder}', f'--workdir={workdir}'], {'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and 'vocab.json: disagrees with source.spm' in lines[0], done.stderr
  assert not os.path.exists(workdir)

  separate = str(tmp_path / 'separate')
  fields, saved, eos_bias, std = VARIANTS[list(VARIANTS)[2]]
  make_folder(separate, fields, saved, eos_bias, std)
  hf_marian.read_model(separate)  # Its own target.spm agrees.
  _foreign_spm(separate, 'target.spm')
  with pytest.raises(UserInputError, match='vocab.json: disagrees with target.spm') as error:
    hf_marian.read_model(separate)
  assert '\n' not in str(error.value)
