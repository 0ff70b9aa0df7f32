"""The model checked against the equations of "Attention Is All You Need" (Vaswani et al., 2017).

`_reference` recomputes the whole encoder-decoder forward pass in float64 NumPy from the model's
own parameters, equation by equation. Each test also runs the reference as a plausible wrong
architecture (another layer-norm order, GELU, no sqrt(d_model) scale, misplaced dropout, ...)
with the same parameters and asserts that the model is far from it, so each test can fail.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.linen import meta

from transformer_jax import Transformer, TransformerConfig
from transformer_jax.model import inputs as model_inputs

# The model runs in float32 through 4 layers: its logits (|logits| < ~5) are within ~1e-6 of
# the float64 equations, up to ~9e-6 with dropout's 1 / (1 - rate) scaling.
ATOL = RTOL = 1e-5
FAR = 0.1  # A wrong architecture must miss the model by 10^4 times the tolerance.
CFG = TransformerConfig(
  vocab_size=11,
  d_model=8,
  d_ff=16,
  num_heads=2,
  num_encoder_layers=2,
  num_decoder_layers=2,
  max_len=8,
  dropout_rate=0.1,
  attention_dropout_rate=0.1,
)
# Padding id 0: row 0 pads two source positions and one target position.
SRC = np.array([[5, 6, 7, 0, 0], [4, 3, 9, 8, 7]], np.int32)
TGT = np.array([[1, 5, 9, 4], [1, 8, 2, 0]], np.int32)
# The residual blocks, named (stack, block) as in the parameter tree; also their dropout sites.
BLOCKS = [
  ('encoder_layers', 'attention_block'),
  ('encoder_layers', 'ffn_block'),
  ('decoder_layers', 'self_attention_block'),
  ('decoder_layers', 'cross_attention_block'),
  ('decoder_layers', 'ffn_block'),
]
# What the paper does; `_reference(..., **changes)` swaps in a wrong variant of one piece.
PAPER = dict(
  order=None,
  orders={},
  final_norm=None,
  act='relu',
  ffn_bias=True,
  emb_scale=True,
  pe='interleaved',
  logit_scale=1.0,
  qk_scale=True,
  causal=True,
  src_mask=True,
  drop_before_pe=False,
)


@functools.lru_cache(maxsize=None)
def _params(cfg):
  """Random float32 parameters in the model's tree (shapes from eval_shape: no init compile).

  LayerNorm scales and all biases are far from the initialiser's 1 and 0, so that a dropped or
  misplaced one shows.
  """
  ids = jnp.ones((1, 1), jnp.int32)
  shapes = meta.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), ids, ids))
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    noise = rng.normal(size=leaf.shape)
    value = {'scale': 1.0 + 0.3 * noise, 'bias': 0.3 * noise}.get(path[-1].key, 0.5 * noise)
    return jnp.asarray(value, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes['params'])


def _capture(next_fun, args, kwargs, context):
  """Method interceptor that only watches: sows the encoder output and each dropout's mask.

  Flax's dropout returns where(keep, x / (1 - rate), 0), so its kept entries are its non-zero
  outputs (an input entry that is exactly 0, e.g. a masked attention weight, is 0 either way).
  Sown into 'intermediates', nn.scan stacks a layer's masks like its parameters: [layers, ...].
  """
  y = next_fun(*args, **kwargs)
  if isinstance(context.module, nn.Dropout) and context.method_name == '__call__':
    context.module.sow('intermediates', 'dropout_keep', y != 0)
  elif isinstance(context.module, Transformer) and context.method_name == 'encode':
    context.module.sow('intermediates', 'encoded', y)
  return y


@functools.lru_cache(maxsize=None)
def _model(cfg, dropout_seed=None):
  """(logits [b, t, v], encoder output [b, s, m], dropout keep masks by site) of the model.

  dropout_seed None: deterministic=True. A site is the module path of the dropout's parent,
  e.g. ('encoder_layers', 'ffn_block') or ('decoder_layers', 'cross_attention') (attention
  weights).
  """

  def forward(params):
    kwargs = (
      {}
      if dropout_seed is None
      else dict(deterministic=False, rngs={'dropout': jax.random.key(dropout_seed)})
    )
    with nn.intercept_methods(_capture):
      return Transformer(cfg).apply(
        {'params': params}, SRC, TGT, mutable=['intermediates'], **kwargs
      )

  logits, state = jax.jit(forward)(_params(cfg))
  sown = traverse_util.flatten_dict(state['intermediates'])
  masks = [
    (tuple(k for k in path[:-1] if not k.startswith('Dropout')), np.asarray(value[0]))
    for path, value in sown.items()
    if path[-1] == 'dropout_keep'
  ]
  keep = dict(masks)
  assert len(keep) == len(masks), f'two dropouts in one module: {sorted(p for p, _ in masks)}'
  return np.asarray(logits, np.float64), np.asarray(sown[('encoded',)][0], np.float64), keep


def _sinusoids(length, d, layout='interleaved'):
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)). [len, d]."""
  angle = np.arange(length)[:, None] / 10000.0 ** (2 * np.arange(d // 2)[None] / d)
  if layout == 'concat':  # tensor2tensor's layout: all sines, then all cosines.
    return np.concatenate([np.sin(angle), np.cos(angle)], -1)
  pe = np.zeros((length, d))
  pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
  return pe


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def _reference(cfg, keep=None, **changes):
  """(logits [b, t, v], encoder output [b, s, m]) for SRC, TGT by the paper's equations in
  float64.

  keep: dropout keep masks by site as `_model` returns them (None: no dropout). changes: keys
  of PAPER; `order` sets every block's residual order, `orders` single blocks':
  'post' LN(x + Drop(F(x))) (paper), 'pre' x + Drop(F(LN(x))), 'sublayer_norm'
  x + LN(Drop(F(x))), 'drop_after_norm' Drop(LN(x + F(x))).
  """
  opt = {**PAPER, **changes}
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), _params(cfg))
  keep = keep or {}
  d, eps = cfg.d_model, cfg.layer_norm_epsilon

  def drop(x, site, rate, layer=None):
    if site not in keep:
      return x
    return x * (keep[site] if layer is None else keep[site][layer]) / (1.0 - rate)

  def residual(x, sublayer, stack, block, layer_p, i):
    def norm(y):
      return _layer_norm(y, layer_p[block]['norm'], eps)

    def dropped(y):
      return drop(y, (stack, block), cfg.dropout_rate, i)

    order = opt['orders'].get((stack, block), opt['order'] or ('pre' if cfg.pre_norm else 'post'))
    if order == 'post':
      return norm(x + dropped(sublayer(x)))
    if order == 'pre':
      return x + dropped(sublayer(norm(x)))
    if order == 'sublayer_norm':
      return x + norm(dropped(sublayer(x)))
    assert order == 'drop_after_norm', order
    return dropped(norm(x + sublayer(x)))

  def attention(xq, xkv, mask, ap, site, i):
    q = np.einsum('bqm,mhd->bqhd', xq, ap['query']['kernel'])  # [batch, q_len, heads, d_k]
    k = np.einsum('bkm,mhd->bkhd', xkv, ap['key']['kernel'])  # [batch, k_len, heads, d_k]
    v = np.einsum('bkm,mhd->bkhd', xkv, ap['value']['kernel'])  # [batch, k_len, heads, d_v]
    logits = np.einsum('bqhd,bkhd->bhqk', q, k)  # [batch, heads, q_len, k_len]
    if opt['qk_scale']:
      logits = logits / math.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -1e9)  # mask: [batch, 1, q_len or 1, k_len]
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights = drop(weights / weights.sum(-1, keepdims=True), site, cfg.attention_dropout_rate, i)
    heads = np.einsum('bhqk,bkhd->bqhd', weights, v)  # [batch, q_len, heads, d_v]
    return np.einsum('bqhd,hdm->bqm', heads, ap['out']['kernel'])  # no biases, as the model

  def ffn(x, fp):
    bias = 1.0 if opt['ffn_bias'] else 0.0
    hidden = x @ fp['wi']['kernel'] + bias * fp['wi']['bias']  # [batch, len, d_ff]
    if opt['act'] == 'relu':
      hidden = np.maximum(0.0, hidden)
    else:  # GELU (tanh form, as jax.nn.gelu)
      inner = math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)
      hidden = 0.5 * hidden * (1 + np.tanh(inner))
    return hidden @ fp['wo']['kernel'] + bias * fp['wo']['bias']

  def embed(ids, table, name):
    x = table[ids] * (math.sqrt(d) if opt['emb_scale'] else 1.0)  # [batch, len, d_model]
    if cfg.learned_positions:
      positions = p[name]['position_embedding'][: ids.shape[1]]  # [len, d_model]
    else:
      positions = _sinusoids(ids.shape[1], d, opt['pe'])
    if opt['drop_before_pe']:
      return drop(x, (name,), cfg.dropout_rate) + positions
    return drop(x + positions, (name,), cfg.dropout_rate)

  def layer(stack, i):  # Layer i's parameters: the stack's arrays have a leading [layers] axis.
    return jax.tree_util.tree_map(lambda a: a[i], p[stack])

  final_norm = cfg.pre_norm if opt['final_norm'] is None else opt['final_norm']
  plain_norm = {'scale': 1.0, 'bias': 0.0}  # For wrong variants of a model without final norms.
  if cfg.share_embeddings:
    src_table = tgt_table = p['shared_embedding']['embedding']  # [vocab, d_model]
    output = src_table.T
  else:
    src_table, tgt_table = p['source_embedding']['embedding'], p['target_embedding']['embedding']
    output = p['output_projection']['kernel']  # [d_model, vocab]
  src_mask = (SRC != 0) | (not opt['src_mask'])  # [batch, src_len]
  causal = np.tril(np.ones((TGT.shape[1],) * 2, bool)) | (not opt['causal'])  # [t, t]
  self_mask = (TGT != 0)[:, None, None, :] & causal  # [batch, 1, tgt_len, tgt_len]
  cross_mask = src_mask[:, None, None, :]  # [batch, 1, 1, src_len]

  x = embed(SRC, src_table, 'source_embedder')
  for i in range(cfg.num_encoder_layers):
    lp = layer('encoder_layers', i)
    x = residual(
      x,
      lambda y: attention(
        y, y, cross_mask, lp['self_attention'], ('encoder_layers', 'self_attention'), i
      ),
      'encoder_layers',
      'attention_block',
      lp,
      i,
    )
    x = residual(x, lambda y: ffn(y, lp['ffn']), 'encoder_layers', 'ffn_block', lp, i)
  encoded = _layer_norm(x, p.get('encoder_norm', plain_norm), eps) if final_norm else x

  x = embed(TGT, tgt_table, 'target_embedder')
  for i in range(cfg.num_decoder_layers):
    lp = layer('decoder_layers', i)
    x = residual(
      x,
      lambda y: attention(
        y, y, self_mask, lp['self_attention'], ('decoder_layers', 'self_attention'), i
      ),
      'decoder_layers',
      'self_attention_block',
      lp,
      i,
    )
    x = residual(
      x,
      lambda y: attention(
        y, encoded, cross_mask, lp['cross_attention'], ('decoder_layers', 'cross_attention'), i
      ),
      'decoder_layers',
      'cross_attention_block',
      lp,
      i,
    )
    x = residual(x, lambda y: ffn(y, lp['ffn']), 'decoder_layers', 'ffn_block', lp, i)
  if final_norm:
    x = _layer_norm(x, p.get('decoder_norm', plain_norm), eps)
  return x @ output * opt['logit_scale'], encoded


