"""scripts/bench_fleet.py always ends with its JSON line: a failure says what failed (and exits 1),
a size that does not fit the memory given runs at the largest that does and says so."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_fleet.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_fleet", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub(module, monkeypatch, ingest):
    monkeypatch.setattr(module, "fanout", lambda *a: {"fanout_p50_s": 0.1, "fanout_p99_s": 0.2, "fanout_cpu_s": 0.01,
                                                      "engines_behind": 0, "engines_marked_down": 0})
    monkeypatch.setattr(module, "admission", lambda n: {"admission_us_1k": 1.0, "admission_us": 1.1,
                                                        "admission_cost_ratio": 1.1})
    monkeypatch.setattr(module, "ingest", ingest)


def measured(engines, in_flight, tokens, processes, workdir, steps, parse_workers=0, full_logprobs=False,
             batch_format="safetensors"):
    return {"orchestrator_cpu_s": 1.0, "rollouts": in_flight, "lost": 0, "cpu_ms_per_rollout": 1.0,
            "cpu_ms_per_1k_tokens": 0.4, "ingest_tokens_per_core_s": 2_500_000, "rss_baseline_mb": 100,
            "rss_peak_mb": 200, "bytes_per_inflight_rollout": 1000, "bytes_per_inflight_token": 16.0,
            "fleet_peak_mb": 0, "trainer_idle": 0.9}


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_failing_run_still_ends_with_the_json_line_naming_the_error(monkeypatch, capsys):
    module = bench()

    def failing(*args):
        raise RuntimeError("rlorch train failed (1): out of memory")

    stub(module, monkeypatch, failing)
    monkeypatch.setattr(sys, "argv", ["bench_fleet.py", "--engines", "10", "--in-flight", "100"])
    assert module.main() == 1
    line = last_json(capsys)
    assert line["error"] == "RuntimeError: rlorch train failed (1): out of memory"
    assert (line["fanout_p99_s"], line["admission_cost_ratio"], line["lost"]) == (0.2, 1.1, None)


def test_a_size_over_the_memory_given_runs_at_the_largest_that_fits_and_says_so(monkeypatch, capsys):
    module = bench()
    stub(module, monkeypatch, measured)
    # 60 B/token assumed: 0.2 GiB holds 3.6M tokens, so 100,000 x 4,096 halves down to 781 in flight
    monkeypatch.setattr(sys, "argv", ["bench_fleet.py", "--engines", "1000", "--in-flight", "100000",
                                      "--memory-gb", "0.2"])
    assert module.main() == 0
    line = last_json(capsys)
    assert line["in_flight"] == 781 and "error" not in line
    assert line["degraded"] and "ran 781 in flight" in line["degraded"][0]
    assert module.fitting(100_000, 4096, 16.0, 7 * 2**30) == 100_000
    assert module.fitting(100_000, 4096, 60.0, 7 * 2**30) == 25_000


def test_the_assumed_bytes_per_token_can_be_given(monkeypatch, capsys):
    module = bench()
    stub(module, monkeypatch, measured)
    # 15 B/token assumed instead of 60: 0.2 GiB holds 14.3M tokens, so 100,000 x 4,096 halves to 3,125
    monkeypatch.setattr(sys, "argv", ["bench_fleet.py", "--engines", "1000", "--in-flight", "100000",
                                      "--memory-gb", "0.2", "--bytes-per-token", "15"])
    assert module.main() == 0
    line = last_json(capsys)
    assert line["in_flight"] == 3125 and "at 15 B/token" in line["degraded"][0]


def test_the_batch_format_reaches_the_run_and_the_json_line(monkeypatch, capsys):
    module = bench()
    asked = []
    stub(module, monkeypatch, lambda *args, **kwargs: asked.append(args[-1]) or measured(*args))
    monkeypatch.setattr(sys, "argv", ["bench_fleet.py", "--engines", "10", "--in-flight", "100",
                                      "--batch-format", "jsonl"])
    assert module.main() == 0
    assert asked == ["jsonl"] and last_json(capsys)["batch_format"] == "jsonl"


def test_the_kernels_tcp_counters_are_read_when_linux_has_them():
    counters = bench().tcp_trouble()
    assert counters == {} or (set(counters) == set(bench().TCP_TROUBLE) and all(v >= 0 for v in counters.values()))
