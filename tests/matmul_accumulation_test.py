"""16-bit float products accumulate in float32 on XLA:CPU (model/matmul.py): there XLA gives a
bfloat16 x bfloat16 -> float32 product to its AMX / AVX-512-BF16 kernels and a bfloat16 ->
bfloat16 one to a generic loop, 5-6x slower (bench/README.md). The programs that decode and
train in bfloat16 are checked to hold no 16-bit-result product, and the products to be the
float32 product rounded once."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import matmul
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

_SHORT = {'bfloat16': 'bf16', 'float16': 'f16'}  # StableHLO's names.
_DOT = re.compile(r'stablehlo\.(dot_general|dot)\b[^\n]*->\s*tensor<([^>]*)>')


def product_result_types(function, *args) -> list[str]:
  """The element type of every matrix product's result in `function`'s lowered program."""
  text = jax.jit(function).lower(*args).as_text()
  return [shape.rsplit('x', 1)[-1] for _, shape in _DOT.findall(text)]


def _operands(dtype, *shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_each_product_accumulates_in_float32_and_rounds_once(dtype, monkeypatch):
  x, kernel, table = _operands(dtype, (6, 4, 32), (32, 48), (40, 32))
  weights, values = _operands(dtype, (2, 3, 5, 7), (2, 3, 7, 8), seed=1)
  products = {
    'project': (
      lambda: matmul.project(x, kernel, 1),
      x.astype(np.float32) @ kernel.astype(np.float32),
    ),
    'attend': (lambda: matmul.attend(x, table), x.astype(np.float32) @ table.astype(np.float32).T),
    'einsum': (
      lambda: matmul.einsum('bhqk,bhkd->bhqd', weights, values),
      np.einsum('bhqk,bhkd->bhqd', weights.astype(np.float32), values.astype(np.float32)),
    ),
  }
  for name, (product, exact) in products.items():
    assert product_result_types(product) == ['f32'], name
    got = np.asarray(product())
    assert got.dtype == np.dtype(dtype), name
    # Rounded once from the float32 sum: equal to the exact product rounded, but where the
    # float32 sums' order moves it across a rounding boundary (one 16-bit step).
    rounded = np.asarray(jnp.asarray(exact, dtype)).astype(np.float32)
    step = np.abs(rounded) * (2.0**-7 if dtype == 'bfloat16' else 2.0**-10)
    np.testing.assert_array_less(np.abs(got.astype(np.float32) - rounded), step + 1e-30)
    assert np.mean(got.astype(np.float32) == rounded) > 0.95, name
  # Off XLA:CPU (accelerators), the product is the plain 16-bit one, as before.
  monkeypatch.setattr(matmul, 'float32_accumulation', lambda: False)
  assert product_result_types(lambda: matmul.attend(x, table)) == [_SHORT[dtype]]


@pytest.mark.parametrize('share_embeddings', [True, False])
def test_bfloat16_decoding_and_training_programs_hold_no_16_bit_product(share_embeddings):
  cfg = TransformerConfig(
    vocab_size=64,
    d_model=32,
    d_ff=64,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=16,
    share_embeddings=share_embeddings,
    dtype='bfloat16',
  )
  model = Transformer(cfg)
  src = jnp.ones((2, 7), jnp.int32)
  tgt = jnp.ones((2, 5), jnp.int32)
  params = model.init(jax.random.key(0), src, tgt)['params']

  def loss(params):
    logits = model.apply({'params': params}, src, tgt)
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

  def cached_beam_step(params):  # The cache's cross-attention projections, then one step.
    encoded = model.apply({'params': params}, src, method=Transformer.encode)
    _, variables = model.apply(
      {'params': params},
      encoded,
      max_decode_len=8,
      beam_size=4,
      method=Transformer.create_cache,
      mutable=['cache'],
    )
    tokens = jnp.ones((8, 1), jnp.int32)  # [b * beam, 1]
    return model.apply(
      {'params': params, **variables},
      encoded,
      src,
      tokens,
      use_cache=True,
      method=Transformer.decode,
      mutable=['cache'],
    )

  for name, function in (
    ('loss and gradients', jax.value_and_grad(loss)),
    ('cached beam step', cached_beam_step),
  ):
    types = product_result_types(function, params)
    assert types and set(types) == {'f32'}, (name, types)


def test_the_benchmark_peak_times_the_models_product():
  """The benchmark's peak (MFU's denominator) in bfloat16 is the product the model computes,
  not the 16-bit-result one XLA:CPU runs 5x slower."""
  from transformer_jax.benchmark.flops import PeakTimer

  timer = PeakTimer(64, 'bfloat16')
  assert product_result_types(timer._dot, timer._a, timer._b) == ['f32']
  assert timer.measure(1)['flops_per_second'] > 0
