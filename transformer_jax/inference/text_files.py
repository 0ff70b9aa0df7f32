"""The `translate` command's work: lines in (a file or stdin), one output line per input line
out (a file or stdout), in order; and the `score` command's (`score_files`).

Two output formats (`OUTPUT_FORMATS`):
- 'text': one translation per line (an empty line for a blank one);
- 'jsonl': one JSON object per source line, `{"hypotheses": [{"text", "log_prob", "score",
  "tokens"[, "utility"][, "alignment"]}, ...]}`, best first (`Hypothesis`; a blank line has
  none). JSON lines because line N is still source N, every language parses it, a text holding
  tabs or `|||` cannot break a field, and the fields are named (new ones break no reader).
"""

from __future__ import annotations

import json
import sys
from typing import IO

from transformer_jax.common import paths, text_io
from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import models as model_choice
from transformer_jax.inference.options import DecodingOptions, check_decoding_options

OUTPUT_FORMATS = ('text', 'jsonl')


def translate_text(
  workdir: str | None = None,
  *,
  models: str | None = None,
  weights: str | None = None,
  checkpoint: int | str | None = None,
  batch_size: int = 64,
  beam_size: int = 4,
  alpha: float = 0.6,
  beam_rule: str = 'exact',
  input_path: str | None = None,
  output_path: str | None = None,
  target_prefix_path: str | None = None,
  output_format: str = 'text',
  alignments: bool = False,
  stdin: IO[bytes] | None = None,
  stdout: IO[str] | None = None,
  dtype: str | None = None,
  **options,
) -> None:
  """The `translate` command: one output line per input line, in order (see the module).

  Reads `input_path` (or stdin) and writes `output_path` (or stdout). When stdin is a
  terminal, translates each line as soon as it is typed. `options`: the other
  `DecodingOptions` fields (num_hypotheses, sampling and its settings, seed, mbr). Line N of
  `target_prefix_path` is the prefix of source line N (an empty line: none). `alignments`:
  each hypothesis gets its Pharaoh word alignment (`Translator.align`; an ensemble's: its
  first member's attention), in jsonl. Every check of the options, the files, the prefixes
  and where the output goes runs before any parameters are restored; input is read by
  `text_io`'s policy; only a terminal's bytes that are not UTF-8 become U+FFFD.
  """
  stdin = stdin or sys.stdin.buffer
  stdout = stdout or sys.stdout
  decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, **options)
  decoding.check()
  check_decoding_options(beam_size, alpha, batch_size, beam_rule, dtype)
  _check_output_format(output_format, decoding, alignments)
  choice = model_choice.choose(workdir, models, checkpoint, weights)
  for path, flag in ((input_path, '--input'), (target_prefix_path, '--target_prefix_file')):
    if path is not None:
      text_io.check_readable_file(path, flag)
  if output_path is not None:  # Before any work: translations with nowhere to go are lost.
    text_io.check_writable_output(output_path, '--output')
    inputs = {'--input': input_path, '--target_prefix_file': target_prefix_path}
    for folder in choice.workdirs:
      paths.check_outputs_apart({'--output': output_path}, inputs, {choice.flag: folder})
  interactive = input_path is None and stdin.isatty()
  if interactive and target_prefix_path is not None:
    raise UserInputError(
      '--target_prefix_file pairs its line N with input line N: give --input=FILE or pipe stdin'
    )
  if input_path is not None:
    lines = text_io.read_lines(input_path, '--input')
  elif not interactive:
    lines = text_io.decode_text(stdin.read(), 'stdin')
  prefixes = None
  if target_prefix_path is not None:
    prefixes = _read_prefixes(target_prefix_path, input_path, lines, choice)
  model = model_choice.load(choice=choice, batch_size=batch_size, dtype=dtype)
  settings = dict(beam_size=beam_size, alpha=alpha, **_fields(decoding))
  if interactive:
    print('Type a sentence and press Enter (Ctrl-D to quit).', file=sys.stderr)
    for number, line in enumerate(text_io.decode_lines(stdin, 'stdin', replace_invalid=True)):
      # Keyed by its line number, each typed line draws as it would in a file.
      (output,) = _outputs(
        model, [line], None, {**settings, 'draw_positions': [number]}, output_format, alignments
      )
      print(output, file=stdout, flush=True)
    return
  outputs = _outputs(model, lines, prefixes, settings, output_format, alignments, progress=True)
  text_io.write_lines(outputs, output_path, stdout)


def _fields(decoding: DecodingOptions) -> dict:
  """DecodingOptions' fields other than beam_size and alpha (passed by position)."""
  fields = dict(vars(decoding))
  del fields['beam_size'], fields['alpha']
  return fields


def _check_output_format(output_format: str, decoding: DecodingOptions, alignments: bool) -> None:
  if output_format not in OUTPUT_FORMATS:
    raise UserInputError(f'--output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}')
  if output_format != 'text':
    return
  if decoding.num_hypotheses != 1:
    raise UserInputError(
      f'--output_format=text writes one translation per line; --num_hypotheses='
      f'{decoding.num_hypotheses} needs --output_format=jsonl'
    )
  if alignments:
    raise UserInputError(
      '--output_format=text writes translations only; --alignments needs --output_format=jsonl'
    )


