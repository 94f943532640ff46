#!/usr/bin/env bash
# One prepared check of the trainer at Qwen2.5-0.5B's full shape (24 layers, vocabulary 151,936,
# random weights) on a one-GPU machine: one bfloat16 training step of 4 x (200 + 4096) tokens
# in one packed row (scripts/bench_trainer_scale.py --skip-before), with rlorch's own Qwen2 as the
# GSM8K recipe has it, printing its peak GPU memory and tokens/s; PASS within 5 minutes, else
# FAIL and a non-zero exit.
#
# That machine has torch and transformers but none of rlorch's other dependencies and no
# network: they travel as wheels in .gpu-wheels/ (git-ignored), made here first by
# scripts/gpu_wheels.sh, and the device run names .gpu-wheels in `carry`.
#
# Without a CUDA device (a dry run, e.g. here): checks that the wheels are complete and small
# enough to travel, creates a 2-layer model directory and prints the analytic work ratios; exit 0.
# Usage: bash scripts/gpu_wheels.sh && bash scripts/check_gpu_scale.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
budget_s=${SCALE_BUDGET_S:-300}   # scripts/check_gpu.sh passes what its own limit leaves

if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: dry mode"
    check_wheels
    python3 scripts/bench_trainer_scale.py --layers 2 --no-measure
    echo "dry mode: wheels complete, model directory and analytic figures made; nothing measured"
    exit 0
fi

started=$SECONDS
if [[ -z ${GPU_CHECK_INSTALLED:-} ]]; then   # scripts/check_gpu.sh has installed them already
    python3 -c 'import torch; print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
    check_wheels
    install_rlorch
fi
log=$(mktemp)
set +e
# The bench's own limit first, so that it still prints what it reached; `timeout` is the backstop.
PYTHONUNBUFFERED=1 timeout "$budget_s" python3 scripts/bench_trainer_scale.py --device cuda --dtype bfloat16 \
    --layers 24 --completion-tokens 4096 --skip-before --timeout "$((budget_s - 15))" \
    --set model.implementation=native 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
elapsed=$((SECONDS - started))
python3 - "$log" "$status" "$elapsed" "$budget_s" <<'PY'
import json, sys
log, status, elapsed, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lines = [line for line in open(log, errors="replace").read().splitlines() if line.startswith("{")]
result = json.loads(lines[-1]) if lines else {}
peak, rate = result.get("peak_mib_after"), result.get("tokens_per_s_after")
print(f"GPU step: {result.get('gpu')}; peak {peak} MiB beyond weights and optimizer "
      f"({result.get('before_mib_after')} MiB allocated before), {rate} tokens/s, step {result.get('step_s_after')} s; "
      f"{elapsed} s in all (limit {budget} s)")
ok = status == 0 and "error" not in result and peak is not None and rate and elapsed <= budget
if status == 124:
    print(f"the bench ran past {budget} s")
print("PASS" if ok else f"FAIL (exit {status}, error: {result.get('error')})")
sys.exit(0 if ok else 1)
PY
