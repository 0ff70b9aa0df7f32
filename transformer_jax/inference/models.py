"""Which model a command decodes with: one workdir (`--workdir`, `--checkpoint`) or an ensemble
of several (`--models=DIR[@CHECKPOINT],DIR2,...` with `--weights=W1,W2,...`), checked whole
(`choose`) before any file of a model is read, then loaded (`load`).

A `--models` entry is a workdir, optionally followed by `@` and a checkpoint as `--checkpoint`
takes it (a step number, 'averaged', 'best' or 'latest'); an entry without one uses `--checkpoint`
(default: the workdir's default choice, `checkpoints.served`). The last `@` splits, so a folder
whose name holds an `@` needs an explicit checkpoint (`a@b@latest`); commas separate entries.
One `--models` entry without `--weights` is that workdir alone (a `Translator`, exactly).

No absl here: the commands' flags are parsed into these calls by `cli.py` and the commands.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from transformer_jax.common.errors import UserInputError, is_integer, is_number

# The checkpoints that have names (`checkpoints.served`); any other is a step number.
CHECKPOINT_NAMES = ('averaged', 'best', 'latest')


def checkpoint_value(value: str | int | None, name: str = '--checkpoint') -> int | str | None:
  """A checkpoint as the commands take it: a step number, 'averaged', 'best' or 'latest' (None: the
  workdir's default choice), or a one-line error naming `name`."""
  if value is None or value in CHECKPOINT_NAMES:
    return value
  if is_integer(value):
    return int(value)
  try:
    return int(value)
  except (TypeError, ValueError):
    raise UserInputError(
      f"{name} must be a step number, 'averaged', 'best' or 'latest', got {value!r}"
    ) from None


def parse_members(
  text: str, default_checkpoint: int | str | None = None
) -> list[tuple[str, int | str | None]]:
  """`--models=DIR[@CHECKPOINT],DIR2,...` as (workdir, checkpoint) pairs, in order; an entry
  without `@CHECKPOINT` gets `default_checkpoint` (`--checkpoint`)."""
  if not isinstance(text, str) or not text.strip():
    raise UserInputError('--models is empty: give DIR[@CHECKPOINT],DIR2,... (one or more workdirs)')
  members = []
  for number, entry in enumerate(text.split(','), start=1):
    entry = entry.strip()
    if not entry:
      raise UserInputError(
        f'--models entry {number} is empty (in {text!r}): one DIR[@CHECKPOINT] between commas'
      )
    workdir, at, checkpoint = entry.rpartition('@')
    if not at:
      members.append((entry, default_checkpoint))
      continue
    if not workdir:
      raise UserInputError(f'--models entry {number} ({entry!r}) has no workdir before its @')
    members.append((workdir, checkpoint_value(checkpoint, f'--models entry {number} checkpoint')))
  return members


def parse_weights(text: str | Sequence[float] | None, count: int) -> tuple[float, ...] | None:
  """`--weights=W1,W2,...` (or a sequence of numbers): one finite number > 0 per ensemble
  member, or a one-line error naming --weights. None: uniform."""
  if text is None:
    return None
  if isinstance(text, str):
    try:
      weights = tuple(float(part) for part in text.split(','))
    except ValueError:
      raise UserInputError(
        f'--weights must be numbers separated by commas, one per --models entry, got {text!r}'
      ) from None
  else:
    weights = tuple(text)
    if not all(is_number(w) for w in weights):
      raise UserInputError(f'--weights must be numbers, got {list(weights)!r}')
  if not all(math.isfinite(w) and w > 0 for w in weights):
    raise UserInputError(f'--weights must be finite numbers > 0, got {text!r}')
  if len(weights) != count:
    entries = 'entry' if count == 1 else 'entries'
    raise UserInputError(
      f'--weights has {len(weights)} numbers for {count} --models {entries}: give one per entry'
    )
  return weights


@dataclasses.dataclass(frozen=True)
class ModelChoice:
  """What `choose` found: the members to load (one pair: a single model) and their weights."""

  members: tuple[tuple[str, int | str | None], ...]
  weights: tuple[float, ...] | None
  ensemble: bool  # Given with --models (of more than one entry, or with --weights).

  @property
  def workdirs(self) -> list[str]:
    """The folders read, each once, in order (for `paths.check_outputs_apart`)."""
    return list(dict.fromkeys(workdir for workdir, _ in self.members))

  @property
  def flag(self) -> str:
    """The flag the workdirs came from, to name them in errors."""
    return '--models' if self.ensemble or len(self.members) > 1 else '--workdir'


def choose(
  workdir: str | None = None,
  models: str | Sequence | None = None,
  checkpoint: int | str | None = None,
  weights: str | Sequence[float] | None = None,
) -> ModelChoice:
  """Exactly one of `workdir` and `models` (the flag's text, or a list of workdirs and
  (workdir, checkpoint) pairs), checked without reading any file; one-line errors."""
  if (workdir is None) == (models is None):
    raise UserInputError(
      'give --workdir=DIR (one model) or --models=DIR,DIR2,... (an ensemble)'
      + (', not both' if workdir is not None else '')
    )
  if workdir is not None:
    if not isinstance(workdir, str) or not workdir:
      raise UserInputError(f'--workdir must name a workdir, got {workdir!r}')
    if weights is not None:
      raise UserInputError('--weights weighs the members of --models; --workdir is one model')
    return ModelChoice(((workdir, checkpoint),), None, ensemble=False)
  if isinstance(models, str):
    members = parse_members(models, checkpoint)
  else:
    members = [(m, checkpoint) if isinstance(m, str) else tuple(m) for m in models]
    if not members or any(len(m) != 2 or not isinstance(m[0], str) or not m[0] for m in members):
      raise UserInputError(
        f'models must be workdirs or (workdir, checkpoint) pairs, got {models!r}'
      )
  parsed = parse_weights(weights, len(members))
  return ModelChoice(tuple(members), parsed, ensemble=len(members) > 1 or parsed is not None)


def load(
  workdir: str | None = None,
  models: str | Sequence | None = None,
  checkpoint: int | str | None = None,
  weights: str | Sequence[float] | None = None,
  batch_size: int = 64,
  *,
  choice: ModelChoice | None = None,
  dtype: str | None = None,
):
  """A `Translator` (one workdir, or one --models entry without --weights) or an `Ensemble`
  (`Ensemble.from_checkpoints`: vocabularies compared before any parameters are read). Pass
  `choice` (from `choose`, already checked) instead of the other arguments. dtype: the
  inference dtype (`Translator`)."""
  from transformer_jax.inference.translator import Translator  # jax: only when loading.

  choice = choice or choose(workdir, models, checkpoint, weights)
  if not choice.ensemble:
    ((only, only_checkpoint),) = choice.members
    # Positional, and dtype only when given: tests stand a fake in for from_checkpoint.
    if dtype is None:
      return Translator.from_checkpoint(only, only_checkpoint, batch_size)
    return Translator.from_checkpoint(only, only_checkpoint, batch_size, dtype=dtype)
  from transformer_jax.inference.ensemble import Ensemble

  return Ensemble.from_checkpoints(list(choice.members), choice.weights, batch_size, dtype=dtype)


def decoding_translator(model):
  """The `Translator` whose batch loop and programs decode and score for `model`: itself, or
  an Ensemble's (the mixture's searches over the members' parameters), for
  `scoring.score_encoded`."""
  return getattr(model, '_batches', model)


def first_member(model):
  """The Translator whose attention aligns for `model`: itself, or an Ensemble's first member
  (an ensemble has no attention of its own)."""
  translators = getattr(model, 'translators', None)
  return translators[0] if translators else model


def vocabularies_and_max_len(choice: ModelChoice):
  """(source tokenizer, target tokenizer, max_len) of what `choice` will decode with, from the
  small files only (vocab.model, config.json), so that inputs are checked before parameters
  are read. An ensemble decodes within its members' smallest max_len (`inference.ensemble`)."""
  from transformer_jax.data.tokenizer import Tokenizer
  from transformer_jax.model.config import TransformerConfig
  from transformer_jax.workdir.layout import Workdir

  layouts = [Workdir(workdir) for workdir in choice.workdirs]
  max_len = min(
    TransformerConfig.from_dict(layout.read_run_config()['model']).max_len for layout in layouts
  )
  first = layouts[0]
  tokenizer = Tokenizer.load(first.vocab_file)
  target_file = first.target_vocab_file
  target_tokenizer = Tokenizer.load(target_file) if target_file.exists() else tokenizer
  return tokenizer, target_tokenizer, max_len
