"""rlorch's own Qwen2 (rlorch.qwen2) against transformers', the tokenizer its files define
(rlorch.tokenizer) against transformers', and which one a run uses (model.implementation)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from rlorch.config.schema import ConfigError


@pytest.fixture(scope="module")
def models(perturbed_dir):
    from transformers import AutoModelForCausalLM

    from rlorch.qwen2 import Qwen2ForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(perturbed_dir, dtype=torch.float32).eval()
    return hf, Qwen2ForCausalLM.from_pretrained(perturbed_dir).eval()


def _left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(4, 46, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


@torch.no_grad()
def test_native_logits_equal_transformers_in_the_trainers_form(models):
    hf, native = models
    ids = torch.randint(4, 46, (16, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(native(input_ids=ids).logits, hf(input_ids=ids).logits)


@torch.no_grad()
def test_native_decoding_with_a_cache_matches_transformers_and_the_whole_sequence(models):
    """The engine's form: left-padded prefill, then one token a step through the KV cache. Each
    row's logits match transformers' decoding, and the native model's own forward over that
    row's whole unpadded sequence (what the trainer computes)."""
    from transformers import DynamicCache

    hf, native = models
    ids, mask = _left_padded([3, 6, 9, 2])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    theirs, mine = DynamicCache(), native.new_cache()
    kwargs = dict(attention_mask=mask, position_ids=positions, logits_to_keep=1)
    expected = hf(input_ids=ids, use_cache=True, past_key_values=theirs, **kwargs).logits[:, -1]
    got = native(input_ids=ids, cache=mine, **kwargs).logits[:, -1]
    assert torch.equal(got, expected)
    sequences = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    positions = positions[:, -1:]
    for _ in range(4):
        chosen = got.argmax(-1)
        for sequence, token in zip(sequences, chosen.tolist()):
            sequence.append(token)
        mask = torch.cat([mask, torch.ones((len(sequences), 1), dtype=mask.dtype)], dim=1)
        positions = positions + 1
        kwargs = dict(attention_mask=mask, position_ids=positions, logits_to_keep=1)
        expected = hf(input_ids=chosen[:, None], use_cache=True, past_key_values=theirs, **kwargs).logits[:, -1]
        got = native(input_ids=chosen[:, None], cache=mine, **kwargs).logits[:, -1]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # A padded batch and one row sum in other orders: float32 noise of up to 1.5e-5 was
        # measured (AMD EPYC). A wrong position or cache row is off by far more.
        for row, sequence in enumerate(sequences):
            whole = native(input_ids=torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(got[row], whole, rtol=1e-5, atol=5e-5)


def test_native_checkpoints_load_in_transformers_with_the_same_logits(models, tmp_path):
    from transformers import AutoModelForCausalLM

    _, native = models
    native.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()  # tied, as transformers writes it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(4, 46, (4, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, native(input_ids=ids).logits)


def test_a_checkpoint_that_does_not_match_its_config_is_refused_naming_the_tensor(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from rlorch.qwen2 import Qwen2ForCausalLM

    shutil.copytree(model_dir, tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        Qwen2ForCausalLM.from_pretrained(tmp_path / "model")


def _with_config(model_dir, target, **changes):
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_which_implementation_runs_a_model(model_dir, tmp_path):
    from rlorch.model import uses_native

    assert uses_native("auto", model_dir)
    assert not uses_native("auto", model_dir, lora=True)
    assert not uses_native("auto", model_dir, device="cuda")
    assert not uses_native("hf", model_dir)
    assert uses_native("native", model_dir, device="cuda")
    scaled = _with_config(model_dir, tmp_path / "scaled", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 10000.0})
    assert not uses_native("auto", scaled)
    with pytest.raises(ConfigError, match=r"model\.implementation: native cannot run .*RoPE type 'linear'"):
        uses_native("native", scaled)
    llama = _with_config(model_dir, tmp_path / "llama", architectures=["LlamaForCausalLM"])
    assert not uses_native("auto", llama)
    with pytest.raises(ConfigError, match=r"model\.implementation: .*LoRA"):
        uses_native("native", model_dir, lora=True)


def test_an_unknown_implementation_names_the_key():
    from rlorch.config.compose import compose

    with pytest.raises(ConfigError, match=r"model\.implementation: must be one of auto, native, hf"):
        compose(["model.implementation=jax"])


def test_validate_config_refuses_native_for_a_model_it_cannot_run(model_dir, tmp_path):
    llama = _with_config(model_dir, tmp_path / "llama", architectures=["LlamaForCausalLM"])
    out = subprocess.run([sys.executable, "-m", "rlorch.cli", "validate-config", f"model.path={llama}",
                          "model.implementation=native"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "model.implementation: native cannot run" in out.stderr + out.stdout and "LlamaForCausalLM" in out.stderr + out.stdout


def test_the_fast_tokenizer_agrees_with_transformers_on_the_vocabulary(model_dir):
    """Every string the tasks write (characters of the vocabulary), decoding with and without
    special tokens, the special tokens' ids and the chat template's text and ids."""
    from transformers import AutoTokenizer

    from rlorch.model import CHARACTERS
    from rlorch.tokenizer import FastTokenizer, load_tokenizer

    fast, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(fast, FastTokenizer)
    texts = ["407=", "".join(CHARACTERS), "reverse:123|sort:3,1,2=", "12+7=19", ""]
    for text in texts:
        assert fast(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"]
    ids = [1, *fast("ab=12", add_special_tokens=False)["input_ids"], 2, 0]
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert fast.decode_batch([ids, ids[:3]], skip_special_tokens=True) == [theirs.decode(ids, skip_special_tokens=True),
                                                                          theirs.decode(ids[:3], skip_special_tokens=True)]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(fast, key) == getattr(theirs, key)
    assert fast.get_vocab() == theirs.get_vocab() and len(fast) == len(theirs)
    assert sorted(fast.all_special_ids) == sorted(theirs.all_special_ids)
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "12+1="}]
    for prompt in (True, False):
        assert (fast.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
                == theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False))


def test_a_model_specific_tokenizer_class_goes_through_transformers(model_dir, tmp_path):
    from rlorch.tokenizer import FastTokenizer, load_tokenizer

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    settings = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "Qwen2Tokenizer"}))
    assert not isinstance(load_tokenizer(target), FastTokenizer)


