"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX/Flax.

The model: `Transformer(TransformerConfig(...))` (linen). Inference with a trained workdir:
`transformer_jax.inference.Translator`. Training: `transformer_jax.train_lib`.
"""

from transformer_jax.config import TransformerConfig
from transformer_jax.models import Transformer

__all__ = ['Transformer', 'TransformerConfig']
