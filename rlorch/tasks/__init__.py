"""Environments: the registry that turns ``task.name`` (or ``data.path``) into one
(``registry``), the built-in tasks (``digits``, ``calculator``, ``jsonl``), the single-turn base
(``base``), and the conversation an environment drives against an engine (``episode``)."""
