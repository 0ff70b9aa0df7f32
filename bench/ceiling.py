"""The MFU a training step could reach if only its matrix products took time.

    python bench/ceiling.py --size=base     # ~2 min on the 2-core CPU
    python bench/ceiling.py --size=small

Lists every matrix product of one training step of the benchmark's model size (forward, and the
two products per forward product of the backward pass: gradient by input and by weight), at the
exact shapes the model runs, times each distinct product alone (jitted, best and median of
`--repeats` runs, interleaved with the 2048^3 peak product so noise hits all alike), and sums
them. The step's model FLOPs (`flop_count.training_flops`) divided by that sum and by the
measured peak is the MFU of a step in which everything but the matrix products (softmax,
LayerNorm, dropout, the loss, the optimiser update, copies) took no time and every product ran
as fast as it does alone. No real step can beat it; the gap between it and the benchmark's MFU
is what non-matmul work and in-context slowdowns cost.

The FLOPs summed here are checked against `training_flops` (they must agree: the formula
counts exactly these products).
"""

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from transformer_jax.benchmark import flops as flop_count  # noqa: E402
from transformer_jax.benchmark import training  # noqa: E402
from transformer_jax.configs import default  # noqa: E402

flags.DEFINE_string('size', 'base', 'tiny, small, base or big (see transformer_jax.benchmark)')
flags.DEFINE_integer('repeats', 9, 'timed runs of each product (best and median kept)')
flags.DEFINE_integer('rows_per_device', 0, "override the size's batch rows")
FLAGS = flags.FLAGS

# (einsum, shape of operand a, shape of operand b): one product.
Product = tuple[str, tuple[int, ...], tuple[int, ...]]


def _with_backward(equation: str, a: tuple, b: tuple) -> list[Product]:
  """A forward product and its two backward products (d/da and d/db), as einsums."""
  inputs, out = equation.split('->')
  left, right = inputs.split(',')
  sizes = dict(zip(left, a)) | dict(zip(right, b))
  shape = lambda labels: tuple(sizes[c] for c in labels)  # noqa: E731
  return [
    (equation, a, b),
    (f'{out},{right}->{left}', shape(out), b),  # gradient by a
    (f'{left},{out}->{right}', a, shape(out)),
  ]  # gradient by b


def step_products(cfg, rows: int, source_length: int, target_length: int) -> list[Product]:
  """Every matrix product of one training step, with the shapes the model uses."""
  d, h, ff, vocab = cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.vocab_size
  qk, v = cfg.head_qk_dim, cfg.head_v_dim
  products = []

  def attention(q_len, kv_len):
    # Projections: [b, len, d] x [d, h, k] -> [b, len, h, k]; scores and weighted values as
    # the model's einsums; output [b, q, h, v] x [h, v, d].
    products.extend(_with_backward('bld,dhk->blhk', (rows, q_len, d), (d, h, qk)))  # query
    products.extend(_with_backward('bld,dhk->blhk', (rows, kv_len, d), (d, h, qk)))  # key
    products.extend(_with_backward('bld,dhk->blhk', (rows, kv_len, d), (d, h, v)))  # value
    products.extend(_with_backward('bqhd,bkhd->bhqk', (rows, q_len, h, qk), (rows, kv_len, h, qk)))
    products.extend(
      _with_backward('bhqk,bkhd->bqhd', (rows, h, q_len, kv_len), (rows, kv_len, h, v))
    )
    products.extend(_with_backward('blhk,hkd->bld', (rows, q_len, h, v), (h, v, d)))  # out

  def ffn(length):
    products.extend(_with_backward('bld,df->blf', (rows, length, d), (d, ff)))
    products.extend(_with_backward('blf,fd->bld', (rows, length, ff), (ff, d)))

  for _ in range(cfg.num_encoder_layers):
    attention(source_length, source_length)
    ffn(source_length)
  for _ in range(cfg.num_decoder_layers):
    attention(target_length, target_length)
    attention(target_length, source_length)
    ffn(target_length)
  products.extend(_with_backward('bld,dv->blv', (rows, target_length, d), (d, vocab)))
  return products


def product_flops(product: Product) -> float:
  equation, a, b = product
  left, right = equation.split('->')[0].split(',')
  sizes = dict(zip(left, a)) | dict(zip(right, b))
  return 2.0 * float(np.prod([sizes[c] for c in set(left + right)]))


def time_products(distinct: list[Product], repeats: int, dtype: str) -> dict:
  """{product: [seconds of each run]}, runs interleaved across products."""
  compiled = {}
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * len(distinct)))
  for product in distinct:
    equation, a, b = product
    fn = jax.jit(lambda x, y, e=equation: jnp.einsum(e, x, y))
    x = jax.random.normal(next(keys), a, jnp.float32).astype(dtype)
    y = jax.random.normal(next(keys), b, jnp.float32).astype(dtype)
    jax.block_until_ready(fn(x, y))  # Compile and warm up.
    compiled[product] = (fn, x, y)
  times = collections.defaultdict(list)
  for _ in range(repeats):
    for product, (fn, x, y) in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x, y))
      times[product].append(time.perf_counter() - start)
  return times


def main(argv):
  del argv
  spec = training.size_spec(
    FLAGS.size, default.get_config(), dtype='float32', rows_per_device=FLAGS.rows_per_device
  )
  cfg = spec.model_config
  products = step_products(cfg, spec.rows_per_device, spec.source_length, spec.target_length)
  flops = flop_count.training_flops(
    cfg, [spec.source_length] * spec.rows_per_device, [spec.target_length] * spec.rows_per_device
  )['total']
  counted = sum(product_flops(p) for p in products)
  assert abs(counted - flops) <= 1e-9 * flops, (counted, flops)

  counts = collections.Counter(products)
  # The peak product joins the timed ones, so every round measures it too; best kept.
  peak_product = ('mk,kn->mn', (2048, 2048), (2048, 2048))
  times = time_products(list(counts) + [peak_product], FLAGS.repeats, 'float32')
  peak_times = times.pop(peak_product)
  peak = product_flops(peak_product) / min(peak_times)

  best = sum(counts[p] * min(times[p]) for p in counts)
  median = sum(counts[p] * float(np.median(times[p])) for p in counts)
  print(
    f'{FLAGS.size}: {len(products)} products per step ({len(counts)} distinct), '
    f'{flops / 1e12:.3f} TFLOP; peak {peak / 1e9:.0f} GFLOP/s (2048^3 product, best of '
    f'{len(peak_times)}; median {product_flops(peak_product) / np.median(peak_times) / 1e9:.0f})'
  )
  print(f'{"product":22s} {"a":>18s} {"b":>18s} {"count":>5s} {"share":>6s} {"eff(best)":>9s}')
  for product in sorted(counts, key=lambda p: -counts[p] * min(times[p])):
    equation, a, b = product
    share = counts[product] * min(times[product]) / best
    efficiency = product_flops(product) / min(times[product]) / peak
    print(
      f'{equation:22s} {str(a):>18s} {str(b):>18s} {counts[product]:5d} {share:6.1%} '
      f'{efficiency:9.1%}'
    )
  print(f'\nmatmul-only step: {best:.2f} s best, {median:.2f} s median')
  print(
    f'ceiling MFU: {flops / best / peak:.1%} (best times), '
    f'{flops / median / peak:.1%} (median times)'
  )


if __name__ == '__main__':
  app.run(main)
