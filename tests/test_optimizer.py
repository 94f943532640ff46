"""The trainer's AdamW on plain tensors and its single-rank checkpoint state: torch's own, bit for
bit, without importing torch's compiler."""

from __future__ import annotations

import pytest
import torch

from rlorch.config.compose import compose
from rlorch.trainer.optimizer import FusedAdamW, make_optimizer

INPUTS = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _train(model, optimizer, steps: range) -> None:
    """Steps ``steps`` of one run: the learning rate changes per step (as the schedule sets it)
    and, on step 2, a parameter has no gradient (it keeps its weights and moments)."""
    for index in steps:
        model(INPUTS[index]).pow(2).mean().backward()
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (index + 1)
        if index == 2:
            model[1].bias.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


ALL_STEPS, FIRST_HALF, SECOND_HALF = range(6), range(3), range(3, 6)


def _torchs(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _ours(model) -> FusedAdamW:
    return FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _assert_same(model_a, optimizer_a, model_b, optimizer_b) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    state_a, state_b = optimizer_a.state_dict(), optimizer_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys() and state_a["state"]
    for index, moments in state_b["state"].items():
        assert moments.keys() == state_a["state"][index].keys()
        for key, tensor in moments.items():
            mine = state_a["state"][index][key]
            assert mine.dtype == tensor.dtype and mine.device == tensor.device and torch.equal(mine, tensor), (index, key)


def test_updates_and_state_are_torchs_fused_adamw_bit_for_bit():
    ours, torchs = _model(), _model()
    optimizer, reference = _ours(ours), _torchs(torchs)
    _train(ours, optimizer, ALL_STEPS)
    _train(torchs, reference, ALL_STEPS)
    _assert_same(ours, optimizer, torchs, reference)
    assert not torch.equal(ours[0].weight, _model()[0].weight)


def test_a_state_saved_by_either_optimizer_resumes_in_the_other():
    """A checkpoint written by torch's AdamW (every run's before this optimizer) resumes in this
    one, and the other way round: both go on exactly as an uninterrupted run of torch's."""
    uninterrupted = _model()
    reference = _torchs(uninterrupted)
    _train(uninterrupted, reference, ALL_STEPS)
    for first, second in ((_torchs, _ours), (_ours, _torchs)):
        before = _model()
        saved = first(before)
        _train(before, saved, FIRST_HALF)
        after = _model()
        after.load_state_dict(before.state_dict())
        resumed = second(after)
        resumed.load_state_dict(saved.state_dict())
        _train(after, resumed, SECOND_HALF)
        _assert_same(after, resumed, uninterrupted, reference)


def test_sharded_parameters_get_torchs_adamw():
    model = _model()
    assert type(make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0, sharded=True)) is torch.optim.AdamW
    assert type(make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0, sharded=False)) is FusedAdamW


@pytest.mark.parametrize("wrap", ["plain", "activation_checkpointing", "lora"])
def test_a_single_rank_checkpoints_state_is_dcps_own_without_its_lookups(model_dir, wrap):
    """The single-rank checkpoint's state dicts, built without DCP's lookups (which import
    torch's compiler), equal ``get_state_dict``'s: rlorch's own model, with its layers wrapped
    for activation checkpointing, and with LoRA adapters (the trainable ones alone)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from rlorch.trainer import checkpoint
    from rlorch.trainer.fsdp import build_model

    overrides = {"lora": ["model.lora.rank=4"], "activation_checkpointing": ["trainer.activation_checkpointing=true"],
                 "plain": []}[wrap]
    model = build_model(compose([f"model.path={model_dir}", *overrides]), model_dir, torch.device("cpu"), 1)
    optimizer = make_optimizer((p for p in model.parameters() if p.requires_grad), lr=1e-3, weight_decay=0.0,
                               sharded=False)
    assert checkpoint.plain_state_dicts(model, optimizer) is None  # no optimizer state yet: DCP makes it
    model(torch.tensor([[1, 13, 14, 15]])).logits.sum().backward()
    optimizer.step()
    assert checkpoint.plain_state_dicts(model, optimizer) is not None
    trainable_only = wrap == "lora"
    model_state, optim_state = checkpoint._state(model, optimizer, trainable_only)
    expected_model, expected_optim = get_state_dict(model, optimizer,
                                                    options=StateDictOptions(ignore_frozen_params=trainable_only))
    if trainable_only:
        trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
        expected_model = {name: value for name, value in expected_model.items() if name in trained}
    assert list(model_state) == list(expected_model) and model_state
    assert all(torch.equal(model_state[name], expected_model[name]) for name in expected_model)
    assert optim_state["param_groups"] == expected_optim["param_groups"]
    assert list(optim_state["state"]) == list(expected_optim["state"]) and optim_state["state"]
    for name, moments in expected_optim["state"].items():
        assert moments.keys() == optim_state["state"][name].keys()
        assert all(torch.equal(optim_state["state"][name][key], value) for key, value in moments.items())
