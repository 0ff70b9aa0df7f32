"""A/B timing of speed levers on one model size, in one process, interleaved.

    python bench/levers.py --size=small --rounds=6 \
        --variants=baseline,fused_qkv,onehot_loss,dropout_bits16,no_attention_dropout,xla_attention,no_dropout,remat
    python bench/levers.py --size=multi30k --rounds=6 \
        --variants=baseline,layer_loop,whole_logits,argmax_accuracy,none_of_the_three

`--size=multi30k` is `configs/multi30k.py`'s model and training config (unrolled layers, the
loss in chunks of 512 rows) on 128 pairs x 32 tokens, the size of its 4k-token batches
(`--multi30k_rows` and `--multi30k_length` change the batch, to time other batch sizes). Its
variants undo what that config and the library do for speed: `layer_loop` (the layers as a
loop: `unroll_layers` off), `whole_logits` (`loss_rows_per_chunk` 0), `argmax_accuracy` (the
correct-token count by an argmax over the logits, as before `losses.correct_tokens`) and
`none_of_the_three`; and two recipe levers' step cost: `rdrop` (R-Drop, `rdrop_alpha` 5: every
example twice) and `vocab_5000` (a 5,000-piece vocabulary instead of 8,000; its MFU column still
counts 8,000 pieces' FLOPs). With `vocab_5000` among the variants, every variant's batches draw
ids below 5,000.

Every variant's training step is compiled first; then each round times `--steps` steps of every
variant in turn, so a noisy machine slows all variants alike. The table gives each variant's
fastest and median step and its speed relative to the first variant. XLA flags act per
process: compare them by running this script once per `XLA_FLAGS` setting (bench/README.md).

Variants that exist in the library are config changes (`xla_attention`, `remat`,
`no_dropout`, `no_attention_dropout`). The others are throwaway patches applied while the
variant's step is traced, kept here only so that the measurements in bench/README.md can be
repeated: `fused_qkv` (one matmul for the self-attention query/key/value projections, kernels
concatenated at run time), `dropout_bits16` (dropout masks from 16 random bits per element
instead of 32), `onehot_loss` (the label-smoothed loss through a [batch, length, vocab]
one-hot matrix, as the loss was before it avoided one) and `autodiff_kernel_grads` (projection
kernel gradients as autodiff writes them, a product contracting both operands' leading axis,
as they were before `matmul._matmul_row_major_grads`). `threefry_unpartitionable` traces with
`jax.threefry_partitionable(False)` (JAX's older, non-partitionable random-bit generation).

The process reuses freed host memory (`host_memory.reuse_freed_memory`), as train.py does.
"""

import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import flax.linen.stochastic as flax_stochastic  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from transformer_jax.benchmark import flops as flop_count  # noqa: E402
from transformer_jax.benchmark import training  # noqa: E402
from transformer_jax.configs import default, multi30k  # noqa: E402
from transformer_jax.model import layers as transformer_layers  # noqa: E402
from transformer_jax.model import matmul
from transformer_jax.training import host_memory  # noqa: E402
from transformer_jax.training import losses as training_losses  # noqa: E402
from transformer_jax.training import step as training_step  # noqa: E402
from transformer_jax.training.trainer import Trainer, forget_programs

flags.DEFINE_string(
  'size', 'small', "tiny, small or base (see transformer_jax.benchmark), or 'multi30k'"
)
flags.DEFINE_list(
  'variants',
  [
    'baseline',
    'fused_qkv',
    'onehot_loss',
    'dropout_bits16',
    'no_attention_dropout',
    'xla_attention',
    'no_dropout',
    'remat',
  ],
  'variants to compare; the first is the reference',
)
flags.DEFINE_integer(
  'multi30k_rows', 128, "--size=multi30k's batch rows (128 x 32: its 4k-token batch)"
)
flags.DEFINE_integer('multi30k_length', 32, "--size=multi30k's source and target length")
flags.DEFINE_integer('rounds', 6, 'timing rounds (each times every variant)')
flags.DEFINE_integer('steps', 3, 'steps per variant per round')
FLAGS = flags.FLAGS

