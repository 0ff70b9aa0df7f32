"""The paper's optimiser: Adam(0.9, 0.98, 1e-9) with the inverse-square-root warmup schedule,
optionally ending in a linear cooldown to zero (`cooldown_steps`; the paper has none), or in one
whose start and length the training loop sets when a wall-clock budget nears its end
(`timed_cooldown`), and optionally decoupled weight decay (AdamW; the paper has none).

For fine-tuning a pretrained model (`import_marian`) the paper's schedule is wrong: it assumes
training from scratch, and its peak (d_model^-0.5 / sqrt(warmup)) is far above what a trained
model tolerates. `schedule='constant'` warms up linearly to a given `learning_rate` and holds it
(then the cooldown, if any)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1.

  optax calls the schedule with the number of updates already applied (0 for the first), so the
  paper's step number is count + 1; otherwise the first update would have a learning rate of 0.
  """

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

  return schedule


def constant_schedule(learning_rate: float, warmup_steps: int) -> optax.Schedule:
  """lr(step) = learning_rate * min(1, step / warmup), step counted from 1 (as `rsqrt_schedule`)."""

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return learning_rate * jnp.minimum(1.0, step / warmup_steps)

  return schedule


SCHEDULES = ('rsqrt', 'constant')


def with_cooldown(
  schedule: optax.Schedule, total_steps: int, cooldown_steps: int
) -> optax.Schedule:
  """`schedule` times a factor falling linearly from 1 to 0 over the last `cooldown_steps` of
  `total_steps` updates (the last update gets 1/cooldown_steps of it); unchanged before.

  The rsqrt schedule is still at ~0.6x its peak when a short run ends, and the last parameters
  carry that step size's noise; cooling down makes the final checkpoint the one to keep.
  """
  if cooldown_steps <= 0:
    return schedule
  start = total_steps - cooldown_steps  # Updates applied before the cooldown begins.

  def cooled(count):
    remaining = jnp.asarray(total_steps - count, jnp.float32)
    factor = jnp.clip(remaining / cooldown_steps, 0.0, 1.0)
    return schedule(count) * jnp.where(count < start, 1.0, factor)

  return cooled


class TimedCooldownState(NamedTuple):
  """`timed_cooldown`'s state: updates applied so far, and the cooldown's first update and
  length (start -1: not started). int32 scalars, saved with the checkpoint."""

  count: jax.Array
  cooldown_start: jax.Array
  cooldown_length: jax.Array


def timed_cooldown() -> optax.GradientTransformation:
  """Scales the updates by a factor falling linearly from 1 to 0 over `cooldown_length` updates
  from update `cooldown_start` (the last gets 1/cooldown_length of it, as `with_cooldown`), once
  `start_timed_cooldown` has set them; 1 before. At the end of the chain it scales the learning
  rate and, with AdamW, its decay term alike.

  For a wall-clock budget (`config.cooldown_minutes`): the number of updates the budget allows
  is known only near its end, when the loop measures its step rate, so the cooldown's place is
  state (restored on resume, so a resumed run cools down as the uninterrupted one), not a
  function of the step count fixed when the optimiser is built.
  """

  def init(params):
    del params
    return TimedCooldownState(
      jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32), jnp.ones((), jnp.int32)
    )

  def update(updates, state, params=None):
    del params
    factor = timed_cooldown_factor(state)
    updates = jax.tree_util.tree_map(lambda u: (u * factor).astype(u.dtype), updates)
    return updates, state._replace(count=state.count + 1)

  return optax.GradientTransformation(init, update)


def timed_cooldown_factor(state: TimedCooldownState) -> jax.Array:
  """The factor `timed_cooldown` gives the next update (float32 scalar)."""
  remaining = (state.cooldown_start + state.cooldown_length - state.count).astype(jnp.float32)
  factor = jnp.clip(remaining / state.cooldown_length.astype(jnp.float32), 0.0, 1.0)
  return jnp.where(state.cooldown_start < 0, 1.0, factor)


