"""Fault cases on real processes (CPU): each one starts a run (or an engine), does to it what an
operator or a failure would, and returns an :class:`Outcome` with the figures the reliability
claims rest on. ``tests/test_faults.py`` asserts them; ``scripts/fault_report.py`` prints them.

Every process a case starts carries a tag in its environment (inherited by the trainer, torchrun's
ranks and the engines), so what survives a case is found by the tag, not by a name.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import free_port, wait_until as wait_for  # noqa: E402
from rlorch.rundir.batchfile import read_records  # noqa: E402

TAG = "RLORCH_FAULT_TAG"
LEFTOVER_BOUND_S = 10.0
"""Nothing of a run may outlive it (or its orchestrator) by more than this."""

REAL = ["rollout.batch_size=16", "rollout.group_size=4", "rollout.max_concurrent=32", "run.progress=false",
        "inference.num_servers=1", "eval.enabled=false", "trainer.checkpoint_every=3", "run.shutdown_timeout=20"]
"""A small CPU default: `rlorch serve` engines, the FSDP2 trainer under torchrun, the tiny model."""

SIM = ["conf=sim", "run.progress=false", "trainer.sim.step_time=0.02", "inference.sim.latency=[0.01,0.05]",
       "trainer.checkpoint_every=5", "run.shutdown_timeout=5"]


@dataclass
class Outcome:
    case: str
    ok: bool = False
    exit_s: Optional[float] = None
    """Seconds from the fault to the end of the run (or the refusal)."""
    lost: Optional[int] = None
    duplicates: Optional[int] = None
    leftovers: int = 0
    """Processes of the run still alive LEFTOVER_BOUND_S after it ended."""
    notes: list[str] = field(default_factory=list)

    def check(self, condition: bool, note: str) -> None:
        if not condition:
            self.notes.append(note)

    def done(self) -> "Outcome":
        self.ok = not self.notes
        return self


class Run:
    """One ``rlorch`` command as a tagged process group of its own. Its output goes to a file,
    not a pipe: a pipe nobody reads until the end would block a process that writes more than
    the pipe holds, and the case would measure the harness."""

    def __init__(self, *args: str, env: Optional[dict] = None, preexec: Optional[Callable] = None):
        self.tag = uuid.uuid4().hex
        self.env = {**(env or os.environ), TAG: self.tag, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
        # A fault run forks through a fork server of its own, as a run does by default: what a
        # shared one forks does not carry the run's tag in its environment (a fork inherits the
        # server's), so leftovers of the run would go unseen.
        if self.env.get("RLORCH_FORKSERVER", "1") != "0":
            self.env["RLORCH_FORKSERVER"] = "1"
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "rlorch.cli", *args], env=self.env,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=preexec)
        self.output = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float) -> Optional[int]:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._log.seek(0)
        self.output = self._log.read().decode(errors="replace")
        return self.process.returncode

    def text(self) -> str:
        """The run's output so far (while it runs; :attr:`output` is set once it ended)."""
        return os.pread(self._log.fileno(), 1 << 26, 0).decode(errors="replace")

    def kill_all(self) -> None:
        for pid in tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.wait(30)


def tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry))
    return found


def leftovers_after(tag: str, bound: float = LEFTOVER_BOUND_S) -> int:
    """How many tagged processes are still alive once ``bound`` seconds have passed."""
    deadline = time.monotonic() + bound
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(tagged(tag))


def strike(run: Run, out: Outcome, *, when: Callable[[], bool], what: str, fault: Callable[[], None],
           wait: float = 60, bound: float = LEFTOVER_BOUND_S) -> Optional[int]:
    """Wait (up to 240 s) until ``when`` holds, then do ``fault`` to the run and time its end
    from there: returns the run's exit code (None if it outlived ``wait``) and records
    ``exit_s`` and ``leftovers`` on ``out``; whatever of the run is left is killed."""
    try:
        wait_for(when, 240, what)
        struck = time.monotonic()
        fault()
        code = run.wait(wait)
        out.exit_s = round(time.monotonic() - struck, 2)
        out.leftovers = leftovers_after(run.tag, bound)
    finally:
        run.kill_all()
    return code


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def newest_checkpoint(run_dir: Path) -> int:
    return max(checkpoint_steps(run_dir), default=0)