def _assert_close(actual, reference):
  np.testing.assert_allclose(actual, reference, atol=ATOL, rtol=RTOL)


def _assert_far(actual, wrong, what):
  gap = np.abs(actual - wrong).max()
  assert gap > FAR, f'the model is within {gap:.2g} of the wrong "{what}": no test of it'


def test_post_ln_sublayer_is_layer_norm_of_x_plus_sublayer():
  """Paper 3.1: every sub-layer's output is LayerNorm(x + Sublayer(x)); no final norm.

  CFG has dropout rates > 0: deterministic=True (the default) must be the dropout-free
  equations exactly.
  """
  logits, encoded, _ = _model(CFG)
  ref_logits, ref_encoded = _reference(CFG)
  _assert_close(encoded, ref_encoded)
  _assert_close(logits, ref_logits)
  # Every block on its own in another order must break it (so each block's order is tested).
  for block in BLOCKS:
    for order in ('pre', 'sublayer_norm'):
      _assert_far(logits, _reference(CFG, orders={block: order})[0], f'{order} in {block}')
  _assert_far(logits, _reference(CFG, order='pre', final_norm=True)[0], 'pre-LN model')
  _assert_far(logits, _reference(CFG, final_norm=True)[0], 'post-LN plus final norms')


def test_pre_norm_sublayer_is_x_plus_sublayer_of_layer_norm():
  """pre_norm=True: x + Sublayer(LN(x)) in every block and one final LN on each stack."""
  cfg = CFG.replace(pre_norm=True)
  logits, encoded, _ = _model(cfg)
  ref_logits, ref_encoded = _reference(cfg)
  _assert_close(encoded, ref_encoded)
  _assert_close(logits, ref_logits)
  _assert_far(logits, _reference(cfg, final_norm=False)[0], 'pre-LN without final norms')
  _assert_far(logits, _reference(cfg, order='post')[0], 'post-LN')
  for block in BLOCKS:
    _assert_far(logits, _reference(cfg, orders={block: 'post'})[0], f'post-LN {block}')


