"""Greedy and beam search driven by a `tokens -> logits` step function; never imports the
model (`inference.decoding` binds the two)."""

from transformer_jax.search.decode import BEAM_RULES, beam_search, greedy_search, strip_after_eos

__all__ = ['BEAM_RULES', 'beam_search', 'greedy_search', 'strip_after_eos']
