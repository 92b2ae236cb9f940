"""Both sides of the differential tests, once per session and model.

Ours: the real serve_app graph over HTTP through Ray Serve. qwen3-tiny is the shared ``app_url``
app (``tests/conftest.py``); deepseek-v4 and mistral-sp are two more applications in the same Serve
instance, under ``/deepseek`` and ``/mistral``.

Theirs: :class:`~tests.differential.oracle.VllmRenderOracle`, vLLM's own render server in this
process, started from the literal ``vllm launch render`` command line with the same parser flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import deploy_app
from tests.differential.corpus import MODELS
from tests.differential.oracle import VllmRenderOracle, cli_argv

# The parser flags each model is served with, as `vllm launch render` flags (the oracle) and as
# AppArgs fields (ours). deepseek-v4's template writes DeepSeek-V3.1's format
# (<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, and
# `thinking` opening <think>): vLLM's `deepseek_v31` tool parser and `deepseek_v3` reasoning parser
# (which reads the same `thinking` / `enable_thinking` kwargs). `deepseek_v4` is the DSML format.
PARSER_FLAGS: dict[str, list[str]] = {
    "qwen3-tiny": ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"],
    "deepseek-v4": ["--tool-call-parser", "deepseek_v31", "--reasoning-parser", "deepseek_v3", "--enable-auto-tool-choice"],
    "mistral-sp": [],
}

OUR_URL_FIXTURE = {"qwen3-tiny": "app_url", "deepseek-v4": "deepseek_url", "mistral-sp": "mistral_url"}
ORACLE_FIXTURE = {"qwen3-tiny": "qwen3_oracle", "deepseek-v4": "deepseek_oracle", "mistral-sp": "mistral_oracle"}


# Package-scoped and deleted afterwards: the engine tests later in the session need the room.
@pytest.fixture(scope="package")
def deepseek_url(serve_instance: None, model_dirs: dict[str, Path]) -> Iterator[str]:
    from ray import serve

    yield deploy_app(
        "deepseek",
        "/deepseek",
        model="deepseek-v4",
        tool_call_parser="deepseek_v31",
        reasoning_parser="deepseek_v3",
        enable_auto_tool_choice=True,
    )
    serve.delete("deepseek")


@pytest.fixture(scope="package")
def mistral_url(serve_instance: None, model_dirs: dict[str, Path]) -> Iterator[str]:
    from ray import serve

    yield deploy_app("mistral", "/mistral", model="mistral-sp")
    serve.delete("mistral")


def _oracle(name: str, model_dirs: dict[str, Path]) -> Iterator[VllmRenderOracle]:
    spec = MODELS[name]
    oracle = VllmRenderOracle(cli_argv(str(model_dirs[name]), name, spec.max_model_len, *PARSER_FLAGS[name]))
    yield oracle
    oracle.close()


# Each oracle asks for the Ray cluster first so Ray's processes start before vLLM is imported here.
@pytest.fixture(scope="session")
def qwen3_oracle(ray_cluster: None, model_dirs: dict[str, Path]) -> Iterator[VllmRenderOracle]:
    yield from _oracle("qwen3-tiny", model_dirs)


@pytest.fixture(scope="session")
def deepseek_oracle(ray_cluster: None, model_dirs: dict[str, Path]) -> Iterator[VllmRenderOracle]:
    yield from _oracle("deepseek-v4", model_dirs)


@pytest.fixture(scope="session")
def mistral_oracle(ray_cluster: None, model_dirs: dict[str, Path]) -> Iterator[VllmRenderOracle]:
    yield from _oracle("mistral-sp", model_dirs)


@pytest.fixture(scope="session")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client
