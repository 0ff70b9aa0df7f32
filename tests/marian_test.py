"""Our model -> Marian .npz -> import_marian: the same model (tests/marian_npz.py's inverse).

A small random model of ours with Marian's switches is written as an OPUS-MT folder by
`marian_export.write_marian_model_from_params` and read back by `marian.read_model`:
  * with zero PAD and BOS embedding rows and MASKED_LOGIT_BIAS on their logits (what an
    imported model has), every parameter comes back bit for bit, and the vocabulary segments
    text into the same ids;
  * with any PAD row and PAD/BOS logit biases, only those come back changed (Marian has no PAD
    and no BOS): zero rows, bias MASKED_LOGIT_BIAS. The PAD row is never a real input, so the
    logits of every other id at every real position are unchanged; a non-zero BOS row (our
    decoder's first input, Marian's is a zero vector) is refused;
  * the written .npz computes our model's log-probs in Marian's NumPy forward pass
    (`marian_reference_logits`) and in CTranslate2's `MarianConverter` made Marian-exact
    (`marian_npz_check.convert`: Marian's sinusoids and layer-norm epsilon), and CTranslate2's
    greedy outputs are ours.
"""

import types

import ctranslate2
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transformer_jax.importers import marian
from transformer_jax.inference import decoding
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.testing import marian_export, marian_npz_check, marian_reference

WORDS = (
  'the cat sat on the mat while two dogs ran quickly over green hills and into deep valleys '
  'where seven old farmers were singing songs about rain sun and wind'
).split()
VOCAB = 64
MAX_LEN = 64
VARIANTS = {
  'post-norm swish, shared embeddings (Wemb)': dict(ffn_activation='swish'),
  'pre-norm gelu of Marian v1.11, separate embeddings and output': dict(
    ffn_activation='gelu_sigmoid', pre_norm=True, share_embeddings=False
  ),
}


@pytest.fixture(scope='module')
def vocabulary():
  """Our SentencePiece model (pad 0, eos 1, bos 2, unk 3), BPE on random English."""
  rng = np.random.default_rng(0)
  text = [' '.join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(300)]
  return Tokenizer.train(text, vocab_size=VOCAB).model_bytes, text


def _random_params(config, seed, *, zero_pad=True):
  """Random values in every leaf of `Transformer(config)`'s tree (biases and norms too, so each
  mapping is exercised); PAD (if zero_pad) and BOS rows zero, PAD/BOS logit biases
  MASKED_LOGIT_BIAS if zero_pad, else ordinary values."""
  dummy = jnp.ones((1, 1), jnp.int32)
  shapes = nn.meta.unbox(
    jax.eval_shape(Transformer(config).init, jax.random.PRNGKey(0), dummy, dummy)['params']
  )
  rng = np.random.default_rng(seed)

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    value = rng.normal(0.0, 0.3, shape.shape)
    return (value + 1.0 if "'scale'" in name else value).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(leaf, shapes)
  tables = [t for t in ('shared_embedding', 'source_embedding', 'target_embedding') if t in params]
  for table in tables:
    params[table]['embedding'][BOS_ID] = 0.0
    if zero_pad:
      params[table]['embedding'][PAD_ID] = 0.0
  if 'output_projection' in params and zero_pad:
    params['output_projection']['kernel'][:, [PAD_ID, BOS_ID]] = 0.0
  if zero_pad:
    params['logits_bias'][[PAD_ID, BOS_ID]] = marian.MASKED_LOGIT_BIAS
  params['logits_bias'][EOS_ID] += 2.0  # Some outputs end before the length cap.
  return params


def _config(**fields):
  return TransformerConfig(
    vocab_size=VOCAB,
    d_model=16,
    d_ff=32,
    num_heads=2,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=MAX_LEN,
    attention_bias=True,
    logits_bias=True,
    sinusoid_layout='concatenated',
    layer_norm_epsilon=1e-6,
    dropout_rate=0.0,
    **fields,
  )


def _padded(rows, start=()):
  width = max(len(start) + len(r) for r in rows)
  out = np.full((len(rows), width), PAD_ID, np.int32)
  for i, row in enumerate(rows):
    out[i, : len(start) + len(row)] = [*start, *row]
  return out


def _leaves(tree):
  return {
    jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
  }


@pytest.fixture(scope='module', params=list(VARIANTS), ids=list(VARIANTS))
def case(request, vocabulary, tmp_path_factory):
  config = _config(**VARIANTS[request.param])
  params = _random_params(config, seed=len(request.param))
  directory = str(tmp_path_factory.mktemp('marian'))
  files = marian_export.write_marian_model_from_params(directory, params, config, vocabulary[0])
  imported = marian.read_model(directory, max_len=MAX_LEN)
  rng = np.random.default_rng(1)
  marian_ids = [list(rng.integers(1, VOCAB - 2, rng.integers(1, 12))) for _ in range(60)]
  return types.SimpleNamespace(
    name=request.param,
    config=config,
    params=params,
    files=files,
    imported=imported,
    sources=marian_ids[:30],
    targets=marian_ids[30:],
    ids=marian.our_ids(VOCAB - 2),
    model=Transformer(config),
  )


