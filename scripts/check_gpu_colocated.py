"""One GPU, both sides on it: a colocated `rlorch train` with `rlorch serve --device cuda` and the
FSDP2 trainer sharing the device, in each mode (resident, swap), for a few steps of a
random-weight model of Qwen2.5-0.5B's shape in bfloat16 (made here, with the tiny default's
tokenizer: nothing is downloaded). Prints, per mode, the peak GPU memory (nvidia-smi, sampled
every 0.2 s), the reload latency (the watcher's: pause or resume, load, continue), the swap
step's release and the trainer's onload/offload, the trainer's step time and trained tokens/s,
and PASS/FAIL; the last line is JSON. Exit status 1 on any FAIL.

Without CUDA (``--dry``): makes a 2-layer model of that shape and prints each mode's launch plan
and memory split as a 141 GiB GPU would get them (``rlorch train --dry-run``), measuring nothing.

A mode that runs past ``--timeout`` gets a Ctrl-C, so it still reports the steps it reached and
their figures (and FAILs). ``--rehearse`` runs the whole measured path on the CPU, one layer and a
small batch, records and figures included: the dry mode of scripts/check_gpu.sh does, and
tests/test_gpu_check.py, so that what the check reads is the run's own before it runs on a GPU.

Usage: python scripts/check_gpu_colocated.py [--steps 20] [--layers 24] [--root DIR] [--dry | --rehearse]
       [--device cpu] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer_scale import ensure_model  # noqa: E402  (the random-weight model of that shape)

MODES = {"resident": ["run.colocate=resident", "rollout.max_staleness=1"],
         "swap": ["run.colocate=swap", "rollout.max_staleness=0"]}
# A rehearsal's run: float32 (the CPU's fast dtype), a batch of 8 short completions.
REHEARSAL = ["model.dtype=float32", "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_concurrent=8",
             "rollout.max_new_tokens=8"]
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


def overrides(model: Path, mode: str, steps: int, run_dir: Path, device: str = "cuda") -> list[str]:
    return [f"model.path={model}", "model.dtype=bfloat16", "model.implementation=native", "inference=cpu",
            f"inference.cpu.device={device}", "inference.num_servers=1", "trainer=fsdp", f"trainer.fsdp.device={device}",
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


RLORCH = [sys.executable, "-c", "from rlorch.cli import main; main()"]


def rlorch(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([*RLORCH, *args], text=True, capture_output=True, timeout=timeout)


def train_within(args: list[str], timeout: float, grace: float = 60.0) -> tuple[int, str]:
    """``rlorch train`` with a time limit that keeps its figures: past ``timeout`` it gets the
    Ctrl-C a user would give (the run stops, tears down and writes ``summary.json`` as
    ``interrupted``), and only past ``grace`` more is its process group killed. Returns the exit
    status (124 when the limit was reached) and the output's tail."""
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen([*RLORCH, "train", *args], stdout=output, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = 124
        output.seek(0)
        tail = output.read()[-1500:]
    if code == 124:
        tail += f"\nran past {timeout:.0f} s: interrupted"
    return code, tail


def figures(run_dir: Path) -> dict:
    """The mode's figures from its run directory; a run stopped short (no ``summary.json``) still
    gives what its step records hold."""
    summary_file = run_dir / "summary.json"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if '"kind": "step"' in line]
    summary = (json.loads(summary_file.read_text()) if summary_file.is_file()
               else {"status": "no summary", "steps": steps[-1]["step"] if steps else 0, "lost": None})
    trained = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    ready = json.loads((run_dir / "trainer" / "ready").read_text())
    served = re.search(r"listening on .*device (\S+), dtype (\w+)\)", (run_dir / "logs" / "server-0.log").read_text())
    trainer_log = (run_dir / "logs" / "trainer.log").read_text().splitlines()
    swaps = [line.split() for line in trainer_log if "swap: onload" in line]
    publish_s = [float(m.group(1)) for line in trainer_log if (m := re.search(r" publish_s=([\d.]+)", line))]
    reloads = [s["reload_s"] for s in steps if s.get("reload_s") is not None]
    releases = [s["release_s"] for s in steps if s.get("release_s") is not None]
    steady = trained[1:] or trained      # the first step pays for warm-up (allocator, kernels)
    step_s = [t["step_s"] for t in steady]
    positions = sum(t.get("positions", t.get("tokens", 0)) for t in steady)
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")

    def median(values):
        return round(statistics.median(values), 4) if values else None

    return {"status": summary["status"], "steps": summary["steps"], "lost": summary["lost"],
            "trainer_device": ready.get("device"),
            "server_device": served.group(1) if served else None, "server_dtype": served.group(2) if served else None,
            "startup_s": summary.get("startup_s"),
            "reload_s_median": median(reloads), "reload_s_max": round(max(reloads), 4) if reloads else None,
            "release_s_median": median(releases),
            "onload_s_median": median([float(w[w.index("onload") + 1].rstrip("s")) for w in swaps]),
            "offload_s_median": median([float(w[w.index("offload") + 1].rstrip("s")) for w in swaps]),
            "trainer_step_s_median": median(step_s), "publish_s_median": median(publish_s),
            "trainer_positions_per_s": round(positions / sum(step_s), 1) if sum(step_s) > 0 else None,
            "trained_tokens_per_s": summary.get("tokens_per_s"),
            "loop_s": summary.get("loop_s", round(span, 2) if span == span else None)}


def run_mode(model: Path, mode: str, steps: int, root: Path, timeout: float, device: str = "cuda",
             extra: tuple[str, ...] = (), grace: float = 60.0) -> dict:
    run_dir = root / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.monotonic()
    with PeakMemory() as memory:
        code, tail = train_within([*overrides(model, mode, steps, run_dir, device), *extra], timeout, grace)
    result = {"mode": mode, "exit": code, "wall_s": round(time.monotonic() - started, 1), "peak_gpu_mib": memory.peak}
    try:
        result.update(figures(run_dir))
    except (OSError, ValueError, KeyError, IndexError) as err:
        result["error"] = f"no run record: {err}"
    ok = (code == 0 and result.get("status") == "completed" and result.get("lost") == 0
          and result.get("steps") == steps and str(result.get("trainer_device", "")).startswith(device)
          and str(result.get("server_device", "")).startswith(device))
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--root", type=Path, default=Path("outputs/gpu-check"))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds each mode's run may take")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds a mode past --timeout has to stop after its Ctrl-C before it is killed")
    parser.add_argument("--dry", action="store_true", help="no CUDA: plans and model only")
    parser.add_argument("--device", default="cuda", help="where both sides run (cuda, or cpu to rehearse)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides after the check's own")
    parser.add_argument("--rehearse", action="store_true",
                        help="the measured path on the CPU, small: --device cpu, 1 layer, 2 steps, a batch of 8")
    args = parser.parse_args(argv)
    if args.dry:
        return dry(args.root)
    if args.rehearse:
        args.device, args.layers, args.steps, args.set = "cpu", 1, 2, [*REHEARSAL, *args.set]
    model = model_with_tokenizer(args.root, args.layers)
    results = []
    for mode in MODES:
        result = run_mode(model, mode, args.steps, args.root, args.timeout, args.device, tuple(args.set), args.grace)
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
