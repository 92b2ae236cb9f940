"""Shared fixtures: builtin model directories and one real Ray Serve app per test session."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test cluster: no token auth
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILTINS = ("qwen3-tiny", "deepseek-v4", "mistral-sp")
SERVE_HTTP_PORT = 8011  # not 8000, which `serve run serve_config.yaml` uses in tests/e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from serve_app.models import ensure_model

    return {name: ensure_model(name) for name in BUILTINS}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A real local Ray cluster, started once per session.

    Logical CPUs are over-declared (the machine has 2 cores) so fractional-CPU replicas of every
    deployment fit at once; their work is tiny in tests.
    """
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="serve_app_tests")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_instance(ray_cluster: None) -> Iterator[None]:
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_HTTP_PORT})
    yield
    serve.shutdown()


def deploy_app(name: str, route_prefix: str, **app_args) -> str:
    """Build the product graph from ``AppArgs(**app_args)``, serve it under ``route_prefix``, return its URL."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    serve.run(build_app(AppArgs(**app_args)), name=name, route_prefix=route_prefix)
    return f"http://127.0.0.1:{SERVE_HTTP_PORT}{route_prefix.rstrip('/')}"


@pytest.fixture(scope="session")
def app_url(serve_instance: None, model_dirs: dict[str, Path]) -> str:
    """The default graph (qwen3-tiny, hermes + qwen3 parsers) served over HTTP."""
    return deploy_app(
        "serve_app",
        "/",
        model="qwen3-tiny",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        limits={"max_body_bytes": 1 << 20},
    )


@pytest.fixture(scope="session")
def plain_app_url(serve_instance: None, model_dirs: dict[str, Path]) -> str:
    """mistral-sp with no parser: chat derender goes through PlainDerender."""
    return deploy_app("plain", "/plain", model="mistral-sp", max_model_len=2048)


@pytest.fixture(scope="session")
def colocated_app_url(serve_instance: None, model_dirs: dict[str, Path]) -> str:
    """The default model with Render and PlainDerender running inside the Ingress replica."""
    return deploy_app(
        "colocated",
        "/colocated",
        model="qwen3-tiny",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        colocate_in_ingress=["render", "plain_derender"],
    )
