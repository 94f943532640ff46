"""The orchestrator in front of a simulated fleet: fan-out, admission, ingest and memory at scale.

Runs against ``rlorch fleet`` (simulated engines behind SGLang's HTTP API, see
``rlorch/serve/fleet.py``), with the real client, pool, dispatcher, gate, sinks and watcher:

- **fan-out**: an ``EnginePool`` of the real ``SGLangEngine`` clients loads ``--versions``
  versions on every engine (pause, update, continue) of an instant fleet; p50/p99 seconds from
  the call to every engine serving the version, and the orchestrator's CPU per version;
- **admission**: the gate's decision plus the start of the admitted pack's task, with
  ``--in-flight`` tasks pending against 1k pending (the event loop's cost grows with what waits);
- **ingest and memory**: ``rlorch train inference=sglang trainer=sim`` against the fleet, with
  ``--in-flight`` rollouts of ``--completion-tokens`` tokens in flight (batch = in-flight / 2,
  staleness 1; the sim trainer's step time keeps the buffers full). Its CPU and RSS are read from
  /proc: CPU per rollout and per 1k tokens ingested, RSS per in-flight rollout and token (RSS at
  the fullest point above the RSS before the first rollout), the trainer's idle share. With
  ``--parse-workers N`` (``inference.parse_workers``) the workers' CPU counts as the
  orchestrator's (``ingest_tokens_per_core_s``); ``loop_tokens_per_core_s`` is the event loop's
  process alone. ``--batch-format jsonl`` writes the batch files as JSON lines (``run.batch_format``).

The last line is always one JSON object to compare run to run, a failed run's too (with
``"error"``, and the exit status 1). A size that would not fit the memory given, at the bytes per
in-flight token measured so far (orchestrator and fleet together; 60 assumed before the first
run, or ``--bytes-per-token``), is run at the largest in-flight count that fits, halving, and the JSON
says so (``"degraded"``).

    python scripts/bench_fleet.py --engines 1000 --in-flight 10000 --completion-tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
"""The fleet and ``rlorch train`` run this tree's rlorch, whatever else is installed."""
PRIOR_BYTES_PER_TOKEN = 60.0
"""Memory per in-flight token, orchestrator and fleet together, assumed until a run measures it
(the orchestrator held about 18, the fleet's answers waiting in its sockets up to ~35)."""


