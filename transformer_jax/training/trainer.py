"""`Trainer`: one model and config on a device mesh with axes ('data', 'fsdp', 'tensor'): the
batch is split over 'data' and 'fsdp', parameters and optimiser state are placed by the
logical-axis rules in the config (FSDP over 'fsdp', heads/FFN over 'tensor'; with both of size 1
this is plain data parallelism), and XLA inserts the collectives. State buffers are donated so
an update does not need twice the memory. Also greedy decoding of evaluation batches."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax.data import input_pipeline
from transformer_jax.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from transformer_jax.inference import decoding
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.search.decode import strip_after_eos
from transformer_jax.training import sharding
from transformer_jax.training.optim import make_optimizer, start_timed_cooldown
from transformer_jax.training.step import TrainState, eval_step, train_step


@dataclasses.dataclass(frozen=True)
class _StepSettings:
  """The config values the jitted programs close over, besides the model and optimiser."""

  label_smoothing: float
  grad_accum_steps: int
  loss_rows_per_chunk: int
  rdrop_alpha: float
  max_source_length: int
  max_target_length: int


@dataclasses.dataclass(frozen=True)
class _Programs:
  model: Transformer
  optimizer: Any
  learning_rate_fn: Any
  batch_sharding: Any
  state_shardings: Any
  abstract_state: Any
  init: Any
  train_step: Any
  start_cooldown: Any
  eval_step: Any
  all_finite: Any
  greedy_decode: Any


# Trainers of the same model, optimiser, settings, mesh and rules share their jitted programs:
# jit caches what it traced and compiled per function object, so a second run in one process
# (a sweep, a notebook, a resumed run, the test suite) skips tracing, lowering and compiling,
# ~2-5 s per run at the sizes tests use. The persistent compilation cache saves only the last.
# The optimiser is shared too: it is a static field of TrainState, part of the jit cache key.
# `_programs` is given each value its programs close over, never the config: a value a program
# comes to depend on has to be one of its arguments, and so of the cache's key.
@functools.lru_cache(maxsize=8)
def _programs(
  model_config: TransformerConfig,
  optimizer_settings: tuple,
  settings: _StepSettings,
  mesh: jax.sharding.Mesh,
  rules: tuple,
) -> _Programs:
  model = Transformer(model_config)
  optimizer, learning_rate_fn = make_optimizer(**dict(optimizer_settings))

  def init_state(rng) -> TrainState:
    params_rng, dropout_rng = jax.random.split(rng)
    source = jnp.ones((1, settings.max_source_length), jnp.int32)
    target = jnp.ones((1, settings.max_target_length), jnp.int32)
    params = model.init({'params': params_rng}, source, target)['params']
    return TrainState.create(
      apply_fn=model.apply,
      params=params,
      tx=optimizer,
      dropout_rng=dropout_rng,
      skipped_steps=jnp.zeros((), jnp.int32),
      nonfinite_streak=jnp.zeros((), jnp.int32),
    )

  batch_sharding = sharding.batch_sharding(mesh)
  abstract = jax.eval_shape(init_state, jax.random.PRNGKey(0))
  state_shardings = sharding.logical_shardings(abstract, mesh, list(rules))
  abstract_state = jax.tree_util.tree_map(
    lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
    nn.meta.unbox(abstract),
    state_shardings,
  )
  replicated = sharding.replicated(mesh)
  return _Programs(
    model=model,
    optimizer=optimizer,
    learning_rate_fn=learning_rate_fn,
    batch_sharding=batch_sharding,
    state_shardings=state_shardings,
    abstract_state=abstract_state,
    init=sharding.sharded_initializer(init_state, state_shardings),
    train_step=jax.jit(
      functools.partial(
        train_step,
        model=model,
        learning_rate_fn=learning_rate_fn,
        label_smoothing=settings.label_smoothing,
        grad_accum_steps=settings.grad_accum_steps,
        loss_rows_per_chunk=settings.loss_rows_per_chunk,
        rdrop_alpha=settings.rdrop_alpha,
      ),
      in_shardings=(state_shardings, batch_sharding),
      out_shardings=(state_shardings, replicated),
      donate_argnums=(0,),
    ),
    # (state, length: int32 scalar) -> the state with its timed cooldown placed to start at
    # the next update (`optim.timed_cooldown`); the old state's buffers are donated.
    start_cooldown=jax.jit(
      lambda state, length: state.replace(opt_state=start_timed_cooldown(state.opt_state, length)),
      in_shardings=(state_shardings, replicated),
      out_shardings=state_shardings,
      donate_argnums=(0,),
    ),
    eval_step=jax.jit(
      functools.partial(eval_step, model=model, label_smoothing=settings.label_smoothing),
      in_shardings=(state_shardings.params, batch_sharding),
      out_shardings=replicated,
    ),
    all_finite=jax.jit(
      lambda params: jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(params)])
      ),
      in_shardings=(state_shardings.params,),
      out_shardings=replicated,
    ),
    greedy_decode=jax.jit(
      functools.partial(decoding.greedy_decode, model, max_decode_len=settings.max_target_length),
      in_shardings=(state_shardings.params, batch_sharding),
      out_shardings=replicated,
    ),
  )


def forget_programs() -> None:
  """Drops the shared programs, so that the next Trainer traces its own: for code changed in
  between that its programs call (bench/levers.py patches functions to time variants)."""
  _programs.cache_clear()


class Trainer:
  """Owns the mesh, the jitted steps and the state shardings for one model and config.

  The config is taken as valid (`run_config.validate_run_config`); a mesh or rule that does not
  fit is a ValueError here.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    model_config: TransformerConfig,
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.config = config
    self.model_config = model_config
    self.mesh = mesh if mesh is not None else sharding.create_mesh(tuple(config.mesh_shape))
    self.rules = sharding.normalize_rules(config.logical_axis_rules)
    optimizer_settings = dict(
      d_model=model_config.d_model,
      warmup_steps=config.warmup_steps,
      learning_rate_scale=config.learning_rate_scale,
      total_steps=config.num_train_steps,
      cooldown_steps=round(config.cooldown_fraction * config.num_train_steps),
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      grad_clip_norm=config.grad_clip_norm,
      schedule=config.learning_rate_schedule,
      learning_rate=config.learning_rate,
      weight_decay=config.weight_decay,
      timed=config.cooldown_minutes > 0,
    )
    step_settings = _StepSettings(
      label_smoothing=config.label_smoothing,
      grad_accum_steps=config.grad_accum_steps,
      loss_rows_per_chunk=config.loss_rows_per_chunk,
      rdrop_alpha=config.rdrop_alpha,
      max_source_length=config.max_source_length,
      max_target_length=config.max_target_length,
    )
    programs = _programs(
      model_config,
      tuple(sorted(optimizer_settings.items())),
      step_settings,
      self.mesh,
      tuple(self.rules),
    )
    self.model = programs.model
    self.optimizer, self.learning_rate_fn = programs.optimizer, programs.learning_rate_fn
    self.batch_sharding = programs.batch_sharding
    self.state_shardings = programs.state_shardings
    self.abstract_state = programs.abstract_state
    self._init = programs.init
    self.train_step = programs.train_step
    self.start_cooldown = programs.start_cooldown
    self.eval_step = programs.eval_step
    self.all_finite = programs.all_finite
    self.greedy_decode = programs.greedy_decode

  def init_state(self, seed: int) -> TrainState:
    """Parameters and optimiser state created directly in their shardings."""
    with jax.set_mesh(self.mesh):
      return self._init(jax.random.PRNGKey(seed))

  def global_batch(self, local_batch: dict) -> dict:
    """This process's rows -> global arrays, rows split jointly over ('data', 'fsdp').

    Devices that differ only in their 'tensor' coordinate hold the same rows.
    """
    # Batch shards this process feeds (at least 1: a shard may span processes).
    local_shards = max(1, sharding.data_parallel_size(self.mesh) // jax.process_count())
    for key, value in local_batch.items():
      if np.shape(value)[0] % local_shards:
        raise ValueError(
          f'batch {key!r} has {np.shape(value)[0]} rows, not divisible by the '
          f'{local_shards} data-parallel shards of mesh {dict(self.mesh.shape)}'
        )
    return {
      key: jax.make_array_from_process_local_data(self.batch_sharding, value)
      for key, value in local_batch.items()
    }

  def global_batch_from_full(self, full_batch: dict) -> dict:
    """A batch every process holds whole (evaluation) -> global arrays, each device its rows."""
    return {
      key: jax.make_array_from_callback(
        np.shape(value), self.batch_sharding, lambda index, value=value: value[index]
      )
      for key, value in full_batch.items()
    }

  def step(self, state, local_batch):
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return self.train_step(state, self.global_batch(local_batch))

  def evaluate(self, params, batches) -> dict[str, float]:
    totals: dict[str, Any] = {}
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      for batch in batches:
        metrics = self.eval_step(params, self.global_batch_from_full(batch))
        totals = metrics if not totals else jax.tree_util.tree_map(jnp.add, totals, metrics)
    totals = jax.device_get(totals)
    count = max(float(totals['token_count']), 1.0)
    return {
      'loss': float(totals['loss_sum']) / count,
      'token_accuracy': float(totals['correct_tokens']) / count,
    }

  def decode_batches(self, params, batches) -> list[list[int]]:
    """Greedy output ids (EOS and padding removed) for every row of every batch."""
    outputs = []
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      for batch in batches:
        src = self.global_batch_from_full({'inputs': batch['inputs']})['inputs']
        tokens = np.asarray(jax.device_get(self.greedy_decode(params, src)))
        outputs.extend(strip_after_eos(tokens, EOS_ID, pad_id=PAD_ID))
    return outputs


def decode_split(
  trainer: Trainer,
  params,
  source,
  tokenized: input_pipeline.TokenizedSplit,
  tokenizer: Tokenizer,
  config: ml_collections.ConfigDict,
  max_examples: int | None,
) -> tuple[list[str], list[str], list[str]]:
  """(sources, references, greedy hypotheses) for the first `max_examples` of a split."""
  batches = input_pipeline.make_eval_batches(
    tokenized, config, batch_size=config.eval_batch_size, max_examples=max_examples
  )
  sources, references = input_pipeline.eval_texts(source, config, max_examples)
  outputs = trainer.decode_batches(params, batches)[: len(references)]  # Drop filler rows.
  return sources, references, [tokenizer.decode(ids) for ids in outputs]
