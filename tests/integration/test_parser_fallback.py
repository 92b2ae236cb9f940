"""Every ParserDerender replica SIGKILLed mid-stream (issue 21, goal 2): the Ingress, which holds the
parsers when parser derender is colocated, parses the chunks itself, replaying the carried state, so
a client that sends no ``x-session-id`` (as vLLM's clients) sees neither a 5xx nor a stall, and the
stream equals a clean run. How long the chunk after the kill took is ``bench/parser_fallback_bench.py``'s.

One app, deleted after the module: one Ingress (render, plain and parser derender colocated), two
ParserDerender replicas, no engine.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import QWEN3_PARSER_ARGS, deploy_app
from tests.integration.test_parser_derender import _chunk_body, _normalize, rendered_stream_inputs

APP = "parser_fallback"


@pytest.fixture(scope="module")
def app(serve_instance, model_dirs) -> Iterator[str]:
    from ray import serve

    fixed = {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2}}
    yield deploy_app(
        APP,
        f"/{APP}",
        model="qwen3-tiny",
        **QWEN3_PARSER_ARGS,
        colocate_in_ingress=["render", "plain_derender", "parser_derender"],
        deployments={"parser_derender": fixed},
    )
    serve.delete(APP)


@pytest.fixture(scope="module")
def inputs(app, model_dirs) -> tuple[list[int], list[int]]:
    return rendered_stream_inputs(app, model_dirs["qwen3-tiny"])


def _parser_pids() -> dict[str, int]:
    """ParserDerender replica id -> pid, for the live replicas (the GCS actor table)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#ParserDerender#"
    actors = ray._private.state.actors().values()
    return {a["Name"][len(prefix) :]: a["Pid"] for a in actors if a["State"] == "ALIVE" and a["Name"].startswith(prefix)}


def _counter(base: str, name: str) -> dict[str, float]:
    """A counter of ``/metrics`` by its label set (summed over Ingress replicas)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            key = ",".join(p for p in labels.strip("{}").split(",") if not p.startswith("replica="))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _stream(base: str, rid: str, prompt: list[int], output: list[int], before_chunk=None) -> list[dict]:
    """One parser stream without ``x-session-id``, one token per chunk; every chunk must answer 200
    at the first try (no 503 to retry, no cut connection)."""
    chunks, state = [], None
    with httpx.Client(base_url=base, timeout=60) as c:
        for i, tid in enumerate(output):
            if before_chunk is not None:
                before_chunk(i)
            r = c.post("/v1/chat/completions/derender", json=_chunk_body(rid, [tid], i == len(output) - 1, state, prompt))
            assert r.status_code == 200, (i, r.status_code, r.text)
            state = r.json()["stream_state"]
            chunks.append({**_normalize(r.json()["chunk"]), "id": None})  # the stream's own request id
    return chunks


def test_every_parser_replica_killed_mid_stream_the_ingress_parses_on(app, inputs):
    prompt, output = inputs
    clean = _stream(app, "clean", prompt, output)
    pids = _parser_pids()
    assert len(pids) == 2, pids
    fallbacks_before = _counter(app, "serve_app_parser_local_fallbacks_total")
    killed: list[int] = []

    def kill_all_half_way(i: int) -> None:
        if i == len(output) // 2:
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    faulted = _stream(app, "killed", prompt, output, before_chunk=kill_all_half_way)
    assert faulted == clean
    # The fault was observed: every replica that held streams is gone, and the Ingress parsed chunks
    # ParserDerender could not take (its replica died under the call, or none was left to route to).
    assert killed and not set(pids) & set(_parser_pids()), (pids, _parser_pids())
    fallbacks = _counter(app, "serve_app_parser_local_fallbacks_total")
    assert sum(fallbacks.values()) > sum(fallbacks_before.values()), (fallbacks_before, fallbacks)
