"""Sampling parameters as SGLang's native API takes them, and the sampler of the CPU engine.

Behaviour logprobs are what SGLang reports: the sampled token's ``log_softmax(logits / temperature)``
over the whole vocabulary, whatever top-k / top-p / min-p cut the token was drawn from, and the
unscaled ``log_softmax(logits)`` when greedy (``temperature == 0``). The CPU engine reports the
same so that importance ratios computed against it mean what they mean against SGLang. Tokens are
drawn from the cut, renormalised distribution; only the reported logprob ignores the cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

# Fields SGLang accepts that the CPU engine does not implement: accepted only at their defaults.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": None, "custom_params": None, "sampling_seed": None, "stream_interval": None,
    "spaces_between_special_tokens": True,
}


class RequestError(ValueError):
    """A request the server refuses with HTTP 400 ``{"error": {"message": ...}}``."""


@dataclass(slots=True)
class RequestParams:
    """One request's ``sampling_params`` (SGLang 0.5.x names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @classmethod
    def parse(cls, raw: Any, vocab_size: int) -> "RequestParams":
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        values = {}
        for key, value in raw.items():
            if key in known:
                values[key] = value
            elif key in _UNSUPPORTED_DEFAULTS:
                if value is not None and value != _UNSUPPORTED_DEFAULTS[key]:
                    raise RequestError(f"sampling_params.{key} is not supported by rlorch serve")
            else:
                raise RequestError(f"unknown sampling_params field {key!r}")
        params = cls(**values)
        params._check(vocab_size)
        return params

    def _check(self, vocab_size: int) -> None:
        _expect_int(self.max_new_tokens, "max_new_tokens", minimum=0)
        _expect_int(self.min_new_tokens, "min_new_tokens", minimum=0)
        _expect_int(self.n, "n", minimum=1)
        _expect_int(self.top_k, "top_k", minimum=-1)
        if self.top_k == 0:
            raise RequestError("sampling_params.top_k must be -1 (whole vocabulary) or >= 1")
        _expect_number(self.temperature, "temperature", 0.0, float("inf"))
        _expect_number(self.top_p, "top_p", 0.0, 1.0)
        if self.top_p <= 0:
            raise RequestError("sampling_params.top_p must be in (0, 1]")
        _expect_number(self.min_p, "min_p", 0.0, 1.0)
        for flag in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(f"sampling_params.{flag} must be a boolean")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) for t in self.stop_token_ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise RequestError(f"sampling_params.stop_token_ids must lie in [0, {vocab_size})")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect_int(value: Any, name: str, minimum: int) -> None:
    if not is_int(value):
        raise RequestError(f"sampling_params.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise RequestError(f"sampling_params.{name} must be >= {minimum}, got {value}")


def _expect_number(value: Any, name: str, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"sampling_params.{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(f"sampling_params.{name} must be in [{lo}, {hi}], got {value}")


def sample(logits: torch.Tensor, params: list[RequestParams], banned: list[list[int]],
           generator: torch.Generator, *, generators: Optional[list[Optional[torch.Generator]]] = None,
           top: Optional[list[int]] = None) -> tuple[list[int], list[float], Optional[list[list[tuple[int, float]]]]]:
    """Draw one token per row; return the tokens, their behaviour logprobs (see module doc) and,
    where ``top`` asks (``top[i]`` alternatives for row ``i``), the most likely tokens of the same
    distribution with their logprobs, best first (None when no row asks: no cost otherwise).

    ``banned[i]`` are token ids row ``i`` may not produce yet (eos and stop ids before
    ``min_new_tokens``); ``generators[i]``, where not None, draws row ``i`` instead of the shared
    ``generator`` (a request's own seed).
    """
    logits = logits.float()
    # On a GPU, multinomial on a NaN would be a device-side assert: the engine's CUDA context
    # lost, with no word of why. Refused here, the batch fails naming its cause (one sync a step).
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError("the model's logits are not finite (NaN or inf): its weights or activations "
                                 "overflowed")
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    draw_from = logp
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        draw_from = _filtered(logp, params)
    probs = draw_from.exp()
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    for row, own in enumerate(generators or []):
        if own is not None:
            drawn[row] = torch.multinomial(probs[row], 1, generator=own)[0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    reported = torch.where(greedy[:, None], torch.log_softmax(logits, dim=-1), logp)
    chosen = reported.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist(), _top(reported, top)


def _top(reported: torch.Tensor, top: Optional[list[int]]) -> Optional[list[list[tuple[int, float]]]]:
    if not top or not any(top):
        return None
    values, ids = reported.topk(min(max(top), reported.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[row][:k], values[row][:k])) for row, k in enumerate(top)]


def _filtered(logp: torch.Tensor, params: list[RequestParams]) -> torch.Tensor:
    """Restrict each row to its top-k / top-p / min-p set and renormalise (the top token stays)."""
    vocab = logp.shape[-1]
    device = logp.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    keep = torch.arange(vocab, device=device)[None, :] < top_k[:, None]
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    kept = sorted_logp.masked_fill(~keep, float("-inf"))
    masked = torch.full_like(logp, float("-inf")).scatter(1, order, kept)
    return torch.log_softmax(masked, dim=-1)
