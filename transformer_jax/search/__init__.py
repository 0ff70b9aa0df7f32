"""Greedy, beam and sampling searches driven by a `tokens -> logits` step function (`Steps`: a
model's or an ensemble's step, cache and its reordering), with optional target prefixes and
length caps (`prefix.Forcing`), one frozen spec per search (`SearchSpec`, run by `run`), and
ensembles of step functions (`ensemble`); never imports the model (`inference.decoding` binds
the two)."""

from transformer_jax.search.decode import BEAM_RULES, beam_search, greedy_search, strip_after_eos
from transformer_jax.search.ensemble import (
  combine_log_probs,
  ensemble_extend,
  ensemble_reorder,
  ensemble_step_fn,
  ensemble_steps,
)
from transformer_jax.search.prefix import Forcing, force_logits, forced_tokens
from transformer_jax.search.sampling import filter_logits, sample_search, sampling_option_problem
from transformer_jax.search.spec import SearchInputs, SearchSpec, run
from transformer_jax.search.steps import Steps

__all__ = [
  'BEAM_RULES',
  'Forcing',
  'SearchInputs',
  'SearchSpec',
  'Steps',
  'beam_search',
  'combine_log_probs',
  'ensemble_extend',
  'ensemble_reorder',
  'ensemble_step_fn',
  'ensemble_steps',
  'filter_logits',
  'force_logits',
  'forced_tokens',
  'greedy_search',
  'run',
  'sample_search',
  'sampling_option_problem',
  'strip_after_eos',
]