_CONFIG_CHANGES = {
  'baseline': {},
  'no_dropout': dict(dropout_rate=0.0, attention_dropout_rate=0.0),
  'no_attention_dropout': dict(attention_dropout_rate=0.0),
  'xla_attention': dict(attention_dropout_rate=0.0, attention_impl='xla'),
  'remat': dict(remat=True),
  'fused_qkv': {},
  'dropout_bits16': {},
  'onehot_loss': {},
  'autodiff_kernel_grads': {},
  'rbg_dropout': {},
  'threefry_unpartitionable': {},
  'layer_loop': dict(unroll_layers=False),
  'whole_logits': {},
  'argmax_accuracy': {},
  'none_of_the_three': dict(unroll_layers=False),
  'rdrop': {},
  'vocab_5000': dict(vocab_size=5000),
}
# Training-config changes of the variants (the rest change only the model config).
_TRAINING_CHANGES = {
  'whole_logits': dict(loss_rows_per_chunk=0),
  'none_of_the_three': dict(loss_rows_per_chunk=0),
  'rdrop': dict(rdrop_alpha=5.0),
}


def _onehot_loss(logits, targets, weights, label_smoothing=0.1):
  vocab_size = logits.shape[-1]
  confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab_size - 1)
  soft_targets = jax.nn.one_hot(targets, vocab_size) * (confidence - low) + low  # [b, t, v]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  entropy = -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low))
  per_token = (-(soft_targets * log_probs).sum(-1) - entropy) * weights
  return per_token.sum(), weights.sum()


_JAX_BERNOULLI = jax.random.bernoulli  # flax_stochastic.random is jax.random: keep the original


def _bernoulli_rbg(key, p, shape):
  data = key if key.dtype == jnp.uint32 else jax.random.key_data(key)  # uint32[2]
  data = jnp.concatenate([data, jax.random.bits(key, (2,), jnp.uint32)])  # unsafe_rbg: [4]
  return _JAX_BERNOULLI(jax.random.wrap_key_data(data, impl='unsafe_rbg'), p, shape)


def _bernoulli_from_16_bits(key, p, shape):
  return jax.random.bits(key, shape, jnp.uint16) < int(round(float(p) * 2**16))


class _Kernel(nn.Module):
  """Just the kernel of a `models.Projection` (same name and shape, so the same params)."""

  shape: tuple

  @nn.compact
  def __call__(self):
    init = nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform', in_axis=(0,), out_axis=(1, 2)
    )
    return self.param('kernel', init, self.shape, jnp.float32)


def _fused_qkv_attention(original):
  def call(
    self, query_inputs, kv_inputs, mask, deterministic, use_cache=False, decode_position=None
  ):
    cfg = self.config
    if self.kind != 'self' or use_cache:
      return original(
        self, query_inputs, kv_inputs, mask, deterministic, use_cache, decode_position
      )
    d_model, dtype = query_inputs.shape[-1], cfg.compute_dtype
    kernels = [
      _Kernel((d_model, cfg.num_heads, size), name=name)()
      for name, size in (
        ('query', cfg.head_qk_dim),
        ('key', cfg.head_qk_dim),
        ('value', cfg.head_v_dim),
      )
    ]
    kernel = jnp.concatenate(kernels, axis=-1).astype(dtype)  # [m, h, 2 d_k + d_v]
    qkv = jnp.einsum('btm,mhd->bthd', query_inputs.astype(dtype), kernel)
    query, key, value = jnp.split(qkv, [cfg.head_qk_dim, 2 * cfg.head_qk_dim], axis=-1)
    weights = transformer_layers.dot_product_attention_weights(query, key, mask)  # [b, h, q, k]
    if cfg.attention_dropout_rate > 0.0 and not deterministic:
      weights = nn.Dropout(cfg.attention_dropout_rate)(weights, deterministic=False)
    heads = jnp.einsum('bhqk,bkhd->bqhd', weights.astype(dtype), value)
    return transformer_layers.Projection(
      (cfg.d_model,), 2, ('heads', 'kv', 'embed'), dtype, use_bias=False, name='out'
    )(heads)

  return call


def _argmax_correct_tokens(logits, targets, weights):
  return jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights)


def _size_spec(size):
  if size != 'multi30k':
    return training.size_spec(size, default.get_config(), dtype='float32')
  config = multi30k.get_config()
  config.batching = 'fixed'
  config.per_device_batch_size = FLAGS.multi30k_rows
  config.max_source_length = config.max_target_length = FLAGS.multi30k_length
  return training.size_spec('tiny', config, dtype='float32')


def _traced_config(variant):
  """JAX config a variant is traced under. It is part of jit's cache key, so it must also hold
  at every timed call, or the call would retrace and recompile under the default."""
  if variant == 'threefry_unpartitionable':
    return jax.threefry_partitionable(False)
  return contextlib.nullcontext()


