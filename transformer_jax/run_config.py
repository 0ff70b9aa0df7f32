"""The training config as a run sees it: every check made once, before any work; saved in the
workdir; compared on resume.

`validate_run_config` is the one place a run config is checked — data, vocabulary, model fields
(by building the `TransformerConfig`), batching, optimiser, loop, mesh, sharding rules and what
the devices can run — so an impossible value is a one-line `UserInputError` naming the field
before any dataset is prepared, vocabulary trained or step compiled. `save_run_config` writes
`config.json` (all that inference needs besides the vocabulary and checkpoints) and, on resume,
refuses changes to the fields the saved parameters and data order depend on.
"""

from __future__ import annotations

import json

import jax
import ml_collections

from transformer_jax import paths, sharding
from transformer_jax.config import TransformerConfig
from transformer_jax.errors import (
  UserInputError,
  check_fraction,
  check_integer_at_least,
  check_number_at_least,
  check_positive_integer,
)
from transformer_jax.workdir import Workdir

BATCHING_MODES = ('fixed', 'tokens', 'packed')


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The frozen model config of a run config, for a vocabulary of `vocab_size` pieces."""
  return TransformerConfig.from_dict({'vocab_size': vocab_size, **config.model.to_dict()})


# Config fields that decide what the parameters and the data order mean: a resumed run must
# keep them. Everything else (number of steps, intervals, paths, batch size) may change.
_RESUME_FIXED_FIELDS = (
  'dataset',
  'data.src_lang',
  'data.tgt_lang',
  'vocab_size',
  'vocab_model_type',
  'max_source_length',
  'max_target_length',
  'seed',
)


def _resume_fields(config_dict: dict, model: dict) -> dict:
  fields = {f'model.{k}': v for k, v in model.items()}
  for name in _RESUME_FIXED_FIELDS:
    value = config_dict
    for part in name.split('.'):
      value = value.get(part) if isinstance(value, dict) else None
    fields[name] = value
  return fields


def save_run_config(
  config: ml_collections.ConfigDict, model_config: TransformerConfig, workdir: Workdir
) -> None:
  """Writes the resolved config; on resume, refuses changes to fields the run depends on."""
  path = workdir.config_file
  resolved = {'config': json.loads(config.to_json()), 'model': model_config.to_dict()}
  saved = workdir.read_run_config_if_present()
  if saved is not None:
    before = _resume_fields(saved.get('config', {}), saved.get('model', {}))
    after = _resume_fields(resolved['config'], resolved['model'])
    differing = [k for k in after if before.get(k) != after[k]]
    if differing:
      details = ', '.join(f'{k}: {before.get(k)!r} -> {after[k]!r}' for k in differing)
      raise UserInputError(
        f'{path}: resuming with changed fields ({details}); use a new '
        '--workdir or the original settings'
      )
  if jax.process_index() == 0:
    workdir.write_run_config(resolved)


def validate_run_config(config: ml_collections.ConfigDict) -> None:
  """Every check of a run config; raises a one-line UserInputError naming the first bad field.

  Cheap and free of data work: it may query the devices (mesh, cuDNN), nothing else.
  """
  _validate_data(config)
  _validate_model(config)
  _validate_batching(config)
  _validate_optimiser(config)
  _validate_loop(config)
  _validate_devices(config)


def _validate_data(config) -> None:
  for name in ('max_source_length', 'max_target_length', 'vocab_size', 'vocab_max_examples'):
    check_positive_integer(f'config.{name}', config[name])
  if config.dataset == 'text' and not config.data.dir:
    raise UserInputError(
      'config.dataset=text needs config.data.dir: the directory holding '
      f'train.{config.data.src_lang} and train.{config.data.tgt_lang}'
    )
  if config.data_dir:
    paths.resolve(config.data_dir, 'config.data_dir')  # A scheme we cannot serve: refused.
  if config.dataset == 'text':
    paths.resolve(config.data.dir, 'config.data.dir')


def _validate_model(config) -> None:
  try:
    model_config_from(config, config.vocab_size)
  except UserInputError as error:
    # Name the field as the user sets it (--config.model.d_ff), not the dataclass's.
    raise UserInputError(str(error).replace('TransformerConfig.', 'config.model.')) from None
  except TypeError as error:  # A field TransformerConfig does not have.
    raise UserInputError(f'config.model: {error}') from None
  # Sequences are padded or bucketed up to these lengths; the model rejects longer ones only
  # once the step is traced, as a traceback.
  longest = max(config.max_source_length, config.max_target_length)
  if config.model.max_len < longest:
    raise UserInputError(
      f'config.model.max_len={config.model.max_len} is shorter than max_source_length='
      f'{config.max_source_length} / max_target_length={config.max_target_length}; '
      f'set it to at least {longest}'
    )


def _validate_batching(config) -> None:
  if config.batching not in BATCHING_MODES:
    raise UserInputError(
      f"config.batching must be 'fixed', 'tokens' or 'packed', got {config.batching!r}"
    )
  check_positive_integer('config.per_device_batch_size', config.per_device_batch_size)
  if config.batching != 'fixed':
    check_positive_integer('config.tokens_per_batch', config.tokens_per_batch)
  check_positive_integer('config.grad_accum_steps', config.grad_accum_steps)
  check_positive_integer('config.eval_batch_size', config.eval_batch_size)


def _validate_optimiser(config) -> None:
  check_positive_integer('config.warmup_steps', config.warmup_steps)
  check_number_at_least('config.learning_rate_scale', config.learning_rate_scale, 0, strict=True)
  for name in ('adam_b1', 'adam_b2'):
    check_fraction(f'config.{name}', config[name])
  for name in ('adam_eps', 'grad_clip_norm'):
    check_number_at_least(f'config.{name}', config[name], 0)
  check_fraction('config.label_smoothing', config.label_smoothing)


def _validate_loop(config) -> None:
  for name in (
    'num_train_steps',
    'log_every_steps',
    'eval_every_steps',
    'checkpoint_every_steps',
    'keep_checkpoints',
    'max_consecutive_nonfinite_steps',
  ):
    check_positive_integer(f'config.{name}', config[name])
  check_integer_at_least('config.eval_decode_examples', config.eval_decode_examples, 0)
  check_number_at_least('config.lock_expiry_seconds', config.lock_expiry_seconds, 0, strict=True)


def _validate_devices(config) -> None:
  """The mesh fits the devices, the rules name its axes, the kernels exist here."""
  try:
    mesh = sharding.create_mesh(tuple(config.mesh_shape))
  except (ValueError, TypeError) as error:
    raise UserInputError(f'config.mesh_shape: {error}') from None
  try:
    rules = sharding.normalize_rules(config.logical_axis_rules)
  except (ValueError, TypeError) as error:
    raise UserInputError(f'config.logical_axis_rules: {error}') from None
  for logical_name, mesh_axes in rules:
    for axis in mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,):
      if axis is not None and axis not in mesh.axis_names:
        raise UserInputError(
          f'config.logical_axis_rules: {logical_name!r} -> {axis!r} names no '
          f'mesh axis (the mesh has {", ".join(mesh.axis_names)})'
        )
  if config.eval_batch_size % mesh.devices.size:
    raise UserInputError(
      f'config.eval_batch_size={config.eval_batch_size} must be a multiple '
      f'of the {mesh.devices.size} devices'
    )
  if config.model.attention_impl == 'cudnn' and jax.default_backend() != 'gpu':
    raise UserInputError(
      "config.model.attention_impl='cudnn' needs an NVIDIA GPU; this "
      f"process runs on {jax.default_backend()}: use 'einsum' or 'xla'"
    )
