"""The output layer as the trainer uses it: per-token logprobs and entropies of the trained
positions, computed from the final hidden states a chunk of rows at a time, never as a
``[rows, positions, vocab]`` logits tensor.

A real vocabulary (Qwen2.5's 151,936) makes the full logits the largest tensor of a step: four
bytes per position and vocabulary entry, several copies alive at once in the logprob, the
entropy and their backward. Here only the positions whose next token is trained (loss mask 1)
reach the output layer, ``chunk_rows`` of them at a time; the backward recomputes a chunk's
logits from its hidden states instead of keeping them, so the head's memory is a few chunks of
``chunk_rows x vocab`` whatever the batch holds.

:func:`install` gives a model's output layer (``lm_head``, same parameter, same name: state
dicts, checkpoints and weight tying are unchanged) a forward that reads the request of the
innermost :func:`scoring` context: inside one it returns ``[rows, positions, 2]`` (logprob,
entropy; 0 where not requested) in float32, outside it returns plain logits. The model's own
forward, FSDP's hooks around it and its mixed precision are untouched: the head runs inside the
root module's forward like the linear layer it replaces.

The arithmetic of a chunk is that of :func:`rlorch.trainer.loss.token_logprobs` and
:func:`rlorch.trainer.loss.token_entropy` on the same rows (float32 logits, divided by the
sampling temperature, logsumexp / log-softmax), so the results agree with the full computation
(tested within 1e-6, gradients within 1e-5).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_ROWS = 1024
"""Rows of logits alive at once: 1024 x 151,936 float32 is 0.6 GiB a copy."""


@dataclass(frozen=True)
class ScoreRequest:
    """What one forward of the model should score.

    ``rows`` and ``positions`` (1-D, same length) index the trained tokens of the
    ``[rows, positions]`` input: token ``(r, t)`` is scored under the hidden state of position
    ``t - 1`` of row ``r`` (so ``t >= 1``); ``targets`` holds their token ids."""

    rows: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    temperature: float = 1.0
    """The sampling temperature the engines drew at (0: greedy, scored unscaled)."""
    entropy: bool = False
    """Also the entropy of each scored position's distribution (a pass over the vocabulary)."""
    chunk_rows: int = DEFAULT_CHUNK_ROWS


_REQUEST: contextvars.ContextVar[Optional[ScoreRequest]] = contextvars.ContextVar("rlorch_score_request",
                                                                                  default=None)


@contextlib.contextmanager
def scoring(request: ScoreRequest) -> Iterator[None]:
    """Forwards of a model with :func:`install`'s head inside this block return the scores of
    ``request`` in place of logits."""
    token = _REQUEST.set(request)
    try:
        yield
    finally:
        _REQUEST.reset(token)


def request_for(mask: torch.Tensor, tokens: torch.Tensor, *, temperature: float, entropy: bool,
                chunk_rows: int = DEFAULT_CHUNK_ROWS, device=None) -> ScoreRequest:
    """The request scoring every position of ``mask`` (``[rows, positions]``, nonzero = trained),
    its indices on ``device`` (default: the mask's)."""
    rows, positions = torch.nonzero(mask, as_tuple=True)
    targets = tokens[rows, positions]
    if device is not None:
        rows, positions, targets = rows.to(device), positions.to(device), targets.to(device)
    return ScoreRequest(rows, positions, targets, temperature, entropy, chunk_rows)


def output_layer(model) -> torch.nn.Module:
    """The layer that maps hidden states to logits (``lm_head``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear output layer (lm_head) to score tokens with")
    return head


def install(model) -> torch.nn.Module:
    """Give ``model``'s output layer the scoring forward (in place; returns ``model``)."""
    head = output_layer(model)
    head.forward = types.MethodType(_head_forward, head)
    return model


def _head_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    request = _REQUEST.get()
    if request is None:
        return F.linear(hidden, self.weight, self.bias)
    return token_scores(hidden, self.weight, self.bias, request)


def token_scores(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 request: ScoreRequest) -> torch.Tensor:
    """``[rows, positions, 2]`` float32: (logprob, entropy) of each requested token, 0 elsewhere."""
    picked = hidden[request.rows, request.positions - 1]
    logp, entropy = _ChunkedScores.apply(picked, weight, bias, request.targets, request.temperature,
                                         request.chunk_rows, request.entropy)
    out = hidden.new_zeros((*hidden.shape[:2], 2), dtype=torch.float32)
    return out.index_put((request.rows, request.positions), torch.stack([logp, entropy], dim=-1))


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
           temperature: float, entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs of ``targets`` (and entropies) of one chunk of rows, as token_logprobs and
    token_entropy compute them (dividing by 1.0 is exact, so it is skipped)."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not entropy:
        return logp, None
    log_softmax = torch.log_softmax(logits, dim=-1)
    return logp, -(log_softmax.exp() * log_softmax).sum(-1)


class _ChunkedScores(torch.autograd.Function):
    """Head, logprob and entropy over row chunks; the backward recomputes each chunk's logits
    (nothing of size ``rows x vocab`` is kept between forward and backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, entropy):
        ctx.set_materialize_grads(False)
        count = hidden.shape[0]
        logp = torch.zeros(count, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(count, dtype=torch.float32, device=hidden.device)
        for start in range(0, count, chunk_rows):
            stop = min(start + chunk_rows, count)
            chunk_logp, chunk_ent = _chunk(hidden[start:stop], weight, bias, targets[start:stop], temperature, entropy)
            logp[start:stop] = chunk_logp
            if chunk_ent is not None:
                ent[start:stop] = chunk_ent
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.settings = (temperature, chunk_rows, entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk_rows, entropy = ctx.settings
        with_entropy = entropy and grad_ent is not None
        # Gradients for every input that asks for one, zeros included: each rank's collectives
        # (FSDP's reduce-scatter) must see the same parameters whether or not it trained a token.
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        wanted = [grad is not None for grad in (grad_hidden, grad_weight, grad_bias)]
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            with torch.enable_grad():
                inputs = [hidden[start:stop].detach().requires_grad_(wanted[0]),
                          weight.detach().requires_grad_(wanted[1]),
                          None if bias is None else bias.detach().requires_grad_(wanted[2])]
                chunk_logp, chunk_ent = _chunk(*inputs, targets[start:stop], temperature, with_entropy)
                outputs, grads = [], []
                if grad_logp is not None:
                    outputs.append(chunk_logp)
                    grads.append(grad_logp[start:stop])
                if with_entropy:
                    outputs.append(chunk_ent)
                    grads.append(grad_ent[start:stop])
                asked = [tensor for tensor, want in zip(inputs, wanted) if want]
                if not outputs or not asked:
                    continue
                found = iter(torch.autograd.grad(outputs, asked, grads))
            if wanted[0]:
                grad_hidden[start:stop] = next(found)
            if wanted[1]:
                grad_weight += next(found)
            if wanted[2]:
                grad_bias += next(found)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