@contextlib.contextmanager
def _patched(variant):
  saved = (
    flax_stochastic.random.bernoulli,
    training_step.label_smoothed_cross_entropy,
    transformer_layers.MultiHeadAttention.__call__,
    matmul.row_major_kernel_grads,
    training_losses.correct_tokens,
    training_step.correct_tokens,
  )
  try:
    if variant == 'dropout_bits16':
      flax_stochastic.random.bernoulli = _bernoulli_from_16_bits
    elif variant == 'rbg_dropout':
      flax_stochastic.random.bernoulli = _bernoulli_rbg
    elif variant == 'onehot_loss':
      training_step.label_smoothed_cross_entropy = _onehot_loss
    elif variant == 'fused_qkv':
      transformer_layers.MultiHeadAttention.__call__ = _fused_qkv_attention(saved[2])
    elif variant == 'autodiff_kernel_grads':
      matmul.row_major_kernel_grads = lambda: False
    elif variant in ('argmax_accuracy', 'none_of_the_three'):
      training_losses.correct_tokens = training_step.correct_tokens = _argmax_correct_tokens
    with _traced_config(variant):
      yield
  finally:
    (
      flax_stochastic.random.bernoulli,
      training_step.label_smoothed_cross_entropy,
      transformer_layers.MultiHeadAttention.__call__,
      matmul.row_major_kernel_grads,
      training_losses.correct_tokens,
      training_step.correct_tokens,
    ) = saved


def main(argv):
  del argv
  host_memory.reuse_freed_memory()
  unknown = [v for v in FLAGS.variants if v not in _CONFIG_CHANGES]
  if unknown:
    raise app.UsageError(f'unknown variant(s) {unknown}; known: {sorted(_CONFIG_CHANGES)}')
  spec = _size_spec(FLAGS.size)
  rng = np.random.default_rng(0)
  # Ids every variant's embedding can look up: the smallest vocabulary among the variants.
  batch_vocab_size = min(
    [spec.model_config.vocab_size]
    + [
      _CONFIG_CHANGES[v]['vocab_size'] for v in FLAGS.variants if 'vocab_size' in _CONFIG_CHANGES[v]
    ]
  )
  batches = [
    training.synthetic_batch(
      rng,
      spec.rows_per_device,
      spec.source_length,
      spec.target_length,
      batch_vocab_size,
    )
    for _ in range(2)
  ]
  flops = flop_count.training_flops(
    spec.model_config,
    [spec.source_length] * spec.rows_per_device,
    [spec.target_length] * spec.rows_per_device,
  )['total']
  runs = {}
  for variant in FLAGS.variants:
    variant_config = ml_collections.ConfigDict(spec.config.to_dict())
    variant_config.update(_TRAINING_CHANGES.get(variant, {}))
    variant_spec = dataclasses.replace(
      spec,
      config=variant_config,
      model_config=spec.model_config.replace(**_CONFIG_CHANGES[variant]),
    )
    with _patched(variant):  # Patches matter while tracing, i.e. during the first step.
      forget_programs()  # Variants of one config differ only by their patches: trace each.
      trainer = Trainer(variant_spec.config, variant_spec.model_config)
      state = trainer.init_state(0)
      start = time.perf_counter()
      state, metrics = trainer.step(state, batches[0])
      jax.block_until_ready(metrics)
    runs[variant] = dict(trainer=trainer, state=state, first=time.perf_counter() - start, times=[])
    print(f'compiled {variant} ({runs[variant]["first"]:.1f} s)', flush=True)
  peaks = []
  for _ in range(FLAGS.rounds):
    peaks.append(flop_count.measure_peak(2048, 'float32', 2)['flops_per_second'])
    for variant in FLAGS.variants:
      run = runs[variant]
      for i in range(FLAGS.steps):
        start = time.perf_counter()
        with _traced_config(variant):
          run['state'], metrics = run['trainer'].step(run['state'], batches[i % 2])
        jax.block_until_ready(metrics)
        run['times'].append(time.perf_counter() - start)
  peak = max(peaks)
  reference = runs[FLAGS.variants[0]]['times']
  print(
    f'\n{FLAGS.size}: {FLAGS.rounds} rounds x {FLAGS.steps} steps, peak '
    f'{peak / 1e9:.0f} GFLOP/s, XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}'
  )
  print(
    f'{"variant":22s} {"min step":>9s} {"median":>8s} {"MFU(min)":>9s} {"speed(min)":>11s} '
    f'{"speed(median)":>14s}'
  )
  for variant in FLAGS.variants:
    times = runs[variant]['times']
    print(
      f'{variant:22s} {min(times):8.3f}s {np.median(times):7.3f}s '
      f'{flops / min(times) / peak:9.1%} {min(reference) / min(times):10.3f}x '
      f'{np.median(reference) / np.median(times):13.3f}x'
    )


if __name__ == '__main__':
  app.run(main)
