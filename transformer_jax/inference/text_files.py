"""The `translate` command's work: lines in (a file or stdin), one translation per line out (a
file or stdout), in order."""

from __future__ import annotations

import sys
from typing import IO

from transformer_jax.common import paths, text_io
from transformer_jax.inference.translator import Translator, check_decoding_options


def translate_text(
  workdir: str,
  *,
  checkpoint: int | str | None = None,
  batch_size: int = 64,
  beam_size: int = 4,
  alpha: float = 0.6,
  beam_rule: str = 'exact',
  input_path: str | None = None,
  output_path: str | None = None,
  stdin: IO[bytes] | None = None,
  stdout: IO[str] | None = None,
) -> None:
  """The `translate` command: one translation per input line, in order (empty in, empty out).

  Reads `input_path` (or stdin) and writes `output_path` (or stdout). When stdin is a
  terminal, translates each line as soon as it is typed. Input is read by `text_io`'s policy
  (what is not UTF-8 text is refused with its line), before the checkpoint is restored; only a
  terminal's bytes that are not UTF-8 become U+FFFD instead of ending the session.
  """
  stdin = stdin or sys.stdin.buffer
  stdout = stdout or sys.stdout
  check_decoding_options(beam_size, alpha, batch_size, beam_rule)
  if input_path is not None:
    text_io.check_readable_file(input_path, '--input')
  if output_path is not None:  # Before any work: translations with nowhere to go are lost.
    text_io.check_writable_output(output_path, '--output')
    paths.check_outputs_apart(
      {'--output': output_path}, {'--input': input_path}, {'--workdir': workdir}
    )
  interactive = input_path is None and stdin.isatty()
  if input_path is not None:
    lines = text_io.read_lines(input_path, '--input')
  elif not interactive:
    lines = text_io.decode_text(stdin.read(), 'stdin')
  translator = Translator.from_checkpoint(workdir, checkpoint, batch_size)
  if interactive:
    print('Type a sentence and press Enter (Ctrl-D to quit).', file=sys.stderr)
    for line in text_io.decode_lines(stdin, 'stdin', replace_invalid=True):
      (translation,) = translator.translate([line], beam_size, alpha, beam_rule=beam_rule)
      print(translation, file=stdout, flush=True)
    return
  translations = translator.translate(
    lines, beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, progress=True
  )
  text_io.write_lines(translations, output_path, stdout)