def test_the_import_gives_back_every_parameter_and_the_vocabulary(case, vocabulary):
  config, params, imported_vocabulary, origin, target_vocabulary = case.imported
  assert target_vocabulary is None  # target.spm is a copy of source.spm here.
  assert config == case.config.replace(dropout_rate=config.dropout_rate)
  assert origin['mapped']['pieces_appended_as_unk'] == 0
  ours, back = _leaves(case.params), _leaves(params)
  assert ours.keys() == back.keys()
  for name, value in ours.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  original, again = Tokenizer(vocabulary[0]), Tokenizer(imported_vocabulary)
  assert again.pieces(range(VOCAB)) == original.pieces(range(VOCAB))
  for sentence in vocabulary[1][:50] + ['zebras sing over 7 XYZ hills']:
    assert again.encode(sentence) == original.encode(sentence)
  assert case.files.pieces == ['</s>', '<unk>', *original.pieces(range(4, VOCAB))]


def test_pad_and_bos_are_the_only_changes_and_change_no_other_logit(vocabulary, tmp_path):
  config = _config(ffn_activation='swish')
  params = _random_params(config, seed=3, zero_pad=False)  # A PAD row, PAD/BOS biases.
  marian_export.write_marian_model_from_params(str(tmp_path), params, config, vocabulary[0])
  back = marian.read_model(str(tmp_path), max_len=MAX_LEN)[1]
  table, bias = back['shared_embedding']['embedding'], back['logits_bias']
  assert not table[[PAD_ID, BOS_ID]].any()
  assert (bias[[PAD_ID, BOS_ID]] == marian.MASKED_LOGIT_BIAS).all()
  others = np.setdiff1d(np.arange(VOCAB), [PAD_ID, BOS_ID])
  np.testing.assert_array_equal(table[others], params['shared_embedding']['embedding'][others])
  np.testing.assert_array_equal(bias[others], params['logits_bias'][others])

  rng = np.random.default_rng(2)
  ids = marian.our_ids(VOCAB - 2)
  rows = [ids[rng.integers(1, VOCAB - 2, rng.integers(1, 12))] for _ in range(16)]
  src = _padded([[*r, EOS_ID] for r in rows])  # Padded: PAD rows are inputs here, masked.
  tgt = _padded(rows[::-1], start=[BOS_ID])
  apply = jax.jit(Transformer(config).apply)
  before = np.asarray(apply({'params': params}, src, tgt))
  after = np.asarray(apply({'params': back}, src, tgt))
  real = tgt != PAD_ID
  difference = np.abs(after - before)[real][:, others].max()
  print(f'largest logit difference at real positions, ids other than PAD/BOS: {difference:.1e}')
  assert difference < 1e-6
  params['shared_embedding']['embedding'][BOS_ID] = 0.5
  with pytest.raises(ValueError, match='BOS embedding row is not zero'):
    marian_export.marian_arrays_from_params(params, config)


def test_marian_and_ctranslate2_compute_our_model_from_the_npz(case, tmp_path):
  src = _padded([[*case.ids[s], EOS_ID] for s in case.sources])
  tgt = _padded([case.ids[t] for t in case.targets], start=[BOS_ID])
  logits = jax.jit(case.model.apply)({'params': case.params}, src, tgt)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  reference = max(
    float(
      np.max(
        np.abs(
          marian_reference.log_softmax(
            marian_reference.marian_reference_logits(case.files.arrays, [*s, 0], t)
          )
          - log_probs[r, : len(t) + 1][:, case.ids]
        )
      )
    )
    for r, (s, t) in enumerate(zip(case.sources, case.targets))
  )
  translator = ctranslate2.Translator(
    marian_npz_check.convert(case.files, str(tmp_path / 'ct2'), marian_exact=True),
    intra_threads=1,
  )
  pieces = case.files.pieces
  source_tokens = [[pieces[i] for i in s] for s in case.sources]
  scores = translator.score_batch(source_tokens, [[pieces[i] for i in t] for t in case.targets])
  targets = [[*case.ids[t], EOS_ID] for t in case.targets]
  ours = [log_probs[r, np.arange(len(t)), t] for r, t in enumerate(targets)]
  ctranslate2_difference = max(
    float(np.max(np.abs(np.array(result.log_probs) - o))) for result, o in zip(scores, ours)
  )
  greedy = np.asarray(
    jax.jit(lambda p, s: decoding.greedy_decode(case.model, p, s, max_decode_len=20))(
      case.params, src
    )
  )
  marian_id = {int(our): i for i, our in enumerate(case.ids)}
  mine = [
    [pieces[marian_id[i]] for i in row[: list(row).index(EOS_ID) if EOS_ID in row else None]]
    for row in greedy
  ]
  theirs = translator.translate_batch(
    source_tokens, beam_size=1, max_decoding_length=20, min_decoding_length=0
  )
  equal = sum(m == r.hypotheses[0] for m, r in zip(mine, theirs))
  print(
    f'{case.name}: max |log-prob difference| {reference:.1e} vs marian_npz, '
    f'{ctranslate2_difference:.1e} vs Marian-exact CTranslate2; greedy {equal}/{len(mine)} equal'
  )
  assert reference < 1e-4 and ctranslate2_difference < 1e-4
  assert equal == len(mine) and len({tuple(m) for m in mine}) >= 5
