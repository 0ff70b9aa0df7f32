"""Tests for transformer_jax.model (transformer, config) and the model side of inference (tiny;
CPU).

Random parameters come from `jax.eval_shape(model.init)` filled with NumPy noise: on CPU,
compiling the model's real (threefry) initialiser takes several seconds per config, while the
shapes cost nothing and the behaviour under test does not depend on the initialiser.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.linen import meta

from transformer_jax.data.tokenizer import BOS_ID, EOS_ID
from transformer_jax.inference import decoding
from transformer_jax.model import matmul
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.inputs import (
  PAD_ID,
  causal_padding_mask,
  padding_mask,
  sinusoidal_positions,
)
from transformer_jax.model.layers import (
  FeedForward,
  MultiHeadAttention,
  Projection,
  dot_product_attention_weights,
)
from transformer_jax.model.transformer import Transformer, count_params

VOCAB = 40  # distinct from every other dimension, so shape checks can find it
TINY = TransformerConfig(
  vocab_size=VOCAB,
  d_model=16,
  d_ff=32,
  num_heads=2,
  num_encoder_layers=2,
  num_decoder_layers=2,
  max_len=16,
)

# Row 0 has two padded source positions; targets (BOS-led, teacher-forced) have no padding.
SRC = np.array([[5, 6, 7, 0, 0], [4, 3, 9, 8, 7]], np.int32)
TGT = np.array([[BOS_ID, 5, 9, 4, 7, 3], [BOS_ID, 8, 8, 6, 11, 10]], np.int32)


# --- helpers -----------------------------------------------------------------------------------


def _fill(shapes, seed):
  """Random float32 arrays for an (unboxed) tree of ShapeDtypeStructs.

  LayerNorm scales around 1, biases small but non-zero (so a bias that is dropped or
  misplaced shows up), everything else N(0, 0.3^2).
  """
  rng = np.random.default_rng(seed)

  def one(path, leaf):
    name = path[-1].key
    noise = rng.normal(size=leaf.shape)
    if name == 'scale':
      value = 1.0 + 0.1 * noise
    elif name == 'bias':
      value = 0.1 * noise
    else:
      value = 0.3 * noise
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(one, shapes)


def _param_shapes(cfg):
  variables = jax.eval_shape(
    Transformer(cfg).init,
    jax.random.key(0),
    jnp.ones((1, 1), jnp.int32),
    jnp.ones((1, 1), jnp.int32),
  )
  return meta.unbox(variables['params'])


@functools.lru_cache(maxsize=None)
def _random_params(cfg, seed=0):
  return _fill(_param_shapes(cfg), seed)


@functools.lru_cache(maxsize=None)
def _apply_fn(cfg):
  """One jitted forward pass per config (cached so tests sharing a config compile once)."""
  model = Transformer(cfg)
  return jax.jit(lambda params, src, tgt: model.apply({'params': params}, src, tgt))


def _logits(cfg, params, src=SRC, tgt=TGT):
  return np.asarray(_apply_fn(cfg)(params, src, tgt))


def _paths(tree):
  return {
    '/'.join(p.key for p in path): leaf.shape
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


# --- attention ---------------------------------------------------------------------------------


def _softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize('qk_dim,v_dim', [(None, None), (3, 5)])
def test_multi_head_attention_matches_numpy(qk_dim, v_dim):
  cfg = TransformerConfig(vocab_size=8, d_model=16, d_ff=8, num_heads=2, qk_dim=qk_dim, v_dim=v_dim)
  rng = np.random.default_rng(1)
  # Different query and key lengths so a transposed axis cannot go unnoticed.
  xq = rng.normal(size=(2, 3, 16)).astype(np.float32)
  xkv = rng.normal(size=(2, 4, 16)).astype(np.float32)
  key_ids = np.array([[5, 6, 0, 0], [7, 8, 9, 3]], np.int32)
  mask = padding_mask(None, jnp.asarray(key_ids))
  module = MultiHeadAttention(cfg, kind='cross')
  shapes = meta.unbox(jax.eval_shape(module.init, jax.random.key(0), xq, xkv, mask, True)['params'])
  params = _fill(shapes, seed=2)
  out, state = module.apply({'params': params}, xq, xkv, mask, True, mutable=['intermediates'])

  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  dk = cfg.head_qk_dim
  # Attention projections have no biases (tensor2tensor / Flax WMT).
  assert set(p['query']) == set(p['key']) == set(p['value']) == set(p['out']) == {'kernel'}
  q = np.einsum('bqm,mhd->bqhd', xq, p['query']['kernel'])
  k = np.einsum('bkm,mhd->bkhd', xkv, p['key']['kernel'])
  v = np.einsum('bkm,mhd->bkhd', xkv, p['value']['kernel'])
  scores = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(dk)
  scores = np.where((key_ids != PAD_ID)[:, None, None, :], scores, -np.inf)
  weights = _softmax(scores)  # masked keys get exactly 0
  heads = np.einsum('bhqk,bkhd->bqhd', weights, v)
  expected = np.einsum('bqhd,hdm->bqm', heads, p['out']['kernel'])

  assert out.shape == (2, 3, 16) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
  (sown,) = state['intermediates']['attention_weights']
  np.testing.assert_allclose(np.asarray(sown), weights, atol=1e-6)
  assert np.all(np.asarray(sown)[0, :, :, 2:] < 1e-6)  # row 0's padded keys


# (x features, kernel shape, num_in_axes): both branches of the kernel gradient (x narrower
# than dy: transpose x; x wider: transpose dy) and a two-axis contraction (attention output).
@pytest.mark.parametrize('row_major', [True, False])
@pytest.mark.parametrize(
  'features, num_in_axes, in_shape',
  [((12,), 1, (5,)), ((3,), 1, (7,)), ((2, 4), 1, (6,)), ((6,), 2, (2, 4))],
)
def test_projection_gradients_equal_plain_dot_general(
  features, num_in_axes, in_shape, row_major, monkeypatch
):
  # The CPU path's custom VJP (explicit transposes for the kernel gradient) must give exactly
  # the gradients of the one-line contraction it replaces; accelerators take that contraction
  # itself (the switch is flipped here; the arithmetic still runs on CPU).
  monkeypatch.setattr(matmul, 'row_major_kernel_grads', lambda: row_major)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, *in_shape)), jnp.float32)
  layer = Projection(features, num_in_axes, ('a',) * (num_in_axes + len(features)))
  params = meta.unbox(layer.init(jax.random.key(0), x))['params']
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  cotangent = jnp.asarray(rng.normal(size=(2, 3, *features)), jnp.float32)

  def projection_loss(params, x):
    return jnp.sum(layer.apply({'params': params}, x) * cotangent)

  def reference_loss(params, x):
    contracted = tuple(range(x.ndim - num_in_axes, x.ndim))
    y = (
      jax.lax.dot_general(x, params['kernel'], ((contracted, tuple(range(num_in_axes))), ((), ())))
      + params['bias']
    )
    return jnp.sum(y * cotangent)

  got = jax.grad(projection_loss, argnums=(0, 1))(params, x)
  want = jax.grad(reference_loss, argnums=(0, 1))(params, x)
  jaxpr = str(jax.make_jaxpr(projection_loss)(params, x))
  assert ('custom_vjp' in jaxpr) == row_major  # the path under test was taken
  np.testing.assert_allclose(got[0]['kernel'], want[0]['kernel'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[0]['bias'], want[0]['bias'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
  assert np.abs(want[0]['kernel']).max() > 0.1  # a real gradient, not zeros on both sides


def test_dot_product_attention_weights_masks_and_normalises():
  rng = np.random.default_rng(3)
  q = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)  # [b, q, h, d]
  k = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)  # [b, k, h, d]
  # Large scores on the keys that will be masked: the mask must win anyway.
  k[0, 3:] *= 50.0
  key_ids = np.array([[4, 4, 4, 0, 0], [4, 4, 4, 4, 0]], np.int32)
  mask = padding_mask(None, jnp.asarray(key_ids))
  assert mask.shape == (2, 1, 1, 5)
  w = np.asarray(dot_product_attention_weights(jnp.asarray(q), jnp.asarray(k), mask))
  assert w.shape == (2, 2, 3, 5) and w.dtype == np.float32
  assert np.all(w[0, ..., 3:] < 1e-6) and np.all(w[1, ..., 4:] < 1e-6)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
  scores = np.einsum('bqhd,bkhd->bhqk', q.astype(np.float64), k) / 2.0  # sqrt(d_k) = 2
  scores = np.where((key_ids != 0)[:, None, None, :], scores, -np.inf)
  np.testing.assert_allclose(w, _softmax(scores), atol=1e-6)


def test_causal_padding_mask_values():
  mask = np.asarray(causal_padding_mask(jnp.array([[7, 8, 9, 0]])))
  expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]], bool)
  assert mask.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(mask[0, 0], expected)


def test_separate_qk_and_v_dims():
  cfg = TINY.replace(qk_dim=3, v_dim=5)
  shapes = _paths(_param_shapes(cfg))
  n = cfg.num_encoder_layers
  for stack in (
    'encoder_layers/self_attention',
    'decoder_layers/self_attention',
    'decoder_layers/cross_attention',
  ):
    assert shapes[f'{stack}/query/kernel'] == (n, 16, 2, 3)
    assert shapes[f'{stack}/key/kernel'] == (n, 16, 2, 3)
    assert shapes[f'{stack}/value/kernel'] == (n, 16, 2, 5)
    assert shapes[f'{stack}/out/kernel'] == (n, 2, 5, 16)
  logits = _logits(cfg, _random_params(cfg))
  assert logits.shape == (2, 6, VOCAB) and np.all(np.isfinite(logits))


# --- masking at the model level ----------------------------------------------------------------


@pytest.mark.parametrize('j', [0, 2, 5])
def test_decoder_cannot_see_the_future(j):
  params = _random_params(TINY)
  before = _logits(TINY, params)
  changed = TGT.copy()
  changed[:, j] = (changed[:, j] + 7) % (VOCAB - 3) + 3  # another non-special token
  assert np.all(changed[:, j] != TGT[:, j])
  after = _logits(TINY, params, tgt=changed)
  np.testing.assert_allclose(after[:, :j], before[:, :j], rtol=0, atol=1e-6)
  # Every position from j on (in both rows) sees the change.
  diff = np.abs(after - before).max(axis=-1)  # [b, t]
  assert np.all(diff[:, j:] > 1e-3), diff


def test_extra_source_padding_changes_nothing():
  params = _random_params(TINY)
  before = _logits(TINY, params)
  padded = np.pad(SRC, [(0, 0), (0, 3)])  # both rows get three more PAD_IDs
  after = _logits(TINY, params, src=padded)
  np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)
  # Control: a real token in place of row 1's first pad does change row 1's logits.
  padded[1, 5] = 9
  changed = _logits(TINY, params, src=padded)
  assert np.abs(changed[1] - before[1]).max() > 1e-3
  np.testing.assert_allclose(changed[0], before[0], rtol=0, atol=1e-5)


def test_sinusoidal_positions_match_paper_formula():
  d = 16
  pos = np.arange(50)
  expected = np.zeros((50, d))
  for i in range(d // 2):
    angle = pos / 10000.0 ** (2 * i / d)
    expected[:, 2 * i] = np.sin(angle)
    expected[:, 2 * i + 1] = np.cos(angle)
  got = np.asarray(sinusoidal_positions(jnp.asarray(pos)[None], d))
  assert got.shape == (1, 50, d)
  np.testing.assert_allclose(got[0], expected, atol=2e-5)


def test_concatenated_sinusoids_are_tensor2tensors_and_marians():
  """[sin | cos] halves, timescales 10000^(i / (d/2 - 1)) (tensor2tensor's get_timing_signal_1d;
  Marian's tensor_operators.cpp): position 0 is [0 ... 0 | 1 ... 1]."""
  d, pos = 16, np.arange(50)
  frequency = np.exp(-np.log(10000.0) * np.arange(d // 2) / (d // 2 - 1))
  expected = np.concatenate(
    [np.sin(pos[:, None] * frequency), np.cos(pos[:, None] * frequency)], axis=1
  )
  got = np.asarray(sinusoidal_positions(jnp.asarray(pos)[None], d, 'concatenated'))[0]
  np.testing.assert_allclose(got, expected, atol=2e-5)
  np.testing.assert_array_equal(got[0], [0.0] * 8 + [1.0] * 8)
  assert frequency[-1] == pytest.approx(1e-4)  # The last timescale is 10000 exactly.


@pytest.mark.parametrize(
  'activation, expected',
  [
    ('relu', [0.0, 0.0, 0.5, 2.0]),
    ('swish', [-0.238406, -0.0, 0.311234, 1.761594]),
    ('silu', [-0.238406, -0.0, 0.311234, 1.761594]),
    ('gelu', [-0.045500, -0.0, 0.345731, 1.954500]),  # x Phi(x), with erf
    ('gelu_sigmoid', [-0.064341, 0.0, 0.350388, 1.935659]),  # x sigmoid(1.702 x)
  ],
)
def test_ffn_activations(activation, expected):
  """The FFN with identity projections and zero biases is its activation."""
  cfg = TINY.replace(d_model=4, d_ff=4, num_heads=1, ffn_activation=activation)
  identity = {'kernel': jnp.eye(4), 'bias': jnp.zeros(4)}
  x = jnp.array([[-2.0, 0.0, 0.5, 2.0]])
  y = FeedForward(cfg).apply({'params': {'wi': identity, 'wo': identity}}, x)
  np.testing.assert_allclose(np.asarray(y)[0], expected, atol=1e-5)


def _param_count(cfg):
  return count_params(_param_shapes(cfg))


def test_marian_switches_add_exactly_their_parameters_and_the_logits_bias_adds_to_logits():
  base = _param_count(TINY)
  d, layers = TINY.d_model, TINY.num_encoder_layers
  # Per attention: query, key, value biases [h, d_k] and the output's [d]: 4 d. Encoder layers
  # have one attention, decoder layers two.
  assert _param_count(TINY.replace(attention_bias=True)) == base + 4 * d * 3 * layers
  assert _param_count(TINY.replace(logits_bias=True)) == base + TINY.vocab_size
  for changes in (dict(ffn_activation='swish'), dict(sinusoid_layout='concatenated')):
    assert _param_count(TINY.replace(**changes)) == base
  cfg = TINY.replace(logits_bias=True)
  params = _random_params(cfg)
  bias = np.linspace(-1.0, 1.0, cfg.vocab_size).astype(np.float32)
  without = _logits(cfg, {**params, 'logits_bias': jnp.zeros(cfg.vocab_size)})
  with_bias = _logits(cfg, {**params, 'logits_bias': jnp.asarray(bias)})
  np.testing.assert_allclose(with_bias - without, np.broadcast_to(bias, without.shape), atol=1e-5)


@pytest.mark.parametrize(
  'changes',
  [
    dict(),
    dict(share_embeddings=False),
    dict(logits_bias=True, pre_norm=True),
    dict(share_embeddings=False, logits_bias=True, dtype='bfloat16'),
  ],
  ids=['shared', 'unshared', 'bias_pre_norm', 'unshared_bias_bfloat16'],
)
def test_block_logits_are_the_output_logits_columns(changes):
  cfg = TINY.replace(**changes)
  model = Transformer(cfg)
  params = _random_params(cfg)
  rng = np.random.default_rng(1)
  decoder_output = jnp.asarray(rng.normal(size=(3, 4, cfg.d_model)), jnp.float32)
  whole = model.apply({'params': params}, decoder_output, method=Transformer.output_logits)
  features = model.apply({'params': params}, decoder_output, method=Transformer.output_features)
  if cfg.pre_norm:  # The final layer norm is applied once, by output_features.
    assert np.abs(np.asarray(features) - np.asarray(decoder_output)).max() > 1e-2
  block = jax.jit(
    lambda p, x, start: model.apply({'params': p}, x, start, 7, method=Transformer.block_logits)
  )
  for start in (0, 11, VOCAB - 7):  # A traced start: one program for every block.
    np.testing.assert_allclose(
      block(params, features, start), whole[..., start : start + 7], rtol=0, atol=1e-5
    )


def test_each_marian_switch_changes_the_logits():
  params = _random_params(TINY)
  reference = _logits(TINY, params)
  for changes in (
    dict(ffn_activation='swish'),
    dict(ffn_activation='gelu'),
    dict(sinusoid_layout='concatenated'),
  ):
    assert np.abs(_logits(TINY.replace(**changes), params) - reference).max() > 1e-2, changes
  # Attention biases: zero ones are the bias-free model exactly; random ones (`_fill`) are not.
  cfg = TINY.replace(attention_bias=True)
  biased = traverse_util.flatten_dict(_random_params(cfg))
  projections = ('query', 'key', 'value', 'out')
  is_attention_bias = [k for k in biased if k[-1] == 'bias' and k[-2] in projections]
  assert len(is_attention_bias) == 4 * 3  # Per stack: self (+ cross) attention's four.
  zeroed = {k: jnp.zeros_like(v) if k in is_attention_bias else v for k, v in biased.items()}
  stripped = {k: v for k, v in biased.items() if k not in is_attention_bias}
  np.testing.assert_allclose(
    _logits(cfg, traverse_util.unflatten_dict(zeroed)),
    _logits(TINY, traverse_util.unflatten_dict(stripped)),
    atol=1e-5,
  )
  assert np.abs(_logits(cfg, traverse_util.unflatten_dict(biased)) - reference).max() > 1e-2


def test_source_longer_than_max_len_is_rejected():
  params = _random_params(TINY)
  too_long = jnp.ones((1, TINY.max_len + 1), jnp.int32)
  with pytest.raises(ValueError, match='max_len'):
    jax.eval_shape(_apply_fn(TINY), params, too_long, jnp.ones((1, 2), jnp.int32))


# --- parameter counts and embedding sharing ----------------------------------------------------


def _paper_param_count(vocab, d, d_ff, n):
  """Shared embedding V*d, no output bias, plus per layer:
  encoder: 4*d*d [q, k, v, out; no biases] + 2*d*d_ff + d_ff + d [FFN] + 2*2*d [2 LNs]
  decoder: 8*d*d [self + cross attention] + 2*d*d_ff + d_ff + d + 3*2*d [3 LNs].
  """
  encoder = 4 * d * d + 2 * d * d_ff + d_ff + d + 2 * 2 * d
  decoder = 8 * d * d + 2 * d * d_ff + d_ff + d + 3 * 2 * d
  return vocab * d + n * encoder + n * decoder


@pytest.mark.parametrize('size,paper_count', [('base', 65e6), ('big', 213e6)])
def test_parameter_count_matches_formula_and_paper(size, paper_count):
  cfg = getattr(TransformerConfig, size)(37000)
  count = count_params(_param_shapes(cfg))
  # base: 63,045,632 (3.0% under the paper's 65M); big: 214,171,648 (0.6% over 213M).
  assert count == {'base': 63_045_632, 'big': 214_171_648}[size]
  assert count == _paper_param_count(37000, cfg.d_model, cfg.d_ff, cfg.num_encoder_layers)
  assert abs(count - paper_count) / paper_count < 0.05


def test_shared_embedding_is_one_matrix_and_the_output_layer():
  shapes = _paths(_param_shapes(TINY))
  vocab_matrices = [k for k, s in shapes.items() if VOCAB in s]
  assert vocab_matrices == ['shared_embedding/embedding']
  assert shapes['shared_embedding/embedding'] == (VOCAB, 16)
  # Tied output layer: zeroing embedding row 13 makes logit 13 exactly 0 everywhere.
  params = dict(_random_params(TINY))
  params['shared_embedding'] = {
    'embedding': params['shared_embedding']['embedding'].at[13].set(0.0)
  }
  logits = _logits(TINY, params)
  np.testing.assert_array_equal(logits[..., 13], 0.0)
  assert np.all(np.abs(logits[..., 12]) > 0)


def test_unshared_embeddings_have_their_own_output_projection():
  cfg = TINY.replace(share_embeddings=False)
  shapes = _paths(_param_shapes(cfg))
  vocab_matrices = sorted(k for k, s in shapes.items() if VOCAB in s)
  assert vocab_matrices == [
    'output_projection/kernel',
    'source_embedding/embedding',
    'target_embedding/embedding',
  ]
  assert shapes['source_embedding/embedding'] == (VOCAB, 16)
  assert shapes['target_embedding/embedding'] == (VOCAB, 16)
  assert shapes['output_projection/kernel'] == (16, VOCAB)
  # The logits come from output_projection alone.
  params = dict(_random_params(cfg))
  params['output_projection'] = {'kernel': jnp.zeros((16, VOCAB))}
  np.testing.assert_array_equal(_logits(cfg, params), 0.0)


# --- variants ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'changes,extra_params',
  [
    (dict(pre_norm=True), ['encoder_norm/scale', 'decoder_norm/scale']),
    (
      dict(learned_positions=True),
      ['source_embedder/position_embedding', 'target_embedder/position_embedding'],
    ),
    (dict(share_embeddings=False), ['output_projection/kernel']),
  ],
  ids=['pre_norm', 'learned_positions', 'unshared'],
)
def test_variants_run(changes, extra_params):
  cfg = TINY.replace(**changes)
  params = _random_params(cfg)
  for name in extra_params:
    assert name in _paths(params)
  logits = _logits(cfg, params)
  assert logits.shape == (2, 6, VOCAB) and logits.dtype == np.float32
  assert np.all(np.isfinite(logits))
  # A different model from the default one (same seed gives the shared params same values).
  assert np.abs(logits - _logits(TINY, _random_params(TINY))).max() > 1e-2


def test_bfloat16_compute():
  cfg = TINY.replace(dtype='bfloat16')
  shapes = _param_shapes(cfg)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(shapes))
  params = _random_params(TINY)  # same shapes as the float32 model
  jaxpr = str(jax.make_jaxpr(_apply_fn(cfg))(params, SRC, TGT))
  assert 'bf16' in jaxpr  # the compute dtype is actually used
  logits = _logits(cfg, params)
  assert logits.shape == (2, 6, VOCAB) and logits.dtype == np.float32
  assert np.all(np.isfinite(logits))
  # Same function, lower precision.
  reference = _logits(TINY, params)
  # Measured: max |diff| 0.049 for max |logit| 2.55 (1.9%).
  assert np.abs(logits - reference).max() < 0.05 * np.abs(reference).max()


def _assert_same_training_gradients(params, cfg, reference_cfg):
  """Parameter gradients of a training-mode loss agree, leaf by leaf, to 1e-5 of each's max."""

  def loss(params, cfg):
    logits = Transformer(cfg).apply({'params': params}, SRC, TGT, deterministic=False)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

  grads = jax.jit(jax.grad(loss), static_argnums=1)(params, cfg)
  reference_grads = jax.jit(jax.grad(loss), static_argnums=1)(params, reference_cfg)
  for got, want in zip(
    jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference_grads)
  ):
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_remat_gives_the_same_logits_and_gradients():
  cfg = TINY.replace(remat=True)
  assert jax.tree_util.tree_structure(_param_shapes(cfg)) == jax.tree_util.tree_structure(
    _param_shapes(TINY)
  )
  params = _random_params(TINY)
  np.testing.assert_allclose(_logits(cfg, params), _logits(TINY, params), rtol=0, atol=1e-5)

  # Recomputation inside the scanned stack, through the projections' custom VJP, must give
  # the gradients of storing the activations (dropout off, so no RNG bookkeeping enters).
  no_dropout = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
  _assert_same_training_gradients(params, cfg.replace(**no_dropout), TINY.replace(**no_dropout))