def _timed_cooldown_state(opt_state) -> TimedCooldownState | None:
  found = [
    leaf
    for leaf in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, TimedCooldownState)
    )
    if isinstance(leaf, TimedCooldownState)
  ]
  return found[0] if found else None


def learning_rate_factor(opt_state) -> jax.Array | float:
  """What multiplies the schedule's rate at the next update: the timed cooldown's factor, or 1
  where the optimiser has none."""
  state = _timed_cooldown_state(opt_state)
  return 1.0 if state is None else timed_cooldown_factor(state)


def start_timed_cooldown(opt_state, length):
  """`opt_state` with its timed cooldown starting at the next update and lasting `length`
  updates (an int32 scalar, at least 1)."""

  def start(node):
    if not isinstance(node, TimedCooldownState):
      return node
    return node._replace(
      cooldown_start=node.count, cooldown_length=jnp.maximum(length, 1).astype(jnp.int32)
    )

  return jax.tree_util.tree_map(
    start, opt_state, is_leaf=lambda x: isinstance(x, TimedCooldownState)
  )


def timed_cooldown_remaining(opt_state) -> int | None:
  """Updates left in a started timed cooldown (0 once it is over); None if it has not started
  or the optimiser has none. Reads the state from the device."""
  state = _timed_cooldown_state(opt_state)
  if state is None or int(state.cooldown_start) < 0:
    return None
  return max(0, int(state.cooldown_start) + int(state.cooldown_length) - int(state.count))


def make_optimizer(
  *,
  d_model: int,
  warmup_steps: int,
  learning_rate_scale: float = 1.0,
  total_steps: int = 0,
  cooldown_steps: int = 0,
  b1: float = 0.9,
  b2: float = 0.98,
  eps: float = 1e-9,
  grad_clip_norm: float = 0.0,
  schedule: str = 'rsqrt',
  learning_rate: float = 0.0,
  weight_decay: float = 0.0,
  timed: bool = False,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Adam with `schedule`: 'rsqrt' (the paper's; learning_rate_scale multiplies it) or
  'constant' (`constant_schedule` to learning_rate), then the cooldown.

  weight_decay > 0 makes it AdamW (Loshchilov & Hutter, 2019): each step also moves every
  matrix (kernels, embeddings) by -lr(step) x weight_decay x itself, outside Adam's
  normalisation, as fairseq's and PyTorch's AdamW do; biases and layer-norm scales are not
  decayed (`decays_weight`). With 0 the optimiser state has the paper's Adam's layout,
  so checkpoints of runs without weight decay are unchanged.

  timed=True ends the chain with `timed_cooldown` (a cooldown the training loop places), which
  adds its state to the optimiser's; without it the layout is unchanged.
  """
  if schedule == 'constant':
    schedule = constant_schedule(learning_rate, warmup_steps)
  else:
    schedule = rsqrt_schedule(d_model, warmup_steps, learning_rate_scale)
  schedule = with_cooldown(schedule, total_steps, cooldown_steps)
  if weight_decay > 0:
    optimizer = optax.adamw(
      schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decays_weight
    )
  else:
    optimizer = optax.adam(schedule, b1=b1, b2=b2, eps=eps)
  if grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(grad_clip_norm), optimizer)
  if timed:
    optimizer = optax.chain(optimizer, timed_cooldown())
  return optimizer, schedule


DECAYED_PARAMETERS = ('kernel', 'embedding')


def decays_weight(params):
  """Which parameters weight decay acts on: Flax's matrices by name (`kernel`, `embedding`),
  not the vectors (`bias`, layer-norm `scale`), whose decay would only pull them towards 0 (the
  usual exclusion: BERT, MaxText, Hugging Face). By name, not by rank: the layers' parameters
  are stacked, so a layer-norm scale is [layers, d_model]."""

  def decayed(path, leaf):
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    return bool(names) and names[-1] in DECAYED_PARAMETERS

  return jax.tree_util.tree_map_with_path(decayed, params)
