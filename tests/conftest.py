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

    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="serve_app_tests")
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


# --- engine fixtures (issue 6): one engine per session, reference `vllm serve` per module ----------

SCRIPTED_LOGITS_PROCESSOR = "serve_app.testing.scripted:ScriptedOutputLogitsProcessor"
ENGINE_KV_CACHE_BYTES = 256 * 1024 * 1024  # a fixed KV cache: no 20 GiB grab, no 40 s warm-up on CPU
QWEN3_PARSER_ARGS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}


@pytest.fixture(scope="session")
def engine_app_url(serve_instance: None, model_dirs: dict[str, Path]) -> str:
    """qwen3-tiny with the engine (CPU, scripted-output logits processor), hermes + qwen3 parsers,
    render and plain derender colocated as in serve_config.yaml."""
    return deploy_app(
        "engine_app",
        "/engine",
        model="qwen3-tiny",
        **QWEN3_PARSER_ARGS,
        colocate_in_ingress=["render", "plain_derender"],
        engine={
            "enabled": True,
            "kv_cache_memory_bytes": ENGINE_KV_CACHE_BYTES,
            "logits_processors": [SCRIPTED_LOGITS_PROCESSOR],
        },
    )


class VllmServe:
    """A real ``vllm serve`` subprocess (through ``serve_app.vllm_cli``), up once ``/health`` answers."""

    def __init__(self, model_dir: Path, *flags: str, log_path: Path) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "serve_app.vllm_cli", "serve", str(model_dir), "--port", str(self.port)]
        argv += ["--host", "127.0.0.1", "--enforce-eager", "--kv-cache-memory-bytes", str(ENGINE_KV_CACHE_BYTES)]
        argv += ["--served-model-name", "qwen3-tiny", "--max-num-seqs", "16"]
        argv += ["--logits-processors", SCRIPTED_LOGITS_PROCESSOR, *flags]
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 240) -> VllmServe:
        import time

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-4000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log_path.read_text()[-4000:]
            time.sleep(1)

    def stop(self) -> None:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def vllm_tokens_only(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    """``vllm serve --tokens-only`` on qwen3-tiny: the reference for ``/inference/v1/generate``."""
    server = VllmServe(
        model_dirs["qwen3-tiny"], "--tokens-only", log_path=tmp_path_factory.mktemp("vllm") / "tokens_only.log"
    ).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_coupled(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    """Coupled ``vllm serve`` on qwen3-tiny with the same parser flags: the reference for the composed API."""
    flags = ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    server = VllmServe(model_dirs["qwen3-tiny"], *flags, log_path=tmp_path_factory.mktemp("vllm") / "coupled.log")
    yield server.wait_ready()
    server.stop()
