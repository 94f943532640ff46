"""model.dtype=bfloat16: FSDP2 computes in bf16 over fp32 master weights, gradients and optimizer
state, and publishes bf16 weights."""

from __future__ import annotations

import json

import torch


def test_bf16_computes_in_bf16_and_keeps_fp32_weights_gradients_and_optimizer_state(one_rank):
    from rlorch.config.compose import compose
    from rlorch.model import ensure_default_model
    from rlorch.trainer.fsdp import _decoder_layers, build_model, uses_fsdp

    config = compose(["model.dtype=bfloat16"])
    assert uses_fsdp(1, "bfloat16") and not uses_fsdp(1, "float32")
    model = build_model(config, ensure_default_model(), torch.device("cpu"), 1)
    seen = []
    for layer in _decoder_layers(model):
        layer.mlp.down_proj.register_forward_hook(
            lambda module, args, out: seen.append((module.weight.dtype, args[0].dtype, out.dtype)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    logits.log_softmax(-1)[..., 3].sum().backward()
    optimizer.step()

    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)
    assert logits.dtype == torch.float32  # the root casts its output for the loss
    parameters = list(model.parameters())
    assert all(hasattr(p, "to_local") and p.dtype == torch.float32 for p in parameters)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in parameters)
    states = [state for state in optimizer.state.values()]
    assert len(states) == len(parameters)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_served_weights_are_cast_once_per_tensor_and_the_config_names_their_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlorch.model import ensure_default_model
    from rlorch.trainer.handoff import cast
    from rlorch.trainer.publish import HFWriter

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    state = model.state_dict()
    assert cast(state, torch.float32)["model.norm.weight"] is state["model.norm.weight"]
    served = cast(state, torch.bfloat16)
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    assert served["lm_head.weight"] is served["model.embed_tokens.weight"]  # tied stays tied
    writer = HFWriter(model, None)
    for version in ("v1", "v2"):  # the first write learns the layout, the second reuses it
        writer.write(tmp_path / version, served)
        assert json.loads((tmp_path / version / "config.json").read_text())["dtype"] == "bfloat16"
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / version)
        assert loaded.dtype == torch.bfloat16
        assert torch.equal(loaded.state_dict()["model.norm.weight"], served["model.norm.weight"])
