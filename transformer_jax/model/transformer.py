"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax linen modules.

Every parameter carries logical axis names (`nn.with_logical_partitioning`) so that a mesh and
a set of rules in the training config decide how it is sharded; the model itself never names
a device axis. Layers of a stack are one `nn.scan`ned module (parameters stacked on a leading
'layers' axis), which compiles one layer instead of N.

Shapes use: b = batch, s = source length, t = target length, h = heads, d = head size,
m = d_model, v = vocabulary.
"""

from __future__ import annotations

import functools

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
  sinusoidal_positions,
)

# Added to masked attention logits. Finite so a fully masked row gives a uniform softmax, not NaN.
_MASK_VALUE = -1e9

_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def _logical(init, names):
  return nn.with_logical_partitioning(init, names)


class Projection(nn.Module):
  """A linear map from the last `num_in_axes` input axes to `features` (a dense layer whose
  kernel keeps its multi-axis shape, e.g. [embed, heads, kv], so each axis has a logical name).

  Xavier-uniform over the true fans (fan_in = product of input axes, fan_out = product of
  output axes), as for the equivalent 2-D matrix.
  """

  features: tuple[int, ...]
  num_in_axes: int
  kernel_axes: tuple[str, ...]
  dtype: object = jnp.float32
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    in_shape = x.shape[-self.num_in_axes :]
    in_axes = tuple(range(self.num_in_axes))
    out_axes = tuple(range(self.num_in_axes, self.num_in_axes + len(self.features)))
    init = nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform', in_axis=in_axes, out_axis=out_axes
    )
    kernel = self.param(
      'kernel', _logical(init, self.kernel_axes), (*in_shape, *self.features), jnp.float32
    )
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    y = matmul.project(x, kernel, self.num_in_axes)
    if self.use_bias:
      bias = self.param(
        'bias', _logical(_zeros, self.kernel_axes[self.num_in_axes :]), self.features, jnp.float32
      )
      y = y + bias.astype(self.dtype)
    return y


_ACTIVATIONS = {
  'relu': nn.relu,
  'swish': nn.swish,
  'silu': nn.swish,
  'gelu': functools.partial(nn.gelu, approximate=False),
  'gelu_sigmoid': lambda x: x * nn.sigmoid(1.702 * x),
}


def dot_product_attention_weights(query, key, mask, dtype=jnp.float32):
  """softmax(Q K^T / sqrt(d_k)) with masked entries at ~zero weight. -> [b, h, q, k] float32."""
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = jnp.einsum('bqhd,bkhd->bhqk', query, key, preferred_element_type=jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, _MASK_VALUE)
  # Softmax statistics in float32 whatever the compute dtype.
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def _attend(query, key, value, mask, dtype):
  """softmax(Q K^T / sqrt(d_k)) V over head-major arrays: query [b, h, q, d_k], key [b, h, k, d_k],
  value [b, h, k, d_v], mask broadcastable to [b, h, q, k] -> [b, h, q, d_v].

  Cached decoding's keys and values are head-major (`model.cache`)."""
  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(query.dtype)
  logits = jnp.einsum('bhqd,bhkd->bhqk', query, key, preferred_element_type=jnp.float32)
  weights = jax.nn.softmax(jnp.where(mask, logits, _MASK_VALUE), axis=-1)
  return jnp.einsum('bhqk,bhkd->bhqd', weights.astype(dtype), value.astype(dtype))


def _attention_projection(cfg: TransformerConfig, features: int, **module_args) -> Projection:
  """[..., m] -> [..., h, features]. No biases unless cfg.attention_bias (Marian's models): the
  paper's, tensor2tensor's and Flax's WMT example have none (a key bias cannot change the
  softmax, so its gradient is rounding noise)."""
  axes, dtype = ('embed', 'heads', 'kv'), cfg.compute_dtype
  bias = cfg.attention_bias
  return Projection((cfg.num_heads, features), 1, axes, dtype, use_bias=bias, **module_args)