def summary(run_dir: Path) -> dict:
    """The run's summary.json ({} with status "none" when there is none)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return {"status": "none", "lost": None, "error": None, "checkpoint": None, "steps": 0}
    return json.loads(path.read_text())


def duplicate_groups(run_dir: Path) -> int:
    """Group ids that appear in more than one trained batch (``rollouts/step_*``)."""
    seen: dict[int, str] = {}
    duplicates = 0
    for path in sorted((run_dir / "rollouts").glob("step_*.*")):
        groups = {record["group_id"] for record in read_records(path)}
        for group in groups:
            duplicates += group in seen
            seen[group] = path.name
    return duplicates


def tree_digest(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Path -> content hash of every file under ``root`` (to show a refusal changed nothing)."""
    digest = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_file() and not relative.startswith(skip):
            digest[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            digest[relative + "/"] = ""
    return digest


def step_files(run_dir: Path, upto: int) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "rollouts").glob("step_*.*")) if int(p.stem[5:]) <= upto}


def checkpoint_state(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}" / "orchestrator.json"


def trainer_steps(run_dir: Path) -> int:
    path = run_dir / "trainer" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines[:-1] if lines and not lines[-1].endswith("}") else lines)
            if r["kind"] == "step"]


def _live_pids(pids: list[int]) -> list[int]:
    live = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.append(pid)
    return live


def trainer_pid(run_dir: Path, tag: str, module: str) -> int:
    """The tagged process running ``module`` (torch.distributed.run or rlorch.trainer.fsdp). A
    rank forked by the fork server keeps the server's command line: it is found by the pid it
    records in the run directory."""
    if module == "rlorch.trainer.fsdp":
        rank = run_dir / "trainer" / "workers" / "rank-0.json"
        if rank.exists() and json.loads(rank.read_text())["pid"] in tagged(tag):
            return json.loads(rank.read_text())["pid"]
    for pid in tagged(tag):
        try:
            if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise LookupError(f"no {module} process")


# ---- the cases ------------------------------------------------------------------------------

