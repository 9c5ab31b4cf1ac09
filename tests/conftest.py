"""Shared fixtures: the real default model, loaded once per session, offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def backend():
    from verinfer.models.backend import Backend

    return Backend.load("smollm2-135m")


@pytest.fixture(scope="session")
def chat_prompts():
    from verinfer.prompts import load_prompts

    return load_prompts("chitchat", 12, seed=3)
