"""One GPU, both sides on it: a colocated `rlorch train` with `rlorch serve --device cuda` and the
FSDP2 trainer sharing the device, in each mode (resident, swap), for a few steps of a
random-weight model of Qwen2.5-0.5B's shape in bfloat16 (made here, with the tiny default's
tokenizer: nothing is downloaded). Prints, per mode, the peak GPU memory (nvidia-smi, sampled
every 0.2 s), the reload latency (the watcher's: pause or resume, load, continue), the swap
step's release and the trainer's onload/offload, the trainer's step time and trained tokens/s,
and PASS/FAIL; the last line is JSON. Exit status 1 on any FAIL.

Without CUDA (``--dry``): makes a 2-layer model of that shape and prints each mode's launch plan
and memory split as a 141 GiB GPU would get them (``rlorch train --dry-run``), measuring nothing.

Usage: python scripts/check_gpu_colocated.py [--steps 20] [--layers 24] [--root DIR] [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer_scale import ensure_model  # noqa: E402  (the random-weight model of that shape)

MODES = {"resident": ["run.colocate=resident", "rollout.max_staleness=1"],
         "swap": ["run.colocate=swap", "rollout.max_staleness=0"]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_with_tokenizer(root: Path, layers: int) -> Path:
    """The random-weight model directory with the tiny default's tokenizer beside its weights (its
    ids are the first of the vocabulary; sampled ids past it decode to nothing, which the task
    scores as wrong: rewards are flat, the steps run all the same)."""
    from rlorch.model import ensure_default_model

    model = ensure_model(root, layers)
    tokenizer = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, model / name)
    return model


def overrides(model: Path, mode: str, steps: int, run_dir: Path) -> list[str]:
    return [f"model.path={model}", "model.dtype=bfloat16", "model.implementation=native", "inference=cpu",
            "inference.cpu.device=cuda", "inference.num_servers=1", "trainer=fsdp", "trainer.fsdp.device=cuda",
            "trainer.fsdp.nproc=1", "trainer.fsdp.max_tokens_per_micro_batch=8192",
            "trainer.activation_checkpointing=true", "run.gpus=1", f"train.steps={steps}",
            "rollout.batch_size=64", "rollout.group_size=8", "rollout.max_concurrent=64", "rollout.max_new_tokens=128",
            "rollout.filter_groups=false", f"train.max_empty_batches={10 * steps}", "eval.enabled=false",
            "run.progress=false", "run.report=false", f"run.dir={run_dir}", *MODES[mode]]


class PeakMemory:
    """The largest ``memory.used`` nvidia-smi reports for GPU 0 while it runs (MiB)."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, int(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rlorch(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from rlorch.cli import main; main()", *args], text=True,
                          capture_output=True, timeout=timeout)


def figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"kind": "step"' in line]
    trained = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    ready = json.loads((run_dir / "trainer" / "ready").read_text())
    servers = json.loads((run_dir / "servers.json").read_text())
    swaps = [line.split() for line in (run_dir / "logs" / "trainer.log").read_text().splitlines()
             if "swap: onload" in line]
    reloads = [s["reload_s"] for s in steps if s.get("reload_s") is not None]
    releases = [s["release_s"] for s in steps if s.get("release_s") is not None]
    step_s = [t["step_s"] for t in trained[1:]] or [t["step_s"] for t in trained]
    tokens = sum(t.get("positions", t.get("tokens", 0)) for t in trained[1:])
    wall = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")

    def median(values):
        return round(statistics.median(values), 4) if values else None

    return {"status": summary["status"], "steps": summary["steps"], "lost": summary["lost"],
            "trainer_device": ready.get("device"),
            "server_device": next(iter(servers.values()), {}).get("device") if isinstance(servers, dict) else None,
            "reload_s_median": median(reloads), "reload_s_max": round(max(reloads), 4) if reloads else None,
            "release_s_median": median(releases),
            "onload_s_median": median([float(w[w.index("onload") + 1].rstrip("s")) for w in swaps]),
            "offload_s_median": median([float(w[w.index("offload") + 1].rstrip("s")) for w in swaps]),
            "trainer_step_s_median": median(step_s), "trained_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            "loop_wall_s": round(wall, 2)}


def run_mode(model: Path, mode: str, steps: int, root: Path, timeout: float) -> dict:
    run_dir = root / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    with PeakMemory() as memory:
        try:
            done = rlorch("train", *overrides(model, mode, steps, run_dir), timeout=timeout)
            code, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            code, tail = 124, f"ran past {timeout:.0f} s"
    result = {"mode": mode, "exit": code, "wall_s": round(time.monotonic() - started, 1), "peak_gpu_mib": memory.peak}
    try:
        result.update(figures(run_dir))
    except (OSError, ValueError, KeyError, IndexError) as err:
        result["error"] = f"no run record: {err}"
    ok = (code == 0 and result.get("status") == "completed" and result.get("lost") == 0
          and result.get("steps") == steps and str(result.get("trainer_device", "")).startswith("cuda"))
    result["pass"] = ok
    if not ok:
        result["tail"] = tail
    return result


def dry(root: Path) -> int:
    model = model_with_tokenizer(root, 2)
    print(f"model: {model} (2 layers of Qwen2.5-0.5B's shape, the tiny default's tokenizer)")
    for mode in MODES:
        done = rlorch("train", *overrides(model, mode, 20, root / f"run-{mode}"), "run.gpu_memory_gb=141", "--dry-run",
                      timeout=120)
        print(f"--- {mode}: exit {done.returncode}\n{done.stdout}{done.stderr}", end="")
        if done.returncode != 0:
            print("FAIL")
            return 1
    print("dry mode: model made, both plans printed; nothing measured (no CUDA device)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--root", type=Path, default=Path("outputs/gpu-check"))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds each mode's run may take")
    parser.add_argument("--dry", action="store_true", help="no CUDA: plans and model only")
    args = parser.parse_args(argv)
    if args.dry:
        return dry(args.root)
    model = model_with_tokenizer(args.root, args.layers)
    results = []
    for mode in MODES:
        result = run_mode(model, mode, args.steps, args.root, args.timeout)
        results.append(result)
        shown = {k: v for k, v in result.items() if k != "tail"}
        print(f"colocated {mode}: " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
        if "tail" in result:
            print(result["tail"])
        print(f"colocated {mode}: {'PASS' if result['pass'] else 'FAIL'}", flush=True)
    print(json.dumps({"colocated": results}))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
