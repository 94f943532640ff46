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

DEFAULT_CHUNK_ROWS = 256
"""Rows of logits alive at once: 256 x 151,936 float32 is 0.15 GiB a copy."""


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
    hidden_index: Optional[torch.Tensor] = None
    """Where the input is laid out otherwise (:mod:`rlorch.trainer.prefix`): for each token, the
    position in the flattened input whose hidden state scores it. None: ``(row, position - 1)``."""
    shape: Optional[tuple[int, int]] = None
    """The ``[rows, positions]`` the tokens index, where the input has another shape."""


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
                chunk_rows: int = DEFAULT_CHUNK_ROWS, device=None,
                hidden_index: Optional[torch.Tensor] = None) -> ScoreRequest:
    """The request scoring every position of ``mask`` (``[rows, positions]``, nonzero = trained),
    its indices on ``device`` (default: the mask's); ``hidden_index`` (in ``torch.nonzero(mask)``
    order) where the model's input is laid out otherwise."""
    rows, positions = torch.nonzero(mask, as_tuple=True)
    targets = tokens[rows, positions]
    if device is not None:
        rows, positions, targets = rows.to(device), positions.to(device), targets.to(device)
        hidden_index = None if hidden_index is None else hidden_index.to(device)
    shape = None if hidden_index is None else tuple(mask.shape)
    return ScoreRequest(rows, positions, targets, temperature, entropy, chunk_rows, hidden_index, shape)


