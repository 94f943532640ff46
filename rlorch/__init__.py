"""rlorch: the control loop of asynchronous RL post-training.

The top level holds the entry points and the shared vocabulary: ``cli`` (typer), ``runner``
(``rlorch train`` / ``resume``), ``simulate`` (gate sweeps), ``types`` (the dataclasses and
Protocols every package speaks), ``backends`` (which module starts each backend), ``model`` (model
directories: the built-in tiny models, one pretrained to copy, and whose code runs one), ``qwen2`` (rlorch's own Qwen2, run by
the CPU engine and trainer without transformers), ``tokenizer`` (a tokenizer its files define,
loaded without transformers), ``lifecycle`` (bounded stops) and ``jsonlines`` (the JSON codec). Everything
else lives in a package named for its concern; ``docs/architecture.md`` is the map.
"""
