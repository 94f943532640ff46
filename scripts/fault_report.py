"""Run the fault cases of ``tests/faults.py`` on real processes (CPU) and print the table our
reliability claims rest on: case, result, seconds from the fault to the end of the run (or the
refusal), rollouts lost, group ids trained twice, and processes of the run still alive 10 s
after it ended.

Usage: python scripts/fault_report.py [CASE ...] [--list]   (all cases by default, ~5 min)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import faults  # noqa: E402


def fmt(value) -> str:
    return "-" if value is None else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all): {', '.join(faults.CASES)}")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(faults.CASES))
        return 0
    unknown = [name for name in args.cases if name not in faults.CASES]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    header = ("case", "result", "exit s", "lost", "duplicates", "leftovers", "took s")
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="rlorch-faults-") as tmp:
        for name in args.cases or list(faults.CASES):
            started = time.monotonic()
            outcome = faults.run_case(name, Path(tmp))
            failed += not outcome.ok
            rows.append((outcome.case, "ok" if outcome.ok else "FAIL", fmt(outcome.exit_s), fmt(outcome.lost),
                         fmt(outcome.duplicates), fmt(outcome.leftovers), f"{time.monotonic() - started:.0f}"))
            print(f"{name}: {'ok' if outcome.ok else 'FAIL ' + '; '.join(outcome.notes)}", file=sys.stderr, flush=True)
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
