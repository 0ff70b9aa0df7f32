"""A trained model's attention as labelled heatmaps, like the paper's Figures 3-5
(`python -m transformer_jax.plot_attention`; matplotlib: `pip install -e '.[plot]'`).

One panel per layer (rows) and head (columns); queries on the vertical axis, keys on the
horizontal one. For `cross` (the default) the target pieces are the rows and the source pieces
the columns. Without --target the model's own beam-search translation is used.

The image is drawn in memory and written like the other commands' outputs (`text_io`): --out is
checked before the checkpoint is restored, a symlink is written through, a pipe in place.
"""

from __future__ import annotations

import io
import os

from transformer_jax.common import paths, text_io
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.inference.translator import AttentionMaps, Translator, check_decoding_options

KINDS = {
  # kind: (AttentionMaps field, query tokens, key tokens, title)
  'cross': ('cross', 'target_tokens', 'source_tokens', 'encoder-decoder attention'),
  'encoder': ('encoder_self', 'source_tokens', 'source_tokens', 'encoder self-attention'),
  'decoder': ('decoder_self', 'target_tokens', 'target_tokens', 'decoder self-attention'),
}


def plot(maps: AttentionMaps, kind: str, out: str, layers: list[int] | None = None) -> str:
  """Writes the heatmaps of one kind of attention to `out` (any format matplotlib knows, by
  its extension; PNG without one)."""
  plt = _pyplot()
  image_format = check_image_format(out)
  if kind not in KINDS:
    raise UserInputError(f'--kind={kind!r}: expected one of {", ".join(KINDS)}')
  field, query_field, key_field, title = KINDS[kind]
  weights = getattr(maps, field)  # [layers, heads, queries, keys]
  queries, keys = getattr(maps, query_field), getattr(maps, key_field)
  num_layers, num_heads = weights.shape[:2]
  check_layers(layers, num_layers)
  layers = layers or list(range(1, num_layers + 1))
  cell = 0.22  # Inches per token, so labels stay legible.
  panel_width, panel_height = 1.2 + cell * len(keys), 1.0 + cell * len(queries)
  figure, axes = plt.subplots(
    len(layers),
    num_heads,
    squeeze=False,
    figsize=(panel_width * num_heads, panel_height * len(layers)),
  )
  for row, layer in enumerate(layers):
    for head in range(num_heads):
      axis = axes[row][head]
      axis.imshow(
        weights[layer - 1, head],
        cmap='viridis',
        vmin=0.0,
        vmax=1.0,
        aspect='auto',
        interpolation='nearest',
      )
      axis.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
      axis.set_yticks(range(len(queries)), queries, fontsize=7)
      axis.set_title(f'layer {layer}, head {head + 1}', fontsize=8)
  figure.suptitle(title)
  figure.tight_layout()
  image = io.BytesIO()
  figure.savefig(image, format=image_format, dpi=100)
  plt.close(figure)
  text_io.write_output(out, image.getvalue(), '--out')
  return out


def check_layers(layers: list[int] | None, num_layers: int) -> None:
  """A one-line error unless every layer number is one of the model's (numbered from 1)."""
  for layer in layers or ():
    if not is_integer(layer) or not 1 <= layer <= num_layers:
      raise UserInputError(
        f'--layers: layer {layer!r} does not exist (the model has {num_layers}, numbered from 1)'
      )


def _check_sentence(flag: str, value) -> None:
  if not isinstance(value, str):
    raise UserInputError(f'{flag} must be a sentence (str), got {type(value).__name__}')
  if not value.strip():  # An unset shell variable: a plot of nothing but </s>.
    raise UserInputError(f'{flag} is empty: give the sentence to draw')


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserInputError("plotting needs matplotlib: pip install -e '.[plot]'") from None
  matplotlib.use('Agg')  # Files only; no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def check_image_format(out: str) -> str:
  """The image format `out`'s extension names (png without one), or a one-line error."""
  _pyplot()
  from matplotlib.backend_bases import FigureCanvasBase  # pylint: disable=g-import-not-at-top

  extension = os.path.splitext(os.fspath(out))[1][1:].lower()
  supported = FigureCanvasBase.get_supported_filetypes()
  if extension and extension not in supported:
    raise UserInputError(
      f'--out={out}: cannot draw .{extension} images; use one of '
      + ', '.join(f'.{name}' for name in sorted(supported))
    )
  return extension or 'png'


def plot_translation(
  workdir: str,
  text: str,
  out: str,
  *,
  target: str | None = None,
  kind: str = 'cross',
  layers: list[int] | None = None,
  checkpoint: int | str | None = None,
  beam_size: int = 4,
  alpha: float = 0.6,
) -> tuple[AttentionMaps, str]:
  """The `plot_attention` command: restores `workdir`, translates `text` unless `target` is
  given, and draws one kind of attention to `out`. Returns (the maps, the target used)."""
  if kind not in KINDS:
    raise UserInputError(f'--kind={kind!r}: expected one of {", ".join(KINDS)}')
  _check_sentence('--text', text)
  if target is not None:
    _check_sentence('--target', target)
  check_decoding_options(beam_size, alpha)
  # Before the checkpoint is restored: a wrong --out costs seconds, not a translation.
  check_image_format(out)
  text_io.check_writable_output(out, '--out')
  paths.check_outputs_apart({'--out': out}, runs={'--workdir': workdir})
  translator = Translator.from_checkpoint(workdir, checkpoint)
  model = translator.model_config
  check_layers(layers, model.num_encoder_layers if kind == 'encoder' else model.num_decoder_layers)
  if target is None:
    target = translator.translate([text], beam_size, alpha)[0]
  maps = translator.attention(text, target)
  plot(maps, kind, out, layers)
  return maps, target
