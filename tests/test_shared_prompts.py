"""Shared prompts (rlorch.trainer.prefix): each distinct prompt of a micro-batch runs through the
model once, with the scores and gradients of the padded micro-batch."""

from __future__ import annotations

import random

import pytest
import torch

from rlorch.config.schema import Correction
from rlorch.trainer import head
from rlorch.trainer.batch import Sequence, packed, padded
from rlorch.trainer.fsdp import accepts_packing, scores
from rlorch.trainer.loss import aggregate, policy_loss
from rlorch.trainer.prefix import layout


def _grouped(vocab: int, seed: int = 0) -> list[Sequence]:
    """Three prompts of different lengths sampled three times each with completions of 1-6
    tokens, a multi-turn sequence (trained, then an untrained reply, then trained again) sharing
    the first prompt, and one with nothing trained."""
    generator = random.Random(seed)

    def tokens(count):
        return [generator.randrange(4, vocab) for _ in range(count)]

    out = []
    for prompt_length in (3, 5, 4):
        prompt = tokens(prompt_length)
        for _ in range(3):
            completion = tokens(generator.randint(1, 6))
            out.append(Sequence(prompt + completion, [0] * prompt_length + [1] * len(completion),
                                [-1.5] * (prompt_length + len(completion)), generator.uniform(-1, 1), 0.0))
    first = out[0].tokens[:3]
    out.append(Sequence(first + tokens(6), [0, 0, 0, 1, 1, 0, 0, 1, 1], [-1.0] * 9, 0.5, 0.0))
    out.append(Sequence(tokens(4), [0, 0, 0, 0], [0.0] * 4, 0.0, 0.0))
    return out


def _model():
    from rlorch.model import ensure_default_model
    from rlorch.qwen2 import Qwen2ForCausalLM

    return head.install(Qwen2ForCausalLM.from_pretrained(ensure_default_model()))


def test_each_prompt_is_laid_out_once_and_each_sequence_stops_before_its_last_trained_token():
    sequences = _grouped(40)
    micro = padded(sequences, 0)
    shared = layout(micro.tokens, micro.mask)
    assert shared is not None
    prompts = 3 + 5 + 4  # the multi-turn sequence shares the first prompt
    spans = sum(max(i for i, m in enumerate(s.loss_mask) if m) - s.loss_mask.index(1)
                for s in sequences if any(s.loss_mask))
    assert shared.positions == prompts + spans < micro.positions
    assert shared.gather.shape[0] == len(sequences) - 1  # the untrained sequence is left out
    assert len(shared.hidden_index) == int(micro.mask.sum())
    # Every laid-out position is read back from exactly one slot of a virtual row that holds it.
    flat_gather = shared.gather.flatten()
    assert torch.equal(flat_gather[shared.scatter], torch.arange(shared.positions))
    assert sorted(shared.scatter.tolist()) == sorted(set(shared.scatter.tolist()))
    # A packed micro-batch of the same sequences lays out the same row.
    packed_layout = packed(sequences, 0).shared_layout
    assert torch.equal(packed_layout.input_ids, shared.input_ids)
    assert torch.equal(packed_layout.hidden_index, shared.hidden_index)


def test_each_position_of_a_shared_row_sees_its_own_sequences_earlier_positions_only():
    prompt = [7, 8]
    sequences = [Sequence(prompt + [9, 10], [0, 0, 1, 1], [0.0] * 4, 1.0, 0.0),
                 Sequence(prompt + [11, 12, 13], [0, 0, 1, 1, 1], [0.0] * 5, 1.0, 0.0)]
    micro = padded(sequences, 0)
    shared = layout(micro.tokens, micro.mask)
    # The row: the prompt once (0, 1), the first sequence's span (2), the second's (3, 4).
    assert shared.input_ids.tolist() == [[7, 8, 9, 11, 12]]
    assert shared.lengths.tolist() == [3, 4]
    expected = [[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [1, 1, 0, 1, 0],
                [1, 1, 0, 1, 1]]
    assert shared.packing(torch.device("cpu")).visible().int().tolist() == expected


def test_no_layout_where_it_saves_too_little_or_a_token_at_position_0_is_trained():
    distinct = [Sequence([5 + i] + [6] * 11, [0] + [1] * 11, [0.0] * 12, 1.0, 0.0) for i in range(4)]
    micro = padded(distinct, 0)  # nothing shared; only the last token of each row is saved
    assert layout(micro.tokens, micro.mask) is None
    shorter = padded([Sequence(s.tokens[:4], s.loss_mask[:4], s.logprobs[:4], 1.0, 0.0) for s in distinct], 0)
    assert layout(shorter.tokens, shorter.mask).positions == 4 * 3  # a quarter saved
    first = [Sequence([5, 6, 7], [1, 1, 1], [0.0] * 3, 1.0, 0.0)] * 4
    micro = padded(first, 0)
    assert layout(micro.tokens, micro.mask) is None
    nothing = padded([Sequence([5, 6, 7], [0, 0, 0], [0.0] * 3, 0.0, 0.0)] * 4, 0)
    assert layout(nothing.tokens, nothing.mask) is None


def _loss(model, micro, share: bool):
    logp, entropy = scores(model, micro, temperature=1.2, chunk_rows=4, device=torch.device("cpu"), entropy=True,
                           share_prompts=share)
    tokens = float(micro.mask.sum())
    loss, _ = policy_loss(logp, micro.behaviour, micro.mask, micro.advantages, correction=Correction.decoupled,
                          clip_eps=0.2, is_cap=2.0, prox=logp.detach() - 0.01, normalizer=tokens,
                          sequences=micro.sequences, segments=micro.segments)
    return logp, entropy, loss - 0.05 * aggregate(entropy, micro.mask, tokens=tokens, sequences=micro.sequences,
                                                   segments=micro.segments)


@pytest.mark.parametrize("attention", ["masked", "gathered"])
@pytest.mark.parametrize("build", [padded, packed])
def test_the_shared_layout_gives_the_micro_batchs_logprobs_entropies_and_gradients(build, attention, monkeypatch):
    from rlorch import qwen2

    # The row is short enough to attend in place; with no row that short, it is gathered.
    monkeypatch.setattr(qwen2, "DENSE_ROW_POSITIONS", qwen2.DENSE_ROW_POSITIONS if attention == "masked" else 0)
    model = _model()
    assert accepts_packing(model)
    micro = build(_grouped(model.config.vocab_size), 0)
    assert micro.shared_layout is not None
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy, loss = _loss(model, micro, share)
        loss.backward()
        results.append((logp.detach(), entropy.detach(), loss.item(),
                        {name: p.grad.clone() for name, p in model.named_parameters()}))
    (logp, entropy, loss, grads), (shared_logp, shared_entropy, shared_loss, shared_grads) = results
    assert logp.shape == shared_logp.shape == micro.mask.shape
    assert not shared_logp[micro.mask == 0].any()  # untrained positions stay 0
    torch.testing.assert_close(shared_logp, logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_entropy, entropy, rtol=1e-5, atol=1e-5)
    assert shared_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_without_a_packing_argument_runs_the_micro_batch_as_it_is():
    from transformers import AutoModelForCausalLM

    from rlorch.model import ensure_default_model

    model = head.install(AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32))
    assert not accepts_packing(model)
    micro = padded(_grouped(model.config.vocab_size), 0)
    with torch.no_grad():
        torch.testing.assert_close(_loss(model, micro, True)[0], _loss(model, micro, False)[0], rtol=0, atol=0)