class MultiHeadAttention(nn.Module):
  """Multi-head attention with separate per-head query/key size and value size.

  Without `cache`, every query position attends at once (training, uncached decoding). Cached
  decoding passes one query position for each of b * beam rows and this layer's part of the
  cache (`model.cache`), and gets (output, new cache). Self: this step's key/value is
  written in each row's slot, `mask` [b, 1, beam, max_t * beam] picks each beam's prefix.
  Cross: {'key', 'value'} [b, h, s, d], projected once per sentence, returned unchanged.
  """

  config: TransformerConfig
  kind: str  # 'self' or 'cross': decides what the cache holds.

  @nn.compact
  def __call__(self, query_inputs, kv_inputs, mask, deterministic: bool, cache=None):
    cfg = self.config
    dtype = cfg.compute_dtype

    def projection(features, name):
      return _attention_projection(cfg, features, name=name)

    output = Projection(
      (cfg.d_model,), 2, ('heads', 'kv', 'embed'), dtype, use_bias=cfg.attention_bias, name='out'
    )
    query = projection(cfg.head_qk_dim, 'query')(query_inputs)  # [b, q, h, d_k]
    if cache is not None:
      beam_size = query.shape[0] // cache['key'].shape[0]
      queries = model_cache.by_sentence(query, beam_size)  # [b, h, beam, d_k]
      if self.kind == 'cross':
        heads = _attend(queries, cache['key'], cache['value'], mask, dtype)
        return output(model_cache.by_row(heads)), cache
      new_cache = {
        name: model_cache.write_step(
          cache[name], projection(depth, name)(query_inputs), cache['index']
        )  # [b * beam, 1, h, d] projected, written in [b, h, max_t * beam, d]
        for name, depth in (('key', cfg.head_qk_dim), ('value', cfg.head_v_dim))
      }
      heads = _attend(queries, new_cache['key'], new_cache['value'], mask, dtype)
      return output(model_cache.by_row(heads)), new_cache

    key = projection(cfg.head_qk_dim, 'key')(kv_inputs)  # [b, k, h, d_k]
    value = projection(cfg.head_v_dim, 'value')(kv_inputs)  # [b, k, h, d_v]
    if cfg.attention_impl != 'einsum' and not self.is_mutable_collection('intermediates'):
      # The config rules out attention dropout here. Masked-out keys get a large negative
      # logit, as in the einsum path; rows with no key at all (padding queries) are ignored.
      heads = jax.nn.dot_product_attention(
        query.astype(dtype),
        key.astype(dtype),
        value.astype(dtype),
        mask=mask,
        implementation=cfg.attention_impl,
      )  # [b, q, h, d_v]
    else:
      weights = dot_product_attention_weights(query, key, mask)  # [b, h, q, k]
      self.sow('intermediates', 'attention_weights', weights)
      if cfg.attention_dropout_rate > 0.0 and not deterministic:
        weights = nn.Dropout(cfg.attention_dropout_rate)(weights, deterministic=False)
      heads = jnp.einsum('bhqk,bkhd->bqhd', weights.astype(dtype), value.astype(dtype))
    return output(heads)  # [b, q, m]


