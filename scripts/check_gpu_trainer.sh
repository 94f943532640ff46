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
# The trainer's AdamW of one plain rank against torch's fused AdamW on CUDA: equal bit for bit on
# the CPU (tests/test_optimizer.py); this prints the largest difference after 5 CUDA steps.
python3 - cuda <<'PY'
import sys
import torch
from rlorch.trainer.optimizer import FusedAdamW
device = torch.device(sys.argv[1])
def run(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).to(device)
    optimizer = make(model.parameters())
    for step in range(5):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]
ours = run(lambda p: FusedAdamW(p, lr=1e-2, weight_decay=0.1))
torchs = run(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True))
diff = max((a - b).abs().max().item() for a, b in zip(ours, torchs))
print(f"FusedAdamW vs torch AdamW(fused=True) on {device}: max weight difference {diff:.3g}")
assert diff == 0.0, "the trainer's AdamW differs from torch's fused AdamW on this device"
PY
