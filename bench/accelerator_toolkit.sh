#!/usr/bin/env bash
# Issue 27's speed rows on an accelerator: the toolkit section (scoring against greedy, sampling
# against greedy, n-best against beam) of the base model, at the CPU runs' batch (32) and at an
# accelerator's (256), then the tests whose outcome can differ off the CPU (cached == uncached
# decoding, greedy and beam) with whatever time is left. Each step has its own time limit, so the
# script ends inside a 10-minute lease and says which steps did not finish.
#
#   bash bench/accelerator_toolkit.sh [OUT_DIR]    # JSON reports and logs go to OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1

step() { printf '\n=== %s (%dm%02ds elapsed)\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

step 'Devices'
"$PYTHON" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' || exit 1

for batch in 32 256; do
  step "Toolkit, base model, batch $batch"
  timeout 200 "$PYTHON" -m transformer_jax.benchmark --sizes=base --sections=toolkit \
    --decode_batch_size="$batch" --compare_rounds=5 --json="$out/toolkit-base-b$batch.json" \
    2>&1 | tee "$out/toolkit-base-b$batch.log" | grep -v '^W\|^I' || echo "--- batch $batch: FAILED or timed out"
done

step 'Tests on the accelerator (cached == uncached decoding, scoring, sampling)'
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 \
  "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/decode_test.py tests/sampling_test.py \
  2>&1 | tail -15 || echo '--- tests: FAILED or timed out'
step 'Done'
