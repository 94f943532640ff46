"""Benchmark ``rlorch serve`` through the real client and print the figures.

1. Generated tokens per second with ``--concurrency`` requests in flight at once vs the same
   requests one at a time, and their ratio (batched decoding should give >= 4x at 32).
2. The client's overhead per request: wall time per sequential request minus the server-side
   ``e2e_latency`` it reports (HTTP, JSON and the client's own bookkeeping).

The server runs as a subprocess started by the launcher, exactly as in a run.

Usage: python scripts/bench_serve.py [--concurrency 32] [--max-new-tokens 64] [--threads 1]
       [--model-path DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from rlorch.config.schema import Config, InferenceBackend
from rlorch.inference.servers import start_engines
from rlorch.model import resolve_model_path
from rlorch.types import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


async def sequential(engine, params: SamplingParams, count: int) -> tuple[float, int, float]:
    """(seconds, tokens, server seconds) for ``count`` requests sent one after another."""
    served = engine.gauges()["server_seconds"]
    start, tokens = time.perf_counter(), 0
    for i in range(count):
        tokens += len((await engine.generate(PROMPT, params, f"seq-{i}")).output_ids)
    return time.perf_counter() - start, tokens, engine.gauges()["server_seconds"] - served


async def concurrent(engine, params: SamplingParams, count: int, tag: str) -> tuple[float, int]:
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(PROMPT, params, f"{tag}-{i}") for i in range(count)))
    return time.perf_counter() - start, sum(len(r.output_ids) for r in results)


async def bench(args: argparse.Namespace) -> dict:
    config = Config()
    config.inference.backend = InferenceBackend.cpu
    config.inference.num_servers = 1
    config.inference.cpu.threads = args.threads
    config.inference.cpu.max_batch = max(args.concurrency, 1)
    config.model.path = args.model_path
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as root:
        pool = await start_engines(config, log_dir=Path(root) / "logs", servers_file=Path(root) / "servers.json",
                                   model_path=resolve_model_path(args.model_path))
        try:
            engine = pool.engines[0]
            engine.extra_params = {"ignore_eos": True}
            await concurrent(engine, params, 4, "warmup")
            one_s, one_tokens, served = 0.0, 0, 0.0
            many_s, many_tokens = 0.0, 0
            for round_ in range(args.rounds):
                s, t, srv = await sequential(engine, params, args.concurrency)
                one_s, one_tokens, served = one_s + s, one_tokens + t, served + srv
                s, t = await concurrent(engine, params, args.concurrency, f"c{round_}")
                many_s, many_tokens = many_s + s, many_tokens + t
        finally:
            await pool.close()
    requests = args.rounds * args.concurrency
    return {"concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
            "tokens_per_s_one_at_a_time": one_tokens / one_s,
            "tokens_per_s_concurrent": many_tokens / many_s,
            "speedup": (many_tokens / many_s) / (one_tokens / one_s),
            "client_overhead_ms_per_request": 1000 * (one_s - served) / requests,
            "request_ms_one_at_a_time": 1000 * one_s / requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-path", default=None, help="HF model directory (default: the tiny model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args()
    figures = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(figures))
        return
    print(f"one at a time : {figures['tokens_per_s_one_at_a_time']:9.1f} tokens/s "
          f"({figures['request_ms_one_at_a_time']:.1f} ms per request)")
    print(f"{args.concurrency:3d} concurrent : {figures['tokens_per_s_concurrent']:9.1f} tokens/s")
    print(f"speedup       : {figures['speedup']:9.2f}x (target >= 4x)")
    print(f"client overhead: {figures['client_overhead_ms_per_request']:8.2f} ms per request "
          f"(wall time minus server e2e_latency)")


if __name__ == "__main__":
    main()