def test_ffn_is_relu_between_two_biased_linear_maps():
  """Paper eq. 2: FFN(x) = max(0, x W1 + b1) W2 + b2. The model's FFN has both biases (its
  attention projections have none, see `_reference.attention`)."""
  logits, _, _ = _model(CFG)
  _assert_close(logits, _reference(CFG)[0])
  _assert_far(logits, _reference(CFG, act='gelu')[0], 'GELU')
  _assert_far(logits, _reference(CFG, ffn_bias=False)[0], 'FFN without biases')


def test_embeddings_are_scaled_plus_sinusoids_and_shared_with_the_output_layer():
  """Paper 3.4/3.5: E[id] * sqrt(d_model) + PE, PE interleaving sin (even features) and cos
  (odd); with share_embeddings one matrix E embeds both sides and gives logits = h E^T."""
  table = np.asarray(model_inputs.sinusoidal_positions(jnp.arange(6)[None], CFG.d_model)[0])
  np.testing.assert_allclose(table, _sinusoids(6, CFG.d_model), atol=1e-6, rtol=0)
  _assert_far(table, _sinusoids(6, CFG.d_model, 'concat'), 'sines-then-cosines layout')
  # One vocabulary-sized matrix in the whole tree: input and output embeddings are shared.
  vocab_sized = [
    path
    for path, leaf in traverse_util.flatten_dict(_params(CFG)).items()
    if CFG.vocab_size in leaf.shape
  ]
  assert vocab_sized == [('shared_embedding', 'embedding')]
  logits, _, _ = _model(CFG)
  _assert_close(logits, _reference(CFG)[0])
  _assert_far(logits, _reference(CFG, emb_scale=False)[0], 'no sqrt(d_model) scale')
  _assert_far(logits, _reference(CFG, pe='concat')[0], 'sines-then-cosines positions')
  _assert_far(
    logits, _reference(CFG, logit_scale=math.sqrt(CFG.d_model))[0], 'logits scaled by sqrt(d_model)'
  )


