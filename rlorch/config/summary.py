"""A short, human-readable view of a resolved config."""

from __future__ import annotations

from rich.table import Table

from rlorch.config.schema import Config


def config_summary(config: Config) -> Table:
    r = config.rollout
    table = Table(title="rlorch config", show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = [
        ("staleness S / batch B / concurrency C", f"{r.max_staleness} / {r.batch_size} / {r.max_concurrent}"),
        ("pending limit (S+1)*B", str(r.pending_limit)),
        ("group size / enforce", f"{r.group_size} / {r.enforce.value}"),
        ("inference", f"{config.inference.backend.value} x{config.inference.num_servers}"
                      + (f" at {', '.join(config.inference.addresses)}" if config.inference.addresses else "")),
        ("trainer / correction", f"{config.trainer.backend.value} / {config.trainer.correction.value}"),
        ("model", config.model.path or "tiny default (created locally)"),
        ("task", config.data.path or config.task.name),
        ("train.steps", str(config.train.steps)),
        ("run.dir", config.run.dir or f"outputs/{config.run.name}-<timestamp>"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table
