"""Marian's forward pass in NumPy, with its exact inference semantics (sinusoids, epsilon, zero
start embedding): a reference to check an importer against, independent of CTranslate2."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from transformer_jax.testing.marian_npz import LAYER_NORM_EPS, read_marian_config

# ---------------------------------------------------------------------------------------------
# Marian's forward pass, in NumPy


def marian_sinusoids(num_positions: int, dim: int, start: int = 0) -> np.ndarray:
  """Marian's position table [num_positions, dim]: [sin | cos] halves, position p = start + row,
  frequency of column i (mod dim/2) = 10000^(-i / (dim/2 - 1))  (tensors/cpu/
  tensor_operators.cpp SinusoidalPositionEmbeddings)."""
  half = dim // 2
  increment = math.log(10000.0) / (half - 1)
  freqs = np.exp(-increment * np.arange(half, dtype=np.float64))
  angles = (start + np.arange(num_positions, dtype=np.float64))[:, None] * freqs[None, :]
  return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def ctranslate2_marian_sinusoids(num_positions: int, dim: int) -> np.ndarray:
  """The table CTranslate2's MarianConverter stores instead (frequency 10000^(-2i/dim), the
  Hugging Face MarianMT formula; converters/marian.py _make_sinusoidal_position_encodings)."""
  positions = np.arange(num_positions)
  timescales = np.power(10000, 2 * (np.arange(dim) // 2) / dim)
  enc = positions[:, None] / timescales[None, :]
  table = np.zeros_like(enc)
  table[:, : dim // 2] = np.sin(enc[:, 0::2])
  table[:, dim // 2 :] = np.cos(enc[:, 1::2])
  return table.astype(np.float32)


def _activation(name):
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  if name == 'swish':
    return lambda x: x * sigmoid(x)
  if name == 'relu':
    return lambda x: np.maximum(x, 0.0)
  if name == 'gelu':  # Marian before 2023-03 (and CTranslate2's GELUSigmoid); later: erf GELU
    return lambda x: x * sigmoid(1.702 * x)
  raise ValueError(f'unsupported activation {name!r}')


def marian_reference_logits(
  arrays: Mapping[str, np.ndarray],
  source_ids: Sequence[int],
  target_ids: Sequence[int],
  *,
  config: Mapping | None = None,
  eps: float = LAYER_NORM_EPS,
  position_table=marian_sinusoids,
) -> np.ndarray:
  """Teacher-forced logits [len(target_ids) + 1, V] of one sentence, as Marian computes them.

  source_ids must already end with </s> (0): Marian appends it to every source sentence.
  Decoder inputs are [zero vector, emb(t_0), ..., emb(t_{n-1})]; row j predicts t_j (row n:
  </s>). Pass position_table=lambda n, d: ctranslate2_marian_sinusoids(n, d) and eps=1e-5 to
  reproduce what a stock CTranslate2 conversion computes.
  """
  if config is None:
    config = read_marian_config(arrays)
  w = {k: np.asarray(v, np.float64) for k, v in arrays.items() if k != 'special:model.yml'}
  d = config['dim-emb']
  heads = config['transformer-heads']
  pre = 'n' in config['transformer-preprocess']
  emb_norm = 'n' in config['transformer-postprocess-emb']
  act = _activation(config['transformer-ffn-activation'])
  if config.get('transformer-decoder-autoreg', 'self-attention') != 'self-attention':
    raise NotImplementedError('only transformer-decoder-autoreg: self-attention')

  def ln(x, name, suffix=''):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[f'{name}_ln_scale{suffix}'] + w[
      f'{name}_ln_bias{suffix}'
    ]

  def mha(prefix, q_in, kv_in, causal):
    q = q_in @ w[f'{prefix}_Wq'] + w[f'{prefix}_bq']
    k = kv_in @ w[f'{prefix}_Wk'] + w[f'{prefix}_bk']
    v = kv_in @ w[f'{prefix}_Wv'] + w[f'{prefix}_bv']
    dk = d // heads
    split = lambda x: x.reshape(x.shape[0], heads, dk).transpose(1, 0, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    z = q @ k.transpose(0, 2, 1) / math.sqrt(dk)
    if causal:
      z = z + np.triu(np.full(z.shape[-2:], -1e9), 1)
    z = np.exp(z - z.max(-1, keepdims=True))
    z /= z.sum(-1, keepdims=True)
    out = (z @ v).transpose(1, 0, 2).reshape(q_in.shape[0], d)
    return out @ w[f'{prefix}_Wo'] + w[f'{prefix}_bo']

  def block(ln_name, x, fn):
    if pre:  # preprocess n, postprocess da
      return x + fn(ln(x, ln_name, '_pre'))
    return ln(x + fn(x), ln_name)  # preprocess '', postprocess dan

  def ffn(prefix, x):
    i = 1
    while f'{prefix}_W{i + 1}' in w:
      x = act(x @ w[f'{prefix}_W{i}'] + w[f'{prefix}_b{i}'])
      i += 1
    return x @ w[f'{prefix}_W{i}'] + w[f'{prefix}_b{i}']

  src_emb = w.get('encoder_Wemb', w.get('Wemb'))
  tgt_emb = w.get('decoder_Wemb', w.get('Wemb'))

  # Encoder: sqrt(d) * emb + sinusoid(positions 0..S-1).
  x = math.sqrt(d) * src_emb[np.asarray(source_ids)]
  x = x + position_table(len(source_ids), d)
  if emb_norm:
    x = ln(x, 'encoder_emb', '_pre')
  for i in range(1, config['enc-depth'] + 1):
    p = f'encoder_l{i}'
    x = block(f'{p}_self_Wo', x, lambda h, p=p: mha(f'{p}_self', h, h, causal=False))
    x = block(f'{p}_ffn_ffn', x, lambda h, p=p: ffn(f'{p}_ffn', h))
  if 'n' in config.get('transformer-postprocess-top', ''):
    x = ln(x, 'encoder_top')
  memory = x

  # Decoder: position 0 is an all-zero embedding (no BOS token), then sqrt(d) * emb(t_j).
  y = np.concatenate([np.zeros((1, d)), math.sqrt(d) * tgt_emb[np.asarray(target_ids, int)]])
  y = y + position_table(len(y), d)
  if emb_norm:
    y = ln(y, 'decoder_emb', '_pre')
  for i in range(1, config['dec-depth'] + 1):
    p = f'decoder_l{i}'
    y = block(f'{p}_self_Wo', y, lambda h, p=p: mha(f'{p}_self', h, h, causal=True))
    # Pre-norm: only the query is normalised; the encoder output goes in as it is.
    y = block(f'{p}_context_Wo', y, lambda h, p=p: mha(f'{p}_context', h, memory, False))
    y = block(f'{p}_ffn_ffn', y, lambda h, p=p: ffn(f'{p}_ffn', h))
  if 'n' in config.get('transformer-postprocess-top', ''):
    y = ln(y, 'decoder_top')

  if 'decoder_ff_logit_out_Wt' in w:
    logits = y @ w['decoder_ff_logit_out_Wt'].T
  elif 'decoder_ff_logit_out_W' in w:
    logits = y @ w['decoder_ff_logit_out_W']
  else:
    logits = y @ tgt_emb.T
  if 'decoder_ff_logit_out_b' in w:
    logits = logits + w['decoder_ff_logit_out_b']
  return logits.astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))
