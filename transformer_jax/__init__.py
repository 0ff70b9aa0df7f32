"""transformer_jax: the Transformer of "Attention Is All You Need" in JAX/Flax."""

from transformer_jax.config import TransformerConfig
from transformer_jax.models import Transformer

__all__ = ['Transformer', 'TransformerConfig']
