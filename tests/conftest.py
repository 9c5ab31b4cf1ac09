"""Shared fixtures: the real default model, loaded once per session, offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

# The commands' thread policy (verinfer.machine): one torch thread in a pytest-xdist worker (`-n 2` on
# two cores: the same prefill measured 4x slower oversubscribed, benchmarks/verify_speed.py).
from verinfer.machine import use_threads  # noqa: E402

use_threads()


@pytest.fixture(scope="session")
def backend():
    from verinfer.models.backend import Backend

    return Backend.load("smollm2-135m")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module whose server decodes in its own thread beside the test's."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chat_prompts():
    from verinfer.prompts import load_prompts

    return load_prompts("chitchat", 12, seed=3)
