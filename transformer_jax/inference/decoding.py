"""The model bound to the search: `model_steps` gives every search of `search` (which never
imports the model) the model's `tokens -> logits` step over its key/value cache, and
`search_model` runs one `search.SearchSpec` over it (the Translator's programs, an ensemble's
through `search.ensemble.ensemble_steps`). `greedy_decode` / `beam_decode` / `sample_decode` are
the same searches by keyword (training's evaluation, the exports, benchmarks), the uncached
ones the references the cached must match. Also the source length buckets every decoding
caller pads to (`source_bucket`) and teacher-forced log-probabilities of given targets
(`target_log_probs`: scoring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.model.cache import extend_cache, reorder_beams, unstack_decoder_layers
from transformer_jax.model.transformer import Transformer
from transformer_jax.search import decode, sampling
from transformer_jax.search import spec as search
from transformer_jax.search.spec import SearchInputs, SearchSpec
from transformer_jax.search.steps import Steps


def init_cache(
  model: Transformer,
  params,
  encoded: jax.Array,
  src_ids: jax.Array,
  max_decode_len: int,
  beam_size: int = 1,
):
  """Creates the decoding cache (`Transformer.create_cache`) of src_ids.shape[0] sentences,
  beam_size rows each: empty self-attention keys/values for `max_decode_len` positions and the
  cross-attention keys/values projected once per sentence from the encoder output."""
  del src_ids  # The steps read it: the cache holds only what the encoder output gives.
  _, variables = model.apply(
    {'params': params},
    encoded,
    max_decode_len=max_decode_len,
    beam_size=beam_size,
    mutable=['cache'],
    method=Transformer.create_cache,
  )
  return variables['cache']


# The self-attention cache of beam search's first steps; it doubles, up to the decode length.
_FIRST_CACHE_LENGTH = 8


def beam_cache_lengths(max_decode_len) -> tuple:
  """Cached beam search's cache lengths, each a loop of its own (`decode.beam_search`'s
  cache_lengths): 8, 16, 32, ... below max_decode_len, then max_decode_len, which replaces
  the last power of two if that is within 25% of it (64 for 66: a loop compiled for 2 steps).
  A symbolic length (jax.export) gets one loop."""
  if not isinstance(max_decode_len, int):
    return (max_decode_len,)
  lengths, length = [], _FIRST_CACHE_LENGTH
  while length < max_decode_len:
    lengths.append(length)
    length *= 2
  if lengths and 1.25 * lengths[-1] >= max_decode_len:
    lengths.pop()
  return (*lengths, max_decode_len)


def cached_step_fn(model: Transformer, params, src_ids: jax.Array) -> decode.StepFn:
  """The searches' step: tokens [rows, 1] and the cache -> (logits [rows, v], new cache), for
  rows = b sentences (src_ids [b, s]) x the cache's beams."""
  params = unstack_decoder_layers(params)  # Once, outside the search loop.

  def step_fn(token_ids, cache):
    logits, variables = model.apply(
      {'params': params, 'cache': cache},
      None,  # The encoder output: the cache holds its keys and values.
      src_ids,
      token_ids,
      use_cache=True,
      mutable=['cache'],
      method=Transformer.decode,
    )
    return logits[:, -1], variables['cache']

  return step_fn


def model_steps(model: Transformer, params, src_ids: jax.Array) -> Steps:
  """The model as every search takes it (`search.Steps`): the source encoded once, the cached
  step over it (`cached_step_fn`), the cache made for b * beam rows (`init_cache`), its beams
  reordered by their table (`reorder_beams`) and grown through `beam_cache_lengths`."""
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  return Steps(
    step=cached_step_fn(model, params, src_ids),
    # Made for batch * beam rows; its keys/values are never gathered, only its beam table.
    init_cache=lambda positions, beam_size: init_cache(
      model, params, encoded, src_ids, positions, beam_size
    ),
    reorder=reorder_beams,
    extend=extend_cache,
    # Greedy and sampling take one length: their cache is beam_size times smaller, and growing
    # it measured no faster, for one more compiled loop per length.
    cache_lengths=beam_cache_lengths,
  )