def test_xla_attention_impl_gives_the_same_logits_gradients_and_cache():
  """jax.nn.dot_product_attention ('xla') computes what the explicit-weights path computes:
  logits, parameter gradients (training mode, dropout off) and cached greedy decoding."""
  cfg = TINY.replace(attention_impl='xla', attention_dropout_rate=0.0, dropout_rate=0.0)
  reference_cfg = cfg.replace(attention_impl='einsum')
  params = _random_params(TINY)
  np.testing.assert_allclose(
    _logits(cfg, params), _logits(reference_cfg, params), rtol=0, atol=1e-5
  )

  _assert_same_training_gradients(params, cfg, reference_cfg)

  src = np.array([[5, 6, 7, 8, 0, 0], [9, 4, 3, 12, 20, 11]], np.int32)
  decoded = [
    np.asarray(
      jax.jit(functools.partial(decoding.greedy_decode, Transformer(c), max_decode_len=10))(
        params, src
      )
    )
    for c in (cfg, reference_cfg)
  ]
  np.testing.assert_array_equal(decoded[0], decoded[1])


def test_attention_maps_come_from_the_einsum_path_whatever_the_impl():
  cfg = TINY.replace(attention_impl='xla', attention_dropout_rate=0.0)
  params = _random_params(TINY)
  _, state = Transformer(cfg).apply({'params': params}, SRC, TGT, mutable=['intermediates'])
  _, reference = Transformer(cfg.replace(attention_impl='einsum')).apply(
    {'params': params}, SRC, TGT, mutable=['intermediates']
  )
  got, want = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(reference)
  assert len(got) == len(want) == 3  # encoder self, decoder self, cross (layers stacked)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
  'changes,message',
  [
    (dict(attention_impl='flash'), 'attention_impl must be one of einsum, xla, cudnn'),
    (dict(attention_impl='xla', attention_dropout_rate=0.1), 'has no attention dropout'),
    (dict(attention_impl='cudnn'), 'needs dtype bfloat16 or float16'),
  ],
)
def test_config_rejects_bad_attention_impl(changes, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(vocab_size=10, **{'attention_dropout_rate': 0.0, **changes})


def test_dropout():
  model = Transformer(TINY)  # dropout_rate 0.1
  params = _random_params(TINY)

  @jax.jit
  def train_logits(key):
    return model.apply({'params': params}, SRC, TGT, deterministic=False, rngs={'dropout': key})

  a = np.asarray(train_logits(jax.random.key(1)))
  b = np.asarray(train_logits(jax.random.key(1)))
  c = np.asarray(train_logits(jax.random.key(2)))
  eval_logits = _logits(TINY, params)
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - eval_logits).max() > 1e-3
  assert np.abs(a - c).max() > 1e-3
  assert np.all(np.isfinite(a))


