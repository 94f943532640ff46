"""AdamW on one rank's plain tensors without importing torch's compiler.

``torch.optim.AdamW`` sends ``add_param_group``, ``zero_grad``, ``state_dict``,
``load_state_dict`` and ``step`` (and its functional update) through wrappers whose first call
imports ``torch._dynamo``: 1.4 s of CPU on a 2-core machine, spent on the trainer's way to its
first step. The trainer never compiles, so there is nothing for those wrappers to keep from the
compiler. :class:`FusedAdamW` calls the functions they wrap and updates through
``torch._fused_adamw_``, the kernel ``AdamW(fused=True)`` calls. Its updates are that
optimizer's bit for bit, and so is its state: a checkpoint written by either loads into the
other (tests/test_optimizer.py).

Sharded (DTensor) parameters keep ``torch.optim.AdamW``: :func:`make_optimizer` chooses.
"""

from __future__ import annotations

import torch


def _unwrapped(method):
    """The function a ``functools.wraps`` wrapper wraps (the method itself if it wraps nothing)."""
    return getattr(method, "__wrapped__", method)


_ADD_PARAM_GROUP = _unwrapped(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = _unwrapped(torch.optim.Optimizer.zero_grad)
_STATE_DICT = _unwrapped(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = _unwrapped(torch.optim.Optimizer.load_state_dict)


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` for float32 tensors on one device (CPU or CUDA), with
    neither AMSGrad nor a closure."""

    def __init__(self, params, *, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    def add_param_group(self, param_group: dict) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def state_dict(self):
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict) -> None:
        _LOAD_STATE_DICT(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FusedAdamW.step takes no closure")
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # the layout AdamW(fused=True) gives its state
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                params.append(param)
                grads.append(param.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                grad_scale=None, found_inf=None)
        return None


def make_optimizer(parameters, *, lr: float, weight_decay: float, sharded: bool) -> torch.optim.Optimizer:
    """The trainer's AdamW: :class:`FusedAdamW` for plain tensors (one float32 rank: one fused
    call per step instead of a dozen small ops per parameter, and no compiler import), torch's
    own foreach implementation for DTensor shards."""
    parameters = list(parameters)
    if sharded:
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    return FusedAdamW(parameters, lr=lr, weight_decay=weight_decay)
