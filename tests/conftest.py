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


@pytest.fixture(scope="session")
def gemma():
    """Gemma-3-270M, the second bundled model (the ``gemma`` extra, in the test install)."""
    from verinfer.models.backend import Backend

    return Backend.load("gemma3-270m")


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


# The real engines' servers (tests marked ``engines``): one of each per session, shared by every module that
# asks (a fixture imported into a second module would be a second definition, and a second start).


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    from tests.test_engine_vllm_server import vllm_server

    with vllm_server(tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture(scope="session")
def engine_python():
    from tests.test_engine_llama_server import llama_engine_python

    return llama_engine_python()


@pytest.fixture(scope="session")
def f32_gguf(engine_python, tmp_path_factory):
    from tests.test_engine_llama_server import build_f32_gguf

    return build_f32_gguf(engine_python, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def llama_url(engine_python, f32_gguf, tmp_path_factory):
    from tests.test_engine_llama_server import llama_server

    with llama_server(engine_python, f32_gguf, tmp_path_factory.mktemp("llama")) as url:
        yield url
