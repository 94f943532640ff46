#!/usr/bin/env bash
# One prepared check for a GPU machine: installs the sglang extra, prints the launch plan, then runs
# the tiny default on SGLang with the FSDP2 trainer on CUDA/NCCL, placed by rlorch.launch.placement
# (servers first, then the trainer), for 20 steps. Prints reload latency, trained tokens/s and
# PASS/FAIL; exits non-zero on FAIL. First it prints how far rlorch's own Qwen2 (rlorch.qwen2) is
# from transformers' on CUDA (model.implementation=auto uses it on the CPU only).
# Usage: bash scripts/check_gpu_sglang.sh [RUN_DIR] [extra overrides...]
# Needs >= 2 GPUs for the default split (1 server + 1 trainer process).
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir=${1:-outputs/gpu-check-sglang}
shift || true
rm -rf "$run_dir"
python3 -m pip install -q -e ".[sglang]"
python3 -c 'import torch, sglang; n = torch.cuda.device_count(); assert n >= 2, f"need 2 GPUs, see {n}"; print("gpus:", n, torch.cuda.get_device_name(0), "| torch", torch.__version__, "| sglang", sglang.__version__)'
# model.implementation=auto keeps transformers' code on a GPU: how far rlorch's own Qwen2 is from it there.
python3 - <<'PY'
import torch
from transformers import AutoModelForCausalLM
from rlorch.model import ensure_default_model
from rlorch.qwen2 import Qwen2ForCausalLM
path = ensure_default_model()
ids = torch.randint(4, 46, (8, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
for dtype in (torch.float32, torch.bfloat16):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    native = Qwen2ForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits.float() - native(input_ids=ids).logits.float()).abs().max().item()
    print(f"rlorch.qwen2 vs transformers on CUDA, {dtype}: max |logit difference| {diff:.3g}")
PY
overrides=(inference=sglang trainer.fsdp.device=cuda inference.num_servers=1 trainer.fsdp.nproc=1 model.dtype=bfloat16 inference.weight_transfer=distributed train.steps=20 run.progress=false "$@")
rlorch train "${overrides[@]}" --dry-run
status=0
rlorch train "${overrides[@]}" run.dir="$run_dir" || status=$?
python3 - "$run_dir" "$status" <<'PY'
import json, statistics, sys
run, status = sys.argv[1], int(sys.argv[2])
try:
    summary = json.load(open(f"{run}/summary.json"))
    steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"kind": "step"' in l]
    ready = json.load(open(f"{run}/trainer/ready"))
except OSError as err:
    print("FAIL: no run record:", err); sys.exit(1)
reloads = [s["reload_s"] for s in steps if s.get("reload_s") is not None]
tokens = sum(s.get("tokens", 0) for s in steps)
wall = steps[-1]["wall_s"] if steps else float("nan")
print(f"trainer device: {ready.get('device')} | steps {summary['steps']} | lost {summary['lost']}")
if reloads:
    print(f"reload latency: median {statistics.median(reloads):.3f}s max {max(reloads):.3f}s over {len(reloads)}")
print(f"trained tokens/s: {tokens / wall:.1f} ({tokens} tokens in {wall:.1f}s)")
print(f"transfer_fallbacks: {summary.get('transfer_fallbacks')} (versions that went by disk instead of NCCL)")
ok = (status == 0 and summary["status"] == "completed" and summary["lost"] == 0 and summary["steps"] == 20 and summary.get("transfer_fallbacks") == 0
      and str(ready.get("device", "")).startswith("cuda"))
print("PASS" if ok else f"FAIL (exit {status}, status {summary['status']})")
sys.exit(0 if ok else 1)
PY
