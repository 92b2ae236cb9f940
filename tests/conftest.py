"""Shared fixtures: builtin model directories and one real Ray Serve app per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.net import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test cluster: no token auth
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILTINS = ("qwen3-tiny", "deepseek-v4", "mistral-sp")
SERVE_HTTP_PORT = 8011  # not 8000, which `serve run serve_config.yaml` uses in tests/e2e


# --- the session's footprint on the machine ----------------------------------------------------------
#
# The suite runs real Ray clusters and vLLM processes on a 24 GiB box, where Ray's memory monitor
# kills workers (even the Serve controller) at 95 %. Three things keep it well under that:
#   * the tests that start clusters of their own (`serve run serve_config.yaml`, the multi-node
#     autoscaling scenario) run first, before the session's cluster starts;
#   * test modules run grouped by the session-wide app they need (the engine app's users, then the
#     plain app's, then the colocated app's, then the rest), and each such app is deleted right after
#     the last test that uses it, so few are up at once;
#   * the peak (the machine's memory in use, sampled every second) is printed at the end.

# Session fixtures that deploy an app, by the Serve application name they deploy.
SESSION_APPS = {"app_url": "serve_app", "plain_app_url": "plain", "colocated_app_url": "colocated", "engine_app_url": "engine_app"}
_RUN_FIRST = ("tests/e2e/test_serve_run.py", "tests/integration/test_multinode_autoscaling.py")
_GROUPED = ("engine_app_url", "plain_app_url", "colocated_app_url")  # in this order, before the rest


class _MemorySampler:
    def __init__(self) -> None:
        import threading

        import psutil

        self.total = psutil.virtual_memory().total
        self.baseline = self._used()
        self.peak = self.baseline
        self.peak_test = "(before any test)"
        self.current_test = self.peak_test
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> int:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total - vm.available

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            used = self._used()
            if used > self.peak:
                self.peak, self.peak_test = used, self.current_test

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_memory: _MemorySampler | None = None
_last_users: dict[str, list[str]] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    global _memory
    _memory = _MemorySampler()


def _phase(item: pytest.Item) -> int:
    if item.nodeid.startswith(_RUN_FIRST):
        return 0
    fixtures = getattr(item, "fixturenames", ())
    return next((1 + i for i, name in enumerate(_GROUPED) if name in fixtures), 1 + len(_GROUPED))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Whole modules move (their module fixtures are set up once); the sort is stable within a phase.
    module_phase: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_phase[module] = min(module_phase.get(module, _phase(item)), _phase(item))
    items.sort(key=lambda item: module_phase[item.nodeid.split("::", 1)[0]])


def pytest_collection_finish(session: pytest.Session) -> None:
    last: dict[str, str] = {}
    for item in session.items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in SESSION_APPS:
                last[fixture] = item.nodeid
    for fixture, nodeid in last.items():
        _last_users.setdefault(nodeid, []).append(SESSION_APPS[fixture])


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _memory is not None:
        _memory.current_test = nodeid


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Free a session-wide app's replicas once no later test needs it."""
    apps = _last_users.get(item.nodeid)
    import ray

    if apps and ray.is_initialized():
        from ray import serve

        for name in apps:
            if name in serve.status().applications:
                serve.delete(name)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _memory is None:
        return
    _memory.stop()
    gib = 1 << 30
    terminalreporter.write_line(
        f"memory in use on this machine: peak {_memory.peak / gib:.1f} GiB of {_memory.total / gib:.1f} GiB "
        f"(at start {_memory.baseline / gib:.1f} GiB), during {_memory.peak_test}"
    )


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from serve_app.models import ensure_model

    return {name: ensure_model(name) for name in BUILTINS}


def make_hub_cache(
    cache: Path,
    repo_id: str,
    source: Path,
    commit: str = "0123456789abcdef0123456789abcdef01234567",
    *,
    weights: bool = False,
    config: dict | None = None,
    files: dict[str, str] | None = None,
    ref: str | None = "main",
) -> Path:
    """A Hugging Face hub cache entry as ``hf download`` leaves it (``models--Org--Name/snapshots/<commit>/``,
    ``refs/main``), filled with a builtin model's files; returns the snapshot directory.

    ``weights``: copy ``*.safetensors`` too (the engine loads them); ``config``: keys to overwrite in
    ``config.json`` (a stand-in's shape); ``files``: more files by name and text.
    """
    import json
    import shutil

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith(".") and (weights or f.suffix != ".safetensors"):
            shutil.copyfile(f, snapshot / f.name)
    if config:
        data = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**data, **config}, indent=2))
    for name, text in (files or {}).items():
        (snapshot / name).write_text(text)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty hub cache this process reads offline (``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE``): serve_app
    reads both at call time, so setting them after huggingface_hub was imported is enough here."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


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
    """The default model with Render, PlainDerender and the parsers running inside the Ingress replica."""
    return deploy_app(
        "colocated",
        "/colocated",
        model="qwen3-tiny",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        colocate_in_ingress=["render", "plain_derender", "parser_derender"],
    )


# --- engine fixtures (issue 6): one engine per session, reference `vllm serve` per module ----------

SCRIPTED_LOGITS_PROCESSOR = "serve_app.testing.scripted:ScriptedOutputLogitsProcessor"
ENGINE_KV_CACHE_BYTES = 256 * 1024 * 1024  # a fixed KV cache: no 20 GiB grab, no 40 s warm-up on CPU
QWEN3_PARSER_ARGS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
# vLLM's defaults are for GPUs; the CPU tests set the demo engine explicitly, as serve_config.yaml does:
# no graph capture, 16 sequences, a fixed KV cache, no tokenizer in the engine (`vllm serve --tokens-only`).
CPU_ENGINE = {"enforce_eager": True, "max_num_seqs": 16, "tokens_only": True, "kv_cache_memory_bytes": ENGINE_KV_CACHE_BYTES}


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
        # Paced hard (50 ms waits): every engine-app test runs on streams whose messages merge tokens.
        engine={"enabled": True, **CPU_ENGINE, "logits_processors": [SCRIPTED_LOGITS_PROCESSOR], "stream_messages_per_s": 20},
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
