"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax linen modules.

Every parameter carries logical axis names (`nn.with_logical_partitioning`) so that a mesh and
a set of rules in the training config decide how it is sharded; the model itself never names
a device axis. Layers of a stack are one `nn.scan`ned module (parameters stacked on a leading
'layers' axis), which compiles one layer instead of N. The layers themselves: `model.layers`.

Shapes use: b = batch, s = source length, t = target length, h = heads, d = head size,
m = d_model, v = vocabulary.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import cache as model_cache
from transformer_jax.model import matmul
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.inputs import (
  causal_padding_mask,
  padding_mask,
  segment_mask,
  segment_positions,
)
from transformer_jax.model.layers import (
  DecoderLayer,
  Embedder,
  EncoderLayer,
  Projection,
  attention_projection,
  layer_norm,
  logical_param,
  stacked_layers,
  token_embedding,
)


# Added to masked attention logits. Finite so a fully masked row gives a uniform softmax, not NaN.
class _DecodePosition(nn.Module):
  """Cached decoding's step counter: None on the call that creates the cache, else the index."""

  @nn.compact
  def __call__(self):
    exists = self.has_variable('cache', 'index')
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    if not exists:
      return None
    current = index.value
    index.value = current + 1
    return current


class Transformer(nn.Module):
  """Encoder-decoder Transformer. `apply({'params': p}, src_ids, tgt_in_ids) -> logits`.

  src_ids [b, s] and tgt_in_ids [b, t] are int token ids with padding id 0; tgt_in_ids is the
  target shifted right (starting with BOS). Logits are float32 [b, t, vocab_size].

  Packed rows (several examples per row) also pass src_segment_ids / tgt_segment_ids (example
  number 1..k within the row, 0 = padding) and optionally per-example positions: attention
  then never crosses an example boundary and positional encodings restart per example.
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      shared = token_embedding(cfg, 'shared_embedding')
      source_embedding = target_embedding = shared
      self.output_embedding = shared
    else:
      source_embedding = token_embedding(cfg, 'source_embedding')
      target_embedding = token_embedding(cfg, 'target_embedding')
      self.output_projection = Projection(
        (cfg.vocab_size,),
        1,
        ('embed', 'vocab'),
        cfg.compute_dtype,
        use_bias=False,
        name='output_projection',
      )
    if cfg.logits_bias:
      self.logits_bias = self.param(
        'logits_bias',
        logical_param(nn.initializers.zeros_init(), ('vocab',)),
        (cfg.vocab_size,),
        jnp.float32,
      )
    self.source_embedder = Embedder(cfg, source_embedding, name='source_embedder')
    self.target_embedder = Embedder(cfg, target_embedding, name='target_embedder')
    self.encoder_layers = stacked_layers(
      EncoderLayer,
      cfg,
      cfg.num_encoder_layers,
      num_broadcast_args=2,
      num_static_args=1,
      name='encoder_layers',
    )
    self.decoder_layers = stacked_layers(
      DecoderLayer,
      cfg,
      cfg.num_decoder_layers,
      num_broadcast_args=4,
      num_static_args=1,
      name='decoder_layers',
    )
    self.decode_position = _DecodePosition(name='decode_position')
    if cfg.pre_norm:
      # Pre-LN leaves the residual stream unnormalised; normalise each stack's output once.
      self.encoder_norm = layer_norm(cfg, 'encoder_norm')
      self.decoder_norm = layer_norm(cfg, 'decoder_norm')

  def encode(self, src_ids, *, deterministic: bool = True, segment_ids=None, positions=None):
    """Source ids [b, s] -> encoder output [b, s, m].

    Packed rows pass `segment_ids` [b, s] (example number 1..k within the row, 0 = padding):
    attention then stays within each example. `positions` [b, s] default to 0..s-1, or, with
    segment ids, to positions restarting at each example.
    """
    self._check_length(src_ids, 'source')
    if positions is None:
      positions = (
        jnp.broadcast_to(jnp.arange(src_ids.shape[1]), src_ids.shape)
        if segment_ids is None
        else segment_positions(segment_ids)
      )
    x = self.source_embedder(src_ids, positions, deterministic)
    mask = padding_mask(src_ids, src_ids)
    if segment_ids is not None:
      mask = mask & segment_mask(segment_ids, segment_ids)
    x, _ = self.encoder_layers(x, mask, deterministic)
    if self.config.pre_norm:
      x = self.encoder_norm(x)
    return x

  def decode(
    self,
    encoded,
    src_ids,
    tgt_in_ids,
    *,
    deterministic: bool = True,
    use_cache: bool = False,
    src_segment_ids=None,
    tgt_segment_ids=None,
    tgt_positions=None,
  ):
    """Decoder: (encoder output [b, s, m], source ids, target inputs [b, t]) -> logits [b, t, v].

    With use_cache=True (after `create_cache`, with mutable=['cache']) each call takes one token
    per row, tgt_in_ids [b * beam, 1], and the sources once per sentence, src_ids [b, s]
    (`encoded` is not read: the cache holds its projections); it advances the cache by one.

    Packed rows pass both `src_segment_ids` and `tgt_segment_ids` (see `encode`): target
    position i then attends only to earlier positions of its own example and to its own
    example's source. `tgt_positions` default as in `encode`. Cached decoding is not packed.
    """
    packed = _check_segments(src_segment_ids, tgt_segment_ids)
    if use_cache:
      if packed or not deterministic:
        raise ValueError('cached decoding is deterministic and takes no segment ids')
      return self._cached_step(src_ids, tgt_in_ids)
    features = self.decode_features(
      encoded,
      src_ids,
      tgt_in_ids,
      deterministic=deterministic,
      src_segment_ids=src_segment_ids,
      tgt_segment_ids=tgt_segment_ids,
      tgt_positions=tgt_positions,
    )
    return self.output_logits(features)

  def decode_features(
    self,
    encoded,
    src_ids,
    tgt_in_ids,
    *,
    deterministic: bool = True,
    src_segment_ids=None,
    tgt_segment_ids=None,
    tgt_positions=None,
  ):
    """`decode` without the cache and without the output projection: the decoder stack's
    output [b, t, m], which `output_logits` turns into logits [b, t, v] (scoring projects it one
    block of the vocabulary at a time, `block_logits`: `inference.decoding.target_log_probs`)."""
    packed = _check_segments(src_segment_ids, tgt_segment_ids)
    self._check_length(tgt_in_ids, 'target')
    cross_mask = padding_mask(tgt_in_ids, src_ids)
    if packed:
      cross_mask = cross_mask & segment_mask(tgt_segment_ids, src_segment_ids)
    positions = tgt_positions
    if positions is None:
      positions = (
        jnp.broadcast_to(jnp.arange(tgt_in_ids.shape[1]), tgt_in_ids.shape)
        if not packed
        else segment_positions(tgt_segment_ids)
      )
    self_mask = causal_padding_mask(tgt_in_ids)
    if packed:
      self_mask = self_mask & segment_mask(tgt_segment_ids, tgt_segment_ids)
    x = self.target_embedder(tgt_in_ids, positions, deterministic)
    x, _ = self.decoder_layers(x, encoded, self_mask, cross_mask, deterministic)
    return x

  def output_logits(self, x):
    """Decoder output [..., m] (`decode_features`) -> float32 logits [..., v]."""
    x = self.output_features(x)
    if self.config.share_embeddings:
      # nn.Embed.attend's product (both in the embedder's dtype), by matmul.attend.
      embedder = self.output_embedding
      logits = matmul.attend(x.astype(embedder.dtype), embedder.embedding.astype(embedder.dtype))
    else:
      logits = self.output_projection(x)
    logits = logits.astype(jnp.float32)
    return logits + self.logits_bias if self.config.logits_bias else logits

  def output_features(self, x):
    """Decoder output [..., m] -> what the output projection reads: the final layer norm under
    pre-LN, else x unchanged (`block_logits` takes these, normalised once for every block)."""
    return self.decoder_norm(x) if self.config.pre_norm else x

  def block_logits(self, features, start, size: int):
    """`output_logits` of the vocabulary entries start .. start + size - 1 only: float32
    [..., size], from `output_features`' output [..., m]. `start` may be traced; start + size
    must not pass vocab_size (`lax.dynamic_slice` would move the block back to fit). Scoring
    reduces the vocabulary one block at a time (`inference.decoding.target_log_probs`)."""
    cfg = self.config
    params = nn.meta.unbox(self.variables['params'])
    features = features.astype(cfg.compute_dtype)
    if cfg.share_embeddings:
      # Rows of the [v, m] table, as `nn.Embed.attend` reads the whole table.
      table = jax.lax.dynamic_slice_in_dim(params['shared_embedding']['embedding'], start, size)
      logits = matmul.attend(features, table.astype(cfg.compute_dtype))
    else:
      # Columns of the [m, v] kernel, as the `Projection` reads the whole kernel.
      kernel = params['output_projection']['kernel']
      kernel = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=1)
      logits = matmul.project(features, kernel.astype(cfg.compute_dtype), 1)
    logits = logits.astype(jnp.float32)
    if cfg.logits_bias:
      logits = logits + jax.lax.dynamic_slice_in_dim(params['logits_bias'], start, size)
    return logits

  def create_cache(self, encoded, *, max_decode_len: int, beam_size: int = 1):
    """Creates cached decoding's state (call with mutable=['cache']; layout: `model.cache`)
    for b sentences, encoder output encoded [b, s, m], beam_size rows each and max_decode_len
    positions: empty self-attention keys/values, the encoder output's cross-attention
    keys/values (projected here, once per sentence), the beam table and the step counter."""
    cfg = self.config

    def project(params, x):
      depth = params['kernel'].shape[-1]
      return attention_projection(cfg, depth, parent=None).apply({'params': params}, x)

    cache = model_cache.create(
      cfg,
      model_cache.layer_params(self.variables['params']['decoder_layers']),
      encoded,
      project,
      max_decode_len=max_decode_len,
      beam_size=beam_size,
    )
    for name, value in cache.items():
      self.put_variable('cache', name, value)
    self.decode_position()  # Creates the counter at 0.

  def _cached_step(self, src_ids, tgt_in_ids):
    """One cached decoding step: tgt_in_ids [b * beam, 1] -> logits [b * beam, 1, v]."""
    if not self.has_variable('cache', 'self_attention'):
      raise ValueError('cached decoding needs a cache: Transformer.create_cache first')
    if tgt_in_ids.shape[1] != 1:
      raise ValueError(
        f'cached decoding takes one target position per call, got {tgt_in_ids.shape[1]}'
      )
    index = self.decode_position()  # This step's position; the counter moves on.
    names = ('self_attention', 'cross_attention', 'beam_of_position')
    cache = {
      name: self.get_variable('cache', name) for name in names if self.has_variable('cache', name)
    }
    self_mask, cache = model_cache.self_attention_mask(cache, tgt_in_ids.shape[0], index)
    cross_mask = padding_mask(None, src_ids)  # [b, 1, 1, s]
    x = self.target_embedder(tgt_in_ids, jnp.broadcast_to(index, tgt_in_ids.shape), True)
    layer = DecoderLayer(self.config, parent=None)
    new_self_caches = []
    layers = model_cache.layer_params(self.variables['params']['decoder_layers'])
    for params, self_cache, cross_cache in zip(
      layers, cache['self_attention'], cache['cross_attention']
    ):
      layer_cache = {'self': {**self_cache, 'index': index}, 'cross': cross_cache}
      x, new = layer.apply({'params': params}, x, None, self_mask, cross_mask, True, layer_cache)
      new_self_caches.append(new['self'])
    self.put_variable('cache', 'self_attention', tuple(new_self_caches))
    if 'beam_of_position' in cache:
      self.put_variable('cache', 'beam_of_position', cache['beam_of_position'])
    return self.output_logits(x)

  def features(
    self,
    src_ids,
    tgt_in_ids,
    *,
    deterministic: bool = True,
    src_segment_ids=None,
    tgt_segment_ids=None,
    src_positions=None,
    tgt_positions=None,
  ):
    """`__call__` without the output projection: the decoder's output [b, t, m], which
    `output_logits` turns into logits [b, t, v] (training's loss projects it a few positions at
    a time: `training.losses.chunked_token_metrics`)."""
    _check_segments(src_segment_ids, tgt_segment_ids)
    encoded = self.encode(
      src_ids, deterministic=deterministic, segment_ids=src_segment_ids, positions=src_positions
    )
    return self.decode_features(
      encoded,
      src_ids,
      tgt_in_ids,
      deterministic=deterministic,
      src_segment_ids=src_segment_ids,
      tgt_segment_ids=tgt_segment_ids,
      tgt_positions=tgt_positions,
    )

  def __call__(
    self,
    src_ids,
    tgt_in_ids,
    *,
    deterministic: bool = True,
    src_segment_ids=None,
    tgt_segment_ids=None,
    src_positions=None,
    tgt_positions=None,
  ):
    """Logits [b, t, v]. Packed rows (several examples per row) pass segment ids for both
    sides (and optionally per-example positions); see `encode` and `decode`."""
    features = self.features(
      src_ids,
      tgt_in_ids,
      deterministic=deterministic,
      src_segment_ids=src_segment_ids,
      tgt_segment_ids=tgt_segment_ids,
      src_positions=src_positions,
      tgt_positions=tgt_positions,
    )
    return self.output_logits(features)

  def _check_length(self, ids, what):
    if ids.shape[1] > self.config.max_len:
      raise ValueError(
        f'{what} length {ids.shape[1]} exceeds TransformerConfig.max_len={self.config.max_len}'
      )


def _check_segments(src_segment_ids, tgt_segment_ids) -> bool:
  """Whether the call is packed; segment ids come for both sides or for neither."""
  if (src_segment_ids is None) != (tgt_segment_ids is None):
    raise ValueError(
      'packed rows need segment ids for both source and target, got only '
      + ('source' if tgt_segment_ids is None else 'target')
    )
  return src_segment_ids is not None


def count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
