"""The training config as a run sees it: read from the command line, checked once at start,
saved in the workdir.

`define_config_flag`, `parse_flags` and `loaded_config` give the entry points `--config=FILE`
and `--config.field=value` with one-line errors; `validate_run_config` turns impossible values
into one-line `UserInputError`s naming the field before anything is prepared or compiled;
`save_run_config` writes `<workdir>/config.json` (all that inference needs besides the
vocabulary and checkpoints) and, on resume, refuses changes to the fields the saved parameters
and data order depend on.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from absl import app
from ml_collections import config_flags

from transformer_jax.config import TransformerConfig, UserInputError, is_number

CONFIG_FILE = 'config.json'

# What ml_collections raises for a bad `--config.field=value` (a misspelt field, a value of the
# wrong type) and, deferred to the first access of the flag, for a config file it cannot load.
_CONFIG_FLAG_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)


def define_config_flag(default: str, help_text: str, lock_config: bool = True) -> None:
  """`--config=FILE` (`get_config()` returning a ConfigDict) with `--config.field=value`.

  ml_collections applies the overrides as soon as a file is loaded (the default file: while
  the flag is defined) and reports a misspelt field or a missing file as a traceback; these
  helpers make them one line and exit status 2. Entry points then call
  `app.run(main, flags_parser=parse_flags)` and read the config with `loaded_config()`.
  """
  try:
    config_flags.DEFINE_config_file('config', default, help_text, lock_config=lock_config)
  except _CONFIG_FLAG_ERRORS as error:
    _exit_with_config_error(error)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the config errors above as one line (for `app.run`)."""
  try:
    return app.parse_flags_with_usage(argv)
  except _CONFIG_FLAG_ERRORS as error:
    _exit_with_config_error(error)


def loaded_config(flag_values) -> ml_collections.ConfigDict:
  """The `--config` flag's ConfigDict, or a one-line error if its file did not load."""
  try:
    config = flag_values.config
    config.keys()  # A file that did not load is a stand-in that raises on first use.
    return config
  except _CONFIG_FLAG_ERRORS as error:
    _exit_with_config_error(error)


def config_flag_message(error: BaseException) -> str:
  """One line for ml_collections' multi-line config-flag errors."""
  if isinstance(error, SyntaxError):
    return f'--config: {error}'  # Names the file and line.
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]  # AttributeError(KeyError("'name'\nDid you mean ...?"))
  text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()] or [repr(error)]
  if isinstance(error, KeyError):
    hint = f' ({lines[1]})' if len(lines) > 1 else ''
    return f'--config.*: the config has no field {lines[0]}{hint}'
  if isinstance(error, OSError):
    # "Failed loading config file ...", "Attempted [...]:", the path, then the cause.
    return f'--config: {lines[-1]}'
  return f'--config: {" ".join(lines)}'


def _exit_with_config_error(error: BaseException):
  print(f'error: {config_flag_message(error)}', file=sys.stderr)
  sys.exit(2)


# Config fields that decide what the parameters and the data order mean: a resumed run must
# keep them. Everything else (number of steps, intervals, paths, batch size) may change.
_RESUME_FIXED_FIELDS = ('dataset', 'data.src_lang', 'data.tgt_lang', 'vocab_size',
                        'vocab_model_type', 'max_source_length', 'max_target_length', 'seed')


def _resume_fields(config_dict: dict, model: dict) -> dict:
  fields = {f'model.{k}': v for k, v in model.items()}
  for name in _RESUME_FIXED_FIELDS:
    value = config_dict
    for part in name.split('.'):
      value = value.get(part) if isinstance(value, dict) else None
    fields[name] = value
  return fields


def save_run_config(config: ml_collections.ConfigDict, model_config: TransformerConfig,
                    workdir: str) -> None:
  """Writes the resolved config; on resume, refuses changes to fields the run depends on."""
  path = os.path.join(workdir, CONFIG_FILE)
  resolved = {'config': json.loads(config.to_json()), 'model': model_config.to_dict()}
  if os.path.exists(path):
    try:
      with open(path) as f:
        saved = json.load(f)
    except json.JSONDecodeError as error:
      raise UserInputError(f'{path}: not valid JSON ({error})') from None
    before = _resume_fields(saved.get('config', {}), saved.get('model', {}))
    after = _resume_fields(resolved['config'], resolved['model'])
    differing = [k for k in after if before.get(k) != after[k]]
    if differing:
      details = ', '.join(f'{k}: {before.get(k)!r} -> {after[k]!r}' for k in differing)
      raise UserInputError(f'{path}: resuming with changed fields ({details}); use a new '
                           '--workdir or the original settings')
  if jax.process_index() == 0:
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
      json.dump(resolved, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def validate_run_config(config: ml_collections.ConfigDict) -> None:
  for name in ('per_device_batch_size', 'num_train_steps', 'log_every_steps',
               'eval_every_steps', 'checkpoint_every_steps', 'keep_checkpoints',
               'max_source_length', 'max_target_length', 'vocab_size', 'eval_batch_size',
               'warmup_steps', 'grad_accum_steps'):
    value = config[name]
    if not isinstance(value, int) or value <= 0:
      raise UserInputError(f'config.{name} must be a positive integer, got {value!r}')
  if (not isinstance(config.max_consecutive_nonfinite_steps, int)
      or config.max_consecutive_nonfinite_steps < 1):
    raise UserInputError('config.max_consecutive_nonfinite_steps must be a positive integer, '
                         f'got {config.max_consecutive_nonfinite_steps!r}')
  if not 0.0 <= config.label_smoothing < 1.0:
    raise UserInputError(f'config.label_smoothing must be in [0, 1), got {config.label_smoothing}')
  if config.batching != 'fixed' and (not isinstance(config.tokens_per_batch, int)
                                     or config.tokens_per_batch <= 0):
    raise UserInputError(f'config.tokens_per_batch must be a positive integer, '
                         f'got {config.tokens_per_batch!r}')
  if not isinstance(config.eval_decode_examples, int) or config.eval_decode_examples < 0:
    raise UserInputError('config.eval_decode_examples must be an integer >= 0, '
                         f'got {config.eval_decode_examples!r}')
  if not is_number(config.learning_rate_scale) or config.learning_rate_scale <= 0:
    raise UserInputError(f'config.learning_rate_scale must be a positive number, '
                         f'got {config.learning_rate_scale!r}')
  for name in ('adam_b1', 'adam_b2'):
    if not is_number(config[name]) or not 0.0 <= config[name] < 1.0:
      raise UserInputError(f'config.{name} must be in [0, 1), got {config[name]!r}')
  for name in ('adam_eps', 'grad_clip_norm'):
    if not is_number(config[name]) or config[name] < 0:
      raise UserInputError(f'config.{name} must be a number >= 0, got {config[name]!r}')
  # Sequences are padded or bucketed up to these lengths; the model rejects longer ones only
  # once the step is traced, as a traceback.
  longest = max(config.max_source_length, config.max_target_length)
  if config.model.max_len < longest:
    raise UserInputError(
        f'config.model.max_len={config.model.max_len} is shorter than max_source_length='
        f'{config.max_source_length} / max_target_length={config.max_target_length}; '
        f'set it to at least {longest}')
