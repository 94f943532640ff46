#!/usr/bin/env bash
# The prepared check for a one-GPU machine (one H200, say, with torch and
# transformers installed, no sglang, no network), within 8 minutes (hard limits, so a 10-minute
# device call always prints the verdict):
#   1. colocated: `rlorch train` with `rlorch serve --device cuda` and the FSDP2 trainer on the
#      same GPU, resident then swap, 20 steps each, on a random-weight model of Qwen2.5-0.5B's
#      shape in bfloat16 made here (scripts/check_gpu_colocated.py): peak GPU memory, reload
#      latency, the swap step's release/onload/offload, step time, trained tokens/s;
#   2. the trainer at that shape: one packed 4 x (200 + 4096)-token step's peak memory and
#      tokens/s (scripts/check_gpu_scale.sh).
# Prints PASS/FAIL per part and exits non-zero on any FAIL. rlorch's dependencies the machine
# lacks travel as wheels (scripts/gpu_wheels.sh writes .gpu-wheels/, which the device run carries).
#
# Without a CUDA device (a dry run, e.g. here): says so, checks the wheels, makes the model (2
# layers), prints both colocated plans and splits as a 141 GiB GPU gets them, rehearses the
# colocated part on the CPU (1 layer, 2 steps a mode, its figures read as on the GPU), and prints
# the trainer check's analytic figures; exit 0 when all of that works.
# The 2-GPU check with SGLang and NCCL weight transfer is scripts/check_gpu_sglang.sh.
# Usage: bash scripts/gpu_wheels.sh && bash scripts/check_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
budget_s=480
started=$SECONDS

if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: dry mode"
    check_wheels
    python3 scripts/check_gpu_colocated.py --dry
    python3 scripts/check_gpu_colocated.py --rehearse --timeout 240
    bash scripts/check_gpu_scale.sh
    exit 0
fi

python3 -c 'import torch; print("cuda:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
check_wheels
install_rlorch
colocated=0 scale=0
# Hard limits that add up to the budget, so a device call of 10 minutes always prints the verdict:
# each colocated mode 150 s, then 20 s to stop on its Ctrl-C (340 s at worst, the model's making
# and the install before them); the trainer check gets what is left, at most its own 300 s, and
# reuses this install (GPU_CHECK_INSTALLED).
python3 scripts/check_gpu_colocated.py --steps 20 --timeout 150 --grace 20 || colocated=$?
left=$((budget_s - (SECONDS - started)))
if ((left >= 90)); then
    GPU_CHECK_INSTALLED=1 SCALE_BUDGET_S=$((left < 300 ? left : 300)) bash scripts/check_gpu_scale.sh || scale=$?
else
    echo "trainer scale: FAIL (only $left s of the $budget_s s budget left)"; scale=1
fi
elapsed=$((SECONDS - started))
echo "parts: colocated $([[ $colocated == 0 ]] && echo PASS || echo FAIL), trainer scale $([[ $scale == 0 ]] && echo PASS || echo FAIL); $elapsed s in all (limit $budget_s s)"
[[ $colocated == 0 && $scale == 0 && $elapsed -le $budget_s ]] && echo PASS || { echo FAIL; exit 1; }
