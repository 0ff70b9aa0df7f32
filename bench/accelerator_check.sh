#!/usr/bin/env bash
# What to run first on a GPU host or a single-host Cloud TPU VM (one process; not a multi-host
# slice, whose workers must all start at once): the devices JAX sees, the tests whose outcome
# can differ off the CPU, a cuDNN-attention equality check, and the benchmark. An estimate (it
# has not yet run on an accelerator), mostly compiling: tests 2-3 min, cuDNN check < 1 min,
# benchmark 4-6 min; 7-10 min in all on one modern GPU.
#
#   pip install -e '.[test,cuda12]'     # or '.[test,tpu]' on a TPU VM
#   bash bench/accelerator_check.sh     # BENCH_JSON=path to put the benchmark JSON elsewhere
#
# Exit status: 0 every check passed; 1 some check failed (all checks still run, and a summary
# names the failures); 2 JAX found no accelerator, so nothing was checked (the message says what
# JAX found and what to install).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
BENCH_JSON=${BENCH_JSON:-bench/results/accelerator-$(date +%F).json}
failed=()

step() { printf '\n=== %s (%dm%02ds elapsed)\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

# check NAME TIMEOUT_S COMMAND...: runs it, records a failure, never stops the script.
check() {
  local name=$1 limit=$2
  shift 2
  if timeout "$limit" "$@"; then
    echo "--- $name: passed"
  else
    echo "--- $name: FAILED (exit $?)"
    failed+=("$name")
  fi
}

step 'Devices'
# Also what host_memory decided before JAX started (its CPU-only malloc tuning must be off).
if ! info=$(
  "$PYTHON" - <<'EOF'
import sys

import jax

from transformer_jax.training import host_memory

devices = jax.devices()
expected = host_memory.expected_accelerator()
print(f'jax {jax.__version__}, backend {jax.default_backend()}: {devices}', file=sys.stderr)
print(f'host_memory.expected_accelerator(): {expected}', file=sys.stderr)
version = devices[0].client.platform_version.split() or ['?']  # 'cuda 12090', 'rocm ...'.
print(jax.default_backend(), version[0], len(devices), 'accelerator' if expected else 'cpu')
EOF
); then
  echo 'JAX failed to start (the error is above).' >&2
  exit 1
fi
read -r backend platform_version device_count expected <<<"${info##*$'\n'}"  # The last line.
if [[ $backend == cpu ]]; then
  echo "No accelerator: JAX's default backend is the CPU, so there is nothing to check here." >&2
  echo "Install jax's plugin for this machine (pip install -e '.[cuda12]', '.[cuda13]' or" >&2
  echo "'.[tpu]') and check that JAX_PLATFORMS is unset or names the accelerator." >&2
  exit 2
fi
if [[ $expected != accelerator ]]; then
  echo '--- host_memory detection: FAILED (it would tune malloc for XLA:CPU on an accelerator)'
  failed+=('host_memory detection')
fi

# The tests were written for XLA:CPU, where float32 matmuls are exact float32. GPUs (TF32) and
# TPUs (bf16 passes) round float32 matmuls by default, which would fail their float32 tolerances
# for reasons of platform precision, not of this code: full float32 while testing. The tests'
# models are tiny: no preallocation of 75% of each GPU's memory.
# tests/conftest.py's XLA_FLAGS (LLVM at -O0, fewer LLVM passes) are valid on GPU and TPU too:
# they change how XLA's generated code is optimised (slower kernels, at most last-bit rounding
# differences), not the HLO, i.e. not what is computed.
export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false

step 'Tests on the accelerator'
# Sharding (meshes, rules, multi-process detection), the bf16 loss curve against float32,
# cached == uncached decoding (greedy and beam, tests/decode_test.py; the model's cache,
# tests/models_test.py -k cache, which also covers attention_impl='xla'), and host_memory's
# detection and the projections' gradient choice (tests/host_memory_test.py). The two 8-device
# tests run apart, below: each starts its own process, which needs the accelerators free.
eight_device_tests=(
  tests/sharding_test.py::test_layouts_equal_one_device_and_checkpoints_move_between_them
  tests/sharding_test.py::test_tensor_parallel_checkpoint_restores_under_data_parallel_and_on_one_device
)
check 'tests' 600 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/sharding_test.py tests/decode_test.py tests/train_lib_test.py tests/models_test.py \
  tests/host_memory_test.py \
  -k 'not (train_lib_test and not bfloat16) and not (models_test and not cache)' \
  "${eight_device_tests[@]/#/--deselect=}"

step 'Sharding on 8 devices'
# Every layout (data, FSDP, tensor, mixed) equals one device and checkpoints move between them:
# on real devices only where there are exactly 8 (the tests' mesh shapes assume 8). Their
# tolerances were set on the CPU: read a failure's numbers before calling it a bug.
if [[ $device_count == 8 ]]; then
  check 'sharding, 8 devices' 600 "$PYTHON" -m pytest -q -p no:cacheprovider \
    "${eight_device_tests[@]}"
else
  echo "skipped: $device_count devices, the tests need 8 (on the CPU they run with 8 fake ones)"
fi

step 'cuDNN attention == einsum attention (bf16)'
if [[ $backend == gpu && $platform_version == cuda* ]]; then
  # One model (d_model 256, 4 heads of 64, 2+2 layers; even lengths and a head size that is a
  # multiple of 8, as cuDNN's kernel needs), the same float32 parameters and padded batch,
  # computed with attention_impl='einsum' in float32 (the reference) and in bfloat16, and with
  # 'cudnn' in bfloat16. Compared: the logits at real target positions and the gradient of
  # every parameter (masked cross-entropy). bf16 tolerance: logits within 2% of max |logit|
  # (the einsum bf16 path's own error: 0.45% on the CPU); each gradient's relative L2 distance
  # from einsum's at most 2x einsum's own bf16 error + 1% (that error is 1-6% per parameter:
  # two computations rounding at different places are ~1.4x apart). A wrong mask or layout
  # gives O(1) differences. Exit 1 on a mismatch.
  check 'cuDNN attention' 300 "$PYTHON" - cudnn <<'EOF'
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer

impl = sys.argv[1]  # 'cudnn'; 'xla' runs the same comparison on any backend.
cfg = TransformerConfig(
  vocab_size=512,
  d_model=256,
  d_ff=1024,
  num_heads=4,
  num_encoder_layers=2,
  num_decoder_layers=2,
  max_len=64,
  dropout_rate=0.0,
  attention_dropout_rate=0.0,
)
rng = np.random.default_rng(0)
batch, src_len, tgt_len = 8, 48, 40


def padded(length, rows):
  ids = rng.integers(4, cfg.vocab_size, (rows, length)).astype(np.int32)
  real = rng.integers(length // 2, length + 1, rows)  # Every row keeps some real tokens.
  return np.where(np.arange(length)[None] < real[:, None], ids, 0).astype(np.int32)


src, tgt_in = padded(src_len, batch), padded(tgt_len, batch)
labels = rng.integers(4, cfg.vocab_size, tgt_in.shape).astype(np.int32)
weights = (tgt_in != 0).astype(np.float32)
params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), src[:1], tgt_in[:1])['params'])