def kill_orchestrator_then_resume(tmp: Path) -> Outcome:
    """kill -9 the orchestrator once checkpoint 3 has its state; its trainer and engine must
    follow within the bound; a resume then trains alone (one trainer line per step)."""
    out, run_dir = Outcome("kill -9 orchestrator, resume"), tmp / "kill-orch"
    run = Run("train", f"run.dir={run_dir}", "train.steps=40", *REAL)
    before = {}
    strike(run, out, when=lambda: checkpoint_state(run_dir, 3).exists(), what="checkpoint 3",
           fault=lambda: (before.update(step_files(run_dir, 3)), os.kill(run.pid, signal.SIGKILL)), wait=10)
    resumed = Run("resume", f"checkpoint={run_dir}/checkpoints/step_000003", "train.steps=6")
    code = resumed.wait(240)
    out.leftovers += leftovers_after(resumed.tag)
    out.check(code == 0, f"resume exited {code}: {resumed.output[-800:]}")
    result = summary(run_dir)
    out.lost, out.duplicates = result["lost"], duplicate_groups(run_dir)
    lines = [json.loads(x)["step"] for x in (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    after = lines[len(lines) - lines[::-1].index(4) - 1:] if 4 in lines else []
    out.check(after == [4, 5, 6], f"trainer lines after the resume: {after} (two trainers?)")
    out.check(step_files(run_dir, 3) == before, "batches 1..3 changed")
    out.check(out.lost == 0 and out.duplicates == 0 and out.leftovers == 0, "lost/duplicates/leftovers")
    return out.done()


def kill_trainer_process(tmp: Path, module: str, case: str) -> Outcome:
    """kill -9 torchrun (or its rank) mid-run: the run fails clearly and nothing survives it."""
    out, run_dir = Outcome(case), tmp / f"kill-{module.rsplit('.', 1)[-1]}"
    # One process runs without torchrun's agent unless torchrun has arguments to take.
    agent = ["trainer.fsdp.torchrun_args=['--max-restarts=0']"] if module == "torch.distributed.run" else []
    run = Run("train", f"run.dir={run_dir}", "train.steps=60", *REAL, *agent)
    code = strike(run, out, when=lambda: trainer_steps(run_dir) >= 2, what="two trainer steps",
                  fault=lambda: os.kill(trainer_pid(run_dir, run.tag, module), signal.SIGKILL))
    out.check(code == 1, f"exit {code}: {run.output[-800:]}")
    result = summary(run_dir)
    out.lost, out.duplicates = result["lost"], duplicate_groups(run_dir)
    out.check(result["status"] == "failed" and "trainer" in (result["error"] or ""), f"summary {result}")
    out.check(out.lost == 0 and out.leftovers == 0 and out.duplicates == 0, "lost/leftovers/duplicates")
    return out.done()


def kill_engine(tmp: Path) -> Outcome:
    """kill -9 the only engine (no restarts) once the trainer is ready: noticed at once, the run
    fails within 30 s naming the engine and its log."""
    out, run_dir = Outcome("kill -9 only engine"), tmp / "kill-engine"
    run = Run("train", "conf=sync", f"run.dir={run_dir}", "train.steps=200", "rollout.max_new_tokens=100",
              "rollout.request_timeout=60", "inference.max_restarts=0", *REAL)
    code = strike(run, out, when=lambda: trainer_steps(run_dir) >= 1, what="a trainer step",
                  fault=lambda: os.kill(json.loads((run_dir / "servers.json").read_text())[0]["pid"], signal.SIGKILL))
    out.check(code == 1, f"exit {code}: {run.output[-800:]}")
    out.check(out.exit_s is not None and out.exit_s < 30, f"took {out.exit_s}s")
    result = summary(run_dir)
    out.lost, out.duplicates = result["lost"], duplicate_groups(run_dir)
    out.check("server-0.log" in (result["error"] or ""), f"error does not name the engine's log: {result['error']}")
    complete = sorted(p.parent.parent for p in (run_dir / "checkpoints").glob("step_*/trainer/COMPLETE"))
    out.check(all((p / "orchestrator.json").exists() for p in complete)
              and result["checkpoint"] == (str(complete[-1]) if complete else None),
              f"complete checkpoints {complete}, summary names {result['checkpoint']}")
    out.check(out.lost == 0 and out.leftovers == 0, "lost/leftovers")
    return out.done()


HANG = ["inference.health_interval=0.5", "inference.health_timeout=1", "inference.health_failures=2",
        "inference.control_timeout=2", "inference.reload_timeout=10", "inference.hang_timeout=4"]
"""Hang detection sized for a test: suspect after ~2 s of silence, killed after 4 s more."""


def freeze_engine(tmp: Path, *, only: bool) -> Outcome:
    """SIGSTOP an engine mid-run (alive, answering nothing). One of two: the run goes on with the
    other, the frozen one is killed after inference.hang_timeout and restarted, nothing is lost.
    The only one (no restarts): the run fails within hang_timeout + a few seconds, naming it."""
    out = Outcome("SIGSTOP only engine" if only else "SIGSTOP one of two engines")
    run_dir = tmp / ("freeze-only" if only else "freeze-one")
    layout = ["inference.num_servers=1", "inference.max_restarts=0"] if only else ["inference.num_servers=2"]
    # The engines are the subject: real `rlorch serve` engines, the sim trainer.
    run = Run("train", f"run.dir={run_dir}", "train.steps=200" if not only else "train.steps=400", *REAL, *HANG,
              *layout, "trainer=sim", "trainer.sim.step_time=0.1", "rollout.max_new_tokens=8")
    frozen: list[int] = []

    def freeze() -> None:
        frozen.append(json.loads((run_dir / "servers.json").read_text())[0]["pid"])
        os.kill(frozen[0], signal.SIGSTOP)

    try:
        code = strike(run, out, when=lambda: len(step_records(run_dir)) >= (3 if only else 10), what="step records",
                      fault=freeze, wait=240)
    finally:
        for pid in _live_pids(frozen):
            os.kill(pid, signal.SIGCONT)
    result = summary(run_dir)
    out.lost, out.duplicates = result.get("lost"), duplicate_groups(run_dir)
    if only:
        out.check(code == 1 and out.exit_s < 4 + 20, f"exit {code} after {out.exit_s}s: {run.output[-800:]}")
        error = result.get("error") or ""
        out.check("hung" in error and "inference.hang_timeout" in error and "inference.max_restarts" in error,
                  f"error does not say the engine hung, naming the keys: {error}")
    else:
        out.check(code == 0 and result.get("status") == "completed", f"exit {code}: {run.output[-800:]}")
        out.check(result.get("server_restarts", 0) >= 1 and result.get("servers_dead") == 0, f"no restart: {result}")
        steps = step_records(run_dir)
        # Training went on while the engine was frozen, and the restarted one rejoined.
        out.check(any(r["step"] > 10 and r.get("servers_suspect") for r in steps), "no step while it was suspect")
        out.check(any(r.get("server_restarts") and r.get("servers_up") == 2 for r in steps),
                  "the restarted server never rejoined")
    # leftovers (counted before this case kills anything) include the frozen engine: 0 means the
    # run killed it.
    out.check(out.lost == 0 and out.leftovers == 0 and out.duplicates == 0, "lost/leftovers/duplicates")
    return out.done()


def signal_during_startup(tmp: Path, sig: signal.Signals = signal.SIGTERM) -> Outcome:
    """A signal while the trainer is still starting: clean exit, a summary, no orphan."""
    out, run_dir = Outcome(f"{sig.name} during start-up"), tmp / f"startup-{sig.name}"
    run = Run("train", f"run.dir={run_dir}", "train.steps=5", *REAL)
    code = strike(run, out, when=lambda: (run_dir / "logs" / "trainer.log").exists(), what="the trainer to start",
                  fault=lambda: os.kill(run.pid, sig))
    out.check(code == 128 + sig.value, f"exit {code}: {run.output[-800:]}")
    result = summary(run_dir)
    out.lost = result["lost"]
    out.check(result["status"] == "interrupted", f"summary {result}")
    out.check(out.lost == 0 and out.leftovers == 0, "lost/leftovers")
    return out.done()


def signal_twice_midrun_then_resume(tmp: Path, sig: signal.Signals = signal.SIGINT, *, resume: bool = True) -> Outcome:
    """Two signals mid-run: one bounded shutdown, a checkpoint with its state; the resume trains
    the rest without repeating or changing a batch (``resume=False``: the shutdown only, for a
    second signal whose resume would repeat the first's)."""
    out, run_dir = Outcome(f"{sig.name} twice mid-run" + (", resume" if resume else "")), tmp / f"twice-{sig.name}"
    run = Run("train", f"run.dir={run_dir}", "train.steps=40", *REAL)

    def twice() -> None:
        os.kill(run.pid, sig)
        time.sleep(0.3)      # the second signal lands during the shutdown the first one started (no state shows it)
        os.kill(run.pid, sig)

    code = strike(run, out, when=lambda: trainer_steps(run_dir) >= 2, what="two trainer steps", fault=twice)
    out.check(code == 128 + sig.value, f"exit {code}: {run.output[-800:]}")
    first = summary(run_dir)
    out.check(first["status"] == "interrupted" and first["checkpoint"], f"summary {first}")
    stopped = first["steps"]
    # One checkpoint for the interruption (the second signal adds none): beside the periodic
    # ones (trainer.checkpoint_every=3) only step `stopped`'s, the one the summary names.
    extra = [step for step in checkpoint_steps(run_dir) if step % 3]
    out.check(extra in ([], [stopped]) and first["checkpoint"] == str(run_dir / "checkpoints" / f"step_{stopped:06d}"),
              f"checkpoints {checkpoint_steps(run_dir)} after stopping at {stopped}: {first['checkpoint']}")
    if not resume:
        out.lost = first["lost"]
        out.check(out.lost == 0 and out.leftovers == 0, "lost/leftovers")
        return out.done()
    before = step_files(run_dir, stopped)
    resumed = Run("resume", f"checkpoint={first['checkpoint']}", f"train.steps={stopped + 2}")
    code = resumed.wait(240)
    out.check(code == 0, f"resume exited {code}: {resumed.output[-800:]}")
    out.leftovers += leftovers_after(resumed.tag)
    result = summary(run_dir)
    out.lost, out.duplicates = max(first["lost"], result["lost"]), duplicate_groups(run_dir)
    out.check(step_files(run_dir, stopped) == before, "earlier batches changed")
    out.check(out.lost == 0 and out.duplicates == 0 and out.leftovers == 0, "lost/duplicates/leftovers")
    return out.done()


def sim_run(run_dir: Path, *extra: str, steps: int = 20) -> dict:
    run = Run("train", f"run.dir={run_dir}", f"train.steps={steps}", *SIM, *extra)
    code = run.wait(120)
    if code != 0:
        raise RuntimeError(f"sim run exited {code}: {run.output[-800:]}")
    return summary(run_dir)


def corrupt_checkpoint(tmp: Path, which: str) -> Outcome:
    """Truncate a checkpoint's orchestrator state: a resume from it is refused and the run
    directory stays byte-identical; the other checkpoint still resumes."""
    out, run_dir = Outcome(f"corrupt {which} checkpoint"), tmp / f"corrupt-{which}"
    sim_run(run_dir, steps=20)
    bad, good = (20, 10) if which == "newest" else (10, 20)
    os.truncate(checkpoint_state(run_dir, bad), 100)
    digest = tree_digest(run_dir)
    started = time.monotonic()
    refused = Run("resume", f"checkpoint={run_dir}/checkpoints/step_{bad:06d}", "train.steps=25")
    code = refused.wait(60)
    out.exit_s = round(time.monotonic() - started, 2)
    out.check(code == 2 and "orchestrator.json" in refused.output, f"exit {code}: {refused.output[-600:]}")
    out.check(f"step_{good:06d}" in refused.output, "the refusal does not offer the good checkpoint")
    out.check(tree_digest(run_dir) == digest, "the refused resume changed the run directory")
    before = step_files(run_dir, good)
    resumed = Run("resume", f"checkpoint={run_dir}/checkpoints/step_{good:06d}", "train.steps=25", *SIM[1:])
    code = resumed.wait(120)
    out.check(code == 0, f"resume from {good} exited {code}: {resumed.output[-600:]}")
    result = summary(run_dir)
    out.lost, out.duplicates = result["lost"], duplicate_groups(run_dir)
    out.leftovers = leftovers_after(refused.tag) + leftovers_after(resumed.tag)
    out.check(step_files(run_dir, good) == before, "earlier batches changed")
    out.check(out.lost == 0 and out.duplicates == 0, "lost/duplicates")
    return out.done()


def two_processes_one_run_dir(tmp: Path) -> Outcome:
    """A train and a resume into a run directory another process is running in are refused,
    naming its pid; once it is gone (kill -9) the lock is taken over."""
    out, run_dir = Outcome("two processes, one run dir"), tmp / "locked"
    sim_run(run_dir, steps=10)
    first = Run("resume", f"checkpoint={run_dir}/checkpoints/step_000010", "train.steps=100000", *SIM[1:],
                "trainer.sim.step_time=0.05")
    try:
        wait_for(lambda: (run_dir / "LOCK").exists() and str(first.pid) in (run_dir / "LOCK").read_text(),
                 60, "the first resume's lock")
        started = time.monotonic()
        second = Run("resume", f"checkpoint={run_dir}/checkpoints/step_000010", "train.steps=30")
        code = second.wait(60)
        third = Run("train", f"run.dir={run_dir}", *SIM)
        third_code = third.wait(60)
        out.exit_s = round(time.monotonic() - started, 2)
        out.check(code == 2 and f"process {first.pid}" in second.output, f"resume: {code} {second.output[-400:]}")
        out.check(third_code == 2 and f"process {first.pid}" in third.output, f"train: {third_code} {third.output[-400:]}")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        first.kill_all()
    # The holder ran on (and pruned old checkpoints): the lock's new owner resumes the newest.
    taken = Run("resume", f"checkpoint={run_dir}", f"train.steps={newest_checkpoint(run_dir) + 5}", *SIM[1:])
    code = taken.wait(120)
    out.check(code == 0, f"resume after the holder died exited {code}: {taken.output[-400:]}")
    result = summary(run_dir)
    out.lost, out.duplicates = result["lost"], duplicate_groups(run_dir)
    out.leftovers = leftovers_after(first.tag)
    out.check(out.lost == 0 and out.duplicates == 0 and not (run_dir / "LOCK").exists(), "lost/duplicates/LOCK")
    return out.done()


def disk_full(tmp: Path) -> Outcome:
    """A file-size limit (RLIMIT_FSIZE) stands in for a full disk: the run stops with the file
    and the error named, checkpoints what it has (lost = 0), and resumes once there is room."""
    out, run_dir = Outcome("disk full (RLIMIT_FSIZE)"), tmp / "full"
    limit = 64 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    started = time.monotonic()
    run = Run("train", f"run.dir={run_dir}", "train.steps=400", *SIM, "metrics.interval=0.05", preexec=small_files)
    code = run.wait(120)
    out.exit_s = round(time.monotonic() - started, 2)
    out.leftovers = leftovers_after(run.tag)
    out.check(code == 1, f"exit {code}: {run.output[-600:]}")
    out.check("File too large" in run.output and "metrics.jsonl" in run.output, f"no cause named: {run.output[-600:]}")
    out.check("Traceback" not in run.output, "a traceback instead of a message")
    first = summary(run_dir)
    out.check(bool(first.get("checkpoint")), f"no checkpoint: {first}")
    if first.get("checkpoint"):
        stopped = first["steps"]
        before = step_files(run_dir, stopped)
        resumed = Run("resume", f"checkpoint={first['checkpoint']}", f"train.steps={stopped + 5}", *SIM[1:])
        code = resumed.wait(120)
        out.check(code == 0, f"resume exited {code}: {resumed.output[-600:]}")
        out.check(step_files(run_dir, stopped) == before, "earlier batches changed")
    result = summary(run_dir)
    out.lost, out.duplicates = max(first["lost"] or 0, result["lost"] or 0), duplicate_groups(run_dir)
    out.check(out.lost == 0 and out.duplicates == 0, "lost/duplicates")
    return out.done()


def non_finite_config(tmp: Path) -> Outcome:
    """``trainer.lr=inf`` is refused before anything starts."""
    out = Outcome("non-finite trainer.lr")
    started = time.monotonic()
    run = Run("train", f"run.dir={tmp / 'inf'}", "trainer.lr=inf", *REAL)
    code = run.wait(60)
    out.exit_s = round(time.monotonic() - started, 2)
    out.leftovers = leftovers_after(run.tag)
    out.check(code == 2 and "trainer.lr" in run.output and not (tmp / "inf").exists(), f"{code}: {run.output[-400:]}")
    return out.done()


def non_finite_training(tmp: Path) -> Outcome:
    """An lr so large that version 1's weights overflow the engine's logits: the engine answers
    500 and fails its health check, the pool marks it down, and the run fails naming the cause
    instead of hanging. (No restarts: a restarted engine loads the same weights and fails the
    same way; restarts are the kill and freeze cases' subject.)"""
    out, run_dir = Outcome("non-finite training"), tmp / "nan"
    started = time.monotonic()
    run = Run("train", f"run.dir={run_dir}", "train.steps=30", "trainer.lr=1e30", "trainer.max_grad_norm=1e30",
              "inference.max_restarts=0", *REAL)
    code = run.wait(240)
    out.exit_s = round(time.monotonic() - started, 2)
    out.leftovers = leftovers_after(run.tag)
    run.kill_all()
    flat = " ".join(run.output.split())
    out.check(code == 1 and ("generation loop failed" in flat or "non-finite" in flat), f"exit {code}: {flat[-800:]}")
    result = summary(run_dir)
    out.lost = result["lost"]
    out.check(out.lost == 0 and out.leftovers == 0, "lost/leftovers")
    return out.done()


def serve_limits(tmp: Path) -> Outcome:
    """`rlorch serve` against an oversized body and a slow client: a 413 at once, the slow
    connection timed out (BODY_TIMEOUT_S), the server answering health checks throughout. (Idle
    connections close after IDLE_TIMEOUT_S = 75 s; the suite checks that with shorter limits.)"""
    out = Outcome("serve: 50 MB body, slow client")
    port = free_port()
    run = Run("serve", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(f"{base}/health") == 200, 120, "rlorch serve")
        started = time.monotonic()
        status = post_status(port, "/generate", 50_000_000)
        out.exit_s = round(time.monotonic() - started, 2)
        out.check(status == 413, f"50 MB body answered {status}")
        out.check(_status(f"{base}/health") == 200 and run.process.poll() is None, "the server died on the body")
        out.check(closed_after_refusal(port) < 5, "the refused connection stayed open, waiting for the body")
        out.check(slow_and_idle_closed(port, within=30, idle=False) == [], "the slow connection stayed open")
    finally:
        os.kill(run.pid, signal.SIGTERM)
        run.wait(30)
        run.kill_all()
    out.leftovers = leftovers_after(run.tag)
    return out.done()


def post_status(port: int, path: str, size: int) -> int:
    """POST a ``size``-byte JSON body and return the status the server answered, read off the
    socket: a server that refuses a large body may close the connection before reading it, so
    the status line is read even when sending the rest fails (0 when no status came back)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {size}\r\n\r\n".encode())
        chunk = b"a" * 65536
        try:
            for start in range(0, size, len(chunk)):
                connection.sendall(chunk[:size - start])
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            line = connection.makefile("rb").readline()
        except (ConnectionError, socket.timeout):
            return 0
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def closed_after_refusal(port: int) -> float:
    """Seconds from announcing a 50 MB body (and sending none of it) to the server's closing
    the connection after its 413 (a server that drains the body would wait for it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n")
        started = time.monotonic()
        while connection.recv(4096):
            pass
        return time.monotonic() - started


def slow_and_idle_closed(port: int, *, within: float, idle: bool = True) -> list[str]:
    """Open a connection that stalls mid-body (and one that sends nothing); return the ones the
    server did not close within ``within`` seconds, and "health" if it stopped answering."""
    connections = [("slow body", socket.create_connection(("127.0.0.1", port)))]
    connections[0][1].sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    if idle:
        connections.append(("idle", socket.create_connection(("127.0.0.1", port))))
    stuck = [] if _status(f"http://127.0.0.1:{port}/health") == 200 else ["health"]
    opened = time.monotonic()
    for name, connection in connections:
        connection.settimeout(within)
        try:
            while connection.recv(4096):
                pass
        except (socket.timeout, ConnectionError):
            pass
        if time.monotonic() - opened >= within:
            stuck.append(name)
        connection.close()
    return stuck


def _status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, urllib.error.URLError):
        return 0


def run_case(name: str, tmp: Path) -> Outcome:
    """Run case ``name``; a case that raises (it timed out waiting, a file is missing) fails with
    the exception as its note."""
    try:
        return CASES[name](tmp)
    except Exception as err:
        return Outcome(name, notes=[f"{type(err).__name__}: {err}"]).done()


CASES: dict[str, Callable[[Path], Outcome]] = {
    "kill_orchestrator": kill_orchestrator_then_resume,
    "kill_torchrun": lambda tmp: kill_trainer_process(tmp, "torch.distributed.run", "kill -9 torchrun"),
    "kill_worker": lambda tmp: kill_trainer_process(tmp, "rlorch.trainer.fsdp", "kill -9 trainer rank"),
    "kill_engine": kill_engine,
    "freeze_engine": lambda tmp: freeze_engine(tmp, only=False),
    "freeze_only_engine": lambda tmp: freeze_engine(tmp, only=True),
    "sigterm_startup": signal_during_startup,
    "sigint_startup": lambda tmp: signal_during_startup(tmp, signal.SIGINT),
    "sigint_twice": signal_twice_midrun_then_resume,
    "sigterm_twice": lambda tmp: signal_twice_midrun_then_resume(tmp, signal.SIGTERM, resume=False),
    "corrupt_newest": lambda tmp: corrupt_checkpoint(tmp, "newest"),
    "corrupt_older": lambda tmp: corrupt_checkpoint(tmp, "older"),
    "two_processes": two_processes_one_run_dir,
    "disk_full": disk_full,
    "nonfinite_config": non_finite_config,
    "nonfinite_training": non_finite_training,
    "serve_limits": serve_limits,
}
