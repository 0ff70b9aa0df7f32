"""Greedy, beam and sampling searches driven by a `tokens -> logits` step function, with
optional target prefixes, and ensembles of step functions (`ensemble`); never imports the model
(`inference.decoding` binds the two)."""

from transformer_jax.search.decode import BEAM_RULES, beam_search, greedy_search, strip_after_eos
from transformer_jax.search.ensemble import (
  combine_log_probs,
  ensemble_extend,
  ensemble_reorder,
  ensemble_step_fn,
)
from transformer_jax.search.prefix import force_logits, forced_tokens
from transformer_jax.search.sampling import filter_logits, sample_search, sampling_option_problem

__all__ = [
  'BEAM_RULES',
  'beam_search',
  'combine_log_probs',
  'ensemble_extend',
  'ensemble_reorder',
  'ensemble_step_fn',
  'filter_logits',
  'force_logits',
  'forced_tokens',
  'greedy_search',
  'sample_search',
  'sampling_option_problem',
  'strip_after_eos',
]