# --- cached decoding ---------------------------------------------------------------------------


def test_cached_decoding_equals_full_decode():
  model = Transformer(TINY)
  params = _random_params(TINY)
  max_decode_len = 8  # longer than the target: unused cache slots must stay invisible

  @jax.jit
  def cached_logits(params, src, tgt):
    encoded = model.apply({'params': params}, src, method=Transformer.encode)
    cache = decoding.init_cache(model, params, encoded, src, max_decode_len)

    def step(cache, token):  # token [b]
      logits, variables = model.apply(
        {'params': params, 'cache': cache},
        encoded,
        src,
        token[:, None],
        use_cache=True,
        mutable=['cache'],
        method=Transformer.decode,
      )
      return variables['cache'], logits[:, 0]

    cache, logits = jax.lax.scan(step, cache, tgt.T)
    return jnp.swapaxes(logits, 0, 1), cache

  logits, cache = cached_logits(params, SRC, TGT)
  assert int(cache['decode_position']['index']) == TGT.shape[1]
  full = _logits(TINY, params)
  assert logits.shape == full.shape
  np.testing.assert_allclose(np.asarray(logits), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
  'share_embeddings,seed',
  [
    # Untied output layer: a random model's argmax then varies along the sequence.
    pytest.param(False, 6, id='varied_tokens'),
    # This random model scores PAD_ID (0) highest for row 1's first token. Were PAD emitted,
    # the uncached reference would mask it as padding while the cache attends to it, and the
    # outputs would part (they did, before decode.py excluded PAD from the argmax).
    pytest.param(True, 5, id='would_emit_pad'),
  ],
)
def test_greedy_decode_cached_equals_uncached(share_embeddings, seed):
  cfg = TINY.replace(share_embeddings=share_embeddings)
  model = Transformer(cfg)
  params = _random_params(cfg, seed=seed)
  src = np.array([[5, 6, 7, 8, 0, 0], [9, 4, 3, 12, 20, 11]], np.int32)
  outputs = {}
  for use_cache in (True, False):
    decode_fn = jax.jit(
      functools.partial(decoding.greedy_decode, model, max_decode_len=12, use_cache=use_cache)
    )
    outputs[use_cache] = np.asarray(decode_fn(params, src))
  assert outputs[True].shape == (2, 12)
  np.testing.assert_array_equal(outputs[True], outputs[False])
  if share_embeddings:
    return
  # Non-trivial: 12 steps per row without EOS or PAD, and the argmax changes along each row
  # (random models mostly repeat one token; seed 6 gives 4 and 2 distinct tokens).
  assert not np.isin(outputs[True], [EOS_ID, PAD_ID]).any(), outputs[True]
  for row in outputs[True]:
    assert len(set(row.tolist())) >= 2, outputs[True]


