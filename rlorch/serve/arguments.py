"""The command line of a CPU engine rlorch launches (``python -m rlorch.serve.server``): every
setting resolved from the run's config, so the engine composes none. Light to import: the run's
checks read it too."""

from __future__ import annotations

import argparse
from typing import Optional

from rlorch.config.schema import IMPLEMENTATIONS

API_KEY_ENV = "RLORCH_API_KEY"
"""Where a launched engine reads its per-run API key (out of ``ps``); with
``inference.addresses``, the key the client sends to servers started elsewhere (optional)."""
DTYPES = ("float32", "bfloat16", "float16")
TOOL_PARSER_NAMES = ("qwen25", "hermes", "pipe")
"""``--tool-call-parser`` choices: :data:`rlorch.openai_api.TOOL_PARSERS`'s names."""


def launched_parser(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    """``inference.launch_args`` of a CPU run are more of these flags."""
    parser = argparse.ArgumentParser(prog="python -m rlorch.serve.server", exit_on_error=exit_on_error,
                                     description="The CPU engine as rlorch launches it (by hand: rlorch serve).")
    parser.add_argument("--model-path", required=True, help="HF model directory, or a run directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS, default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transfer-timeout", type=float, default=60.0)
    parser.add_argument("--min-step-time", type=float, default=0.0, help="seconds each decoding step takes at least")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="on cuda: the share of the device this process may allocate (SGLang's flag)")
    parser.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                        help="how /v1/chat/completions reads tool calls (default none: tools are ignored)")
    return parser


def launch_args_problem(launch_args: list[str]) -> Optional[str]:
    """Why ``launch_args`` cannot extend a launched CPU engine's command line (None: they can)."""
    parser = launched_parser(exit_on_error=False)
    try:
        _, unknown = parser.parse_known_args(["--model-path", "-", "--port", "0", *launch_args])
    except argparse.ArgumentError as err:
        return str(err)
    if unknown:
        return f"not a flag of the CPU engine: {' '.join(unknown)} (its flags: python -m rlorch.serve.server --help)"
    return None
