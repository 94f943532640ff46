"""``rlorch simulate``: the real capacity gate driven through a discrete-tick model.

Every tick admits rollouts one at a time while the gate has capacity, each drawing a latency in
ticks; then every in-flight rollout advances one tick, those that reach zero are accepted in
admission order, and full batches of B are trained in completion order, one version bump per
batch. A trained rollout's age is the version it was trained at minus the version it was
admitted at. With uniform latency the observed maximum age is exactly S; spread in latency makes
it overshoot, which is why the distribution is reported and not the configured bound.

Group size plays no part: the model admits single rollouts, as the gate's formula counts them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from rlorch.config.schema import Config, ConfigError, to_plain
from rlorch.orchestrator.gate import CapacityGate
from rlorch.types import PolicyVersion

SHORT_NAMES = {"rollout.max_staleness": "S", "rollout.batch_size": "B", "rollout.max_concurrent": "C"}
USED_KEYS = ("conf", "rollout.max_staleness", "rollout.batch_size", "rollout.max_concurrent", "sim")
"""The keys the model reads (``sim`` and everything below it); any other is refused, not ignored."""


def check_used(overrides: list[str]) -> None:
    """Refuse a key the simulation would ignore (a sweep of it would print identical rows)."""
    from rlorch.config.compose import config_groups
    from rlorch.config.keys import check_overrides, override_key

    check_overrides([item for item in overrides if override_key(item) != "conf"], groups=config_groups())
    for item in overrides:
        key = override_key(item)
        if not any(key == used or key.startswith(f"{used}.") for used in USED_KEYS):
            raise ConfigError(key, "rlorch simulate ignores this key: the model reads only rollout.max_staleness, "
                                   "rollout.batch_size, rollout.max_concurrent and sim.* (ticks, latency, seed, "
                                   "recover_at, fix_recovery)")


@dataclass(frozen=True)
class SimParams:
    max_staleness: int
    batch_size: int
    max_concurrent: int
    ticks: int
    latency: tuple[int, int]
    seed: int
    recover_at: int
    fix_recovery: bool

    @classmethod
    def from_config(cls, config: Config) -> "SimParams":
        r, s = config.rollout, config.sim
        return cls(r.max_staleness, r.batch_size, r.max_concurrent, s.ticks,
                   (int(s.latency[0]), int(s.latency[1])), s.seed, s.recover_at, s.fix_recovery)

    def to_json(self) -> dict[str, Any]:
        return {"rollout.max_staleness": self.max_staleness, "rollout.batch_size": self.batch_size,
                "rollout.max_concurrent": self.max_concurrent, "sim.ticks": self.ticks,
                "sim.latency": list(self.latency), "sim.seed": self.seed,
                "sim.recover_at": self.recover_at, "sim.fix_recovery": self.fix_recovery}


@dataclass
class SimResult:
    params: SimParams
    swept: dict[str, Any]
    """Values of the swept keys for this run, typed as composed."""
    ages: list[int]
    """Age of every trained rollout, in training order."""
    admissions: list[int]
    """Rollouts admitted in each tick."""

    @property
    def trained(self) -> int:
        return len(self.ages)

    @property
    def max_age(self) -> Optional[int]:
        return max(self.ages) if self.ages else None

    @property
    def mean_age(self) -> Optional[float]:
        return sum(self.ages) / len(self.ages) if self.ages else None

    @property
    def p99_age(self) -> Optional[int]:
        """The smallest observed age that at least 99% of trained rollouts do not exceed."""
        import numpy as np

        return int(np.percentile(self.ages, 99, method="inverted_cdf")) if self.ages else None

    def to_json(self) -> dict[str, Any]:
        return {"params": {**self.params.to_json(), **self.swept}, "swept": sorted(self.swept),
                "max_age": self.max_age, "p99_age": self.p99_age, "mean_age": self.mean_age,
                "trained": self.trained, "admissions": self.admissions}


def run_gate(params: SimParams) -> tuple[list[int], list[int]]:
    """Drive a CapacityGate through ``params.ticks`` ticks; return (ages, admissions per tick)."""
    import numpy as np

    rng = np.random.default_rng(params.seed)
    policy = PolicyVersion(params.recover_at)
    gate = CapacityGate(max_staleness=params.max_staleness, batch_size=params.batch_size,
                        max_concurrent=params.max_concurrent, policy=policy)
    if params.recover_at and params.fix_recovery:
        gate.on_version_recovered(params.recover_at)
    lo, hi = params.latency
    in_flight: list[list[int]] = []  # [birth version, ticks left], in admission order
    finished: list[int] = []  # birth versions, in completion order
    ages: list[int] = []
    admissions: list[int] = []
    for _ in range(params.ticks):
        admitted = 0
        while gate.try_admit(1):  # admits while capacity() > 0
            latency = lo if hi <= lo else int(rng.integers(lo, hi))
            in_flight.append([policy.value, latency])
            admitted += 1
        admissions.append(admitted)
        for rollout in in_flight:
            rollout[1] -= 1
        ripe = [birth for birth, left in in_flight if left <= 0]
        in_flight = [rollout for rollout in in_flight if rollout[1] > 0]
        if ripe:
            gate.on_accepted(len(ripe))
            finished.extend(ripe)
        while len(finished) >= params.batch_size:
            batch, finished = finished[:params.batch_size], finished[params.batch_size:]
            ages.extend(policy.value - birth for birth in batch)
            policy.bump()
    return ages, admissions


def _lookup(config: Config, dotted: str) -> Any:
    node: Any = config
    for part in dotted.lstrip("+~").split("."):
        node = getattr(node, part, None)
    return to_plain(node)


def _with_single_rollouts(overrides: list[str]) -> list[str]:
    """Group size is irrelevant here; pin it to 1 unless set, so any batch size composes."""
    keys = {item.split("=", 1)[0].lstrip("+~") for item in overrides}
    return overrides if "rollout.group_size" in keys else overrides + ["rollout.group_size=1"]


def simulate(overrides: list[str]) -> list[SimResult]:
    """One simulated run per combination of the comma-list sweeps in ``overrides``."""
    from rlorch.config.compose import compose, expand_sweeps

    check_used(overrides)
    try:
        combos = list(expand_sweeps(overrides))
    except Exception as err:  # hydra's override grammar errors
        raise ConfigError("overrides", str(err).splitlines()[0]) from err
    results = []
    for chosen, combo in combos:
        config = compose(_with_single_rollouts(combo))
        params = SimParams.from_config(config)
        swept = {key: _lookup(config, key) if key != "conf" else value for key, value in chosen.items()}
        ages, admissions = run_gate(params)
        results.append(SimResult(params, swept, ages, admissions))
    return results


def _fmt(value: Optional[float], digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _count(value: int) -> str:
    """Powers of ten from a million up as 1eN: the usual way to switch a term off."""
    digits = str(value)
    return f"1e{len(digits) - 1}" if value >= 10**6 and digits.rstrip("0") == "1" else digits


def results_table(results: list[SimResult]):
    """One row per run; swept keys outside S, B, C and latency get a column of their own."""
    from rich.table import Table

    extra = [k for k in results[0].swept if k not in SHORT_NAMES and k != "sim.latency"]
    first = results[0].params.to_json()
    fixed = {k: first[k] for k in ("sim.ticks", "sim.seed", "sim.recover_at", "sim.fix_recovery")
             if k not in extra and (k != "sim.fix_recovery" or first["sim.recover_at"])}
    table = Table(title="capacity gate simulation", title_justify="left",
                  caption=f"age: policy versions behind when trained | {_label(fixed)}",
                  caption_justify="left")
    for name in [k.rsplit(".", 1)[-1].replace("_", "\n") for k in extra] + [
            "S", "B", "C", "latency", "age\nmax", "age\np99", "age\nmean",
            "admitted\ntick 1", "trained\nper tick"]:
        table.add_column(name, justify="left" if name == "latency" else "right", no_wrap=True)
    for result in results:
        p = result.params
        table.add_row(*[str(result.swept[k]) for k in extra],
                      _count(p.max_staleness), _count(p.batch_size), _count(p.max_concurrent),
                      f"[{p.latency[0]}, {p.latency[1]}]", _fmt(result.max_age), _fmt(result.p99_age),
                      _fmt(result.mean_age, 2), str(result.admissions[0]),
                      _fmt(result.trained / p.ticks, 2))
    return table


def _label(keys: dict[str, Any]) -> str:
    return " ".join(f"{SHORT_NAMES.get(k, k.rsplit('.', 1)[-1])}={_count(v) if type(v) is int else v}"
                    for k, v in keys.items())


def plot_ages(results: list[SimResult], path: str) -> None:
    """Write :func:`ages_figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = ages_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ages_figure(results: list[SimResult]):
    """The age distribution, one series per run, as shares of that run's trained rollouts.

    Grouped bars while there are few distinct ages; steps beyond that, so long tails stay legible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    params = [{**r.params.to_json(), **r.swept} for r in results]
    shared = {k: v for k, v in params[0].items() if all(p.get(k) == v for p in params)}
    varying = [{k: v for k, v in p.items() if k not in shared} for p in params]
    top = max((r.max_age or 0) for r in results)
    ages = list(range(top + 1))
    bars = top < 16
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(min(12.0, max(7.0, 0.45 * len(ages) * len(results) ** 0.5 + 4)), 4.8))
    for index, (result, keys) in enumerate(zip(results, varying)):
        counts = [0] * (top + 1)
        for age in result.ages:
            counts[age] += 1
        shares = [c / max(result.trained, 1) for c in counts]
        label = (f"{_label(keys) or 'run'} (max {_fmt(result.max_age)}, p99 {_fmt(result.p99_age)}, "
                 f"mean {_fmt(result.mean_age, 2)})")
        if bars:
            ax.bar([a - 0.4 + width * (index + 0.5) for a in ages], shares, width=width, label=label)
        else:
            ax.plot(ages, shares, drawstyle="steps-mid", linewidth=1.6, label=label)
    if "rollout.max_staleness" in shared and shared["rollout.max_staleness"] < top:
        ax.axvline(shared["rollout.max_staleness"] + 0.5, color="grey", linestyle=":", linewidth=1,
                   label="configured bound S")
    if bars:
        ax.set_xticks(ages)    # every age its own tick: a locator may skip 1 between 0 and 2
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20))
    ax.set_xlim(-0.6, top + 0.6)
    ax.set_xlabel("age at training (policy versions behind)")
    ax.set_ylabel("share of trained rollouts")
    titled = ("rollout.max_staleness", "rollout.batch_size", "rollout.max_concurrent", "sim.latency",
              "sim.ticks", "sim.recover_at")
    title_keys = {k: shared[k] for k in titled if k in shared and (k != "sim.recover_at" or shared[k])}
    ax.set_title(f"Observed rollout age per run ({_label(title_keys)})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def simulate_command(overrides: list[str], *, json_lines: bool, plot: Optional[str]) -> int:
    """The ``rlorch simulate`` command: 0 on success, 2 for an invalid config."""
    from rich.console import Console
    from rich.markup import escape

    try:
        if plot:
            from rlorch.config.preflight import writable_file

            writable_file(plot, "--plot")
        results = simulate(overrides)
    except ConfigError as err:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]invalid config[/] [bold]{escape(err.key)}[/]: "
                                   f"{escape(str(err).split(': ', 1)[-1])}", highlight=False)
        return 2
    if json_lines:
        for result in results:
            print(json.dumps(result.to_json()))
    else:
        Console().print(results_table(results))
    if plot:
        plot_ages(results, plot)
    return 0