def test_unshared_embeddings_and_learned_positions():
  """share_embeddings=False: separate source, target and output matrices; learned_positions:
  a [max_len, d_model] table added in place of the sinusoids (Table 3, row E)."""
  cfg = CFG.replace(share_embeddings=False, learned_positions=True)
  logits, encoded, _ = _model(cfg)
  ref_logits, ref_encoded = _reference(cfg)
  _assert_close(encoded, ref_encoded)
  _assert_close(logits, ref_logits)
  _assert_far(logits, _reference(cfg.replace(learned_positions=False))[0], 'sinusoids')


def test_attention_is_scaled_dot_product_with_padding_and_causal_masks():
  """Paper eq. 1: softmax(Q K^T / sqrt(d_k)) V, source padding keys masked everywhere (the
  encoder and cross-attention) and later target positions masked in decoder self-attention."""
  logits, encoded, _ = _model(CFG)
  ref_logits, ref_encoded = _reference(CFG)
  _assert_close(encoded, ref_encoded)
  _assert_close(logits, ref_logits)
  _assert_far(logits, _reference(CFG, qk_scale=False)[0], 'unscaled Q K^T')
  _assert_far(logits, _reference(CFG, causal=False)[0], 'no causal mask')
  _assert_far(logits, _reference(CFG, src_mask=False)[0], 'no source padding mask')
  _assert_far(encoded, _reference(CFG, src_mask=False)[1], 'encoder without padding mask')


@pytest.mark.parametrize('pre_norm', [False, True])
def test_dropout_placement_reproduced_with_the_models_own_masks(pre_norm):
  """Paper 5.4: dropout on each sub-layer's output before the residual add (and the norm), and
  on the sums of embeddings and positions; the config's attention dropout on the weights.

  The masks the model drew (deterministic=False) are captured with a watching method
  interceptor (`_capture`) and handed to the reference, which must then give the model's
  logits exactly; the same masks applied at wrong places must not. The set of sites is fixed
  too, so an added or removed dropout fails.
  """
  cfg = CFG.replace(dropout_rate=0.3, attention_dropout_rate=0.2, pre_norm=pre_norm)
  logits, encoded, keep = _model(cfg, dropout_seed=1)
  attention_sites = [
    ('encoder_layers', 'self_attention'),
    ('decoder_layers', 'self_attention'),
    ('decoder_layers', 'cross_attention'),
  ]
  residual_sites = [('source_embedder',), ('target_embedder',)] + BLOCKS
  assert sorted(keep) == sorted(residual_sites + attention_sites)
  kept = np.concatenate([keep[site].ravel() for site in residual_sites]).mean()
  assert 0.6 < kept < 0.8, kept  # about 1 - dropout_rate: dropout is really on
  ref_logits, ref_encoded = _reference(cfg, keep=keep)
  _assert_close(encoded, ref_encoded)
  _assert_close(logits, ref_logits)
  _assert_far(logits, _reference(cfg)[0], 'no dropout')
  _assert_far(
    logits,
    _reference(cfg, keep=keep, drop_before_pe=True)[0],
    'dropout on token embeddings before adding positions',
  )
  if not pre_norm:
    for block in BLOCKS:
      _assert_far(
        logits,
        _reference(cfg, keep=keep, orders={block: 'drop_after_norm'})[0],
        f'dropout after the norm in {block}',
      )
