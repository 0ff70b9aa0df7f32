"""`TransformerConfig`: the model's hyperparameters, frozen and validated once.

The field names mirror the paper's notation where it has one (d_model, d_ff, h -> num_heads,
d_k -> qk_dim, d_v -> v_dim, P_drop -> dropout_rate).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer_jax.common.errors import UserInputError, is_integer, is_number

_ATTENTION_IMPLS = ('einsum', 'xla', 'cudnn')
_BOOL_FIELDS = (
  'share_embeddings',
  'pre_norm',
  'learned_positions',
  'remat',
  'unroll_layers',
  'attention_bias',
  'logits_bias',
)
# FFN activations: the paper's relu; swish (= silu, x * sigmoid(x), Marian / OPUS-MT's default);
# gelu (exact, with erf: Marian since 2023-03); gelu_sigmoid (x * sigmoid(1.702 x): Marian's gelu
# before 2023-03 and CTranslate2's).
FFN_ACTIVATIONS = ('relu', 'swish', 'silu', 'gelu', 'gelu_sigmoid')
# 'interleaved': the paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).
# 'concatenated': tensor2tensor's and Marian's [sin | cos] halves, timescales 10000^(i/(d/2-1)).
SINUSOID_LAYOUTS = ('interleaved', 'concatenated')
# Token ids every vocabulary reserves (pad, eos, bos, unk: data/tokenizer.py); the model and
# the decoder index them, so a smaller table would be read out of range (clamped, silently).
_RESERVED_IDS = 4
# The sizes: positive integers, checked together.
SIZE_FIELDS = (
  'vocab_size',
  'd_model',
  'd_ff',
  'num_heads',
  'num_encoder_layers',
  'num_decoder_layers',
  'max_len',
)
# Fields that change how the model trains or computes, not what its parameters mean: a
# fine-tuning run sets them itself, and an export ignores them (parameters are float32 whatever
# the compute dtype). Every other field is the architecture.
TRAINING_ONLY_FIELDS = (
  'dropout_rate',
  'attention_dropout_rate',
  'remat',
  'unroll_layers',
  'attention_impl',
  'dtype',
)
# The architecture fields every exporter maps (exporters/ctranslate2_spec.py, huggingface.py):
# a field added to the model later is refused by them unless at its default
# (`refuse_unknown_variant`), so a new variant is never exported wrong.
EXPORTED_FIELDS = (
  *SIZE_FIELDS,
  'qk_dim',
  'v_dim',
  'share_embeddings',
  'pre_norm',
  'learned_positions',
  'layer_norm_epsilon',
  'attention_bias',
  'ffn_activation',
  'sinusoid_layout',
  'logits_bias',
)
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of the encoder-decoder Transformer.

  Defaults are the paper's base model (Vaswani et al., 2017, Table 3, row "base").
  """

  vocab_size: int
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  # Per-head query/key size d_k and value size d_v; None means d_model // num_heads.
  qk_dim: int | None = None
  v_dim: int | None = None
  # Dropout on each sub-layer output and on embeddings + positions (P_drop).
  dropout_rate: float = 0.1
  # Dropout on the attention weights. The paper does not use it; tensor2tensor's default is 0.
  attention_dropout_rate: float = 0.0
  # One matrix for source embedding, target embedding and the pre-softmax projection.
  share_embeddings: bool = True
  # False: LayerNorm(x + Dropout(Sublayer(x))) as in the paper. True: x + Dropout(Sublayer(LN(x))).
  pre_norm: bool = False
  # False: sinusoidal positional encoding. True: learned position embeddings (Table 3, row E).
  learned_positions: bool = False
  # Longest sequence (source or target) the model accepts; sizes learned positions and the cache.
  max_len: int = 256
  # Compute dtype of activations and matmuls; parameters always stay float32.
  dtype: str = 'float32'
  layer_norm_epsilon: float = 1e-6
  # Rematerialise each layer's activations in the backward pass (saves memory, costs compute).
  remat: bool = False
  # Unroll the encoder's and decoder's layer loops (the layers stay one scanned module with
  # stacked parameters, so checkpoints do not change). Faster steps on XLA:CPU (1.07-1.09x at the
  # Multi30k shape: bench/README.md), longer compiles; a loop compiles faster on accelerators.
  unroll_layers: bool = False
  # How attention is computed. 'einsum': explicit softmax weights (supports attention dropout
  # and returning the weights). 'xla' / 'cudnn': `jax.nn.dot_product_attention` with that
  # implementation ('cudnn': the fused flash-attention kernel on NVIDIA GPUs, float16/bfloat16
  # only). Attention maps (`Translator.attention`) always use 'einsum'.
  attention_impl: str = 'einsum'
  # Biases on the attention projections (query, key, value, output). The paper's models, as
  # tensor2tensor's, have none; Marian's (OPUS-MT) have them.
  attention_bias: bool = False
  # Activation between the two FFN projections: one of FFN_ACTIVATIONS.
  ffn_activation: str = 'relu'
  # How the sinusoidal encoding lays out its features: one of SINUSOID_LAYOUTS.
  sinusoid_layout: str = 'interleaved'
  # A learned bias on the output logits (Marian's decoder_ff_logit_out_b); the paper has none.
  logits_bias: bool = False

  def __post_init__(self):
    self._normalise_numpy_scalars()
    for name in SIZE_FIELDS:
      value = getattr(self, name)
      if not is_integer(value) or value <= 0:
        raise UserInputError(f'TransformerConfig.{name} must be a positive integer, got {value!r}')
    if self.vocab_size < _RESERVED_IDS:
      raise UserInputError(
        f'TransformerConfig.vocab_size={self.vocab_size} is smaller than the {_RESERVED_IDS} '
        'reserved ids (pad, eos, bos, unk)'
      )
    for name in ('qk_dim', 'v_dim'):
      value = getattr(self, name)
      if value is not None and (not is_integer(value) or value <= 0):
        raise UserInputError(
          f'TransformerConfig.{name} must be a positive integer or None, got {value!r}'
        )
    if (self.qk_dim is None or self.v_dim is None) and self.d_model % self.num_heads:
      raise UserInputError(
        f'TransformerConfig.d_model={self.d_model} is not divisible by '
        f'num_heads={self.num_heads}; set qk_dim and v_dim explicitly or change the sizes'
      )
    for name in ('dropout_rate', 'attention_dropout_rate'):
      value = getattr(self, name)
      if not is_number(value) or not 0.0 <= value < 1.0:
        raise UserInputError(f'TransformerConfig.{name} must be in [0, 1), got {value!r}')
    epsilon = self.layer_norm_epsilon
    if not is_number(epsilon) or not 0 < epsilon < math.inf:  # NaN fails too.
      raise UserInputError(
        f'TransformerConfig.layer_norm_epsilon must be a positive finite number, got {epsilon!r}'
      )
    for name in _BOOL_FIELDS:
      value = getattr(self, name)
      if not isinstance(value, bool):  # A string 'False' would be true.
        raise UserInputError(f'TransformerConfig.{name} must be True or False, got {value!r}')
    if self.attention_impl not in _ATTENTION_IMPLS:
      raise UserInputError(
        f'TransformerConfig.attention_impl must be one of '
        f'{", ".join(_ATTENTION_IMPLS)}, got {self.attention_impl!r}'
      )
    if self.attention_impl != 'einsum' and self.attention_dropout_rate > 0:
      raise UserInputError(
        f'TransformerConfig.attention_impl={self.attention_impl!r} has no attention dropout; '
        f"set attention_dropout_rate=0 (got {self.attention_dropout_rate}) or use 'einsum'"
      )
    if self.attention_impl == 'cudnn' and self.dtype == 'float32':
      raise UserInputError(
        "TransformerConfig.attention_impl='cudnn' needs dtype bfloat16 or float16, got float32"
      )
    for name, allowed in (
      ('ffn_activation', FFN_ACTIVATIONS),
      ('sinusoid_layout', SINUSOID_LAYOUTS),
    ):
      if getattr(self, name) not in allowed:
        raise UserInputError(
          f'TransformerConfig.{name} must be one of {", ".join(allowed)}, '
          f'got {getattr(self, name)!r}'
        )
    if self.dtype not in _DTYPES:
      raise UserInputError(
        f'TransformerConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}'
      )

  def _normalise_numpy_scalars(self) -> None:
    """NumPy integers and floats (a vocabulary size computed with NumPy, say) as Python ones, so
    the checks below accept them and `to_dict` stays JSON."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, np.generic):
        continue
      if isinstance(value, np.bool_):
        object.__setattr__(self, field.name, bool(value))
      elif isinstance(value, numbers.Integral):
        object.__setattr__(self, field.name, int(value))
      elif isinstance(value, numbers.Real):
        object.__setattr__(self, field.name, float(value))

  @property
  def head_qk_dim(self) -> int:
    return self.qk_dim if self.qk_dim is not None else self.d_model // self.num_heads

  @property
  def head_v_dim(self) -> int:
    return self.v_dim if self.v_dim is not None else self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, fields: dict) -> 'TransformerConfig':
    if not isinstance(fields, dict):
      raise UserInputError(
        f'TransformerConfig.from_dict takes a dict of fields, got {type(fields).__name__}'
      )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise UserInputError(f'unknown TransformerConfig field(s): {", ".join(unknown)}')
    required = [
      f.name
      for f in dataclasses.fields(cls)
      if f.default is dataclasses.MISSING and f.name not in fields
    ]
    if required:
      raise UserInputError(f'TransformerConfig field(s) missing: {", ".join(required)}')
    return cls(**fields)

  @classmethod
  def base(cls, vocab_size: int, **changes) -> 'TransformerConfig':
    """The paper's base model: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1 (~65M params)."""
    return cls(vocab_size=vocab_size, **changes)

  @classmethod
  def big(cls, vocab_size: int, **changes) -> 'TransformerConfig':
    """The paper's big model: N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 (~213M params)."""
    fields = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    fields.update(changes)
    return cls(vocab_size=vocab_size, **fields)


def architecture_fields() -> tuple[str, ...]:
  """The TransformerConfig fields that say what the parameters mean, vocab_size aside (a run
  config's own field): all but TRAINING_ONLY_FIELDS."""
  names = (field.name for field in dataclasses.fields(TransformerConfig))
  return tuple(n for n in names if n not in TRAINING_ONLY_FIELDS and n != 'vocab_size')


def refuse_unknown_variant(config: TransformerConfig, export: str) -> None:
  """A one-line UserInputError naming the first field neither in EXPORTED_FIELDS nor training-
  only whose value is not its default: `export` (e.g. 'the CTranslate2 export') does not know
  that variant."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    known = field.name in EXPORTED_FIELDS or field.name in TRAINING_ONLY_FIELDS
    if not known and value != field.default:
      raise UserInputError(
        f'TransformerConfig.{field.name}={value!r}: {export} does not know this model variant '
        '(only its default is exported)'
      )
