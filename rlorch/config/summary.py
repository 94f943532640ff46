"""A short, human-readable view of a resolved config."""

from __future__ import annotations

from rich.table import Table

from rlorch.config.schema import Config


def _flat_groups(config: Config) -> str:
    """What zero-variance groups train with, in words."""
    if config.rollout.filter_groups:
        return "filtered"
    flat = config.trainer.flat_advantage.value
    if flat == "zero":
        return "trained with advantage 0"
    if flat == "unlikelihood":
        return f"0; wrong ones unlikelihood x{config.trainer.unlikelihood_scale:g}"
    return f"0; wrong ones flat_advantage={flat}"


def config_summary(config: Config) -> Table:
    r = config.rollout
    table = Table(title="rlorch config", show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = [
        ("staleness S / batch B / concurrency C", f"{r.max_staleness} / {r.batch_size} / {r.max_concurrent}"),
        ("pending limit (S+1)*B", str(r.pending_limit)),
        ("group size / enforce", f"{r.group_size} / {r.enforce.value}"),
        ("zero-variance groups", _flat_groups(config)),
        ("inference", f"{config.inference.backend.value} x{config.inference.num_servers}"
                      + (f" at {', '.join(config.inference.addresses)}" if config.inference.addresses else "")),
        ("trainer / correction / minibatches",
         f"{config.trainer.backend.value} / {config.trainer.correction.value} / {config.trainer.minibatches}"),
        ("model", (config.model.path or "tiny default (created locally)") + f" in {config.model.dtype}"
                  + _attention_note(config)),
        ("weight transfer", config.inference.weight_transfer.value),
        ("task", config.data.path or config.task.name),
        ("train.steps", str(config.train.steps)),
        ("run.dir", config.run.dir or f"outputs/{config.run.name}-<timestamp>"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _attention_note(config: Config) -> str:
    """Launched SGLang servers in float32 get the triton attention backend (FA3, SGLang's
    choice on Hopper, has no float32 kernels)."""
    from rlorch.config.schema import InferenceBackend
    from rlorch.launch.server_command import fp32_attention_args

    launched = config.inference.backend is InferenceBackend.sglang and not config.inference.addresses
    if launched and fp32_attention_args(config):
        return " (SGLang: --attention-backend triton; use model.dtype=bfloat16 for FA3 on Hopper)"
    return ""
