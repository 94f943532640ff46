"""Shared fixtures: one temporary RLORCH_HOME for the session, so the tiny default model is
created once (a few seconds) and every subprocess a test starts finds it there."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def rlorch_home(tmp_path_factory):
    home = tmp_path_factory.getbasetemp() / "rlorch-home"
    previous = os.environ.get("RLORCH_HOME")
    os.environ["RLORCH_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("RLORCH_HOME", None)
    else:
        os.environ["RLORCH_HOME"] = previous


@pytest.fixture(scope="session")
def model_dir(rlorch_home):
    from rlorch.model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def perturbed_dir(model_dir, tmp_path_factory):
    """A second checkpoint of the same architecture with different weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    target = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(target)
    return target
