"""The orchestrator: one module per component — ``gate``, ``dispatcher``, ``sinks``, ``watcher``,
``metrics``, and the bookkeeping ``filing`` (where a finished group goes), ``shipping`` (batches to
the trainer, parked under ship-side gating), ``ledger``, ``steps``, ``checkpoints``,
``evaluation``, ``stops``, ``idle``, ``runstats``, ``loggers`` — none of which imports another;
``loop`` owns the shared objects (policy version, engines, trainer, prompts) and wires them."""
