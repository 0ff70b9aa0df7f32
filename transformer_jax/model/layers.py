"""The Transformer's layers as Flax linen modules: projections, multi-head attention, the
position-wise feed-forward network, the residual sublayer, encoder and decoder layers, their
scanned stacks and the embedder (`model.transformer.Transformer` assembles them).

Every parameter carries logical axis names (`nn.with_logical_partitioning`) so that a mesh and
a set of rules in the training config decide how it is sharded.

Shapes use: b = batch, s = source length, t = target length, h = heads, d = head size,
m = d_model, v = vocabulary.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import cache as model_cache
from transformer_jax.model import matmul
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.inputs import sinusoidal_positions

_MASK_VALUE = -1e9

_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def logical_param(init, names):
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
      'kernel', logical_param(init, self.kernel_axes), (*in_shape, *self.features), jnp.float32
    )
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    y = matmul.project(x, kernel, self.num_in_axes)
    if self.use_bias:
      bias = self.param(
        'bias',
        logical_param(_zeros, self.kernel_axes[self.num_in_axes :]),
        self.features,
        jnp.float32,
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
  return matmul.einsum('bhqk,bhkd->bhqd', weights.astype(dtype), value.astype(dtype))


def attention_projection(cfg: TransformerConfig, features: int, **module_args) -> Projection:
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
      return attention_projection(cfg, features, name=name)

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
      heads = matmul.einsum('bhqk,bkhd->bqhd', weights.astype(dtype), value.astype(dtype))
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


def layer_norm(cfg: TransformerConfig, name: str):
  # Statistics in float32 (Flax upcasts), output in the compute dtype.
  return nn.LayerNorm(
    epsilon=cfg.layer_norm_epsilon,
    dtype=cfg.compute_dtype,
    scale_init=logical_param(_ones, ('embed',)),
    bias_init=logical_param(_zeros, ('embed',)),
    name=name,
  )


class _Residual(nn.Module):
  """Wraps a sub-layer: post-LN `LN(x + Dropout(f(x)))` or pre-LN `x + Dropout(f(LN(x)))`."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, sublayer, deterministic: bool):
    cfg = self.config
    norm = layer_norm(cfg, 'norm')
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


def stacked_layers(
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
    # Unrolled, the layers are straight-line code: XLA:CPU then fuses across them and drops the
    # loop's per-layer slicing and stacking of parameters and saved activations.
    unroll=num_layers if cfg.unroll_layers else 1,
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
        logical_param(nn.initializers.normal(stddev=cfg.d_model**-0.5), ('length', 'embed')),
        (cfg.max_len, cfg.d_model),
      )
      x = x + jnp.take(table, positions, axis=0).astype(cfg.compute_dtype)
    else:
      encoding = sinusoidal_positions(positions, cfg.d_model, cfg.sinusoid_layout)
      x = x + encoding.astype(cfg.compute_dtype)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


def token_embedding(cfg: TransformerConfig, name: str) -> nn.Embed:
  # Normal(0, d_model^-0.5) so that after the sqrt(d_model) scale embeddings have unit variance,
  # matching the scale of the positional encoding (tensor2tensor's choice for shared weights).
  return nn.Embed(
    cfg.vocab_size,
    cfg.d_model,
    dtype=cfg.compute_dtype,
    embedding_init=logical_param(
      nn.initializers.normal(stddev=cfg.d_model**-0.5), ('vocab', 'embed')
    ),
    name=name,
  )
