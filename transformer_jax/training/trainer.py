"""`Trainer`: one model and config on a device mesh with axes ('data', 'fsdp', 'tensor'): the
batch is split over 'data' and 'fsdp', parameters and optimiser state are placed by the
logical-axis rules in the config (FSDP over 'fsdp', heads/FFN over 'tensor'; with both of size 1
this is plain data parallelism), and XLA inserts the collectives. State buffers are donated so
an update does not need twice the memory. Also greedy decoding of evaluation batches."""

from __future__ import annotations

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
    self.model = Transformer(model_config)
    self.mesh = mesh if mesh is not None else sharding.create_mesh(tuple(config.mesh_shape))
    self.rules = sharding.normalize_rules(config.logical_axis_rules)
    self.optimizer, self.learning_rate_fn = make_optimizer(
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
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    abstract = jax.eval_shape(self._init_state, jax.random.PRNGKey(0))
    self.state_shardings = sharding.logical_shardings(abstract, self.mesh, self.rules)
    self.abstract_state = jax.tree_util.tree_map(
      lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
      nn.meta.unbox(abstract),
      self.state_shardings,
    )
    replicated = sharding.replicated(self.mesh)
    self.train_step = jax.jit(
      functools.partial(
        train_step,
        model=self.model,
        learning_rate_fn=self.learning_rate_fn,
        label_smoothing=config.label_smoothing,
        grad_accum_steps=config.grad_accum_steps,
        loss_rows_per_chunk=config.loss_rows_per_chunk,
        rdrop_alpha=config.rdrop_alpha,
      ),
      in_shardings=(self.state_shardings, self.batch_sharding),
      out_shardings=(self.state_shardings, replicated),
      donate_argnums=(0,),
    )
    # (state, length: int32 scalar) -> the state with its timed cooldown placed to start at the
    # next update (`optim.timed_cooldown`); the old state's buffers are donated.
    self.start_cooldown = jax.jit(
      lambda state, length: state.replace(opt_state=start_timed_cooldown(state.opt_state, length)),
      in_shardings=(self.state_shardings, replicated),
      out_shardings=self.state_shardings,
      donate_argnums=(0,),
    )
    self.eval_step = jax.jit(
      functools.partial(eval_step, model=self.model, label_smoothing=config.label_smoothing),
      in_shardings=(self.state_shardings.params, self.batch_sharding),
      out_shardings=replicated,
    )
    self.all_finite = jax.jit(
      lambda params: jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(params)])
      ),
      in_shardings=(self.state_shardings.params,),
      out_shardings=replicated,
    )
    self.greedy_decode = jax.jit(
      functools.partial(
        decoding.greedy_decode, self.model, max_decode_len=config.max_target_length
      ),
      in_shardings=(self.state_shardings.params, self.batch_sharding),
      out_shardings=replicated,
    )

  def _init_state(self, rng) -> TrainState:
    params_rng, dropout_rng = jax.random.split(rng)
    source = jnp.ones((1, self.config.max_source_length), jnp.int32)
    target = jnp.ones((1, self.config.max_target_length), jnp.int32)
    params = self.model.init({'params': params_rng}, source, target)['params']
    return TrainState.create(
      apply_fn=self.model.apply,
      params=params,
      tx=self.optimizer,
      dropout_rng=dropout_rng,
      skipped_steps=jnp.zeros((), jnp.int32),
      nonfinite_streak=jnp.zeros((), jnp.int32),
    )

  def init_state(self, seed: int) -> TrainState:
    """Parameters and optimiser state created directly in their shardings."""
    state, _ = sharding.sharded_init(
      self._init_state,
      self.mesh,
      self.rules,
      jax.random.PRNGKey(seed),
      shardings=self.state_shardings,
    )
    return state

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
