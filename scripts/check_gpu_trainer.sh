#!/usr/bin/env bash
# One prepared check of the FSDP2 trainer on CUDA/NCCL: a few steps of the default run with the
# trainer on the GPU (CPU `rlorch serve` engines generate). Prints the trainer's per-step lines
# and the summary; exits non-zero if the run fails or did not train on CUDA.
# Usage: bash scripts/check_gpu_trainer.sh [RUN_DIR]
set -euo pipefail
run_dir=${1:-outputs/gpu-check}
rm -rf "$run_dir"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
rlorch train run.dir="$run_dir" run.progress=false train.steps=5 trainer.fsdp.device=cuda trainer.fsdp.nproc=1
grep '^\[trainer\]' "$run_dir/logs/trainer.log" || true
python3 - "$run_dir" <<'PY'
import json, sys
run = sys.argv[1]
ready = json.load(open(f"{run}/trainer/ready"))
summary = json.load(open(f"{run}/summary.json"))
print("trainer device:", ready.get("device"), "| summary:", {k: summary[k] for k in ("status", "steps", "trained", "lost")})
assert str(ready.get("device", "")).startswith("cuda") and summary["status"] == "completed" and summary["lost"] == 0
PY
