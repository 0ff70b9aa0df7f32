"""What a training step costs and what the machine can do: model FLOPs and the measured peak.

Model FLOPs per training step (`training_flops`; backward = 2 x forward, hence the 6):

  6 x ((P_enc + P_xkv) x S + P_dec x T + d_model x V x T)
  + 6 x h x (d_k + d_v) x sum over rows of [N_enc x s^2 + N_dec x (t^2 + t x s)]

P_enc / P_dec: matmul parameters of the encoder / decoder stacks (attention projections and FFN
kernels; no embeddings, biases or LayerNorms), except P_xkv, the decoder's cross-attention key
and value projections, which apply to the source tokens; d_model x V the output projection (the
shared embedding used as a matrix), S / T the source / target tokens of the batch, s / t the
lengths of one row, N_enc / N_dec the layer counts. The attention term counts Q K^T and the
weighted sum of values (2 x q x k x h x d_k + 2 x q x k x h x d_v forward) for encoder
self-attention, decoder self-attention (the full t x t square: the causal mask saves no work)
and cross-attention. With h x d_k = h x d_v = d_model it is 6 x 2 x layers x len^2 x d_model x rows
per attention. "flops_per_step" uses the padded lengths (the work the hardware does);
"useful_flops_per_step" the real (non-padding) lengths.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import matmul
from transformer_jax.model.config import TransformerConfig

FLOPS_FORMULA = (
  '6 x ((P_enc + P_xkv) x S + P_dec x T + d_model x V x T) + 6 x h x (d_k + d_v) x sum_rows '
  '[N_enc x s^2 + N_dec x (t^2 + t x s)]; P_* = matmul parameters (attention projections, '
  'FFN kernels; P_xkv = decoder cross-attention key/value, applied to source tokens), '
  'd_model x V = output projection, S/T = source/target tokens; padded lengths '
  'for flops_per_step (hardware work), real lengths for useful_flops_per_step'
)


# ------------------------------------------------------------------------------ FLOPs --


def matmul_params(cfg: TransformerConfig) -> dict[str, int]:
  """Parameters used as matrix-product weights: per stack and the output projection.

  'decoder_cross_kv' (the decoder's cross-attention key and value kernels) is apart from
  'decoder' because those kernels multiply the source tokens, the rest of the decoder the
  target tokens.
  """
  d, h = cfg.d_model, cfg.num_heads
  qk, v = cfg.head_qk_dim, cfg.head_v_dim
  attention = d * h * qk * 2 + d * h * v + h * v * d  # query, key, value, out.
  cross_kv = d * h * qk + d * h * v
  ffn = 2 * d * cfg.d_ff
  return {
    'encoder': cfg.num_encoder_layers * (attention + ffn),
    'decoder': cfg.num_decoder_layers * (2 * attention - cross_kv + ffn),
    'decoder_cross_kv': cfg.num_decoder_layers * cross_kv,
    'output': d * cfg.vocab_size,
  }


def training_flops(
  cfg: TransformerConfig, source_lengths: Sequence[int], target_lengths: Sequence[int]
) -> dict[str, float]:
  """Model FLOPs of one training step (forward + backward) on rows of the given lengths.

  Pass the padded lengths for the work the hardware does, the real lengths for useful work.
  """
  s = np.asarray(source_lengths, np.float64)
  t = np.asarray(target_lengths, np.float64)
  p = matmul_params(cfg)
  dense = 6.0 * (
    (p['encoder'] + p['decoder_cross_kv']) * s.sum() + (p['decoder'] + p['output']) * t.sum()
  )
  per_score = cfg.num_heads * (cfg.head_qk_dim + cfg.head_v_dim)  # FLOPs/2 per (q, k) pair.
  attention = (
    6.0
    * per_score
    * (cfg.num_encoder_layers * (s * s).sum() + cfg.num_decoder_layers * (t * t + t * s).sum())
  )
  return {'dense': float(dense), 'attention': float(attention), 'total': float(dense + attention)}


# ------------------------------------------------------------------------------- Peak --


class PeakTimer:
  """Times an n x n @ n x n product in `dtype` on one device; compiled once, timed on demand.
  The product is the model's (`model.matmul.matrix_product`: 16-bit floats accumulate in float32
  on XLA:CPU), so the peak is of the kernels the model's products use."""

  def __init__(self, n: int, dtype: str, device: jax.Device | None = None):
    self.n, self.dtype = n, dtype
    device = device or jax.devices()[0]
    self._dot = jax.jit(matmul.matrix_product)
    keys = jax.random.split(jax.random.PRNGKey(0))
    self._a, self._b = (
      jax.device_put(jax.random.normal(k, (n, n), jnp.float32).astype(dtype), device) for k in keys
    )
    jax.block_until_ready(self._dot(self._a, self._b))  # Compile and warm up.

  def measure(self, repeats: int) -> dict:
    """Best-of-`repeats` FLOP/s."""
    times = []
    for _ in range(max(repeats, 1)):
      start = time.perf_counter()
      jax.block_until_ready(self._dot(self._a, self._b))
      times.append(time.perf_counter() - start)
    best = min(times)
    return {
      'n': self.n,
      'dtype': self.dtype,
      'repeats': len(times),
      'best_seconds': best,
      'flops': 2.0 * self.n**3,
      'flops_per_second': 2.0 * self.n**3 / best,
    }


def measure_peak(n: int, dtype: str, repeats: int, device: jax.Device | None = None) -> dict:
  """Best-of-`repeats` FLOP/s of an n x n @ n x n product in `dtype` on one device."""
  return PeakTimer(n, dtype, device).measure(repeats)
