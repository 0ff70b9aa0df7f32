"""The model: `Transformer(TransformerConfig(...))` (flax linen), its inputs (masks, sinusoids),
its key/value cache for decoding (`cache`) and the matrix products it is made of (`matmul`)."""

from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer, count_params

__all__ = ['Transformer', 'TransformerConfig', 'count_params']