def search_model(
  model: Transformer, params, src_ids: jax.Array, spec: SearchSpec, inputs: SearchInputs
) -> tuple[jax.Array, jax.Array]:
  """The search `spec` names over `model_steps`: source ids [b, s] -> (ids [b, n,
  max_decode_len], scores [b, n]) (`search.run`). Call under jit (spec static)."""
  return search.run(spec, model_steps(model, params, src_ids), src_ids.shape[0], inputs)


def greedy_decode(
  model: Transformer,
  params,
  src_ids: jax.Array,
  *,
  max_decode_len: int,
  use_cache: bool = True,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
  max_lengths: jax.Array | None = None,
) -> jax.Array:
  """Greedy translation of a batch of source ids [b, s] -> output ids [b, max_decode_len].

  Rows end with EOS followed by padding. Call under jit (`max_decode_len`, `use_cache` static).
  prefix int32[b, P], prefix_lengths int32[b]: each row's forced first target ids, returned as
  the start of its output (`search.prefix`); max_lengths int32[b]: each row's cap.
  """
  forcing = dict(prefix=prefix, prefix_lengths=prefix_lengths, max_lengths=max_lengths)
  if use_cache:
    spec = SearchSpec('greedy', max_decode_len, BOS_ID, EOS_ID, PAD_ID)
    tokens, _ = search_model(model, params, src_ids, spec, SearchInputs(**forcing))
    return tokens[:, 0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)

  def logits_fn(target_input_ids):
    return model.apply(
      {'params': params}, encoded, src_ids, target_input_ids, method=Transformer.decode
    )

  return decode.greedy_search_uncached(
    logits_fn,
    batch_size=src_ids.shape[0],
    max_decode_len=max_decode_len,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    **forcing,
  )


