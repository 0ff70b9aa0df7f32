"""What the server decodes: the modes `--decoding` allows (`parse_decoding`), each request's
`DecodingOptions` checked against them and against the server's limits (`Served.options_of`),
and the options `warm_up` compiles (`Served.warm_up_options`).

--decoding is a comma list of entries; the first is what a request without options gets:
- `B:A`: beam search of beam size B with length penalty alpha A (`1` or `1:0`: greedy). Its
  n-best lists (num_hypotheses K <= B) and MBR over them (mbr N <= B) run the same programs;
- `sampling`, with `:`-separated settings: `topk=0+40` the top-k values allowed (0, no cut, by
  default), `draws=1+4` the numbers of draws per source allowed (num_hypotheses, or N with
  mbr; 1 by default), `temperature` and `topp`: any sampling_temperature / sampling_topp (both
  traced; without them only 1, no filter). Each of these is a program of its own (top_k and the
  draw count are shapes; a temperature of 1 and a top_p of 1 are programs without the filter);
- `:prefix` after any entry: requests with that mode may give a target_prefix (the programs for
  each prefix length bucket are compiled as well).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from transformer_jax.common.errors import UserInputError, check_positive_integer
from transformer_jax.inference.options import MAX_MBR_CANDIDATES, DecodingOptions

# The request fields of `DecodingOptions` a client may set (beam_rule is the server's: 'exact').
OPTION_FIELDS = (
  'beam_size',
  'alpha',
  'num_hypotheses',
  'sampling',
  'sampling_temperature',
  'sampling_topk',
  'sampling_topp',
  'seed',
  'mbr',
)
_SYNTAX = (
  '--decoding must be comma-separated entries: beam_size:alpha pairs like 4:0.6 (1: greedy) '
  'or sampling[:topk=K+K][:draws=N+N][:temperature][:topp], each optionally with :prefix'
)


@dataclasses.dataclass(frozen=True)
class BeamEntry:
  beam_size: int
  alpha: float  # 0 for greedy, which has no length penalty
  prefix: bool = False

  def describe(self) -> str:
    what = 'beam_size=1 (greedy)' if self.beam_size == 1 else f'beam_size={self.beam_size} '
    what += '' if self.beam_size == 1 else f'alpha={self.alpha:g}'
    return what + (' with target_prefix' if self.prefix else '')

  def as_dict(self) -> dict[str, Any]:
    entry: dict[str, Any] = {'beam_size': self.beam_size, 'alpha': self.alpha}
    return {**entry, 'target_prefix': True} if self.prefix else entry


@dataclasses.dataclass(frozen=True)
class SamplingEntry:
  topk: tuple[int, ...] = (0,)
  draws: tuple[int, ...] = (1,)
  temperature: bool = False
  topp: bool = False
  prefix: bool = False

  def describe(self) -> str:
    words = [f'sampling_topk {"/".join(map(str, self.topk))}']
    words.append(f'{"/".join(map(str, self.draws))} draws')
    words.append('any sampling_temperature' if self.temperature else 'sampling_temperature 1')
    words.append('any sampling_topp' if self.topp else 'sampling_topp 1')
    if self.prefix:
      words.append('target_prefix')
    return f'sampling ({", ".join(words)})'

  def as_dict(self) -> dict[str, Any]:
    entry = {
      'sampling': True,
      'sampling_topk': list(self.topk),
      'draws': list(self.draws),
      'sampling_temperature': 'any' if self.temperature else 1.0,
      'sampling_topp': 'any' if self.topp else 1.0,
    }
    return {**entry, 'target_prefix': True} if self.prefix else entry

  def serves(self, options: DecodingOptions) -> bool:
    return (
      options.sampling_topk in self.topk
      and options.candidates in self.draws
      and (self.temperature or options.sampling_temperature == 1)
      and (self.topp or options.sampling_topp == 1)
    )


Entry = BeamEntry | SamplingEntry


def parse_decoding(text: str) -> tuple[Entry, ...]:
  """'4:0.6,1:0,sampling:topk=0+40:draws=1+4' -> the entries, in order (duplicates dropped)."""
  entries: list[Entry] = []
  for part in text.split(','):
    entry = _parse_entry([word.strip() for word in part.strip().split(':')])
    if entry is None:
      raise UserInputError(f'{_SYNTAX}; got {text!r}')
    if entry not in entries:
      entries.append(entry)
  return tuple(entries)


def _parse_entry(words: list[str]) -> Entry | None:
  prefix = 'prefix' in words
  words = [word for word in words if word != 'prefix']
  if not words:
    return None
  if words[0] == 'sampling':
    return _parse_sampling(words[1:], prefix)
  if len(words) > 2:
    return None
  try:
    beam_size, alpha = int(words[0]), float(words[1]) if len(words) == 2 else None
  except ValueError:
    return None
  if beam_size < 1 or (beam_size > 1 and alpha is None):
    return None
  if alpha is not None and (not math.isfinite(alpha) or alpha < 0):
    return None
  return BeamEntry(beam_size, 0.0 if beam_size == 1 else float(alpha), prefix)


def _parse_sampling(words: list[str], prefix: bool) -> SamplingEntry | None:
  settings: dict[str, Any] = {'prefix': prefix}
  for word in words:
    name, equals, values = word.partition('=')
    if name in ('temperature', 'topp') and not equals and name not in settings:
      settings[name] = True
    elif name in ('topk', 'draws') and equals and name not in settings:
      try:
        numbers = tuple(sorted({int(value) for value in values.split('+')}))
      except ValueError:
        return None
      lowest = 0 if name == 'topk' else 1
      highest = math.inf if name == 'topk' else MAX_MBR_CANDIDATES
      if not all(lowest <= number <= highest for number in numbers):
        return None
      settings[name] = numbers
    else:
      return None
  return SamplingEntry(**settings)


@dataclasses.dataclass(frozen=True)
class Served:
  """The entries of --decoding and the limits on what a request may ask for."""

  entries: tuple[Entry, ...]
  max_hypotheses: int = 8
  max_mbr: int = 16

  @classmethod
  def parse(cls, decoding: str, max_hypotheses: int, max_mbr: int) -> 'Served':
    check_positive_integer('--max_hypotheses', max_hypotheses)
    check_positive_integer('--max_mbr', max_mbr)
    if max_mbr > MAX_MBR_CANDIDATES:
      raise UserInputError(f'--max_mbr must be at most {MAX_MBR_CANDIDATES}, got {max_mbr}')
    return cls(parse_decoding(decoding), max_hypotheses, max_mbr)

  def describe(self) -> str:
    return '; '.join(entry.describe() for entry in self.entries)

  def defaults(self) -> dict[str, Any]:
    """A request's options when it gives none: the first entry's (its first top-k and draws)."""
    first = self.entries[0]
    if isinstance(first, SamplingEntry):
      return {'sampling': True, 'sampling_topk': first.topk[0], 'num_hypotheses': first.draws[0]}
    beams = [entry for entry in self.entries if isinstance(entry, BeamEntry)]
    return {'beam_size': beams[0].beam_size, 'alpha': beams[0].alpha} if beams else {}

  def options_of(self, fields: dict[str, Any], prefixed: bool) -> DecodingOptions:
    """The request's DecodingOptions, or a one-line UserInputError naming the field: an
    impossible value (`DecodingOptions.check`), one over a limit, or a mode not served.
    `prefixed`: the request gives a target prefix."""
    given = {name: fields[name] for name in OPTION_FIELDS if name in fields}
    beams = [entry for entry in self.entries if isinstance(entry, BeamEntry)]
    default_beam = beams[0] if beams else BeamEntry(4, 0.6)
    if given.get('sampling', self.defaults().get('sampling', False)) is True:
      # The beam is not used: one key for every sampling request that differs only there.
      merged = {**self.defaults(), **given, 'beam_size': 1}
    else:
      merged = {'beam_size': default_beam.beam_size, 'alpha': default_beam.alpha, **given}
    merged.setdefault('alpha', default_beam.alpha)
    options = DecodingOptions(**merged).check()
    if options.num_hypotheses > self.max_hypotheses:
      raise UserInputError(
        f"num_hypotheses={options.num_hypotheses} is over this server's limit "
        f'(--max_hypotheses={self.max_hypotheses})'
      )
    if options.mbr > self.max_mbr:
      raise UserInputError(
        f"mbr={options.mbr} is over this server's limit (--max_mbr={self.max_mbr})"
      )
    # Floats, so that 1 and 1.0 are one key (one batch); greedy has no length penalty.
    alpha = 0.0 if options.mode == 'greedy' else float(options.alpha)
    options = dataclasses.replace(
      options,
      alpha=alpha,
      sampling_temperature=float(options.sampling_temperature),
      sampling_topp=float(options.sampling_topp),
    )
    self._check_served(options, prefixed)
    return options

  def _check_served(self, options: DecodingOptions, prefixed: bool) -> None:
    served = f'served: {self.describe()}'
    if options.sampling:
      entries = [entry for entry in self.entries if isinstance(entry, SamplingEntry)]
      if not entries:
        raise UserInputError(f'sampling is not served here; {served}')
      matching = [entry for entry in entries if entry.serves(options)]
      if not matching:
        raise UserInputError(f'{_sampling_mismatch(options, entries)} is not served here; {served}')
    else:
      key = BeamEntry(options.beam_size, options.alpha)
      matching = [
        entry
        for entry in self.entries
        if isinstance(entry, BeamEntry)
        and (entry.beam_size, entry.alpha) == (key.beam_size, key.alpha)
      ]
      if not matching:
        raise UserInputError(f'{key.describe()} is not served here; {served}')
    if prefixed and not any(entry.prefix for entry in matching):
      raise UserInputError(f'target_prefix is not served with {matching[0].describe()}; {served}')

  def warm_up_options(self) -> list[tuple[DecodingOptions, bool]]:
    """(options, with a prefix) for every program a served request can run."""
    found: list[tuple[DecodingOptions, bool]] = []
    for entry in self.entries:
      if isinstance(entry, BeamEntry):
        variants = [DecodingOptions(beam_size=entry.beam_size, alpha=entry.alpha)]
      else:
        variants = [
          DecodingOptions(
            beam_size=1,
            sampling=True,
            num_hypotheses=draws,
            sampling_topk=topk,
            sampling_temperature=temperature,
            sampling_topp=topp,
          )
          for topk, draws, temperature, topp in itertools.product(
            entry.topk,
            entry.draws,
            (1.0, 0.5) if entry.temperature else (1.0,),
            (1.0, 0.9) if entry.topp else (1.0,),
          )
        ]
      prefixes = (False, True) if entry.prefix else (False,)
      for options, prefixed in itertools.product(variants, prefixes):
        if (options, prefixed) not in found:
          found.append((options, prefixed))
    return found


def _sampling_mismatch(options: DecodingOptions, entries: list[SamplingEntry]) -> str:
  """The first field of a sampling request that no entry serves, as field=value."""
  checks = [
    ('sampling_topk', options.sampling_topk, lambda e: options.sampling_topk in e.topk),
    (
      'mbr' if options.mbr else 'num_hypotheses',
      options.candidates,
      lambda e: options.candidates in e.draws,
    ),
    (
      'sampling_temperature',
      options.sampling_temperature,
      lambda e: e.temperature or options.sampling_temperature == 1,
    ),
    ('sampling_topp', options.sampling_topp, lambda e: e.topp or options.sampling_topp == 1),
  ]
  for name, value, ok in checks:
    entries = [entry for entry in entries if ok(entry)]
    if not entries:
      return f'sampling with {name}={value:g}'
  return 'these sampling settings'
