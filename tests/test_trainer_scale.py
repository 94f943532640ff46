"""The trainer at a real model's scale, checked on the CPU: the output layer scored in chunks over
trained positions only equals the full logits' computation (values and gradients), packed
micro-batches equal padded ones, token budgets are balanced across ranks, and one float32 rank
is placed on its device."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlorch.config.schema import Correction, KlEstimator, LossAgg
from rlorch.trainer import head
from rlorch.trainer.batch import Sequence, packed, padded, plan_by_count, plan_by_tokens
from rlorch.trainer.loss import aggregate, policy_loss, reference_kl, token_entropy, token_logprobs

VOCAB = 151_936
"""Qwen2.5's vocabulary: the chunked head is checked at the width it exists for."""


def _hidden_and_head(rows: int, length: int, width: int = 16, vocab: int = VOCAB, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, width, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) * 0.5).requires_grad_()
    tokens = torch.randint(0, vocab, (rows, length), generator=generator)
    mask = (torch.rand(rows, length, generator=generator) > 0.3).float()
    mask[:, 0] = 0
    return hidden, weight, tokens, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_entropy_and_kl_equal_the_full_logits(temperature):
    hidden, weight, tokens, mask = _hidden_and_head(2, 24)
    logits = hidden @ weight.T
    full_logp, full_entropy = token_logprobs(logits, tokens, temperature), token_entropy(logits, temperature)
    request = head.request_for(mask, tokens, temperature=temperature, entropy=True, chunk_rows=5)
    out = head.token_scores(hidden, weight, None, request)
    logp, entropy = out[..., 0], out[..., 1]
    on = mask.bool()
    torch.testing.assert_close(logp[on], full_logp[on], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy[on], full_entropy[on], rtol=1e-6, atol=1e-6)
    assert not logp[~on].any() and not entropy[~on].any()  # nothing computed off the mask
    # KL to a reference (another head) from chunked logprobs equals the full one's, within the
    # rounding of a difference of two logprobs near -12 (a float32 ulp there is 1e-6).
    other = weight.detach() * 0.9
    ref_full = token_logprobs(hidden @ other.T, tokens, temperature)
    ref_chunked = head.token_scores(hidden, other, None, head.request_for(mask, tokens, temperature=temperature,
                                                                          entropy=False, chunk_rows=5))[..., 0]
    for estimator in KlEstimator:
        torch.testing.assert_close(reference_kl(logp, ref_chunked, estimator)[on],
                                   reference_kl(full_logp, ref_full, estimator)[on], rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_the_full_logits_gradients():
    hidden, weight, tokens, mask = _hidden_and_head(3, 20, vocab=4096)
    behaviour = torch.full((3, 20), -3.0)
    advantages = torch.tensor([1.0, -0.5, 0.25])

    def loss_of(logp, entropy):
        loss, _ = policy_loss(logp, behaviour, mask, advantages, correction=Correction.tis, clip_eps=0.2, is_cap=2.0)
        return loss - 0.05 * aggregate(entropy, mask)

    logits = hidden @ weight.T
    full = torch.autograd.grad(loss_of(token_logprobs(logits, tokens), token_entropy(logits)), [hidden, weight])
    for chunk_rows in (1, 7, 1000):
        out = head.token_scores(hidden, weight, None,
                                head.request_for(mask, tokens, temperature=1.0, entropy=True, chunk_rows=chunk_rows))
        chunked = torch.autograd.grad(loss_of(out[..., 0], out[..., 1]), [hidden, weight])
        for got, expected in zip(chunked, full):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_step_with_nothing_trained_still_gives_every_parameter_a_gradient():
    """A filler micro-batch (a rank short of data) trains nothing, but its backward must reach
    the output layer like any other rank's: FSDP reduces every parameter's gradient on every rank."""
    hidden, weight, tokens, _ = _hidden_and_head(1, 4, vocab=64)
    nothing = torch.zeros(1, 4)
    out = head.token_scores(hidden, weight, None, head.request_for(nothing, tokens, temperature=1.0, entropy=True))
    (out.sum() * 0).backward()
    assert weight.grad is not None and not weight.grad.any() and hidden.grad is not None


def _tiny(implementation: str):
    from transformers import AutoModelForCausalLM

    from rlorch.model import ensure_default_model
    from rlorch.qwen2 import Qwen2ForCausalLM

    path = ensure_default_model()
    model = (Qwen2ForCausalLM.from_pretrained(path) if implementation == "native"
             else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa"))
    return head.install(model)


def _sequences(vocab: int, lengths=(5, 11, 3, 8)) -> list[Sequence]:
    generator = random.Random(0)
    out = []
    for index, length in enumerate(lengths):
        prompt = max(1, length // 3)
        out.append(Sequence([generator.randrange(4, vocab) for _ in range(length)],
                            [0] * prompt + [1] * (length - prompt), [-2.0] * length, (-1.0) ** index * (index + 1) / 4,
                            0.0))
    return out


def _micro_loss(model, micro, agg):
    from rlorch.trainer.fsdp import scores

    logp, entropy = scores(model, micro, temperature=1.0, chunk_rows=4, device=torch.device("cpu"), entropy=True)
    loss, _ = policy_loss(logp, micro.behaviour, micro.mask, micro.advantages, correction=Correction.tis,
                          clip_eps=0.2, is_cap=2.0, agg=agg, normalizer=float(micro.mask.sum()), sequences=4,
                          segments=micro.segments)
    return logp, loss - 0.05 * aggregate(entropy, micro.mask, agg, tokens=float(micro.mask.sum()), sequences=4,
                                          segments=micro.segments)


@pytest.mark.parametrize("implementation", ["native", "native-gathered", "hf"])
@pytest.mark.parametrize("agg", list(LossAgg))
def test_a_packed_micro_batch_gives_the_padded_ones_logprobs_loss_and_gradients(implementation, agg, monkeypatch):
    if implementation == "native-gathered":  # a row too long to attend in place
        from rlorch import qwen2

        monkeypatch.setattr(qwen2, "DENSE_ROW_POSITIONS", 0)
    model = _tiny(implementation.split("-")[0])
    sequences = _sequences(model.config.vocab_size)
    results = {}
    for name, micro in (("padded", padded(sequences, 0)), ("packed", packed(sequences, 0))):
        model.zero_grad(set_to_none=True)
        logp, loss = _micro_loss(model, micro, agg)
        loss.backward()
        trained = logp[micro.mask.bool()]
        results[name] = trained.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (padded_logp, padded_loss, padded_grads), (packed_logp, packed_loss, packed_grads) = results.values()
    assert packed_logp.shape == padded_logp.shape == (sum(sum(s.loss_mask) for s in sequences),)
    torch.testing.assert_close(packed_logp, padded_logp, rtol=1e-5, atol=1e-5)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_rows_hold_each_sequence_once_with_positions_restarting():
    sequences = _sequences(40)
    micro = packed(sequences, pad_id=0)
    assert micro.tokens.shape == (1, sum(len(s.tokens) for s in sequences)) and micro.sequences == 4
    positions = micro.position_ids()[0].tolist()
    starts = [index for index, position in enumerate(positions) if position == 0]
    assert starts == [0, 5, 16, 19] and micro.segments[0, starts].tolist() == [0, 1, 2, 3]
    assert micro.advantages[0, 5:16].unique().tolist() == [sequences[1].advantage]
    filler = packed([], pad_id=0)
    assert filler.sequences == 0 and not filler.mask.any()


def _lognormal_lengths(count: int, cap: int, seed: int = 0) -> list[int]:
    generator = random.Random(seed)
    prompts = [generator.randint(100, 300) for _ in range(count // 8)]
    return [prompts[index // 8] + min(cap, max(1, round(generator.lognormvariate(math.log(400), 1.0))))
            for index in range(count)]


@pytest.mark.parametrize("cap", [512, 4096])
def test_token_budgets_take_every_sequence_once_fill_no_pass_past_the_budget_and_keep_ranks_in_step(cap):
    lengths, ranks, budget = _lognormal_lengths(512, cap), 4, 16_384
    plans = plan_by_tokens(lengths, ranks, budget)
    assert len({len(plan) for plan in plans}) == 1  # every rank runs as many passes
    members = sorted(index for plan in plans for micro in plan for index in micro)
    assert members == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in micro) <= budget for plan in plans for micro in plan)
    lockstep = sum(max(sum(lengths[i] for i in plans[rank][step]) for rank in range(ranks))
                   for step in range(len(plans[0])))
    assert ranks * lockstep / sum(lengths) <= 1.05
    # The padded count-based split of the same batch does far more work than its real tokens.
    counted = plan_by_count(len(lengths), ranks, 8)
    padded_lockstep = sum(max(len(plans_step) * max((lengths[i] for i in plans_step), default=0)
                              for plans_step in (counted[rank][step] for rank in range(ranks)))
                          for step in range(len(counted[0])))
    assert ranks * padded_lockstep / sum(lengths) > 1.3


def test_a_sequence_longer_than_the_budget_gets_a_pass_of_its_own():
    plans = plan_by_tokens([50, 3, 4, 5], 1, 10)
    assert [0] in plans[0] and all(sum([50, 3, 4, 5][i] for i in micro) <= 10 for micro in plans[0] if micro != [0])


def test_count_based_micro_batches_stride_the_ranks_and_fill_the_short_one():
    assert plan_by_count(5, 2, 2) == [[[0, 2], [4]], [[1, 3], []]]


def test_one_float32_rank_is_moved_to_its_device_and_fsdp_is_not_used():
    """One float32 rank is a plain module: nothing else moves it to the GPU, so placing it does
    (the meta device stands in for CUDA here; scripts/check_gpu_scale.sh runs it on a GPU)."""
    from rlorch.trainer.fsdp import place, uses_fsdp

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    placed = place(model, torch.device("meta"), "float32", world=1)
    assert not uses_fsdp(1, "float32") and all(p.device.type == "meta" for p in placed.parameters())


def test_the_output_layer_outside_a_scoring_block_gives_plain_logits_and_the_state_dict_is_unchanged():
    model = _tiny("native")
    names = set(model.state_dict())
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert set(model.state_dict()) == names and model.tied and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("implementation", ["native", "hf"])
def test_a_tied_embedding_adds_its_rows_into_the_output_layers_dense_gradient(implementation):
    """The tied input embedding's gradient comes sparse (no second vocabulary-sized buffer) and
    lands in the output layer's dense gradient: the sum equals the all-dense gradient, with
    nothing trained and with tokens trained."""
    grads = {}
    for sparse in (False, True):
        model = _tiny(implementation)
        embedding = model.get_input_embeddings() if implementation == "hf" else model.model.embed_tokens
        assert embedding.sparse and embedding.weight is head.output_layer(model).weight
        embedding.sparse = sparse
        for trained in (True, False):
            micro = padded(_sequences(model.config.vocab_size), 0)
            if not trained:
                micro.mask.zero_()
            model.zero_grad(set_to_none=True)
            _, loss = _micro_loss(model, micro, LossAgg.token_mean)
            loss.backward()
            grads[sparse, trained] = embedding.weight.grad
    for trained in (True, False):
        assert not grads[True, trained].is_sparse
        torch.testing.assert_close(grads[True, trained], grads[False, trained], rtol=1e-6, atol=1e-7)


def test_a_sharded_version_streamed_tensor_by_tensor_equals_the_whole_state_dict_written_at_once(one_rank, tmp_path):
    """bf16 makes the model FSDP2 units even on one rank: its versions are gathered, cast and
    written one tensor at a time. The files hold the tensors the whole gathered state dict
    holds, bit for bit; cut into shards, they load as one model in rlorch's Qwen2 and in
    transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlorch.config.compose import compose
    from rlorch.qwen2 import Qwen2ForCausalLM
    from rlorch.rundir.layout import RunDir, save_config
    from rlorch.trainer.fsdp import build_worker
    from rlorch.trainer.handoff import served_state, streams, write_weights
    from rlorch.trainer.publish import StreamedHF

    run = RunDir(tmp_path / "run").make()
    config = compose(["model.dtype=bfloat16", "trainer.fsdp.device=cpu"])
    save_config(config, run.config)
    worker = build_worker(config, run, torch.device("cpu"), None)
    assert streams(worker)
    write_weights(worker, tmp_path / "streamed")
    whole = served_state(worker)
    streamed = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    assert set(streamed) == set(whole) - ({"lm_head.weight"} if worker.model.tied else set())
    assert all(streamed[name].dtype == torch.bfloat16 and torch.equal(streamed[name], whole[name]) for name in streamed)
    assert json_of(tmp_path / "streamed" / "config.json")["dtype"] == "bfloat16"

    sharded = StreamedHF(tmp_path / "sharded", worker.writer.tokenizer.source, worker.writer.tokenizer, torch.bfloat16,
                         shard_bytes=64 * 1024)
    for name, tensor in whole.items():
        sharded.add(name, tensor)
    sharded.close()
    files = sorted(path.name for path in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    native = Qwen2ForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16).state_dict()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16).state_dict()
    for name in streamed:
        assert torch.equal(native[name], whole[name]) and torch.equal(hf[name], whole[name]), name


def json_of(path):
    import json

    return json.loads(path.read_text())


@pytest.mark.parametrize("implementation", ["native", "hf"])
def test_a_sharded_model_loaded_from_its_own_rows_equals_one_loaded_whole(one_rank, implementation):
    """Sharded (bf16 on one rank here; two ranks in tests/test_trainer.py), the model is built on
    the meta device and each rank reads only its rows of the checkpoint: its parameters, its
    rebuilt rotary buffers and its forward equal a model loaded whole."""
    from rlorch.config.compose import compose
    from rlorch.model import ensure_default_model
    from rlorch.trainer import loading
    from rlorch.trainer.fsdp import _from_pretrained, build_model, place

    path = ensure_default_model()
    config = compose(["model.dtype=bfloat16", f"model.implementation={implementation}"])
    model = build_model(config, path, torch.device("cpu"), 1)
    assert loading.meta_skeleton(path, native=implementation == "native") is not None
    whole = head.install(_from_pretrained(path, implementation == "native", torch.float32))
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(mine.full_tensor() if hasattr(mine, "full_tensor") else mine, theirs), name
    for name, buffer in whole.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    whole = place(whole, torch.device("cpu"), "bfloat16", 1)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, whole(input_ids=ids).logits)


def test_a_checkpoint_missing_a_tensor_is_named(one_rank, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from rlorch.config.compose import compose
    from rlorch.model import ensure_default_model
    from rlorch.trainer.fsdp import build_model

    broken = tmp_path / "model"
    shutil.copytree(ensure_default_model(), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        build_model(compose(["model.dtype=bfloat16"]), broken, torch.device("cpu"), 1)
