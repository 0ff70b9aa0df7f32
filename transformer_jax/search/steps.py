"""What every search needs of a model, or of an ensemble of models: one `Steps` object.

A model (`inference.decoding.model_steps`) and an ensemble (`search.ensemble.ensemble_steps`)
each give the searches the same four things, and the searches (`search.run`) take nothing
else of them, so each search is written once for both:

- `step`: token ids int32[rows, 1] and the cache -> (logits float32[rows, vocab], new cache);
- `init_cache(positions, beam_size)`: the cache for batch * beam_size rows (batch-major: row
  i * beam_size + j is beam j of sentence i), able to hold `positions` decoded positions;
- `reorder(cache, rows int32[B])`: the cache in which row r goes on from row rows[r] (beam
  search, after each step); by default every batched leaf's rows are gathered;
- `extend(cache, positions)` and `cache_lengths(max_decode_len)`: optional growth of the cache
  through increasing lengths (beam search: early steps attend over short caches).

Like the rest of `search`, this never imports the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

# step_fn(token_ids int32[b, 1], cache) -> (logits float32[b, vocab], new_cache)
StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]
# logits_fn(target_input_ids int32[b, max_len]) -> float32[b, max_len, vocab]
LogitsFn = Callable[[jax.Array], jax.Array]
# reorder_cache(cache, rows int32[B]) -> the cache whose row r goes on from row rows[r]
ReorderFn = Callable[[Any, jax.Array], Any]
# extend_cache(cache, length) -> the cache made to hold `length` positions
ExtendFn = Callable[[Any, int], Any]


def expand_to_beams(tree: Any, beam_size: int, batch_size: int | None = None) -> Any:
  """Repeats every sentence's rows beam_size times (batch-major rows).

  Leaves with a leading batch axis are repeated along axis 0; 0-d leaves
  (e.g. a decode position counter) are shared by all rows and pass through.
  beam_search applies this to the cache itself; callers use it for anything
  else their step_fn closes over per sentence (encoder output, source ids).
  If batch_size is given, a leaf whose leading axis differs raises ValueError.
  """

  def expand(x):
    x = jnp.asarray(x)
    if x.ndim == 0:
      return x
    if batch_size is not None and x.shape[0] != batch_size:
      raise ValueError(
        f'leaf of shape {x.shape} has no leading batch axis of size {batch_size} (and is not 0-d)'
      )
    return jnp.repeat(x, beam_size, axis=0)

  return jax.tree.map(expand, tree)


def reorder_rows(tree: Any, rows: jax.Array) -> Any:
  """Gathers rows (int32[B]) of every batched leaf; 0-d leaves pass through."""
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows, axis=0), tree)


@dataclasses.dataclass(frozen=True)
class Steps:
  """A model's (or an ensemble's) step function and its cache, as every search takes them
  (the module docstring)."""

  step: StepFn
  init_cache: Callable[[int, int], Any]
  reorder: ReorderFn = reorder_rows
  extend: ExtendFn | None = None
  cache_lengths: Callable[[int], tuple[int, ...]] | None = None

  @classmethod
  def of_cache(cls, step: StepFn, cache: Any, batch_size: int | None = None) -> 'Steps':
    """Steps over a cache made for batch_size rows (any pytree of arrays with a leading batch
    axis, or 0-d): beam search repeats it per beam (`expand_to_beams`) and gathers its rows
    after each step (`reorder_rows`)."""
    return cls(
      step=step,
      init_cache=lambda positions, beam_size: (
        cache if beam_size == 1 else expand_to_beams(cache, beam_size, batch_size)
      ),
    )

  @classmethod
  def of_beam_cache(
    cls,
    step: StepFn,
    cache: Any,
    reorder: ReorderFn,
    extend: ExtendFn | None = None,
    cache_lengths: tuple[int, ...] = (),
  ) -> 'Steps':
    """Steps over a cache already made for the batch * beam rows, reordered by its own
    `reorder` (and grown through `cache_lengths` by `extend`)."""
    lengths = tuple(cache_lengths)
    return cls(
      step=step,
      init_cache=lambda positions, beam_size: cache,
      reorder=reorder,
      extend=extend,
      cache_lengths=(lambda max_decode_len: lengths) if lengths else None,
    )

  def lengths_for(self, max_decode_len) -> tuple[int, ...]:
    """The cache lengths a beam search of max_decode_len steps runs through: () for one."""
    if self.cache_lengths is None or self.extend is None:
      return ()
    lengths = tuple(self.cache_lengths(max_decode_len))
    return lengths if len(lengths) > 1 else ()
