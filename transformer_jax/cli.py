"""What every command shares: the runner that maps exceptions to exit codes, the `--config`
flag, and parsing of flag values that several commands take.

Commands (`train.py`, `python -m transformer_jax.X`) are thin: they define flags and call
`run(main)`, whose `main` makes one library call. Library modules never import commands, and
only this module and the commands touch absl flags.

`run` also ends every command's faults of the disk and of its standard streams in one line, as
`common/streams.py` says.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, NoReturn

import ml_collections
from absl import app, logging
from absl import flags as absl_flags
from ml_collections import config_flags

from transformer_jax.common import errors, streams
from transformer_jax.common.log import quiet_library_logs

# The flags this module defines for the commands (`define_*_flag`) belong to the command that
# asks for them, so that its --help lists them: absl then skips this module as their definer.
absl_flags.disclaim_key_flags()

# What ml_collections raises for a bad `--config.field=value` (a misspelt field, a value of the
# wrong type) and, deferred to the first access of the flag, for a config file it cannot load.
_CONFIG_FLAG_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)


def exit_with_error(message: str, code: int = errors.EXIT_USER_ERROR) -> NoReturn:
  streams.say(f'error: {message}')
  sys.exit(code)


def run(main: Callable[[list[str]], None], *, config_flag: bool = False) -> None:
  """`absl.app.run(main)` with the project's errors as `error: <message>` and exit codes.

  `errors.EXIT_CODES` says which exception gives which status (2: the user's mistake, 3: a
  run stopped on NaN/Inf, 4: the disk failed a write); anything else is a bug and keeps its
  traceback. With `config_flag`, bad `--config` files and fields are one-line errors too (see
  `define_config_flag`). The standard streams' faults: see `common/streams.py`.
  """
  streams.guard_standard_streams()
  sys.unraisablehook = streams.without_closed_loop_reports(sys.unraisablehook)
  threading.excepthook = streams.storage_failure_ends_the_process(
    threading.excepthook, _where_the_command_writes
  )

  def main_with_exit_codes(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    quiet_library_logs()
    logging.get_absl_handler().addFilter(streams.StorageFailureReportFilter())
    try:
      main(argv)
      sys.stdout.flush()  # Now, not at exit, so that its failure is reported as any other.
    except Exception as error:  # pylint: disable=broad-except
      _exit_for(error)
      raise  # A bug: its traceback.

  try:
    app.run(main_with_exit_codes, flags_parser=parse_flags if config_flag else _parse_plain)
  except KeyboardInterrupt as interruption:  # Ctrl-C is no bug: no traceback.
    streams.exit_interrupted(interruption)
  except SystemExit:
    try:  # What absl printed (--help) before Python's exit flushes it and reports a failure.
      sys.stdout.flush()
    except BrokenPipeError:
      streams.exit_now(errors.EXIT_BROKEN_PIPE)
    except Exception:  # pylint: disable=broad-except  # Its exit status is said already.
      pass
    raise
  except Exception as error:  # pylint: disable=broad-except  # Printing --help, before main.
    _exit_for(error)
    raise


def _exit_for(error: Exception) -> None:
  """Ends the command for an exception from its `main` as `run` says; returns for a bug."""
  if isinstance(error, BrokenPipeError) and streams.readers_pipe_is_gone():
    streams.exit_now(errors.EXIT_BROKEN_PIPE)  # As SIGPIPE would: nothing to say, nobody to read.
  code = errors.exit_code(error)
  if code == errors.EXIT_STORAGE_FAILED:
    streams.exit_storage_failed(errors.storage_failure(error), _where_the_command_writes())
  if code is None:
    problem = streams.standard_stream_problem(error)
    if problem is None:
      return
    code, error = errors.EXIT_USER_ERROR, problem
  exit_with_error(str(error), code)


# The flags naming where commands write, most specific first (for a failure the OS did not name).
_OUTPUT_FLAGS = ('out', 'output', 'workdir', 'data_dir')


def _where_the_command_writes() -> streams.Destination | None:
  for name in _OUTPUT_FLAGS:
    with contextlib.suppress(AttributeError, absl_flags.Error):
      value = getattr(absl_flags.FLAGS, name)
      if isinstance(value, str) and value:
        return f'--{name}={value}', value
  return None


_HELP_FLAGS = ('--help', '-h', '-?', '--helpshort', '--helpfull', '--helpxml')


def _help_exits_zero(parse: Callable[[list[str]], list[str]], argv: list[str]) -> list[str]:
  """absl exits 1 after printing --help; asking for help is not an error."""
  try:
    return parse(argv)
  except SystemExit as exit_:
    if exit_.code == 1 and any(arg.split('=')[0] in _HELP_FLAGS for arg in argv[1:]):
      sys.exit(0)
    raise


def _parse_or_exit_2(argv: list[str]) -> list[str]:
  """absl's parsing, with a bad flag (an unknown name, a missing required flag, a value of the
  wrong type) as one `error:` line and status 2: absl prints 'FATAL Flags parsing error' and
  exits 1, the status of a bug."""
  try:
    return absl_flags.FLAGS(argv)
  except absl_flags.Error as error:
    message = ' '.join(line.strip() for line in str(error).splitlines() if line.strip())
    exit_with_error(f'{message} (--helpfull lists every flag)')


def _parse_plain(argv: list[str]) -> list[str]:
  return _help_exits_zero(_parse_or_exit_2, argv)


def define_beam_rule_flag() -> None:
  """--beam_rule, for the commands that decode (translate, evaluate): decode.BEAM_RULES."""
  from transformer_jax.search import decode  # jax: only for the commands that decode.

  absl_flags.DEFINE_enum(
    'beam_rule',
    'exact',
    list(decode.BEAM_RULES),
    "How beam search ends hypotheses and stops: 'exact' (until no beam can beat the finished "
    "ones) or 'ctranslate2' (CTranslate2's; with --alpha=0 its outputs exactly).",
  )


_WORKDIR_HELP = 'Training workdir (config.json, vocab.model, checkpoints).'


def define_workdir_flag(help_text: str = _WORKDIR_HELP, default: str | None = None) -> None:
  """--workdir, the folder of one training run (every command that reads or writes one)."""
  absl_flags.DEFINE_string('workdir', default, help_text)


def define_dtype_flag() -> None:
  """--dtype: the inference dtype (`Translator`'s dtype), for the commands that decode or score."""
  absl_flags.DEFINE_enum(
    'dtype',
    None,
    ['float32', 'bfloat16', 'float16'],
    "Inference dtype of the products and the parameters' matrices (default: the model's own).",
  )


def define_checkpoint_flag() -> None:
  """--checkpoint, which parameters of a workdir to use (read with `checkpoint_flag_value`)."""
  absl_flags.DEFINE_string(
    'checkpoint',
    None,
    "Step number, 'averaged', 'best' (by config.best_checkpoint_metric) or 'latest' (default: "
    'the averaged checkpoint if current, else the latest).',
  )


def define_config_flag(default: str, help_text: str, lock_config: bool = True) -> None:
  """`--config=FILE` (`get_config()` returning a ConfigDict) with `--config.field=value`.

  ml_collections applies the overrides as soon as a file is loaded (the default file: while
  the flag is defined) and reports a misspelt field or a missing file as a traceback; here they
  are one line and exit status 2. Commands then call `run(main, config_flag=True)` and read the
  config with `loaded_config()`.
  """
  try:
    config_flags.DEFINE_config_file('config', default, help_text, lock_config=lock_config)
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the config errors above as one line (for `app.run`)."""
  try:
    return _help_exits_zero(_parse_or_exit_2, argv)
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


def loaded_config(flag_values) -> ml_collections.ConfigDict:
  """The `--config` flag's ConfigDict, or a one-line error if its file did not load."""
  try:
    config = flag_values.config
    config.keys()  # A file that did not load is a stand-in that raises on first use.
    return config
  except _CONFIG_FLAG_ERRORS as error:
    exit_with_error(config_flag_message(error))


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


def checkpoint_flag_value(value: str | None) -> int | str | None:
  """--checkpoint: a step number, 'averaged', 'best' or 'latest' (None: the default choice);
  parsed by `inference.models.checkpoint_value`, which --models entries share."""
  from transformer_jax.inference import models  # The library's rule, imported when used.

  return models.checkpoint_value(value)


def define_models_flags() -> None:
  """--models and --weights: an ensemble instead of --workdir (`inference.models`)."""
  absl_flags.DEFINE_string(
    'models',
    None,
    'Instead of --workdir: an ensemble of workdirs sharing a vocabulary, DIR[@CHECKPOINT],DIR2,'
    '... (CHECKPOINT as --checkpoint; without one, --checkpoint). Each step decodes with the '
    "log of the weighted mean of the members' probabilities.",
  )
  absl_flags.DEFINE_string(
    'weights', None, 'With --models: one number > 0 per member, W1,W2,... (default: equal).'
  )


def define_sampling_flags() -> None:
  """--sampling and its settings, --seed and --mbr: `DecodingOptions`' fields, so that its
  one-line errors name the flags."""
  absl_flags.DEFINE_bool(
    'sampling', False, "Draw each token from the model's distribution instead of beam search."
  )
  absl_flags.DEFINE_float(
    'sampling_temperature', 1.0, 'With --sampling: softmax temperature, finite and > 0.'
  )
  absl_flags.DEFINE_integer(
    'sampling_topk', 0, 'With --sampling: draw among the k most probable pieces (0: all).'
  )
  absl_flags.DEFINE_float(
    'sampling_topp', 1.0, 'With --sampling: draw within the nucleus of probability p (1: all).'
  )
  absl_flags.DEFINE_integer(
    'seed', 0, 'Seed of the draws: the same seed and input give the same output.'
  )
  absl_flags.DEFINE_integer(
    'mbr',
    0,
    'Minimum-Bayes-risk decoding over N candidates (N draws with --sampling, else the N best '
    'of beam search, N <= --beam_size): the one of highest mean chrF against the others. 0: off.',
  )


def sampling_flag_values(flag_values) -> dict:
  """The values of `define_sampling_flags`' flags, as `DecodingOptions` keyword arguments."""
  names = ('sampling', 'sampling_temperature', 'sampling_topk', 'sampling_topp', 'seed', 'mbr')
  return {name: getattr(flag_values, name) for name in names}
