"""The training config as a run sees it: every check made once, before any work; saved in the
workdir; compared on resume.

`validate_run_config` is the one place a run config is checked — data, vocabulary, model fields
(by building the `TransformerConfig`), batching, optimiser, loop, mesh, sharding rules and what
the devices can run — so an impossible value is a one-line `UserInputError` naming the field
before any dataset is prepared, vocabulary trained or step compiled. `save_run_config` writes
`config.json` (all that inference needs besides the vocabulary and checkpoints, and the identity
of the vocabulary and data the parameters depend on); on resume, `check_resume` (before any data
work) and `save_run_config` refuse changes to the fields and files the saved parameters and data
order depend on, and a lost vocabulary.
"""

from __future__ import annotations

import json
import math

import jax
import ml_collections
from etils import epath

from transformer_jax.checkpoints import best
from transformer_jax.checkpoints.checkpointer import list_steps
from transformer_jax.common import paths
from transformer_jax.common.errors import (
  UserInputError,
  check_fraction,
  check_integer_at_least,
  check_number_at_least,
  check_positive_integer,
  is_integer,
  is_number,
)
from transformer_jax.data import number_words, text_dataset, tokenizer
from transformer_jax.evaluation import metrics
from transformer_jax.model.config import TransformerConfig
from transformer_jax.training import optim, sharding
from transformer_jax.workdir import imported
from transformer_jax.workdir.layout import IDENTITY_KEY, Workdir

BATCHING_MODES = ('fixed', 'tokens', 'packed')
# The features of the generated number_words dataset (either may be the source).
_NUMBER_WORDS_LANGS = ('en', 'de')
# Ids every vocabulary reserves: pad, eos, bos, unk (data/tokenizer.py).
_RESERVED_PIECES = 4
# grain's shuffles take seeds in [0, 2**32).
_MAX_SEED = 2**32 - 1


