"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX/Flax.

The model: `Transformer(TransformerConfig(...))` (linen, `transformer_jax.model`). Inference with
a trained workdir: `Translator` (`transformer_jax.inference`). Training: `train_and_evaluate`
(`transformer_jax.training`). docs/layout.md maps the subpackages.
"""

from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

__all__ = ['Transformer', 'TransformerConfig', 'Translator', 'train_and_evaluate']

# Imported on first use: training and inference pull in orbax, grain and tensorflow-datasets,
# which importing the model alone (or one of the package's light modules) should not cost.
_LAZY = {
  'Translator': ('transformer_jax.inference.translator', 'Translator'),
  'train_and_evaluate': ('transformer_jax.training.loop', 'train_and_evaluate'),
}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
