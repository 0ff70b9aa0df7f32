"""The model's matrix products, with two CPU-only forms behind switches.

`project(x, kernel, num_in_axes)` contracts the last `num_in_axes` axes of x with the leading
axes of kernel. Where `row_major_kernel_grads()` (XLA:CPU) it computes the kernel gradient as a
plain row-major product (see `_matmul_row_major_grads`); elsewhere it is `contract`, gradients
by autodiff. Both give the same gradients (tests/models_test.py).

Every product here (`dot_general`: projections, tied output logits, attention's weighted sums)
of 16-bit float operands accumulates in float32 explicitly where `float32_accumulation()`
(XLA:CPU), then rounds to the operands' dtype. XLA:CPU gives a bfloat16 x bfloat16 -> float32
product to its AMX/AVX-512-BF16 kernels and a bfloat16 -> bfloat16 one to a generic loop:
[128, 512] @ [512, 37000] ran at 581 vs 97 GFLOP/s on a 2-core Xeon with AMX (2026-12-07,
bench/README.md). The result is the same product rounded once at the end, as accelerators
compute it; float32 operands are unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging

_SIXTEEN_BIT_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def float32_accumulation() -> bool:
  """Whether 16-bit float products accumulate in float32 explicitly: on XLA:CPU only (module
  docstring). Accelerators' matrix units accumulate in float32 already, and their programs
  stay as they were. Read at trace time."""
  return jax.default_backend() == 'cpu'


def _accumulated(product, x, y):
  """product(**options) of operands x and y in their dtype: accumulated in float32, then
  rounded once, for 16-bit floats where `float32_accumulation()`."""
  dtype = jnp.result_type(x, y)
  if dtype in _SIXTEEN_BIT_FLOATS and float32_accumulation():
    return product(preferred_element_type=jnp.float32).astype(dtype)
  return product()


def dot_general(x, y, dimension_numbers):
  """`jax.lax.dot_general` in the operands' dtype (`_accumulated`)."""
  return _accumulated(functools.partial(jax.lax.dot_general, x, y, dimension_numbers), x, y)


def einsum(spec: str, x, y):
  """`jnp.einsum` of two operands in their dtype (`_accumulated`): attention's weighted sums
  of values."""
  return _accumulated(functools.partial(jnp.einsum, spec, x, y), x, y)


def matrix_product(x, y):
  """[n, i] @ [i, o] -> [n, o] (`dot_general`)."""
  return dot_general(x, y, (((1,), (0,)), ((), ())))


def attend(query, table):
  """query [..., m] against every row of table [v, m] -> [..., v] (tied output logits, as
  `nn.Embed.attend`), by `dot_general`."""
  return dot_general(query, table, (((query.ndim - 1,), (1,)), ((), ())))


@jax.custom_vjp
def _matmul_row_major_grads(x, kernel):
  """x @ kernel ([n, i] @ [i, o] -> [n, o]) whose kernel gradient is a plain row-major product.

  Autodiff's kernel gradient x^T @ dy contracts the leading (token) axis of both operands.
  XLA:CPU hands such a transposed-operand product to a slower Eigen kernel, while its YNNPACK
  kernels take only products whose left operand contracts its minor axis. Transposing the
  smaller operand explicitly (optimisation barriers stop XLA from folding the transpose back
  into the dot) costs one memory pass and makes training steps faster (measured in
  bench/README.md, "Optimisations tried"). The forward and the input gradient are already in
  the fast form.
  """
  return matrix_product(x, kernel)


def _matmul_row_major_grads_fwd(x, kernel):
  return matrix_product(x, kernel), (x, kernel)


def _matmul_row_major_grads_bwd(residuals, dy):
  x, kernel = residuals  # [n, i], [i, o]; dy: [n, o]
  barrier = jax.lax.optimization_barrier
  dx = dot_general(dy, kernel, (((1,), (1,)), ((), ())))  # [n, i]
  if x.shape[1] <= dy.shape[1]:
    dkernel = matrix_product(barrier(x.T), dy)  # [i, n] @ [n, o]
  else:
    # Transpose dy instead (the FFN's output projection: dy [n, m] is 4x smaller than
    # x [n, d_ff]), then the small [o, i] result.
    dkernel = barrier(matrix_product(barrier(dy.T), x)).T  # ([o, n] @ [n, i])^T
  return dx, dkernel


_matmul_row_major_grads.defvjp(_matmul_row_major_grads_fwd, _matmul_row_major_grads_bwd)


def contract(x, kernel, num_in_axes: int):
  """The last `num_in_axes` axes of x with the leading axes of kernel, gradients by autodiff."""
  return dot_general(
    x, kernel, ((tuple(range(x.ndim - num_in_axes, x.ndim)), tuple(range(num_in_axes))), ((), ()))
  )


_logged = False  # Whether row_major_kernel_grads has logged its choice in this process.


def row_major_kernel_grads() -> bool:
  """The switch for `_matmul_row_major_grads`: on for XLA:CPU only.

  GPU/TPU matmul units read transposed operands natively; an explicit transpose would only add
  a memory pass and block fusion. Read at trace time (tests and bench/levers.py patch it); the
  first call in a process logs which kernel gradient the projections use.
  """
  backend = jax.default_backend()
  row_major = backend == 'cpu'
  global _logged
  if not _logged:
    _logged = True
    logging.info(
      'Projections: kernel gradients by %s (backend %s).',
      'the row-major custom VJP, for XLA:CPU' if row_major else 'autodiff',
      backend,
    )
  return row_major


def project(x, kernel, num_in_axes: int):
  """`contract`, with row-major kernel gradients where `row_major_kernel_grads()`."""
  if not row_major_kernel_grads():
    return contract(x, kernel, num_in_axes)
  batch_shape = x.shape[: x.ndim - num_in_axes]
  in_size = math.prod(kernel.shape[:num_in_axes])
  out_shape = kernel.shape[num_in_axes:]
  # [..., *in] -> [n, i] and [*in, *out] -> [i, o]: row-major merges, no data movement.
  y = _matmul_row_major_grads(x.reshape(-1, in_size), kernel.reshape(in_size, -1))
  return y.reshape(*batch_shape, *out_shape)
