"""Integrity checks of checkpoints, free of orbax: checksums of every array, and whether saved
parameters fit a model. `checkpointer.py` (the only orbax importer) records and verifies them.

orbax's compressed chunks do not detect every damaged byte (a flipped byte restored silently
with wrong values with orbax 0.12.8), hence the checksums; a checkpoint of another model is
intact, hence a separate, one-line `UserInputError` rather than "damaged".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.common.errors import CorruptCheckpointError, UserInputError


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


@jax.jit
def _leaf_checksums(tree):
  """Two uint32 sums of each leaf's bit patterns: plain and position-weighted (catches swaps)."""

  def checksum(x):
    x = jnp.asarray(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) % 65521) + 1
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])

  return jax.tree_util.tree_map(checksum, tree)


def checksums(tree) -> dict[str, list[int]]:
  """{leaf path: [sum, weighted sum]} of a pytree's arrays (JSON-able)."""
  sums = jax.device_get(_leaf_checksums(tree))
  return {
    _path_name(path): [int(v) for v in value]
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]
  }


def verify_leaves(where: str, tree: Any, expected: dict | None, prefix: str = '') -> None:
  """CorruptCheckpointError if a leaf of `tree` differs from its checksum in `expected`.

  `where` starts the message ('params checkpoint at DIR', 'checkpoint step N at DIR/N');
  `prefix` is prepended to each leaf's path before looking it up (step checkpoints record the
  whole state, so their params are under 'params/'). Leaves without a recorded checksum are
  skipped, as is everything when `expected` is None: written before checksums existed.
  """
  if expected is None:
    return
  for name, value in checksums(tree).items():
    name = prefix + name
    if name in expected and expected[name] != value:
      raise CorruptCheckpointError(
        f'{where} is damaged: {name} does not match the checksum written with it'
      )


def leaves_by_name(tree: Any) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path, simple=True, separator='/'): leaf for path, leaf in flat}


def check_matches(directory: str, stored: Any, target: Any) -> None:
  """One-line UserInputError if the stored params do not fit `target`."""
  stored, target = leaves_by_name(stored), leaves_by_name(target)
  problems = []
  missing = sorted(set(target) - set(stored))
  unexpected = sorted(set(stored) - set(target))
  if missing:
    problems.append(
      f'missing {", ".join(missing[:3])}'
      + (f' (+{len(missing) - 3} more)' if len(missing) > 3 else '')
    )
  if unexpected:
    problems.append(
      f'unexpected {", ".join(unexpected[:3])}'
      + (f' (+{len(unexpected) - 3} more)' if len(unexpected) > 3 else '')
    )
  for name in sorted(set(stored) & set(target)):
    if tuple(stored[name].shape) != tuple(target[name].shape):
      problems.append(
        f'{name} has shape {tuple(stored[name].shape)}, the '
        f'model expects {tuple(target[name].shape)}'
      )
      break
  if problems:
    raise UserInputError(
      f'{directory}: its parameters do not match this model: {"; ".join(problems)}'
    )
