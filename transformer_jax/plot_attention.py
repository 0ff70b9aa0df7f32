"""Draws a trained model's attention as labelled heatmaps, like the paper's Figures 3-5.

    pip install -e '.[plot]'   # matplotlib
    python -m transformer_jax.plot_attention --workdir=DIR --text="A man rides a bike." \
        --out=attention.png [--target="..."] [--kind=cross|encoder|decoder] [--layers=5,6]

One panel per layer (rows) and head (columns); queries on the vertical axis, keys on the
horizontal one. For `cross` (the default) the target pieces are the rows and the source pieces
the columns. Without --target the model's own beam-search translation is used.
"""

from __future__ import annotations

import sys

from absl import app, flags

from transformer_jax.checkpointing import CorruptCheckpointError
from transformer_jax.config import UserInputError
from transformer_jax.metric_writers import quiet_library_logs
from transformer_jax.translate import AttentionMaps, Translator, checkpoint_flag_value

KINDS = {
    # kind: (AttentionMaps field, query tokens, key tokens, title)
    'cross': ('cross', 'target_tokens', 'source_tokens', 'encoder-decoder attention'),
    'encoder': ('encoder_self', 'source_tokens', 'source_tokens', 'encoder self-attention'),
    'decoder': ('decoder_self', 'target_tokens', 'target_tokens', 'decoder self-attention'),
}


def plot(maps: AttentionMaps, kind: str, out: str, layers: list[int] | None = None) -> str:
  """Writes the heatmaps of one kind of attention to `out` (any format matplotlib knows)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise UserInputError("plotting needs matplotlib: pip install -e '.[plot]'") from None
  matplotlib.use('Agg')  # Files only; no display needed.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  if kind not in KINDS:
    raise UserInputError(f'--kind={kind!r}: expected one of {", ".join(KINDS)}')
  field, query_field, key_field, title = KINDS[kind]
  weights = getattr(maps, field)  # [layers, heads, queries, keys]
  queries, keys = getattr(maps, query_field), getattr(maps, key_field)
  num_layers, num_heads = weights.shape[:2]
  layers = layers or list(range(1, num_layers + 1))
  for layer in layers:
    if not 1 <= layer <= num_layers:
      raise UserInputError(f'--layers: layer {layer} does not exist (the model has '
                           f'{num_layers}, numbered from 1)')
  cell = 0.22  # Inches per token, so labels stay legible.
  panel_width, panel_height = 1.2 + cell * len(keys), 1.0 + cell * len(queries)
  figure, axes = plt.subplots(len(layers), num_heads, squeeze=False,
                              figsize=(panel_width * num_heads, panel_height * len(layers)))
  for row, layer in enumerate(layers):
    for head in range(num_heads):
      axis = axes[row][head]
      axis.imshow(weights[layer - 1, head], cmap='viridis', vmin=0.0, vmax=1.0,
                  aspect='auto', interpolation='nearest')
      axis.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
      axis.set_yticks(range(len(queries)), queries, fontsize=7)
      axis.set_title(f'layer {layer}, head {head + 1}', fontsize=8)
  figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(out, dpi=100)
  plt.close(figure)
  return out


def _define_flags():
  flags.DEFINE_string('workdir', None, 'Training workdir (config, vocabulary, checkpoints).')
  flags.DEFINE_string('text', None, 'The source sentence.')
  flags.DEFINE_string('target', None, 'Its translation; default: the model\'s own (beam).')
  flags.DEFINE_string('out', 'attention.png', 'Image file to write (.png, .pdf, .svg).')
  flags.DEFINE_enum('kind', 'cross', list(KINDS), 'Which attention to draw.')
  flags.DEFINE_list('layers', None, 'Layers to draw, numbered from 1 (default: all).')
  flags.DEFINE_string('checkpoint', None, "A step, 'averaged' or 'latest' (default as translate).")
  flags.DEFINE_integer('beam_size', 4, 'Beam size for the translation when --target is unset.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty for the translation when --target is unset.')
  flags.mark_flags_as_required(['workdir', 'text'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  config = flags.FLAGS
  try:
    layers = [int(layer) for layer in config.layers] if config.layers else None
  except ValueError:
    print(f'error: --layers={",".join(config.layers)}: expected layer numbers like 1,6',
          file=sys.stderr)
    sys.exit(2)
  try:
    translator = Translator.from_checkpoint(config.workdir,
                                            checkpoint_flag_value(config.checkpoint))
    target = config.target
    if target is None:
      target = translator.translate([config.text], config.beam_size, config.alpha)[0]
    maps = translator.attention(config.text, target)
    plot(maps, config.kind, config.out, layers)
  except (UserInputError, FileNotFoundError, CorruptCheckpointError) as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  print(f'{config.kind} attention, {len(maps.source_tokens)} source x '
        f'{len(maps.target_tokens)} target pieces -> {config.out}')
  print(f'target{"" if config.target else " (the model translation)"}: {target}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