def beam_decode(
  model: Transformer,
  params,
  src_ids: jax.Array,
  *,
  beam_size: int,
  alpha: float,
  max_decode_len: int,
  max_lengths: jax.Array | None = None,
  use_cache: bool = True,
  rule: str = 'exact',
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Beam search: source ids [b, s] -> (ids [b, beam, max_decode_len], scores [b, beam]).

  Best hypothesis first; scores are log-probabilities divided by the GNMT length penalty.
  `max_lengths` [b] caps each sentence's output (e.g. its source length + 50). `rule`:
  decode.BEAM_RULES ('ctranslate2' ends and stops as CTranslate2 does; decode.beam_search).
  prefix, prefix_lengths: as for greedy_decode; every hypothesis starts with the prefix and its
  score counts the prefix's log-probability.
  """
  forcing = dict(prefix=prefix, prefix_lengths=prefix_lengths, max_lengths=max_lengths)
  if use_cache:
    spec = SearchSpec(
      'beam', max_decode_len, BOS_ID, EOS_ID, PAD_ID, beam_size=beam_size, alpha=alpha, rule=rule
    )
    return search_model(model, params, src_ids, spec, SearchInputs(**forcing))
  batch_size = src_ids.shape[0]
  encoded = model.apply({'params': params}, src_ids, method=Transformer.encode)
  # The uncached decoder runs on batch * beam rows; the source side is the same for every beam.
  beam_encoded, beam_src = decode.expand_to_beams((encoded, src_ids), beam_size, batch_size)

  def logits_fn(target_input_ids):
    return model.apply(
      {'params': params}, beam_encoded, beam_src, target_input_ids, method=Transformer.decode
    )

  return decode.beam_search_uncached(
    logits_fn,
    batch_size=batch_size,
    beam_size=beam_size,
    max_decode_len=max_decode_len,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    alpha=alpha,
    rule=rule,
    **forcing,
  )


def check_sampling_options(temperature, top_k, top_p) -> None:
  """Raises a one-line UserInputError naming the option (temperature, top_k or top_p) that
  `sample_decode` would refuse: callers check before loading any model."""
  problem = sampling.sampling_option_problem(temperature, top_k, top_p)
  if problem:
    raise UserInputError(problem)


def sample_decode(
  model: Transformer,
  params,
  src_ids: jax.Array,
  *,
  keys,
  temperature=1.0,
  top_k: int = 0,
  top_p=1.0,
  max_decode_len: int,
  max_lengths: jax.Array | None = None,
  prefix: jax.Array | None = None,
  prefix_lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Sampled translations: source ids [b, s] -> (ids [b, max_decode_len], log_probs [b]).

  keys: one PRNG key per sentence (typed [b] or uint32 [b, 2]); a sentence's draw depends on
  its key and source only. temperature, top_k, top_p: `search.sampling.filter_logits` (check
  them first with `check_sampling_options`); log_probs: each output's total log-probability
  under the model (temperature 1, unfiltered). max_lengths [b] caps each output; prefix,
  prefix_lengths as for greedy_decode. Call under jit (max_decode_len and top_k static).
  """
  return sampling.sample_search_steps(
    model_steps(model, params, src_ids),
    batch_size=src_ids.shape[0],
    max_decode_len=max_decode_len,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
    keys=keys,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    max_lengths=max_lengths,
    prefix=prefix,
    prefix_lengths=prefix_lengths,
  )


def target_log_probs(
  model: Transformer,
  params,
  src_ids: jax.Array,
  tgt_ids: jax.Array,
  *,
  exclude_pad_and_bos: bool = True,
  rows_per_chunk: int | None = None,
  vocabulary_block: int | None = None,
) -> jax.Array:
  """log P of each target token given the source and the tokens before it: float32 [b, t].

  src_ids [b, s]: source pieces + EOS, then PAD; tgt_ids [b, t]: target pieces + EOS, then
  PAD. Teacher forcing: the decoder reads BOS + target and predicts target + EOS, in one
  forward pass. PAD positions get 0. `exclude_pad_and_bos`: see inference/scoring.py's docstring.

  Each target position needs its token's logit and the log-sum-exp of its logits, never the
  logits themselves: the output projection runs `vocabulary_block` entries at a time, each
  block folded into a running maximum and sum (the log-sum-exp taken online) and dropped, so
  the [b * t, v] logits are never stored. `rows_per_chunk` bounds the positions projected at
  once. None: the backend's choice (`_scoring_blocks`). Every choice gives the same values up
  to float rounding (tests/score_test.py).
  """
  variables = {'params': params}
  encoded = model.apply(variables, src_ids, method=Transformer.encode)
  features = model.apply(
    variables, encoded, src_ids, teacher_forcing_inputs(tgt_ids), method=Transformer.decode_features
  )  # [b, t, m]
  features = model.apply(variables, features, method=Transformer.output_features)
  b, t, m = features.shape
  vocab = model.config.vocab_size
  rows_per_chunk, vocabulary_block = _scoring_blocks(b * t, vocab, rows_per_chunk, vocabulary_block)
  chunks = -(-b * t // rows_per_chunk)
  rows = chunks * rows_per_chunk
  features = jnp.pad(features.reshape(b * t, m), ((0, rows - b * t), (0, 0)))
  targets = jnp.pad(tgt_ids.reshape(b * t), (0, rows - b * t))
  blocks = -(-vocab // vocabulary_block)

  def log_probs_of_chunk(chunk):  # ([rows, m], [rows]) -> [rows]
    chunk_features, chunk_targets = chunk

    def add_block(carry, index):
      running_max, running_sum, picked = carry  # each [rows]
      # The last block ends at the vocabulary's end; the entries it shares with the block
      # before are masked, so each entry is counted once and no table is padded.
      first = index * vocabulary_block
      start = jnp.minimum(first, vocab - vocabulary_block)
      logits = model.apply(
        variables, chunk_features, start, vocabulary_block, method=Transformer.block_logits
      )  # [rows, block]
      ids = start + jnp.arange(vocabulary_block)
      excluded = ids < first
      if exclude_pad_and_bos:
        excluded = excluded | (ids == PAD_ID) | (ids == BOS_ID)
      logits = jnp.where(excluded, -jnp.inf, logits)
      new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
      running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
        jnp.exp(logits - new_max[:, None]), axis=-1
      )
      offset = jnp.clip(chunk_targets - start, 0, vocabulary_block - 1)
      in_block = chunk_targets >= first
      picked = jnp.where(
        in_block, jnp.take_along_axis(logits, offset[:, None], axis=-1)[:, 0], picked
      )
      return (new_max, running_sum, picked), None

    # A finite lowest maximum: a block with every entry masked leaves the sum at 0, not NaN.
    lowest = jnp.full(chunk_targets.shape, jnp.finfo(jnp.float32).min)
    zeros = jnp.zeros(chunk_targets.shape, jnp.float32)
    (maximum, total, picked), _ = jax.lax.scan(
      add_block, (lowest, zeros, zeros), jnp.arange(blocks)
    )
    return picked - (maximum + jnp.log(total))

  log_probs = jax.lax.map(
    log_probs_of_chunk,
    (
      features.reshape(chunks, rows_per_chunk, m),  # [chunks, rows, m]
      targets.reshape(chunks, rows_per_chunk),
    ),
  ).reshape(rows)[: b * t]
  return jnp.where(tgt_ids == PAD_ID, 0.0, log_probs.reshape(b, t))


# Scoring's blocks on the CPU (target_log_probs), from a grid measured on the 2-core CPU at the
# base model (bench/README.md, issue 27): up to 2,048 positions at once, in equal chunks, and
# 512 vocabulary entries per block: a [rows, 512] block of logits stays in the cache while it
# is reduced. 768 positions x 37,000 entries: 207 ms with whole-vocabulary chunks of 128 rows,
# 156 ms so.
_CPU_SCORED_ROWS = 2048
_CPU_VOCABULARY_BLOCK = 512


def _scoring_blocks(positions: int, vocab: int, rows_per_chunk, vocabulary_block):
  """(rows per chunk, vocabulary entries per block) for target_log_probs: those given, else
  the backend's. On an accelerator, one chunk and one block: a loop of small products would
  leave the device idle between them (bench/README.md, issue 27)."""
  cpu = jax.default_backend() == 'cpu'
  if rows_per_chunk is None:
    chunks = -(-positions // _CPU_SCORED_ROWS) if cpu else 1
    rows_per_chunk = -(-positions // chunks)
  if vocabulary_block is None:
    vocabulary_block = _CPU_VOCABULARY_BLOCK if cpu else vocab
  return rows_per_chunk, min(vocabulary_block, vocab)


def teacher_forcing_inputs(tgt_ids: jax.Array) -> jax.Array:
  """The decoder's inputs [b, t] that predict tgt_ids [b, t]: BOS, then tgt_ids shifted right."""
  decoder_inputs = jnp.concatenate([jnp.full_like(tgt_ids[:, :1], BOS_ID), tgt_ids[:, :-1]], 1)
  # Padding reads as padding (the shifted EOS would do too: causal attention never reaches it).
  return jnp.where(tgt_ids == PAD_ID, PAD_ID, decoder_inputs)


# Source lengths are padded to powers of two from this one (source_bucket).
MIN_SOURCE_BUCKET = 8
# Extra target positions beyond the source length that decoding may use.
EXTRA_DECODE_LENGTH = 50


def source_bucket(length: int, limit: int) -> int:
  """Smallest power of two >= length (at least 8, at most limit): few shapes, few compiles."""
  bucket = MIN_SOURCE_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, limit)
