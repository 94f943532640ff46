"""Environments: the registry that turns ``task.name`` (or ``data.path``) into one
(``registry``), the built-in tasks (``digits``, ``calculator``, ``dataset``: a task from a data
file), the calculator as an ``openai``-client agent (``calculator_agent``), reward functions
(``rewards``), the single-turn base (``base``), prompts as token ids (``prompts``), prompts
stuck on flat groups drawn again (``replay``), and the conversation an environment drives
against an engine (``episode``)."""