# --- config ------------------------------------------------------------------------------------


def test_config_indivisible_d_model():
  with pytest.raises(ValueError, match='d_model'):
    TransformerConfig(vocab_size=10, d_model=10, num_heads=3)
  with pytest.raises(ValueError, match='d_model'):  # qk_dim alone is not enough
    TransformerConfig(vocab_size=10, d_model=10, num_heads=3, qk_dim=4)
  cfg = TransformerConfig(vocab_size=10, d_model=10, num_heads=3, qk_dim=4, v_dim=2)
  assert (cfg.head_qk_dim, cfg.head_v_dim) == (4, 2)


@pytest.mark.parametrize(
  'field',
  [
    'vocab_size',
    'd_model',
    'd_ff',
    'num_heads',
    'num_encoder_layers',
    'num_decoder_layers',
    'max_len',
    'qk_dim',
    'v_dim',
  ],
)
@pytest.mark.parametrize('value', [0, -1])
def test_config_rejects_non_positive_sizes(field, value):
  fields = dict(vocab_size=10, d_model=8, num_heads=2)
  fields[field] = value
  with pytest.raises(ValueError, match=field):
    TransformerConfig(**fields)


@pytest.mark.parametrize('field', ['dropout_rate', 'attention_dropout_rate'])
@pytest.mark.parametrize('value', [1.0, -0.1])
def test_config_rejects_bad_dropout(field, value):
  with pytest.raises(ValueError, match=field):
    TransformerConfig(vocab_size=10, **{field: value})


