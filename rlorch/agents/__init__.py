"""Agents written against the ``openai`` client, trained token for token.

``trajectory`` turns one episode's calls into training sequences (the prompt of each call is the
ids already held plus the chat template's suffix for the new messages, so every trained token is
one the engine sampled); ``gateway`` is the HTTP front the agents call, one session per episode,
forwarding to the run's engines; ``episodes`` runs the agent once per sample and scores it.
"""
