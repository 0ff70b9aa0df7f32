#!/usr/bin/env bash
# Issue 49 item 7 on an accelerator, in one call: the base model in bfloat16, end to end
# (Translator.translate, text in and out) beside the search program alone, greedy and beam 4
# at batch 32 and 256, with the host's share and XLA executions per batch
# (transformer_jax/benchmark/end_to_end.py). The goals: >= 11,000 target tokens/s for beam 4 at
# batch 32 (CTranslate2 float16 on an A10G) and >= 40,000 at batch 256. Ends inside a 10-minute
# lease: each step has its own time limit and says when it did not finish.
#
#   bash bench/accelerator_decode.sh [OUT_DIR]     # JSON report and log go to OUT_DIR
#   SIZE=tiny JAX_PLATFORMS=cpu bash bench/accelerator_decode.sh /tmp/out   # the dry run
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
PYTHON=${PYTHON:-python}
SIZE=${SIZE:-base}
export PYTHONUNBUFFERED=1

step() { printf '\n=== %s (%dm%02ds elapsed)\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

step 'Devices'
"$PYTHON" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' || exit 1

step "End to end, $SIZE model, bfloat16, greedy and beam 4 at batch 32 and 256"
# --decode_batches=1: the decode section's own rows (each search jitted alone, cached and not)
# come first; one batch of each keeps their compilation the only cost.
timeout 480 "$PYTHON" -m transformer_jax.benchmark --sizes="$SIZE" --sections=decode \
  --dtype=bfloat16 --decode_batches=1 --end_to_end_batch_sizes=32,256 \
  --end_to_end_modes=greedy,beam --end_to_end_batches=4 --compare_rounds=3 \
  --json="$out/decode-end-to-end-$SIZE.json" 2>&1 | tee "$out/decode-end-to-end-$SIZE.log" |
  grep -v '^W\|^I' || echo '--- end to end: FAILED or timed out'

step 'Against the goals'
"$PYTHON" - "$out/decode-end-to-end-$SIZE.json" <<'PY' || echo '--- goals: no report to read'
import json, sys

report = json.load(open(sys.argv[1]))
for row in report['end_to_end']:
  for batch, modes in row['batch_sizes'].items():
    for mode, figures in modes.items():
      rate = figures['end_to_end']['target_tokens_per_second']
      goal = {('beam', '32'): 11_000, ('beam', '256'): 40_000}.get((mode, batch))
      verdict = '' if goal is None else f' (goal {goal:,}: {"met" if rate >= goal else "not met"})'
      print(
        f'{row["model"]} {mode} batch {batch}: {rate:,.0f} target tokens/s end to end, program '
        f'{figures["program"]["target_tokens_per_second"]:,.0f}, host share '
        f'{figures["host_share"]:.1%}, {figures["dispatches_per_batch"]:.1f} dispatches/batch'
        + verdict
      )
PY
