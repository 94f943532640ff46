"""Activation checkpointing recomputes each decoder layer in the backward pass and changes
neither the loss nor the gradients."""

from __future__ import annotations

import pytest
import torch

from rlorch.config.schema import Correction
from rlorch.trainer.loss import policy_loss, token_logprobs


def _loss_and_grads(checkpointed: bool):
    from transformers import AutoModelForCausalLM

    from rlorch.model import ensure_default_model
    from rlorch.trainer.fsdp import _decoder_layers, checkpoint_activations

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    if checkpointed:
        checkpoint_activations(model)
    model.train()
    calls = []
    for layer in _decoder_layers(model):  # counted inside: the recomputation runs no module hooks
        def counted(*args, _forward=layer.mlp.forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)

        layer.mlp.forward = counted
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (3, 12), generator=generator)
    mask = torch.ones(3, 12)
    mask[:, :4] = 0
    logp = token_logprobs(model(input_ids=tokens).logits, tokens)
    forwards = len(calls)
    loss, _ = policy_loss(logp, logp.detach() - 0.1, mask, torch.tensor([1.0, -0.5, 0.25]),
                          correction=Correction.tis, clip_eps=0.2, is_cap=2.0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, forwards, len(calls) - forwards, model


def test_checkpointed_layers_are_recomputed_and_give_the_same_loss_and_gradients():
    loss, grads, forwards, recomputed, _ = _loss_and_grads(False)
    ac_loss, ac_grads, ac_forwards, ac_recomputed, model = _loss_and_grads(True)
    assert recomputed == 0 and ac_recomputed == ac_forwards == forwards > 0
    assert ac_loss == pytest.approx(loss, abs=1e-5)
    assert ac_grads.keys() == grads.keys()
    for name in grads:
        assert torch.allclose(ac_grads[name], grads[name], atol=1e-5), name
    assert all("checkpoint" not in key for key in model.state_dict())
    with torch.no_grad():
        before = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert before.shape[-1] == model.config.vocab_size


def test_a_model_without_decoder_layers_is_refused_naming_the_key():
    from rlorch.trainer.fsdp import checkpoint_activations

    with pytest.raises(ValueError, match="trainer.activation_checkpointing"):
        checkpoint_activations(torch.nn.Linear(2, 2))
