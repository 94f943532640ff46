"""The built-in models by name, and the tiny copy model's pretraining (rlorch.model). How often
the agent example learns on it is a benchmark's question (scripts/bench_stuck.py task=agent):
one run's outcome varies with its seed and its threads."""

from __future__ import annotations

import json
import random

import pytest

from rlorch import model as models
from rlorch.config.compose import compose
from rlorch.config.preflight import preflight
from rlorch.config.schema import ConfigError
from rlorch.model import BUILT_IN_MODELS, build_model, build_tokenizer, model_directory, resolve_model_path


def test_every_masked_token_is_predictable_by_copying_what_followed_its_predecessor_before():
    characters, bos = list(range(10, 52)), 1
    rng = random.Random(3)
    for _ in range(200):
        tokens, mask = models._copy_sample(rng, characters, bos)
        assert len(tokens) == len(mask) == models.COPY_SEQUENCE_LENGTH + 1 and tokens[0] == bos
        assert sum(mask) >= 1     # the last span written is intact
        for position in (k for k, marked in enumerate(mask) if marked):
            earlier = [j for j in range(1, position - 1) if tokens[j - 1] == tokens[position - 1]]
            assert any(tokens[j] == tokens[position] for j in earlier), (tokens, position)


def test_pretraining_that_never_reaches_the_copy_skill_fails_naming_the_accuracy(monkeypatch):
    monkeypatch.setattr(models, "COPY_STEPS", 2)
    monkeypatch.setattr(models, "MORE_COPY_STEPS", 2)
    monkeypatch.setattr(models, "MAX_COPY_STEPS", 4)
    lines = []
    tokenizer = build_tokenizer()
    with pytest.raises(models.CopyPriorError, match="did not appear in 4 steps"):
        models.pretrain_copying(build_model(tokenizer), tokenizer, log=lines.append)
    assert [line.split(",")[0] for line in lines] == ["copy prior: step 2", "copy prior: step 4"]


def test_built_in_models_are_named_and_a_bad_path_lists_them(tmp_path):
    assert model_directory(None) == model_directory("tiny") == resolve_model_path("tiny")
    assert model_directory("tiny-copy").name == BUILT_IN_MODELS["tiny-copy"]
    with pytest.raises(ConfigError) as caught:
        resolve_model_path(str(tmp_path / "missing"))
    assert caught.value.key == "model.path" and "built-in model (tiny, tiny-copy)" in str(caught.value)


def test_validating_the_agent_preset_does_not_create_its_model(monkeypatch, tmp_path):
    """validate-config stays fast: the copy model is created by the run that needs it."""
    monkeypatch.setenv("RLORCH_HOME", str(tmp_path))
    config = compose(["task=agent"])
    assert config.model.path == "tiny-copy"
    preflight(config)
    assert not (model_directory("tiny-copy") / "config.json").exists()


@pytest.mark.slow
def test_the_tiny_copy_model_copies_a_span_it_has_never_seen_and_still_samples_widely():
    """Created through its name as a run creates it (about 2 minutes): greedy, it continues a span
    that recurs in a string of characters; where nothing can be copied its next-token
    distribution stays wide (entropy near the uniform's), so RL can still explore."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = resolve_model_path("tiny-copy")
    made = json.loads((directory / "copy_prior.json").read_text())
    assert made["probe_copy_accuracy"] >= models.REQUIRED_COPY_ACCURACY
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    copied = 0
    for text in ["xk7q=p2m3wz+b9|", "a1b2c3d4e5f6", "pq,rs-tu:vw0"]:
        span = text[3:7]
        ids = tokenizer(text + span[:2], return_tensors="pt", add_special_tokens=False).input_ids
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        copied += tokenizer.convert_ids_to_tokens(int(logits.argmax())) == span[2]
    assert copied >= 2
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(list("user:"))])
    with torch.no_grad():
        probabilities = model(ids).logits[0, -1].softmax(-1)
    entropy = float(-(probabilities * probabilities.clamp_min(1e-12).log()).sum())
    assert entropy > 0.5 * math.log(len(models.CHARACTERS))