def _read_prefixes(prefix_path: str, input_path: str | None, lines: list[str], choice):
  """Line N of the prefix file for source line N (empty: None), each checked against its
  source's length cap with the vocabulary and max_len the model will decode with (read from
  the small files, before any parameters)."""
  from transformer_jax.inference import batches  # jax: only with prefixes.

  prefixes = text_io.read_lines(prefix_path, '--target_prefix_file')
  if len(prefixes) != len(lines):
    source = f'--input={input_path}' if input_path is not None else 'stdin'
    raise UserInputError(
      f'--target_prefix_file={prefix_path} has {len(prefixes)} lines but {source} has '
      f'{len(lines)}: line N is the prefix of source line N'
    )
  prefixes = [prefix if prefix.strip() else None for prefix in prefixes]
  tokenizer, target_tokenizer, max_len = model_choice.vocabularies_and_max_len(choice)
  jobs = batches.encode_sources(lines, tokenizer, max_len)
  batches.add_prefixes(
    jobs,
    prefixes,
    target_tokenizer,
    len(lines),
    name=lambda index: f'--target_prefix_file={prefix_path} line {index + 1}',
  )
  return prefixes


def _outputs(
  model, lines, prefixes, settings, output_format, alignments, progress=False
) -> list[str]:
  """The output line of each input line: a translation (text) or a JSON object (jsonl)."""
  if output_format == 'text':
    return model.translate(lines, target_prefix=prefixes, progress=progress, **settings)
  found = model.hypotheses(lines, target_prefix=prefixes, progress=progress, **settings)
  records = [[hypothesis.as_dict() for hypothesis in candidates] for candidates in found]
  if alignments:
    pairs = [
      (row, column) for row, candidates in enumerate(found) for column in range(len(candidates))
    ]
    aligned = model_choice.first_member(model).align(
      [lines[row] for row, _ in pairs], [found[row][column].text for row, column in pairs]
    )
    for (row, column), (_, pharaoh) in zip(pairs, aligned):
      records[row][column]['alignment'] = pharaoh
  return [json.dumps({'hypotheses': record}, ensure_ascii=False) for record in records]


def score_files(
  workdir: str | None,
  src_path: str,
  tgt_path: str,
  *,
  models: str | None = None,
  weights: str | None = None,
  checkpoint: int | str | None = None,
  batch_size: int = 64,
  output_path: str | None = None,
  per_token: bool = False,
  stdout: IO[str] | None = None,
  dtype: str | None = None,
) -> None:
  """The `score` command: line N of `output_path` (or stdout) scores line N of `src_path`
  against line N of `tgt_path` (`format_score`), under a workdir's model or an ensemble's
  mixture (`models`, `weights`: `inference.models.choose`).

  Every check a user's input can fail (unreadable or unwritable files, outputs over inputs,
  different line counts, empty files, a target over the model's max_len, the weights) runs
  before the parameters are restored; the output is written once, complete, or not at all.
  """
  from transformer_jax.inference import scoring  # jax: only once the inputs are checked.

  check_decoding_options(batch_size=batch_size, dtype=dtype)
  choice = model_choice.choose(workdir, models, checkpoint, weights)
  text_io.check_readable_file(src_path, '--src')
  text_io.check_readable_file(tgt_path, '--tgt')
  if output_path is not None:
    text_io.check_writable_output(output_path, '--output')
    for folder in choice.workdirs:
      paths.check_outputs_apart(
        {'--output': output_path}, {'--src': src_path, '--tgt': tgt_path}, {choice.flag: folder}
      )
  sources = text_io.read_lines(src_path, '--src')
  targets = text_io.read_lines(tgt_path, '--tgt')
  for flag, path, lines in (('--src', src_path, sources), ('--tgt', tgt_path, targets)):
    if not lines:
      raise UserInputError(f'{flag}={path}: the file is empty; nothing to score')
  if len(sources) != len(targets):
    raise UserInputError(
      f'--src={src_path} has {len(sources)} lines but --tgt={tgt_path} has {len(targets)}: '
      'line N of each is one pair'
    )
  # The vocabularies and max_len (small files) before the parameters: a target too long is
  # found before the checkpoint is read.
  tokenizer, target_tokenizer, max_len = model_choice.vocabularies_and_max_len(choice)
  pairs = scoring.encode_pairs(
    sources,
    targets,
    tokenizer,
    target_tokenizer,
    max_len,
    source_name=lambda index: f'--src={src_path} line {index + 1}',
    target_name=lambda index: f'--tgt={tgt_path} line {index + 1}',
  )
  model = model_choice.load(choice=choice, batch_size=batch_size, dtype=dtype)
  scorer = model_choice.decoding_translator(model)  # An ensemble's: the mixture's log-probs.
  results = scoring.score_encoded(scorer, pairs, per_token=per_token, progress=True)
  text_io.write_lines([scoring.format_score(r) for r in results], output_path, stdout or sys.stdout)
