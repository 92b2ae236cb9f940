"""Server processes the benchmarks start: free ports, waiting until a URL answers, stopping a process
group, and vLLM's ``vllm launch render`` (the reference) with the flags our app builds vLLM's state from."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from bench.common.paths import LOGS
from tests.harness.net import free_port as free_port  # re-exported: the benches take it from here


async def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, ok_in_a_row: int = 1) -> None:
    """Poll ``url`` (every 0.25 s) until it answers 200 ``ok_in_a_row`` times; fail early if ``proc`` exits."""
    import aiohttp

    deadline = time.monotonic() + timeout
    ok = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
            try:
                async with session.get(url) as resp:
                    ok = ok + 1 if resp.status == 200 else 0
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                ok = 0
            if ok >= ok_in_a_row:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
            await asyncio.sleep(0.25)


def wait_http_blocking(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` (every second, with httpx) until it answers 200; for drivers without an event loop."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def spawn_group(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``Popen(argv, start_new_session=True, **kwargs)``: a server in its own process group, which the
    bench stops with :func:`kill_group` in a ``finally`` (a Ctrl-C in the terminal reaches only the bench).

    A SIGTERM (``timeout``, a CI runner) would end Python without running those ``finally`` blocks and
    leave the group running (a vLLM server holds a GiB or more): so this also makes SIGTERM unwind the
    bench as Ctrl-C does, once, from the main thread, unless the bench set its own handler.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


def _exit_on_sigterm(signum: int, _frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its group (a worker's
    Ray processes, vLLM's children), and nothing else."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                time.sleep(1)  # let raylet and friends finish dying before the group is checked again
        except subprocess.TimeoutExpired:
            continue


def shown(argv: list[str]) -> list[str]:
    """``argv`` as reports show it: the interpreter by its name, not its path."""
    return [Path(a).name if a == sys.executable else a for a in argv]


def vllm_render_argv(app_args: dict[str, Any]) -> list[str]:
    """``python -m serve_app.vllm_cli launch render`` with the flags our Render builds vLLM's state from
    for ``AppArgs(**app_args)`` (model, tokenizer, max model length, served name, parsers)."""
    from serve_app._vllm import vllm_cli_args
    from serve_app.config import AppArgs

    args = AppArgs(**app_args)
    return [sys.executable, "-m", "serve_app.vllm_cli", "launch", "render", *vllm_cli_args(args, args.resolve())]


class VllmRender:
    """``vllm launch render`` on 127.0.0.1 and a free port, in its own process group, logging to ``LOGS/<log_name>``."""

    def __init__(self, app_args: dict[str, Any], log_name: str) -> None:
        self.app_args, self.log_name = app_args, log_name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")
        self._t0 = time.monotonic()

    def command(self) -> list[str]:
        return [*vllm_render_argv(self.app_args), "--host", "127.0.0.1", "--port", str(self.port), "--disable-uvicorn-access-log"]

    def start(self) -> float:
        """Start it and wait for ``/health``; returns (and keeps) the seconds that took."""
        self.launch()
        return asyncio.run(self.wait_ready())

    def launch(self) -> None:
        """Start the process and return at once (:meth:`wait_ready` then waits for it)."""
        LOGS.mkdir(parents=True, exist_ok=True)
        log = (LOGS / self.log_name).open("w")
        self._t0 = time.monotonic()
        self.proc = spawn_group(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    async def wait_ready(self, timeout: float = 300) -> float:
        """Wait until ``/health`` answers; returns (and keeps) the seconds since :meth:`launch`."""
        await wait_http(self.base + "/health", timeout, self.proc)
        self.startup_s = time.monotonic() - self._t0
        return self.startup_s

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)


SCRIPTED_PROCESSOR = "serve_app.testing.scripted:ScriptedOutputLogitsProcessor"
"""The logits processor both engines load so a request's ``vllm_xargs.scripted_output`` is what the model says."""


def vllm_serve_argv(model_dir: str, port: int, *, kv_cache_bytes: int, max_num_seqs: int, scale_out: bool = True) -> list[str]:
    """Coupled ``vllm serve`` as the benchmarks run it next to our Engine: qwen3-tiny's parsers (hermes +
    qwen3, auto tool choice), eager CPU engine, a fixed KV cache, the scripted-output logits processor;
    ``scale_out`` adds ``--enable-scale-out`` (its ``/inference/v1/generate``)."""
    return [sys.executable, "-m", "serve_app.vllm_cli", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "qwen3-tiny", "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-num-seqs", str(max_num_seqs), "--logits-processors", SCRIPTED_PROCESSOR, "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", *(["--enable-scale-out"] if scale_out else []),
            "--disable-log-stats", "--disable-uvicorn-access-log"]


def start_logged(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in its own process group (for :func:`kill_group`), offline, output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        return spawn_group(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


class VllmServe(VllmRender):
    """Coupled ``vllm serve`` (:func:`vllm_serve_argv`) on 127.0.0.1 and a free port, in its own process
    group, logging to ``LOGS/<log_name>``; started and stopped as :class:`VllmRender`."""

    def __init__(self, model_dir: str, log_name: str, *, kv_cache_bytes: int, max_num_seqs: int, scale_out: bool = True) -> None:
        super().__init__({}, log_name)
        self.model_dir, self.kv_cache_bytes, self.max_num_seqs, self.scale_out = model_dir, kv_cache_bytes, max_num_seqs, scale_out

    def command(self) -> list[str]:
        return vllm_serve_argv(self.model_dir, self.port, kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
                               scale_out=self.scale_out)

    def launch(self) -> None:
        self._t0 = time.monotonic()
        self.proc = start_logged(self.command(), LOGS / self.log_name)