def test_the_default_engine_and_trainer_import_neither_transformers_nor_torchs_compiler(model_dir, tmp_path):
    """In a fresh interpreter: the engine, and the trainer's worker taking an optimizer step and
    taking the state a checkpoint saves, for the CPU default, after the fork server's preload for them.
    Transformers' import was most of a cold start; torch's compiler (which torch's AdamW and
    DCP's ``get_state_dict`` import) the largest part of the rest."""
    code = f"""
import json, sys
from pathlib import Path
import torch
from rlorch.launch import forkserver
forkserver.preload()
from rlorch.serve.server import CpuServer
CpuServer(Path({str(model_dir)!r}), threads=1)
import torch.distributed as dist
from rlorch.config.compose import compose
from rlorch.rundir.layout import RunDir
from rlorch.trainer.fsdp import build_worker
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
worker = build_worker(compose([f"model.path={str(model_dir)}"]), RunDir(Path({str(tmp_path)!r})), torch.device("cpu"), None)
model, optimizer = worker.model, worker.optimizer
model(torch.tensor([[1, 13, 14]])).logits.sum().backward()
optimizer.step()
optimizer.zero_grad()
from rlorch.trainer import checkpoint
checkpoint.import_dcp_in_background().join()
checkpoint._state(model, optimizer, False)  # what a checkpoint saves
print(json.dumps({{"model": type(model).__module__,
                   "loaded": [m for m in ("transformers", "torch._dynamo") if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"model": "rlorch.qwen2", "loaded": []}


@pytest.mark.parametrize("overrides, wanted", [
    ([], []),
    (["model.implementation=hf"], ["transformers"]),
    (["model.lora.rank=8"], ["transformers"]),
    (["model.dtype=bfloat16"], ["torch.distributed.fsdp"]),
    (["inference=sim", "trainer=sim"], []),
])
def test_the_fork_server_imports_transformers_and_fsdp_only_for_runs_that_need_them(model_dir, overrides, wanted):
    from rlorch.config.compose import compose
    from rlorch.runner import _heavy_modules

    modules = _heavy_modules(compose(["trainer.fsdp.device=cpu", *overrides]))  # whatever GPUs this machine has
    assert [m for m in ("transformers", "torch.distributed.fsdp") if m in modules] == wanted
