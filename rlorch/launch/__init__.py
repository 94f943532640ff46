"""Starting and stopping the processes of a run, and nothing of what they mean.

``placement`` is the plan as data (which GPUs each process gets); ``server_command`` and
``trainer_command`` build command lines from it and never import each other; ``plan`` joins them
for ``--dry-run``. A :class:`~rlorch.launch.base.Launcher` starts the planned processes, reports
their addresses and exits, and stops them all; ``local`` is the launcher for this machine, ``ray``
places them in placement groups of a Ray cluster (``run.launcher=ray``). Beside
them: the fork server, the guard that ties a server to its orchestrator, signal relaying, the run
lock, the start-up clock and the process group weights are broadcast over.
"""
