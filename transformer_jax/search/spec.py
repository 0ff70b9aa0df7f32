"""One search, as one frozen spec (`SearchSpec`: everything static about it, a jit static
argument) and its traced inputs (`SearchInputs`), run over a model's or an ensemble's `Steps`
by `run`: the one entry point through which `inference` decodes. The decoding options
(`inference.options.DecodingOptions`) become a spec in one place (`DecodingOptions.spec`), so
no option is threaded by hand through the layers between the flag and the search.

Like the rest of `search`, this never imports the model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.search import beam, sampling
from transformer_jax.search.decode import greedy_search_steps
from transformer_jax.search.steps import Steps

MODES = ('greedy', 'beam', 'sampling')


@dataclasses.dataclass(frozen=True)
class SearchSpec:
  """What shapes a search's program (hashable: one compiled program per spec and shapes)."""

  # 'greedy' (the argmax), 'beam' (beam search) or 'sampling' (a draw per row and step).
  mode: str
  # Steps at most: the output's length.
  max_decode_len: int
  bos_id: int
  eos_id: int
  pad_id: int = 0
  # Beam search: hypotheses kept, the GNMT penalty's alpha and the rule (beam.BEAM_RULES).
  beam_size: int = 1
  alpha: float = 0.0
  rule: str = 'exact'
  # Sampling: the top-k cut (0: none), and whether the temperature and the nucleus apply
  # (their values are traced, `SearchInputs`: a new value compiles nothing).
  top_k: int = 0
  tempered: bool = False
  nucleus: bool = False
  # Greedy: sum each output's log-probability in the loop (beam and sampling always do).
  scored: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {self.mode!r}')
    if self.mode == 'beam' and self.rule not in beam.BEAM_RULES:
      raise ValueError(f'rule must be one of {beam.BEAM_RULES}, got {self.rule!r}')

  @property
  def outputs_per_row(self) -> int:
    """Hypotheses per input row: the beam for beam search, else 1."""
    return self.beam_size if self.mode == 'beam' else 1


class SearchInputs(NamedTuple):
  """A search's traced inputs, per row of the batch (None: not used)."""

  max_lengths: jax.Array | None = None  # int32 [b]: most tokens, EOS counted
  prefix: jax.Array | None = None  # int32 [b, P]: forced first tokens (`prefix`)
  prefix_lengths: jax.Array | None = None  # int32 [b]
  keys: jax.Array | None = None  # PRNG keys [b] (typed, or uint32 [b, 2]): sampling
  temperature: jax.Array | None = None  # float32 []: sampling, where spec.tempered
  top_p: jax.Array | None = None  # float32 []: sampling, where spec.nucleus


def run(
  spec: SearchSpec, steps: Steps, batch_size: int, inputs: SearchInputs
) -> tuple[jax.Array, jax.Array]:
  """Runs the search `spec` names: (tokens int32[b, n, max_decode_len] in `decode`'s
  convention, scores float32[b, n]), n = spec.outputs_per_row. Beam search's scores are its
  hypotheses' log-probs over the GNMT penalty, best first; greedy's (with spec.scored) and
  sampling's are each output's total log-probability (unscored greedy: zeros)."""
  common = dict(
    batch_size=batch_size,
    max_decode_len=spec.max_decode_len,
    bos_id=spec.bos_id,
    eos_id=spec.eos_id,
    pad_id=spec.pad_id,
    max_lengths=inputs.max_lengths,
    prefix=inputs.prefix,
    prefix_lengths=inputs.prefix_lengths,
  )
  if spec.mode == 'beam':
    return beam.beam_search_steps(
      steps, beam_size=spec.beam_size, alpha=spec.alpha, rule=spec.rule, **common
    )
  if spec.mode == 'greedy':
    tokens, log_probs = greedy_search_steps(steps, scored=spec.scored, **common)
    if log_probs is None:
      log_probs = jnp.zeros((batch_size,), jnp.float32)
  else:
    tokens, log_probs = sampling.sample_search_steps(
      steps,
      keys=inputs.keys,
      # Each filter statically off (1) unless the spec applies it.
      temperature=inputs.temperature if spec.tempered else 1.0,
      top_k=spec.top_k,
      top_p=inputs.top_p if spec.nucleus else 1.0,
      **common,
    )
  return tokens[:, None], log_probs[:, None]
