"""Two CPU Engine replicas under composed traffic, one SIGKILLed while it holds requests: the scenario
shared by ``tests/integration/test_engine_failover.py`` (outputs, what was observed) and
``bench/engine_failover_bench.py`` (how long the retries took).

Every request kind of the composed API runs at once (chat and completions, streamed and not), each
scripted (the scripted-output logits processor) so its output is known. A request the dead replica
held before answering is sent to the other replica by the Ingress (``serve_app/compose.py``); a
stream it cut is retried once by the client, as the README's failure modes say. Needs a connected
Ray with Serve started; the caller deploys :func:`app_config`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "APP",
    "KINDS",
    "Run",
    "app_config",
    "engine_load",
    "engine_replicas",
    "fault_run",
    "request",
    "retried_request_ids",
    "run_request",
    "wait_engines",
]

APP = "failover"
KINDS = ("chat", "chat_stream", "completion", "completion_stream")
SCRIPTED_LOGITS_PROCESSOR = "serve_app.testing.scripted:ScriptedOutputLogitsProcessor"
PROMPT = "Weather in Paris and Tokyo?"
SENTENCE = "The weather in Paris is mild, and in 東京 it rains 🌧. "  # ~16 tokens


def app_config(route_prefix: str, replicas: int = 2, kv_cache_bytes: int = 128 << 20) -> dict[str, Any]:
    """The application as ``serve deploy`` takes it: qwen3-tiny, render and plain derender in the
    Ingress, ``replicas`` CPU Engine replicas set through the Engine's autoscaling default."""
    engine = {
        "enabled": True,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "max_num_seqs": 8,
        "logits_processors": [SCRIPTED_LOGITS_PROCESSOR],
    }
    fixed = {"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}}
    return {
        "name": APP,
        "route_prefix": route_prefix,
        "import_path": "serve_app.app:build_app",
        "args": {
            "model": "qwen3-tiny",
            "colocate_in_ingress": ["render", "plain_derender"],
            "engine": engine,
            "deployments": {"engine": fixed},
        },
    }


def _engine_replica_details() -> list[dict[str, Any]]:
    import ray
    from ray.serve.context import _get_global_client

    details = ray.get(_get_global_client()._controller.get_serve_instance_details.remote())
    app = details["applications"].get(APP) or {}
    return ((app.get("deployments") or {}).get("Engine") or {}).get("replicas") or []


def engine_replicas() -> dict[str, tuple[str, int | None]]:
    """The Engine's replicas as the Serve controller lists them: ``{replica id: (state, pid)}``."""
    return {r["replica_id"]: (str(getattr(r["state"], "value", r["state"])), r.get("pid")) for r in _engine_replica_details()}


def engine_load() -> dict[str, tuple[int, int]]:
    """``{replica id: (requests in flight, pid)}`` of the RUNNING Engine replicas, each asked directly
    (the queue-length probe Serve's router uses, which user code cannot block)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    load: dict[str, tuple[int, int]] = {}
    for r in _engine_replica_details():
        if str(getattr(r["state"], "value", r["state"])) == "RUNNING" and r.get("pid"):
            actor = ray.get_actor(r["actor_name"], namespace=SERVE_NAMESPACE)
            load[r["replica_id"]] = (ray.get(actor.get_num_ongoing_requests.remote(), timeout=30), r["pid"])
    return load


def wait_engines(n: int, dead: set[str] | frozenset[str] = frozenset(), timeout_s: float = 900) -> dict[str, int | None]:
    """Until ``n`` Engine replicas are RUNNING, none of them in ``dead`` (the controller lists a killed
    replica as RUNNING until it notices); returns ``{replica id: pid}``."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = {rid: pid for rid, (state, pid) in engine_replicas().items() if state == "RUNNING" and rid not in dead}
        if len(running) == n and len(running) == sum(state == "RUNNING" for state, _ in engine_replicas().values()):
            return running
        if time.monotonic() > deadline:
            raise TimeoutError(f"want {n} Engine replicas RUNNING: {engine_replicas()}")
        time.sleep(1)


def request(kind: str, tok: Any, sentences: int = 16) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` of one scripted request of ``kind``, its answer ``sentences`` sentences long."""
    script = tok.encode(SENTENCE * sentences) + [tok.convert_tokens_to_ids("<|im_end|>")]
    body: dict[str, Any] = {"model": "qwen3-tiny", "max_tokens": len(script) + 8, "vllm_xargs": {"scripted_output": script}}
    body["stream"] = kind.endswith("_stream")
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": PROMPT}]}
    return "/v1/completions", {**body, "prompt": PROMPT}


@dataclass
class Run:
    """One request as a client saw it."""

    kind: str
    status: int = 0
    output: dict[str, Any] | None = None  # what the client assembled (ids and timestamps left out)
    response_id: str | None = None
    frames: int = 0  # stream frames before [DONE] or the cut, first attempt
    cut: bool = False  # the first attempt's stream ended with the in-band error or without [DONE]
    cut_error: dict[str, Any] | None = None
    retry: Run | None = None  # the client's one retry of a cut stream
    started: float = 0.0
    first_frame_at: float | None = None
    done_at: float = 0.0
    events: list[str] = field(default_factory=list)


def _assemble(kind: str, frames: list[dict[str, Any]]) -> dict[str, Any]:
    text: dict[int, str] = {}
    finish: dict[int, Any] = {}
    for f in frames:
        for c in f.get("choices") or ():
            piece = c["delta"].get("content") if "delta" in c else c.get("text")
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return {"text": text, "finish": finish, "errors": [f["error"] for f in frames if "error" in f]}


def _whole(kind: str, response: dict[str, Any]) -> dict[str, Any]:
    text = {c["index"]: c["message"]["content"] if kind == "chat" else c["text"] for c in response["choices"]}
    return {"text": text, "finish": {c["index"]: c["finish_reason"] for c in response["choices"]}, "errors": []}


def run_request(base: str, kind: str, body: dict[str, Any], path: str, on_frame: Any = None) -> Run:
    """One request; a stream records its frames as they arrive (``on_frame(n)`` after the n-th)."""
    import httpx

    run = Run(kind, started=time.monotonic())
    with httpx.Client(base_url=base, timeout=120) as c:
        if not body["stream"]:
            r = c.post(path, json=body)
            run.done_at = time.monotonic()
            run.status = r.status_code
            if r.status_code == 200:
                run.response_id = r.json()["id"]
                run.output = _whole(kind, r.json())
            else:
                run.events.append(r.text)
            return run
        frames: list[dict[str, Any]] = []
        done = False
        try:
            with c.stream("POST", path, json=body) as r:
                run.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    run.events.append(r.text)
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        frames.append(json.loads(line[6:]))
                        if run.first_frame_at is None:
                            run.first_frame_at = time.monotonic()
                            run.response_id = frames[0].get("id")
                        if on_frame is not None:
                            on_frame(len(frames))
        except httpx.TransportError as exc:
            run.events.append(f"transport: {exc!r}")
        run.done_at = time.monotonic()
        run.frames = len(frames)
        run.output = _assemble(kind, frames)
        if run.status == 200 and (not done or run.output["errors"]):
            run.cut = True
            run.cut_error = (run.output["errors"] or [None])[-1]
        return run


Victim = Callable[[dict[str, int], dict[str, tuple[int, int]]], "int | None"]


def fault_run(
    base: str, tok: Any, victim_pid: int | Victim, per_kind: int = 3, sentences: int = 16, frames_before_kill: int = 3
) -> tuple[list[Run], float | None]:
    """``per_kind`` requests of every kind; once every stream has ``frames_before_kill`` frames (the
    engines are generating, the whole requests with them), SIGKILL ``victim_pid``. The whole requests
    go first, and once the engines hold them all, which replica holds how many is noted; a callable
    ``victim_pid(whole_held, load)`` is then asked, when the streams run, for the pid to kill, with
    ``load`` from :func:`engine_load`; it may answer None (no replica holds what the caller needs
    killed), and nothing is killed. A cut stream is retried once, at once. Returns the runs and the
    moment of the kill (``time.monotonic``), None when nothing was killed."""
    jobs = [(kind, *request(kind, tok, sentences)) for kind in KINDS for _ in range(per_kind)]
    whole_jobs = [job for job in jobs if not job[2]["stream"]]
    stream_jobs = [job for job in jobs if job[2]["stream"]]
    generating = threading.Semaphore(0)

    def on_frame(n: int) -> None:
        if n == frames_before_kill:
            generating.release()

    def one(kind: str, path: str, body: dict[str, Any]) -> Run:
        run = run_request(base, kind, body, path, on_frame if body["stream"] else None)
        if run.cut:
            run.retry = run_request(base, kind, body, path)
        return run

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(one, *job) for job in whole_jobs]
        whole_held = _held_once_in_flight(len(whole_jobs), futures)
        futures += [pool.submit(one, *job) for job in stream_jobs]
        for _ in stream_jobs:
            if not generating.acquire(timeout=300):
                raise AssertionError("the streams never started generating")
        pid = victim_pid(whole_held, engine_load()) if callable(victim_pid) else victim_pid
        killed_at = None
        if pid is not None:
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        runs = [f.result() for f in futures]
    return runs, killed_at


def _held_once_in_flight(n: int, futures: list[Any], timeout_s: float = 300) -> dict[str, int]:
    """``{replica id: requests in flight}`` once the engines hold ``n`` in all."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {rid: ongoing for rid, (ongoing, _) in engine_load().items()}
        if sum(held.values()) >= n:
            return held
        if time.monotonic() > deadline or any(f.done() for f in futures):
            raise AssertionError(f"the engines never held the {n} whole requests at once: {held}")
        time.sleep(0.05)


def retried_request_ids(since: float) -> set[str]:
    """Request ids the Ingress logged as sent again to another Engine replica (``compose.RETRY_LOG``)
    in this Ray session's log files written since ``since`` (``time.time()``)."""
    import ray

    from serve_app.compose import RETRY_LOG

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    found: set[str] = set()
    pattern = re.compile(r"(\S+): \w+Error, its engine replica went away; " + re.escape(RETRY_LOG))
    for path in logs.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out") and path.stat().st_mtime >= since:
            found.update(pattern.findall(path.read_text(errors="replace")))
    return found
