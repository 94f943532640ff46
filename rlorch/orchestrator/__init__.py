"""The orchestrator: one module per component (``gate``, ``dispatcher``, ``sinks``, ``watcher``,
``metrics``) and per piece of bookkeeping (``ledger``, ``steps``, ``checkpoints``,
``evaluation``, ``stops``, ``idle``, ``runstats``), none of which imports another; ``loop`` owns
the shared objects (policy version, engines, trainer, prompts) and wires them."""