def start_fleet(engines: int, port_base: int, processes: int, workdir: Path, *extra: str):
    """``port_base`` 0: the system picks free ports (another bench on this machine cannot collide)."""
    fleet_file = workdir / f"fleet-{port_base}.txt"
    fleet_file.unlink(missing_ok=True)
    errors = open(workdir / f"fleet-{port_base}.err", "w+b")
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "fleet", "--engines", str(engines),
                                "--port-base", str(port_base), "--processes", str(processes),
                                "--fleet-file", str(fleet_file), *extra],
                               stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 120
    while not fleet_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            errors.seek(0)
            raise RuntimeError(f"fleet did not start: {errors.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return process, fleet_file.read_text().split()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- fan-out ------------------------------------------------------------------------------

async def _fanout(addresses: list[str], versions: int) -> dict:
    from rlorch.inference.client import SGLangEngine
    from rlorch.inference.pool import EnginePool

    engines = [SGLangEngine(a, control_timeout=60, reload_timeout=60) for a in addresses]
    pool = EnginePool(engines, name="fleet")
    times, cpu = [], []
    try:
        await asyncio.gather(*(e.server_info() for e in engines))
        for version in range(1, versions + 1):
            started, cpu_started = time.monotonic(), time.process_time()
            await pool.reload("/fleet/weights", version)
            times.append(time.monotonic() - started)
            cpu.append(time.process_time() - cpu_started)
            await asyncio.sleep(0.2)
        held = await asyncio.gather(*(e.weight_version() for e in engines))
        wrong = sum(v != versions for v in held)
        down = len(engines) - len(pool._live())
    finally:
        await pool.stop()
    return {"fanout_p50_s": round(percentile(times, 0.5), 4), "fanout_p99_s": round(percentile(times, 0.99), 4),
            "fanout_cpu_s": round(percentile(cpu, 0.5), 4), "engines_behind": wrong, "engines_marked_down": down}


def fanout(engines: int, versions: int, processes: int, workdir: Path) -> dict:
    fleet, addresses = start_fleet(engines, 0, processes, workdir)
    try:
        return asyncio.run(_fanout(addresses, versions))
    finally:
        stop(fleet)


# ---- admission ----------------------------------------------------------------------------

async def _admission(in_flight: int, samples: int = 2000) -> float:
    from rlorch.orchestrator.gate import CapacityGate
    from rlorch.types import PolicyVersion

    gate = CapacityGate(max_staleness=1, batch_size=in_flight + samples, max_concurrent=in_flight + samples,
                        policy=PolicyVersion())
    forever = asyncio.Event()
    waiting = [asyncio.ensure_future(forever.wait()) for _ in range(in_flight)]
    gate.on_submitted(in_flight)
    await asyncio.sleep(0)
    admitted = []
    started = time.perf_counter()
    for _ in range(samples):
        if gate.admit_groups(1, 1):
            gate.on_submitted(1)
            admitted.append(asyncio.ensure_future(forever.wait()))
    await asyncio.sleep(0)
    cost = (time.perf_counter() - started) / samples
    forever.set()
    await asyncio.gather(*waiting, *admitted)
    return cost * 1e6


def admission(in_flight: int) -> dict:
    low = min(asyncio.run(_admission(1000)) for _ in range(3))
    high = min(asyncio.run(_admission(in_flight)) for _ in range(3))
    return {"admission_us_1k": round(low, 2), "admission_us": round(high, 2),
            "admission_cost_ratio": round(high / low, 3)}


# ---- ingest and memory --------------------------------------------------------------------

def stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command (state first: ppid is [1], pgrp [2],
    utime and stime [11] and [12])."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def cpu_seconds(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLK


def proc_sample(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    fields = stat(pid)
    with open(f"/proc/{pid}/statm") as handle:
        rss = int(handle.read().split()[1]) * PAGE
    return cpu_seconds(fields), rss


TCP_TROUBLE = ("TCPMemoryPressures", "TCPRcvQDrop", "TCPTimeouts")
"""Kernel counters (/proc/net/netstat, TcpExt) that say the machine's TCP buffers overflowed:
answers dropped and resent after a timeout that doubles (the stall the docs describe)."""


def tcp_trouble() -> dict[str, int]:
    """:data:`TCP_TROUBLE`'s counters now, machine-wide (empty where the file is not there)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            counters = dict(zip(names.split()[1:], map(int, values.split()[1:])))
            return {name: counters.get(name, 0) for name in TCP_TROUBLE}
    return {}


def processes() -> list[tuple[int, list[str]]]:
    """(pid, stat fields) of every process there is."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.append((int(entry), stat(entry)))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


def group_rss(group: int) -> int:
    """RSS bytes of every process in process group ``group`` (the fleet and its workers)."""
    total = 0
    for pid, fields in processes():
        if int(fields[2]) == group:
            try:
                with open(f"/proc/{pid}/statm") as handle:
                    total += int(handle.read().split()[1]) * PAGE
            except (FileNotFoundError, ProcessLookupError):
                continue
    return total


def children_cpu(parent: int) -> dict[int, float]:
    """CPU seconds of each child of process ``parent`` (its answer-parsing workers)."""
    return {pid: cpu_seconds(fields) for pid, fields in processes() if int(fields[1]) == parent}


def ingest(engines: int, in_flight: int, tokens: int, processes: int, workdir: Path, steps: int,
           parse_workers: int = 0, full_logprobs: bool = False, batch_format: str = "safetensors") -> dict:
    fleet, addresses = start_fleet(engines, 0, processes, workdir, "--length-median", str(tokens),
                                   "--length-sigma", "0", "--vocab", "151936",
                                   *(["--full-logprobs"] if full_logprobs else []))
    run_dir = workdir / f"run-{engines}-{in_flight}"
    batch = max(1, in_flight // 2)
    overrides = ["inference=sglang", f"inference.addresses=[{','.join(addresses)}]", "trainer=sim",
                 f"trainer.sim.step_time={max(2.0, in_flight * tokens / 20e6):.1f}",
                 f"run.dir={run_dir}", f"train.steps={steps}", "rollout.group_size=1",
                 f"rollout.batch_size={batch}", f"rollout.max_concurrent={in_flight}", "rollout.max_staleness=1",
                 f"rollout.queue_size={max(1024, batch)}", f"rollout.max_buffered={in_flight}",
                 f"rollout.max_new_tokens={tokens}", "rollout.pack_samples=64", "eval.every=0",
                 "run.report=false", "inference.health_interval=30", "rollout.request_timeout=600",
                 f"inference.parse_workers={parse_workers}", f"run.batch_format={batch_format}"]
    trouble_before = tcp_trouble()
    errors = open(workdir / f"train-{engines}-{in_flight}.err", "w+b")  # a file: a pipe would fill and stall it
    process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", "train", *overrides],
                               stdout=subprocess.DEVNULL, stderr=errors, cwd=workdir, env=ENV)
    baseline, peak, cpu_start, samples, fleet_peak, tick, workers = None, 0, None, [], 0, 0, {}
    try:
        while process.poll() is None:
            try:
                cpu, rss = proc_sample(process.pid)
            except (FileNotFoundError, ProcessLookupError):
                break
            metrics = run_dir / "metrics.jsonl"
            started = metrics.exists() and '"kind": "start"' in metrics.read_text(errors="replace")[:4096]
            if started and baseline is None:
                baseline, cpu_start = rss, cpu
            peak = max(peak, rss)
            samples.append((cpu, rss))
            tick += 1
            if parse_workers:  # every sample: a worker's CPU is read for the last time before it exits
                workers.update(children_cpu(process.pid))
            if tick % 10 == 0:
                fleet_peak = max(fleet_peak, group_rss(fleet.pid))
            time.sleep(0.1)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stop(fleet)
    if process.returncode != 0:
        errors.seek(0)
        raise RuntimeError(f"rlorch train failed ({process.returncode}): {errors.read().decode(errors='replace')[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    cpu_end = samples[-1][0] if samples else 0.0
    rollouts = summary["admitted"]
    ingested = rollouts * tokens
    loop_cpu = cpu_end - (cpu_start or 0.0)
    worker_cpu = sum(workers.values())  # from their start: they start with the first long answer
    cpu = loop_cpu + worker_cpu
    shutil.rmtree(run_dir / "rollouts", ignore_errors=True)
    return {"orchestrator_cpu_s": round(cpu, 2), "parse_workers_cpu_s": round(worker_cpu, 2),
            "loop_tokens_per_core_s": round(ingested / max(loop_cpu, 1e-9)),
            "rollouts": rollouts, "lost": summary["lost"],
            "cpu_ms_per_rollout": round(1e3 * cpu / max(1, rollouts), 3),
            "cpu_ms_per_1k_tokens": round(1e6 * cpu / max(1, ingested), 4),
            "ingest_tokens_per_core_s": round(ingested / max(cpu, 1e-9)),
            "rss_baseline_mb": round((baseline or 0) / 2**20), "rss_peak_mb": round(peak / 2**20),
            "bytes_per_inflight_rollout": round((peak - (baseline or 0)) / in_flight),
            "bytes_per_inflight_token": round((peak - (baseline or 0)) / (in_flight * tokens), 1),
            "fleet_peak_mb": round(fleet_peak / 2**20),
            "trainer_idle": summary.get("trainer_idle"),
            "tcp_trouble": {name: count - trouble_before.get(name, 0) for name, count in tcp_trouble().items()}}


def fitting(in_flight: int, tokens: int, bytes_per_token: float, memory: float) -> int:
    """The largest in-flight count, ``in_flight`` halved until it fits, whose tokens at
    ``bytes_per_token`` fit in ``memory`` (0: none does)."""
    while in_flight >= 1 and in_flight * tokens * bytes_per_token > memory:
        in_flight //= 2
    return in_flight


SUMMARY = ("engines", "in_flight", "completion_tokens", "bytes_per_inflight_token", "ingest_tokens_per_core_s",
           "loop_tokens_per_core_s", "parse_workers_cpu_s",
           "fanout_p50_s", "fanout_p99_s", "admission_cost_ratio", "lost", "rss_peak_mb", "fleet_peak_mb", "trainer_idle",
           "tcp_trouble")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--completion-tokens", type=int, default=4096)
    parser.add_argument("--versions", type=int, default=20, help="Versions loaded per fan-out measurement.")
    parser.add_argument("--processes", type=int, default=2, help="Fleet processes.")
    parser.add_argument("--steps", type=int, default=4, help="Training steps per ingest run.")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="Memory the orchestrator and the fleet may use (default: 70%% of this machine's).")
    parser.add_argument("--parse-workers", type=int, default=0,
                        help="inference.parse_workers of the ingest runs: their CPU counts as the orchestrator's.")
    parser.add_argument("--full-logprobs", action="store_true",
                        help="The fleet writes logprobs in full, as SGLang does (some 33 bytes an entry, not 21).")
    parser.add_argument("--batch-format", choices=("safetensors", "jsonl"), default="safetensors",
                        help="run.batch_format of the ingest runs (jsonl: the batch files as JSON lines, by orjson).")
    parser.add_argument("--bytes-per-token", type=float, default=PRIOR_BYTES_PER_TOKEN,
                        help="Memory per in-flight token (orchestrator and fleet) assumed until a run measures it "
                             "(default %(default)s; a figure an earlier run printed fits more in flight).")
    args = parser.parse_args()
    # A SIGTERM (timeout, a job scheduler) unwinds through the finally blocks that stop the fleets.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    memory = (args.memory_gb * 2**30 if args.memory_gb else
              0.7 * os.sysconf("SC_PHYS_PAGES") * PAGE)
    workdir = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    results, notes, error, partial = [], [], None, {"completion_tokens": args.completion_tokens}
    try:
        run(args, memory, workdir, results, notes, partial)
        if not results:
            raise RuntimeError("no ingest run fitted")
    except BaseException as err:  # the JSON line below says what failed, whatever it was
        error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        last = results[-1] if results else partial  # a failed run: what it measured before
        line = {key: last.get(key) for key in SUMMARY}
        line["batch_format"] = args.batch_format
        if notes:
            line["degraded"] = notes
        if error:
            line["error"] = error[-2000:]
        print(json.dumps(line), flush=True)
    return 1 if error else 0


def run(args, memory: float, workdir: Path, results: list, notes: list, partial: dict) -> None:
    """The three measurements; each result goes into ``results`` as it comes, the fan-out and
    admission figures into ``partial`` too (the JSON line of a run that fails later has them)."""
    print(f"{'engines':>8} {'fanout p50 s':>13} {'p99 s':>8} {'cpu/version s':>14} {'behind':>7} {'down':>5}")
    fan = {}
    for engines in args.engines:
        fan[engines] = fanout(engines, args.versions, args.processes, workdir)
        f = fan[engines]
        partial.update(f, engines=engines)
        print(f"{engines:>8} {f['fanout_p50_s']:>13} {f['fanout_p99_s']:>8} {f['fanout_cpu_s']:>14} "
              f"{f['engines_behind']:>7} {f['engines_marked_down']:>5}", flush=True)
    print(f"\n{'in flight':>10} {'admission us':>13} {'vs 1k':>6}")
    adm = {}
    for in_flight in args.in_flight:
        adm[in_flight] = admission(in_flight)
        partial.update(adm[in_flight], in_flight=in_flight)
        print(f"{in_flight:>10} {adm[in_flight]['admission_us']:>13} {adm[in_flight]['admission_cost_ratio']:>6}",
              flush=True)
    print(f"\n{'engines':>8} {'in flight':>10} {'tokens':>7} {'cpu ms/rollout':>15} {'cpu ms/1k tok':>14} "
          f"{'tok/core-s':>11} {'B/rollout':>10} {'B/token':>8} {'peak MB':>8} {'fleet MB':>9} {'trainer idle':>13}")
    bytes_per_token = args.bytes_per_token
    for engines in args.engines:
        for asked in args.in_flight:
            in_flight = fitting(asked, args.completion_tokens, bytes_per_token, memory)
            if in_flight != asked:
                note = (f"{asked} x {args.completion_tokens} tokens at {bytes_per_token:.0f} B/token (orchestrator "
                        f"and fleet) is {asked * args.completion_tokens * bytes_per_token / 2**30:.1f} GiB, over "
                        f"the {memory / 2**30:.1f} GiB given: ran {in_flight} in flight")
                notes.append(note)
                print(f"{engines:>8} {asked:>10} {note}", flush=True)
                if not in_flight:
                    continue
            got = ingest(engines, in_flight, args.completion_tokens, args.processes, workdir, args.steps,
                         args.parse_workers, args.full_logprobs, args.batch_format)
            measured = got["bytes_per_inflight_token"] + got["fleet_peak_mb"] * 2**20 / (in_flight * args.completion_tokens)
            bytes_per_token = max(measured, 1.0) if not results else max(bytes_per_token, measured)
            print(f"{engines:>8} {in_flight:>10} {args.completion_tokens:>7} {got['cpu_ms_per_rollout']:>15} "
                  f"{got['cpu_ms_per_1k_tokens']:>14} {got['ingest_tokens_per_core_s']:>11} "
                  f"{got['bytes_per_inflight_rollout']:>10} {got['bytes_per_inflight_token']:>8} "
                  f"{got['rss_peak_mb']:>8} {got['fleet_peak_mb']:>9} {got['trainer_idle']:>13}  lost={got['lost']}",
                  flush=True)
            results.append({"engines": engines, "in_flight": in_flight, "completion_tokens": args.completion_tokens,
                            **got, **fan[engines], **adm[asked]})


if __name__ == "__main__":
    sys.exit(main())