def model_config_from(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The frozen model config of a run config, for a vocabulary of `vocab_size` pieces."""
  return TransformerConfig.from_dict({'vocab_size': vocab_size, **config.model.to_dict()})


# Config fields that decide what the parameters and the data order mean: a resumed run must
# keep them. Everything else (number of steps, intervals, paths, batch size) may change.
_RESUME_FIXED_FIELDS = (
  'dataset',
  # The data's identity names the dataset and its split sizes, not the split that trains.
  'train_split',
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
  # AdamW's optimiser state has another layout than Adam's: its rate may change on resume, but
  # not to or from 0. (Workdirs written before the field existed ran without it.)
  fields['config.weight_decay > 0'] = bool(config_dict.get('weight_decay') or 0)
  # Likewise the timed cooldown adds its state to the optimiser's.
  fields['config.cooldown_minutes > 0'] = bool(config_dict.get('cooldown_minutes') or 0)
  return fields


def _changed_fields(before: dict, after: dict) -> list[str]:
  return [f'{k}: {before.get(k)!r} -> {after[k]!r}' for k in after if before.get(k) != after[k]]


def _has_checkpoints(workdir: Workdir) -> bool:
  return workdir.checkpoints.exists() and bool(list_steps(workdir.checkpoints)[0])


def parameters_folder(workdir: Workdir) -> epath.Path | None:
  """Where the workdir's parameters are: its checkpoints, or an imported model's until
  fine-tuning saved one (`workdir/imported.py`); None while it has none, so that nothing
  depends on its vocabulary or data yet."""
  if _has_checkpoints(workdir):
    return workdir.checkpoints
  if imported.imported_params_are_latest(workdir, trained=False):
    return workdir.imported
  return None


def _identity_changes(workdir: Workdir, recorded: dict, data: str, trained: bool) -> list[str]:
  """What differs between the recorded identity and the workdir's files and data now."""
  changes = workdir.vocabulary_changes(recorded)
  # Imported parameters depend on no data: it may change until fine-tuning saved a checkpoint.
  if trained and 'data' in recorded and recorded['data'] != data:
    changes.append(f'data: {recorded["data"]} -> {data}')
  return changes


def check_resume(config: ml_collections.ConfigDict, workdir: Workdir, data: str) -> None:
  """Refuses, in one line and before any data is prepared or vocabulary trained, a run that
  would change what the workdir's run depends on: the fixed config fields (the model's are
  compared by `save_run_config`, once the vocabulary is known) and, where the workdir holds
  parameters, the vocabulary they were trained with (a missing one too) and, once training
  saved a checkpoint, the data (`data`: its identity, `input_pipeline.load_data_sources`).
  Called by every process: all read the same config.json and files.
  """
  saved = workdir.read_run_config_if_present()
  trained = _has_checkpoints(workdir)
  baseline, _ = imported.resume_baseline(saved, trained)
  differing = []
  if baseline is not None:
    before = _resume_fields(baseline['config'], {})
    differing = _changed_fields(before, _resume_fields(json.loads(config.to_json()), {}))
  parameters = parameters_folder(workdir)
  identity_changes = []
  if parameters is not None:
    if not workdir.vocab_file.exists():
      raise UserInputError(
        f'{workdir.vocab_file} is missing, but the parameters in {parameters} were trained '
        'with it: restore the file (a new vocabulary would give their ids other pieces), or '
        'use a new --workdir'
      )
    # Workdirs written before identities were recorded have none: save_run_config records it.
    recorded = (saved or {}).get(IDENTITY_KEY, {})
    if not isinstance(recorded, dict):
      raise UserInputError(
        f'{workdir.config_file}: its "{IDENTITY_KEY}" section is {recorded!r}, not the '
        'record train.py writes'
      )
    identity_changes = _identity_changes(workdir, recorded, data, trained)
  if differing or identity_changes:
    files = ' and files' if identity_changes else ''
    raise UserInputError(
      f'{workdir.config_file}: resuming with changed fields '
      f'({", ".join(differing + identity_changes)}); use a new --workdir or the original '
      f'settings{files}'
    )


def save_run_config(
  config: ml_collections.ConfigDict,
  model_config: TransformerConfig,
  workdir: Workdir,
  data: str,
) -> None:
  """Writes the resolved config and the identity of the vocabulary and `data` it was run with
  (in workdirs written before identities were recorded, too: from this resume on they are
  compared); on resume, refuses changes to fields the run depends on (`check_resume` compared
  the rest before any data work)."""
  path = workdir.config_file
  resolved = {'config': json.loads(config.to_json()), 'model': model_config.to_dict()}
  trained = _has_checkpoints(workdir)
  saved, carried = imported.resume_baseline(workdir.read_run_config_if_present(), trained)
  resolved.update(carried)
  if saved is not None:
    before = _resume_fields(saved.get('config', {}), saved.get('model', {}))
    differing = _changed_fields(before, _resume_fields(resolved['config'], resolved['model']))
    if differing:
      raise UserInputError(
        f'{path}: resuming with changed fields ({", ".join(differing)}); use a new '
        '--workdir or the original settings'
      )
  if jax.process_index() == 0:
    # Process 0 saved the vocabulary if this run trained it: the others may not see it yet.
    resolved[IDENTITY_KEY] = {**workdir.vocabulary_identity(), 'data': data}
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
  _validate_dataset(config)
  for name in ('max_source_length', 'max_target_length', 'vocab_size', 'vocab_max_examples'):
    check_positive_integer(f'config.{name}', config[name])
  check_positive_integer('config.data.max_chars', config.data.max_chars)
  if config.vocab_size <= _RESERVED_PIECES:
    raise UserInputError(
      f'config.vocab_size={config.vocab_size} leaves no pieces besides the '
      f'{_RESERVED_PIECES} reserved ones (pad, eos, bos, unk); the paper uses ~37,000'
    )
  if config.vocab_model_type not in tokenizer.MODEL_TYPES:
    raise UserInputError(
      f'config.vocab_model_type must be one of {", ".join(tokenizer.MODEL_TYPES)}, '
      f'got {config.vocab_model_type!r}'
    )
  if not is_integer(config.seed) or not 0 <= config.seed <= _MAX_SEED:
    raise UserInputError(f'config.seed must be an integer in [0, 2**32 - 1], got {config.seed!r}')
  for name in ('final_test_decode', 'reuse_host_memory'):
    if not isinstance(config[name], bool):
      raise UserInputError(f'config.{name} must be True or False, got {config[name]!r}')
  if config.data_dir:
    paths.resolve(config.data_dir, 'config.data_dir')  # A scheme we cannot serve: refused.
  if config.dataset == 'text':
    paths.resolve(config.data.dir, 'config.data.dir')


def _validate_dataset(config) -> None:
  """The dataset's name, languages and splits, as far as they are known without reading it."""
  name = config.dataset
  if not isinstance(name, str) or not name.strip():
    raise UserInputError(
      f"config.dataset must name a dataset ('number_words', 'text' or a prepared tfds "
      f'dataset), got {name!r}'
    )
  text_dataset.check_langs(config.data.src_lang, config.data.tgt_lang, 'config.data.')
  splits = {'train_split': config.train_split, 'eval_split': config.eval_split}
  splits['test_split'] = config.test_split
  for field, split in splits.items():
    if not isinstance(split, str) or not split:
      raise UserInputError(f'config.{field} must name a split of the dataset, got {split!r}')
  if name == 'text' and not config.data.dir:
    raise UserInputError(
      'config.dataset=text needs config.data.dir: the directory holding '
      f'train.{config.data.src_lang} and train.{config.data.tgt_lang}'
    )
  if name != 'text' and config.data.dir:
    # Otherwise ignored: the run would train on another dataset than the user's files.
    raise UserInputError(
      f'config.data.dir={config.data.dir} is only read with config.dataset=text, but '
      f'config.dataset={name!r}: add --config.dataset=text, or drop config.data.dir'
    )
  if name.split('/')[0] == 'number_words':
    _validate_number_words(config, name)


def _validate_number_words(config, name: str) -> None:
  configs = [builder_config.name for builder_config in number_words.NumberWords.BUILDER_CONFIGS]
  variant = name.split('/', 1)[1] if '/' in name else 'default'
  if variant not in configs:
    raise UserInputError(
      f'config.dataset={name!r}: number_words has no variant {variant!r} (it has '
      f'{", ".join(f"number_words/{c}" for c in configs)})'
    )
  for field in ('src_lang', 'tgt_lang'):
    lang = config.data[field]
    if lang not in _NUMBER_WORDS_LANGS:
      raise UserInputError(
        f'config.data.{field}={lang!r}: number_words has the languages '
        f'{" and ".join(_NUMBER_WORDS_LANGS)}'
      )
  for field in ('train_split', 'eval_split', 'test_split'):
    if config[field] not in number_words.SPLITS:
      raise UserInputError(
        f'config.{field}={config[field]!r}: number_words has the splits '
        f'{", ".join(number_words.SPLITS)}'
      )


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
  if not (is_number(config.bucket_growth) and 1.0 < config.bucket_growth <= 4.0):
    raise UserInputError(
      f'config.bucket_growth must be a number in (1, 4], got {config.bucket_growth!r}'
    )
  check_fraction('config.subword_sampling', config.subword_sampling)
  if config.subword_sampling and config.batching == 'fixed':
    raise UserInputError(
      "config.subword_sampling needs config.batching='tokens' or 'packed' (batches planned "
      "from each epoch's lengths), not 'fixed'"
    )
  if config.subword_sampling and config.vocab_model_type not in ('bpe', 'unigram'):
    raise UserInputError(
      "config.subword_sampling samples 'bpe' or 'unigram' segmentations, not "
      f'config.vocab_model_type={config.vocab_model_type!r}'
    )


def _validate_optimiser(config) -> None:
  check_positive_integer('config.warmup_steps', config.warmup_steps)
  # Infinite: NaN after the first steps (scale), or steps of nothing (eps). A zero eps divides
  # zero by zero on every parameter whose gradient is zero (the padding embedding).
  for name in ('learning_rate_scale', 'adam_eps'):
    check_number_at_least(f'config.{name}', config[name], 0, strict=True)
    if not math.isfinite(config[name]):
      raise UserInputError(f'config.{name} must be a finite number, got {config[name]!r}')
  for name in ('adam_b1', 'adam_b2'):
    check_fraction(f'config.{name}', config[name])
  check_number_at_least('config.grad_clip_norm', config.grad_clip_norm, 0)
  check_fraction('config.label_smoothing', config.label_smoothing)
  check_number_at_least('config.weight_decay', config.weight_decay, 0)
  if not math.isfinite(config.weight_decay):
    raise UserInputError(f'config.weight_decay must be finite, got {config.weight_decay!r}')
  if not (is_integer(config.loss_rows_per_chunk) and config.loss_rows_per_chunk >= 0):
    raise UserInputError(
      'config.loss_rows_per_chunk must be a non-negative integer (0: no chunks), got '
      f'{config.loss_rows_per_chunk!r}'
    )
  check_number_at_least('config.rdrop_alpha', config.rdrop_alpha, 0)
  if not math.isfinite(config.rdrop_alpha):
    raise UserInputError(f'config.rdrop_alpha must be finite, got {config.rdrop_alpha!r}')
  if config.rdrop_alpha and not (config.model.dropout_rate or config.model.attention_dropout_rate):
    raise UserInputError(
      f'config.rdrop_alpha={config.rdrop_alpha} compares two dropout masks, but '
      'config.model.dropout_rate and attention_dropout_rate are 0'
    )
  check_fraction('config.cooldown_fraction', config.cooldown_fraction)
  if config.learning_rate_schedule not in optim.SCHEDULES:
    raise UserInputError(
      f'config.learning_rate_schedule must be one of {", ".join(optim.SCHEDULES)}, '
      f'got {config.learning_rate_schedule!r}'
    )
  if config.learning_rate_schedule == 'constant':
    check_number_at_least('config.learning_rate', config.learning_rate, 0, strict=True)
    if not math.isfinite(config.learning_rate):
      raise UserInputError(f'config.learning_rate must be finite, got {config.learning_rate!r}')


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
  metric = config.best_checkpoint_metric
  if metric and metric not in best.METRIC_MODES:
    raise UserInputError(
      f'config.best_checkpoint_metric must be one of {", ".join(best.METRIC_MODES)} (or empty '
      f'for none), got {metric!r}'
    )
  if metric in best.DECODED_METRICS and not config.eval_decode_examples:
    raise UserInputError(
      f'config.best_checkpoint_metric={metric!r} is computed by greedy decoding at each '
      'evaluation, but config.eval_decode_examples is 0'
    )
  if metric == 'bleu' and not metrics.bleu_is_meaningful(config.dataset):
    raise UserInputError(
      f"config.best_checkpoint_metric='bleu': the evaluation of {config.dataset} reports no "
      "BLEU (its outputs are not sentences): use 'chrf' or 'exact_match'"
    )
  check_integer_at_least('config.early_stopping_patience', config.early_stopping_patience, 0)
  if config.early_stopping_patience and not metric:
    raise UserInputError(
      f'config.early_stopping_patience={config.early_stopping_patience} counts evaluations '
      'without a better config.best_checkpoint_metric, which is not set'
    )
  check_number_at_least('config.lock_expiry_seconds', config.lock_expiry_seconds, 0, strict=True)
  limit = config.train_time_limit_minutes
  check_number_at_least('config.train_time_limit_minutes', limit, 0)
  if not math.isfinite(limit):
    raise UserInputError(f'config.train_time_limit_minutes must be finite, got {limit!r}')
  cooldown = config.cooldown_minutes
  check_number_at_least('config.cooldown_minutes', cooldown, 0)
  if not math.isfinite(cooldown):
    raise UserInputError(f'config.cooldown_minutes must be finite, got {cooldown!r}')
  if cooldown and not 0 < cooldown < limit:
    raise UserInputError(
      f'config.cooldown_minutes={cooldown:g} needs config.train_time_limit_minutes above it '
      f'(it is the end of that budget), got {limit:g}'
    )
  if cooldown and config.cooldown_fraction:
    raise UserInputError(
      f'config.cooldown_minutes={cooldown:g} and config.cooldown_fraction='
      f'{config.cooldown_fraction:g} are two cooldowns: set one of them to 0'
    )


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
  longest = max(config.max_source_length, config.max_target_length)
  if config.batching != 'fixed' and config.tokens_per_batch < longest * mesh.devices.size:
    # Below one row of the longest pairs per device, batches would silently exceed it.
    raise UserInputError(
      f'config.tokens_per_batch={config.tokens_per_batch} is less than one row of '
      f'{longest} tokens (max_source_length / max_target_length) per device on '
      f'{mesh.devices.size} device(s): set it to at least {longest * mesh.devices.size}'
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