def test_config_rejects_unknown_dtype():
  with pytest.raises(ValueError, match='dtype'):
    TransformerConfig(vocab_size=10, dtype='float64')


def test_config_replace_returns_new_config():
  cfg = TransformerConfig.base(100)
  other = cfg.replace(d_model=256, num_heads=4)
  assert other is not cfg
  assert (cfg.d_model, cfg.num_heads) == (512, 8)
  assert (other.d_model, other.num_heads, other.d_ff) == (256, 4, 2048)
  with pytest.raises(ValueError, match='d_model'):  # replace validates too
    cfg.replace(d_model=100)
  assert TransformerConfig.from_dict(other.to_dict()) == other


def test_config_base_and_big_are_the_papers():
  base = TransformerConfig.base(37000)
  big = TransformerConfig.big(37000)
  for cfg in (base, big):
    assert (cfg.vocab_size, cfg.num_encoder_layers, cfg.num_decoder_layers) == (37000, 6, 6)
    assert (cfg.head_qk_dim, cfg.head_v_dim) == (64, 64)
    assert cfg.share_embeddings and not cfg.pre_norm and not cfg.learned_positions
    assert cfg.attention_dropout_rate == 0.0
  assert (base.d_model, base.d_ff, base.num_heads, base.dropout_rate) == (512, 2048, 8, 0.1)
  assert (big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (1024, 4096, 16, 0.3)
  assert TransformerConfig.big(37000, dropout_rate=0.1).dropout_rate == 0.1
  assert math.isclose(base.layer_norm_epsilon, 1e-6)