def loss(params, c):
  logits = Transformer(c).apply({'params': params}, src, tgt_in).astype(jnp.float32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
  return -jnp.sum(logp * weights) / jnp.sum(weights), logits


run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
results = {}
for name, c in [
  ('float32', cfg),
  ('einsum bf16', cfg.replace(dtype='bfloat16')),
  (f'{impl} bf16', cfg.replace(dtype='bfloat16', attention_impl=impl)),
]:
  (_, logits), grads = run(params, c)
  results[name] = (np.asarray(logits)[weights > 0], jax.tree.map(np.asarray, grads))


def relative(x, y):
  return np.linalg.norm(x - y) / np.linalg.norm(y)


f32, einsum, fused = results['float32'], results['einsum bf16'], results[f'{impl} bf16']
logit = np.abs(fused[0] - einsum[0]).max() / np.abs(einsum[0]).max()
print(
  f'logits, {impl} vs einsum (bf16): {logit:.2e} of max |logit| (<= 2e-2); vs float32: '
  f'einsum {np.abs(einsum[0] - f32[0]).max() / np.abs(f32[0]).max():.2e}, '
  f'{impl} {np.abs(fused[0] - f32[0]).max() / np.abs(f32[0]).max():.2e}'
)
bad, worst = [], 0.0
leaves = zip(*(jax.tree_util.tree_leaves_with_path(r[1]) for r in (fused, einsum, f32)))
for (path, g_fused), (_, g_einsum), (_, g_f32) in leaves:
  distance, bound = relative(g_fused, g_einsum), 2 * relative(g_einsum, g_f32) + 1e-2
  worst = max(worst, distance)
  if distance > bound:
    bad.append(f'{jax.tree_util.keystr(path)}: {distance:.2e} > {bound:.2e}')
print(
  f'gradients, {impl} vs einsum (bf16): worst relative L2 distance {worst:.2e}; '
  f'parameters over their bound: {bad or "none"}'
)
sys.exit(0 if logit <= 2e-2 and not bad else 1)
EOF
else
  echo "skipped: cuDNN is NVIDIA's ($backend, $platform_version)"
fi

step 'Benchmark'
# bench/README.md's accelerator command. Compiling dominates: each size's training step, then
# greedy and beam decoders with and without the cache. 20 timed steps (the default is 10) cost
# seconds at these sizes and steady the step time; 3 decoding batches (the default) suffice.
# The input-pipeline section runs on the host CPU, as it would in training. Run with JAX's
# defaults (the test settings above unset), as training would be.
check 'benchmark' 600 env -u JAX_DEFAULT_MATMUL_PRECISION -u XLA_PYTHON_CLIENT_PREALLOCATE \
  "$PYTHON" -m transformer_jax.benchmark --sizes=small,base,big \
  --rows_per_device=256 --train_steps=20 --decode_batches=3 --json="$BENCH_JSON"

step 'Summary'
if ((${#failed[@]})); then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all checks passed; benchmark report: $BENCH_JSON"
