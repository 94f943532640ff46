"""Benchmark the orchestrator loop on the sim backends and print the figures.

1. Rollouts per second through the whole loop (gate, dispatcher, stamping, sink, batch
   persistence, trainer hand-off, weight watcher) with an instant engine and trainer, at group
   size 8 and 1, with the default packing (``rollout.pack_samples``) unless ``--pack-samples``.
2. Admission cost per rollout with 1,000 vs 100,000 rollouts in flight (group size 1, packed as
   a run packs them).
3. Wall-clock of async (S >= 1) vs the synchronous preset with generation time G equal to step
   time T, against the ideal ratio max(G, T) / (G + T).

Usage: python scripts/bench_loop.py [--steps 40] [--batch 2048] [--pack-samples N] [--skip-overlap]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from rlorch.config.compose import compose
from rlorch.config.schema import RolloutConfig
from rlorch.orchestrator.dispatcher import Dispatcher
from rlorch.orchestrator.gate import CapacityGate
from rlorch.runner import run_training
from rlorch.types import PolicyVersion, Prompt


def run_sim(root: Path, name: str, *overrides: str) -> dict:
    config = compose(["conf=sim", f"run.dir={root / name}", "run.progress=false", *overrides])
    if run_training(config, []) != 0:
        raise SystemExit(f"{name} failed")
    return json.loads((root / name / "summary.json").read_text())


def loop_throughput(root: Path, steps: int, batch: int, group: int, pack_samples: int) -> float:
    summary = run_sim(root, f"throughput-{group}", "inference.sim.latency=[0,0]", "inference.sim.tokens=4",
                      f"rollout.pack_samples={pack_samples}",
                      "trainer.sim.step_time=0", "watcher.poll_interval=0.0005", f"train.steps={steps}",
                      f"rollout.batch_size={batch}", f"rollout.group_size={group}", "rollout.max_staleness=4",
                      f"rollout.max_concurrent={5 * batch}", f"rollout.queue_size={batch}",
                      f"rollout.max_buffered={5 * batch}", "metrics.interval=1000",
                      "trainer.checkpoint_every=1000000")
    return summary["trained"] / summary["loop_s"]


async def admission_cost(in_flight: int, pack_samples: int) -> float:
    """Seconds per admission while ``in_flight`` rollouts are already running (the runner's
    garbage-collector settings applied). The work in flight is collected once before the probe:
    in a running loop it has long aged into the oldest generation, while here it was made a
    moment ago and a young-generation collection scanning all of it would land in the probe."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    policy = PolicyVersion()
    gate = CapacityGate(max_staleness=10**9, batch_size=1, max_concurrent=10**9, policy=policy)
    hold = asyncio.Event()

    async def work(prompt: Prompt):
        await hold.wait()
        return []

    prompts = (Prompt(group_id=i, input_ids=[1], env="bench") for i in range(10**9))
    dispatcher = Dispatcher(gate=gate, work=work, prompts=prompts, group_size=1, queue_size=4096,
                            max_buffered=10**9, request_timeout=3600, max_retries=1, pack_groups=pack_samples)
    limit = {"n": in_flight}
    dispatcher.admission_room = lambda: limit["n"] - dispatcher.admitted
    dispatcher._admit_all()
    await asyncio.sleep(0)
    gc.collect()
    probe = 20_000
    limit["n"] = in_flight + probe
    started = time.perf_counter()
    dispatcher._admit_all()
    elapsed = time.perf_counter() - started
    await dispatcher.cancel_in_flight()
    return elapsed / probe


def overlap(root: Path) -> tuple[float, float, float]:
    timing = ["inference.sim.latency=[0.1,0.1]", "trainer.sim.step_time=0.1", "train.steps=20", "rollout.max_concurrent=64"]
    sync = run_sim(root, "sync", *timing, "rollout.max_staleness=0", "trainer.correction=none")
    overlapped = run_sim(root, "async", *timing, "rollout.max_staleness=2")
    return sync["wall_s"], overlapped["wall_s"], overlapped["wall_s"] / sync["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is printed")
    parser.add_argument("--pack-samples", type=int, default=RolloutConfig.pack_samples,
                        help="rollout.pack_samples for the throughput and admission figures")
    parser.add_argument("--skip-overlap", action="store_true", help="only the throughput and admission figures")
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, "
          f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for group in (8, 1):
            rates = [loop_throughput(root / f"r{i}", args.steps, args.batch, group, args.pack_samples)
                     for i in range(args.repeats)]
            print(f"whole loop, instant engine, group size {group}: {statistics.median(rates):,.0f} rollouts/s "
                  f"median of {args.repeats} (runs {', '.join(f'{r:,.0f}' for r in rates)}; "
                  f"{args.steps} steps x {args.batch} rollouts, pack_samples {args.pack_samples})")
        pack = args.pack_samples
        asyncio.run(admission_cost(1_000, pack))  # warm the allocator and the event loop's paths
        small = statistics.median(asyncio.run(admission_cost(1_000, pack)) for _ in range(args.repeats))
        large = statistics.median(asyncio.run(admission_cost(100_000, pack)) for _ in range(args.repeats))
        print(f"admission cost (median of {args.repeats}): {small * 1e6:.2f} us with 1,000 in flight, "
              f"{large * 1e6:.2f} us with 100,000 in flight (ratio {large / small:.2f})")
        if args.skip_overlap:
            return
        sync_s, async_s, ratio = overlap(root)
        print(f"G = T = 0.1 s, 20 steps: sync {sync_s:.2f} s, async (S=2) {async_s:.2f} s, "
              f"ratio {ratio:.2f} (ideal max(G,T)/(G+T) = 0.50)")


if __name__ == "__main__":
    main()
