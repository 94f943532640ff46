"""rlorch: the control loop of asynchronous RL post-training.

The top level holds the entry points and the shared vocabulary: ``cli`` (typer), ``runner``
(``rlorch train`` / ``resume``), ``simulate`` (gate sweeps), ``types`` (the dataclasses and
Protocols every package speaks), ``backends`` (which module starts each backend), ``model`` (the
tiny default model), ``lifecycle`` (bounded stops) and ``jsonlines`` (the JSON codec). Everything
else lives in a package named for its concern; ``docs/architecture.md`` is the map.
"""