def output_layer(model) -> torch.nn.Module:
    """The layer that maps hidden states to logits (``lm_head``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear output layer (lm_head) to score tokens with")
    return head


def install(model) -> torch.nn.Module:
    """Give ``model``'s output layer the scoring forward (in place; returns ``model``).

    An input embedding tied to the output layer (one weight, as Qwen2.5 up to 3B has) then
    gives a sparse gradient (the rows of the tokens looked up), where a dense one would put a
    second vocabulary-sized gradient beside the weight's own for the length of the backward.
    The output layer's dense gradient always reaches the shared weight first (it is computed
    last in the forward, so first in the backward; with nothing trained its gradient is zeros,
    never absent), so the sparse rows are added into a dense gradient in place."""
    head = output_layer(model)
    head.forward = types.MethodType(_head_forward, head)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(embedding, torch.nn.Embedding) and embedding.weight is head.weight:
        embedding.sparse = True
    return model


def _head_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    request = _REQUEST.get()
    if request is None:
        return F.linear(hidden, self.weight, self.bias)
    return token_scores(hidden, self.weight, self.bias, request)


def token_scores(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 request: ScoreRequest) -> torch.Tensor:
    """``[rows, positions, 2]`` float32: (logprob, entropy) of each requested token, 0 elsewhere."""
    if request.hidden_index is None:
        picked = hidden[request.rows, request.positions - 1]
    else:
        picked = hidden.reshape(-1, hidden.shape[-1])[request.hidden_index]
    logp, entropy = _ChunkedScores.apply(picked, weight, bias, request.targets, request.temperature,
                                         request.chunk_rows, request.entropy)
    out = hidden.new_zeros((*(request.shape or hidden.shape[:2]), 2), dtype=torch.float32)
    return out.index_put((request.rows, request.positions), torch.stack([logp, entropy], dim=-1))


def _shifted_logits(hidden, weight, bias, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's logits (float32, divided by the sampling temperature) less each row's maximum,
    and their ``exp`` (a second buffer)."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature > 0 and temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(logits.amax(dim=-1, keepdim=True))
    return logits, logits.exp()


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
           temperature: float, entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs of ``targets`` (and entropies) of one chunk of rows, in the arithmetic of
    token_logprobs and token_entropy (the same values for the same logits), holding at most
    three ``rows x vocab`` buffers at once."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature > 0 and temperature != 1.0:
        logits.div_(temperature)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not entropy:
        return logp, None
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits
    return logp, -log_probs.exp().mul_(log_probs).sum(-1)


class _ChunkedScores(torch.autograd.Function):
    """Head, logprob and entropy over row chunks; the backward recomputes each chunk's logits
    and writes their gradient in place of them (nothing of size ``rows x vocab`` is kept between
    forward and backward, and at most three such buffers exist at once: two in the backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, entropy):
        ctx.set_materialize_grads(False)
        count = hidden.shape[0]
        logp = torch.zeros(count, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(count, dtype=torch.float32, device=hidden.device)
        for start, stop in _chunks(count, chunk_rows):
            chunk_logp, chunk_ent = _chunk(hidden[start:stop], weight, bias, targets[start:stop], temperature, entropy)
            logp[start:stop] = chunk_logp
            if chunk_ent is not None:
                ent[start:stop] = chunk_ent
        ctx.save_for_backward(hidden, weight, bias, targets, ent)
        ctx.settings = (temperature, chunk_rows, entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        temperature, chunk_rows, entropy = ctx.settings
        grad_ent = grad_ent if entropy else None
        # Gradients for every input that asks for one, zeros included: each rank's collectives
        # (FSDP's reduce-scatter) must see the same parameters whether or not it trained a token.
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (torch.zeros_like(bias, dtype=torch.float32)
                     if bias is not None and ctx.needs_input_grad[2] else None)
        if grad_logp is not None or grad_ent is not None:
            for start, stop in _chunks(hidden.shape[0], chunk_rows):
                rows = hidden[start:stop]
                grad_logits = _logits_grad(rows, weight, bias, targets[start:stop], temperature,
                                           None if grad_logp is None else grad_logp[start:stop],
                                           None if grad_ent is None else (grad_ent[start:stop], ent[start:stop]))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:stop] = _rows_times(grad_logits, weight)
                if grad_weight is not None:
                    _add_product(grad_weight, grad_logits.t(), rows)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _logits_grad(hidden, weight, bias, targets, temperature, grad_logp, grad_entropy) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk (float32), given the loss's gradients with respect to the
    chunk's logprobs and (``(gradient, entropy)``) entropies. With ``q = softmax(z)``:
    ``dlog q_t/dz = onehot(t) - q`` and ``dH/dz = -q (log q + H)``; the chain through the
    temperature divides by it."""
    shifted, probs = _shifted_logits(hidden, weight, bias, temperature)
    total = probs.sum(dim=-1, keepdim=True)
    probs.div_(total)
    if grad_entropy is not None:
        gradient, entropy = grad_entropy
        # shifted - log(total) is log q: the buffer becomes -g_H q (log q + H).
        out = shifted.sub_(total.log()).add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-gradient.unsqueeze(-1))
        if grad_logp is not None:
            out.sub_(probs.mul_(grad_logp.unsqueeze(-1)))
    else:
        del shifted
        out = probs.mul_(-grad_logp.unsqueeze(-1))
    if grad_logp is not None:
        out.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if temperature > 0 and temperature != 1.0:
        out.div_(temperature)
    return out


def _chunks(count: int, most: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of near-equal chunks of at most ``most`` rows covering ``count`` rows
    (no short last chunk: see :func:`_rows_times`)."""
    parts = max(1, -(-count // most))
    bounds = [round(index * count / parts) for index in range(parts + 1)]
    return [(bounds[index], bounds[index + 1]) for index in range(parts) if bounds[index + 1] > bounds[index]]


MIN_GEMM_ROWS = 16
"""Rows below which a CPU BLAS multiplies a matrix by a 150k-long dimension with a kernel that
accumulates about ten times less accurately (measured: 1e-5 against 1e-6 relative)."""


def _rows_times(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix``, a short chunk padded with zero rows to :data:`MIN_GEMM_ROWS`."""
    count = rows.shape[0]
    if count >= MIN_GEMM_ROWS:
        return rows @ matrix
    return (F.pad(rows, (0, 0, 0, MIN_GEMM_ROWS - count)) @ matrix)[:count]


def _add_product(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``accumulator += left @ right`` (float32), in place when the operands are float32 too."""
    if left.dtype == accumulator.dtype and right.dtype == accumulator.dtype:
        accumulator.addmm_(left, right)
    else:
        accumulator += left @ right
