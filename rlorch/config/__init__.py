"""Configuration: the typed schema (``schema``), Hydra composition behind the CLI (``compose``),
unknown and renamed keys refused with a suggestion (``keys``), checks that need more than the
config (``preflight``) and the summary ``validate-config`` prints (``summary``)."""