class FeedForward(nn.Module):
  """Position-wise FFN: Linear(d_model -> d_ff) -> activation (ReLU in the paper) ->
  Linear(d_ff -> d_model)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    hidden = Projection((cfg.d_ff,), 1, ('embed', 'mlp'), cfg.compute_dtype, name='wi')(x)
    hidden = _ACTIVATIONS[cfg.ffn_activation](hidden)
    return Projection((cfg.d_model,), 1, ('mlp', 'embed'), cfg.compute_dtype, name='wo')(hidden)


def _layer_norm(cfg: TransformerConfig, name: str):
  # Statistics in float32 (Flax upcasts), output in the compute dtype.
  return nn.LayerNorm(
    epsilon=cfg.layer_norm_epsilon,
    dtype=cfg.compute_dtype,
    scale_init=_logical(_ones, ('embed',)),
    bias_init=_logical(_zeros, ('embed',)),
    name=name,
  )


class _Residual(nn.Module):
  """Wraps a sub-layer: post-LN `LN(x + Dropout(f(x)))` or pre-LN `x + Dropout(f(LN(x)))`."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, sublayer, deterministic: bool):
    cfg = self.config
    norm = _layer_norm(cfg, 'norm')
    dropout = nn.Dropout(cfg.dropout_rate)
    if cfg.pre_norm:
      return x + dropout(sublayer(norm(x)), deterministic=deterministic)
    return norm(x + dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    cfg = self.config
    attention = MultiHeadAttention(cfg, kind='self', name='self_attention')
    x = _Residual(cfg, name='attention_block')(
      x, lambda y: attention(y, y, mask, deterministic), deterministic
    )
    x = _Residual(cfg, name='ffn_block')(x, FeedForward(cfg, name='ffn'), deterministic)
    x = nn.with_logical_constraint(x, ('activation_batch', 'activation_length', 'activation_embed'))
    return x, None  # (carry, per-layer output) for nn.scan


class DecoderLayer(nn.Module):
  """Self-attention, cross-attention, FFN. With `cache` (cached decoding: {'self': ...,
  'cross': ...}, see MultiHeadAttention) returns (x, new cache), else (x, None) for nn.scan."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, deterministic: bool, cache=None):
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, kind='self', name='self_attention')
    cross_attention = MultiHeadAttention(cfg, kind='cross', name='cross_attention')
    new_cache = {}

    def attend(y, attention, kind, kv_inputs, mask):  # With a cache, keeps the new one.
      if cache is None:
        return attention(y, y if kv_inputs is None else kv_inputs, mask, deterministic)
      output, new_cache[kind] = attention(y, None, mask, deterministic, cache[kind])
      return output

    x = _Residual(cfg, name='self_attention_block')(
      x, lambda y: attend(y, self_attention, 'self', None, self_mask), deterministic
    )
    x = _Residual(cfg, name='cross_attention_block')(
      x, lambda y: attend(y, cross_attention, 'cross', encoded, cross_mask), deterministic
    )
    x = _Residual(cfg, name='ffn_block')(x, FeedForward(cfg, name='ffn'), deterministic)
    x = nn.with_logical_constraint(x, ('activation_batch', 'activation_length', 'activation_embed'))
    return x, (new_cache if cache is not None else None)


def _stacked(
  layer_class,
  cfg: TransformerConfig,
  num_layers: int,
  num_broadcast_args: int,
  num_static_args: int,
  name: str,
):
  """N copies of a layer as one scanned module; parameters get a leading 'layers' axis."""
  if cfg.remat:
    # The trailing Python-bool arguments must stay static under remat. Flax counts `self` as
    # argument 0 and the scan carry as argument 1, then the broadcast arguments.
    last = 1 + num_broadcast_args
    layer_class = nn.remat(
      layer_class,
      prevent_cse=False,
      static_argnums=tuple(range(last - num_static_args + 1, last + 1)),
    )
  return nn.scan(
    layer_class,
    variable_axes={'params': 0, 'intermediates': 0},
    split_rngs={'params': True, 'dropout': True},
    in_axes=(nn.broadcast,) * num_broadcast_args,
    length=num_layers,
    metadata_params={nn.PARTITION_NAME: 'layers'},
  )(cfg, name=name)


class Embedder(nn.Module):
  """Token embedding x sqrt(d_model) + positional encoding, then dropout."""

  config: TransformerConfig
  token_embedding: nn.Module

  @nn.compact
  def __call__(self, ids, positions, deterministic: bool):
    cfg = self.config
    x = self.token_embedding(ids) * jnp.sqrt(cfg.d_model).astype(cfg.compute_dtype)
    if cfg.learned_positions:
      table = self.param(
        'position_embedding',
        _logical(nn.initializers.normal(stddev=cfg.d_model**-0.5), ('length', 'embed')),
        (cfg.max_len, cfg.d_model),
      )
      x = x + jnp.take(table, positions, axis=0).astype(cfg.compute_dtype)
    else:
      encoding = sinusoidal_positions(positions, cfg.d_model, cfg.sinusoid_layout)
      x = x + encoding.astype(cfg.compute_dtype)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


def _token_embedding(cfg: TransformerConfig, name: str) -> nn.Embed:
  # Normal(0, d_model^-0.5) so that after the sqrt(d_model) scale embeddings have unit variance,
  # matching the scale of the positional encoding (tensor2tensor's choice for shared weights).
  return nn.Embed(
    cfg.vocab_size,
    cfg.d_model,
    dtype=cfg.compute_dtype,
    embedding_init=_logical(nn.initializers.normal(stddev=cfg.d_model**-0.5), ('vocab', 'embed')),
    name=name,
  )


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
      shared = _token_embedding(cfg, 'shared_embedding')
      source_embedding = target_embedding = shared
      self.output_embedding = shared
    else:
      source_embedding = _token_embedding(cfg, 'source_embedding')
      target_embedding = _token_embedding(cfg, 'target_embedding')
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
        'logits_bias', _logical(_zeros, ('vocab',)), (cfg.vocab_size,), jnp.float32
      )
    self.source_embedder = Embedder(cfg, source_embedding, name='source_embedder')
    self.target_embedder = Embedder(cfg, target_embedding, name='target_embedder')
    self.encoder_layers = _stacked(
      EncoderLayer,
      cfg,
      cfg.num_encoder_layers,
      num_broadcast_args=2,
      num_static_args=1,
      name='encoder_layers',
    )
    self.decoder_layers = _stacked(
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
      self.encoder_norm = _layer_norm(cfg, 'encoder_norm')
      self.decoder_norm = _layer_norm(cfg, 'decoder_norm')

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
    output [b, t, m], which `output_logits` turns into logits [b, t, v] (scoring projects it in
    chunks of rows: `inference.decoding.target_log_probs`)."""
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
    if self.config.pre_norm:
      x = self.decoder_norm(x)
    if self.config.share_embeddings:
      logits = self.output_embedding.attend(x)
    else:
      logits = self.output_projection(x)
    logits = logits.astype(jnp.float32)
    return logits + self.logits_bias if self.config.logits_bias else logits

  def create_cache(self, encoded, *, max_decode_len: int, beam_size: int = 1):
    """Creates cached decoding's state (call with mutable=['cache']; layout: `model.cache`)
    for b sentences, encoder output encoded [b, s, m], beam_size rows each and max_decode_len
    positions: empty self-attention keys/values, the encoder output's cross-attention
    keys/values (projected here, once per sentence), the beam table and the step counter."""
    cfg = self.config

    def project(params, x):
      depth = params['kernel'].shape[-1]
      return _attention_projection(cfg, depth, parent=None).apply({'params': params}, x)

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
    _check_segments(src_segment_ids, tgt_segment_ids)
    encoded = self.encode(
      src_ids, deterministic=deterministic, segment_ids=src_segment_ids, positions=src_positions
    )
    return self.decode(
      encoded,
      src_ids,
      tgt_in_ids,
      deterministic=deterministic,
      src_segment_ids=src_segment_ids,
      tgt_segment_ids=tgt_segment_ids,
      tgt_positions=tgt_positions,
    )

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
