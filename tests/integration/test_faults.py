"""Faults on a real cluster: a replica of each stream-holding stage SIGKILLed mid-stream, and
scale-downs with streams open. The client does what the README's failure-modes table tells it to
(retry the same chunk or request on 503 after ``Retry-After``, retry a stream cut without
``[DONE]``), and every output equals a clean run's.

One app, deleted after the module: two Ingress replicas (render and plain derender colocated), two
ParserDerender replicas, and the engine with the scripted-output logits processor, so generation is
deterministic whatever the batch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import CPU_ENGINE, QWEN3_PARSER_ARGS, SCRIPTED_LOGITS_PROCESSOR, SERVE_HTTP_PORT
from tests.harness.derender_stream import carry_state, split, token_chunks
from tests.harness.metrics import summed_by
from tests.integration.test_parser_derender import CHAT_REQUEST, OUTPUT, _chunk_body

APP = "faults"
# A composed stream long enough (~2 s of CPU generation) to be cut, or drained, mid-way.
LONG_ANSWER = "<think>\nTwo cities.\n</think>\n\n" + "The weather in Paris is mild, and in 東京 it rains 🌧. " * 40


def _deploy(ingress_replicas: int = 2, parser_replicas: int = 2) -> str:
    """Deploy as an operator does (``serve deploy``): a declarative config, whose replica counts are
    Serve's lightweight updates. (``serve.run`` of a Python-built app is a new code version each
    time: every replica, the engine's too, would be replaced.)"""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    def fixed(n: int) -> dict:
        return {"autoscaling_config": {"min_replicas": n, "max_replicas": n, "initial_replicas": n, "downscale_delay_s": 0}}

    engine = {"enabled": True, **CPU_ENGINE, "logits_processors": [SCRIPTED_LOGITS_PROCESSOR]}
    app = {
        "name": APP,
        "route_prefix": f"/{APP}",
        "import_path": "serve_app.app:build_app",
        "args": {
            "model": "qwen3-tiny",
            **QWEN3_PARSER_ARGS,
            "colocate_in_ingress": ["render", "plain_derender", "parser_derender"],  # as serve_config.yaml
            "engine": engine,
        },
        "deployments": [{"name": "Ingress", "num_replicas": ingress_replicas}, {"name": "ParserDerender", **fixed(parser_replicas)}],
    }
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))
    return f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"


@pytest.fixture(scope="module")
def app(serve_instance, model_dirs) -> Iterator[str]:
    from ray import serve

    url = _deploy()
    _wait_healthy(url, timeout_s=600)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["qwen3-tiny"])


@pytest.fixture(scope="module")
def parser_inputs(app, tok) -> tuple[list[int], list[int]]:
    with httpx.Client(base_url=app, timeout=60) as c:
        prompt = c.post("/v1/chat/completions/render", json=CHAT_REQUEST).json()["token_ids"]
    return prompt, tok.encode(OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]


# --- cluster helpers --------------------------------------------------------------------------------


def _running(deployment: str) -> int:
    from ray import serve

    return serve.status().applications[APP].deployments[deployment].replica_states.get("RUNNING", 0)


def _wait_running(deployment: str, n: int, timeout_s: float = 300) -> None:
    """Until ``n`` replicas of ``deployment`` are RUNNING. /ready needs one routable replica per
    stage, so it can answer 200 before the controller has even seen a killed replica die."""
    deadline = time.monotonic() + timeout_s
    while _running(deployment) != n:
        assert time.monotonic() < deadline, f"{deployment}: {_running(deployment)} RUNNING, want {n}"
        time.sleep(1)


def _wait_healthy(app_url: str, timeout_s: float = 300) -> None:
    """Until /ready: every deployment of the app HEALTHY again (a killed replica replaced). While the
    app is first deploying, the proxy holds the probe: that is a time-out, not an answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ready = httpx.get(f"{app_url}/ready", timeout=10)
            if ready.status_code == 200:
                return
        except httpx.TransportError as exc:
            ready = exc  # type: ignore[assignment]
        assert time.monotonic() < deadline, ready
        time.sleep(1)


def _wait_routed_to_every_ingress(app_url: str, timeout_s: float = 120) -> None:
    """Until the front door routes to every live Ingress replica: each has served ``/v1/models``
    (``/metrics`` gathers every replica's counters, labelled by replica). A replica that replaced a
    killed one is RUNNING before the proxy's router sends it anything."""
    deadline = time.monotonic() + timeout_s
    while True:
        for _ in range(8):
            httpx.get(f"{app_url}/v1/models", timeout=10)
        by_route = summed_by(httpx.get(f"{app_url}/metrics", timeout=30).text, "serve_app_http_requests_total", "route", "replica")
        served = {key.split(" ", 1)[1] for key in by_route if key.startswith("/v1/models ")}
        if set(_replica_pids("Ingress")) <= served:
            return
        assert time.monotonic() < deadline, (served, _replica_pids("Ingress"))
        time.sleep(1)


def _busiest_ingress(app_url: str) -> int:
    """The process of the Ingress replica with the most requests in flight (with four streams and
    this scrape open over two replicas, it holds at two or more, so at least one stream)."""
    in_flight = summed_by(httpx.get(f"{app_url}/metrics", timeout=30).text, "serve_app_http_requests_in_flight", "replica")
    pids = _replica_pids("Ingress")
    busiest = max(pids, key=lambda r: in_flight.get(r, 0.0))
    assert in_flight.get(busiest, 0.0) >= 2, (in_flight, pids)
    return pids[busiest]


def _replica_pids(deployment: str) -> dict[str, int]:
    """Replica unique id -> process id, for the live replicas of ``deployment``."""
    import ray

    # The GCS actor table (the state API needs the dashboard, which the test cluster does not run).
    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    actors = ray._private.state.actors().values()
    return {a["Name"][len(prefix) :]: a["Pid"] for a in actors if a["State"] == "ALIVE" and a["Name"].startswith(prefix)}


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


# --- client side: what the failure-modes table tells a client to do ---------------------------------


def _post_retrying(c: httpx.Client, path: str, body: dict, deadline_s: float = 120) -> tuple[httpx.Response, int]:
    """POST until it is not a 503 nor a cut connection; each 503 must be in the envelope with
    Retry-After. Returns the answer and how many 503s and cut connections came first."""
    deadline = time.monotonic() + deadline_s
    unavailable = 0
    while True:
        try:
            r = c.post(path, json=body)
        except httpx.TransportError:  # the replica serving it died: the table says retry
            unavailable += 1
            assert time.monotonic() < deadline
            time.sleep(0.5)
            continue
        if r.status_code != 503:
            return r, unavailable
        unavailable += 1
        assert r.json()["error"]["code"] == 503 and int(r.headers["retry-after"]) > 0, r.text
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)


def _normalize(obj: dict) -> dict:
    """Drop what legitimately differs between two runs: timestamps, response ids, tool-call ids."""
    text = json.dumps({k: v for k, v in obj.items() if k not in ("created", "id")})
    return json.loads(re.sub(r"chatcmpl-tool-[0-9a-f]+", "chatcmpl-tool-X", text))


def _parser_stream(
    base: str, rid: str, prompt: list[int], output: list[int], on_chunk=None, headers: dict | None = None
) -> tuple[list[dict], int]:
    """One parser-derender stream over HTTP, one token per chunk, each 503 retried with the same chunk."""
    chunks, unavailable = [], 0
    with httpx.Client(base_url=base, timeout=60, headers=headers) as c:

        def post(body: dict) -> dict:
            nonlocal unavailable
            if on_chunk is not None:
                on_chunk(len(chunks))  # the index of the chunk about to be sent
            r, n = _post_retrying(c, "/v1/chat/completions/derender", body)
            assert r.status_code == 200, r.text
            unavailable += n
            return r.json()

        for data in carry_state(post, token_chunks(split(output), rid), chat_request=CHAT_REQUEST, prompt_token_ids=prompt):
            chunks.append(_normalize(data["chunk"]))
    return chunks, unavailable


def _composed_body(tok, answer: str) -> dict:
    script = tok.encode(answer) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return {
        "model": "qwen3-tiny",
        "messages": CHAT_REQUEST["messages"],
        "stream": True,
        "max_tokens": len(script) + 8,
        "vllm_xargs": {"scripted_output": script},
    }


def _composed_stream(base: str, body: dict, on_frame=None) -> tuple[list[dict], bool]:
    """A streamed /v1/chat/completions: the frames before ``[DONE]`` and whether ``[DONE]`` came.
    A cut connection is an incomplete stream, not an exception."""
    frames: list[dict] = []
    try:
        with httpx.Client(base_url=base, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return [{"status": r.status_code, "body": r.json(), "retry_after": r.headers.get("retry-after")}], False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return frames, True
                frames.append(json.loads(line[6:]))
                if on_frame is not None:
                    on_frame(len(frames))
    except httpx.TransportError:
        pass
    return frames, False


def _joined(frames: list[dict]) -> dict:
    """What a client assembles from a composed stream. Chunk boundaries are not compared: under load
    the engine merges the tokens of several steps into one chunk, as vLLM's does."""
    deltas = [f["choices"][0] for f in frames if f.get("choices")]
    return {
        "role": deltas[0]["delta"].get("role") if deltas else None,
        "content": "".join(d["delta"].get("content") or "" for d in deltas),
        "reasoning": "".join(d["delta"].get("reasoning") or "" for d in deltas),
        "token_ids": [t for f in frames for t in (f.get("choices") or [{}])[0].get("token_ids") or ()],
        "finish_reason": [d["finish_reason"] for d in deltas if d.get("finish_reason")],
        "errors": [f for f in frames if "error" in f],
    }


# --- SIGKILL mid-stream -------------------------------------------------------------------------------


def test_parser_replica_killed_mid_stream_retried_chunk_continues_identically(app, parser_inputs):
    """The ParserDerender replica holding a stream's live parser is SIGKILLed half-way: the next chunk
    is a fast 503 or goes straight to the other replica, which replays the carried state; every
    chunk equals a clean run's."""
    from ray import serve

    prompt, output = parser_inputs
    clean, unavailable = _parser_stream(app, "clean", prompt, output)
    assert unavailable == 0
    # The replica the consistent-hash ring gives this stream (the Ingress keys on the request id).
    handle = serve.get_deployment_handle("ParserDerender", app_name=APP)
    probe = _chunk_body("killed", output[:1], False, None, prompt)
    _, _, replica = handle.options(session_id="killed").chat_traced.remote(probe).result()
    pid = _replica_pids("ParserDerender")[replica]
    half = len(output) // 2
    killed_at: list[float] = []

    def kill_half_way(i: int) -> None:
        if i == half:
            _sigkill(pid)
            killed_at.append(time.monotonic())

    faulted, _ = _parser_stream(app, "killed", prompt, output, on_chunk=kill_half_way)
    assert killed_at, "the replica was not killed"
    assert faulted == clean
    _wait_healthy(app)
    _wait_running("ParserDerender", 2)
    assert replica not in _replica_pids("ParserDerender")


def _ingress_session_chunks() -> dict[str, dict[str, float]]:
    """Parser-stream chunks each live Ingress replica parsed, by session-cache outcome, from its own
    counters (asked by handle, so a replica's answer is its own, whichever one the caller reaches)."""
    from ray import serve

    ingress = serve.get_deployment_handle("Ingress", app_name=APP)
    out: dict[str, dict[str, float]] = {}
    for answer in ingress.broadcast("metric_families").results(timeout_s=60, return_exceptions=True):
        if not isinstance(answer, tuple):
            continue  # a replica dying under the call
        replica, families = answer[0], answer[1]
        counts = out.setdefault(replica, {})
        for family in families:
            for sample in family.samples:
                if sample.name == "serve_app_parser_session_chunks_total":
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return out


def test_ingress_replica_killed_mid_parser_stream_sent_with_session_header_retried_chunk_is_identical(app, parser_inputs):
    """A parser stream sent with ``x-session-id`` is parsed in the Ingress (parser derender colocated,
    as ``make run``). SIGKILL the Ingress replica holding its live parser half-way through it: the
    client retries the chunk (a cut connection or a 503), the other Ingress replica replays the
    carried state (a miss there: the fault was seen), and every chunk equals a clean run's. None of it
    reaches ParserDerender."""
    from tests.integration.test_colocation import parser_derender_chunks

    prompt, output = parser_inputs
    _wait_running("Ingress", 2)
    clean, unavailable = _parser_stream(app, "affine-clean", prompt, output, headers={"x-session-id": "affine-clean"})
    assert unavailable == 0
    half = len(output) // 2
    before = parser_derender_chunks(APP)
    seen: list[dict[str, dict[str, float]]] = []
    killed: list[tuple[str, dict[str, dict[str, float]]]] = []

    def kill_holder_half_way(i: int) -> None:
        if i == half - 1:
            seen.append(_ingress_session_chunks())
        if i != half:
            return
        # The replica that parsed the last chunk holds the stream's live parser: its count rose. (The
        # test cluster's proxy does not hash x-session-id as make run's HAProxy does, so a stream's
        # chunks may alternate between replicas; the holder is whichever took the last one.)
        now = _ingress_session_chunks()
        grew = [r for r in now if sum(now[r].values()) > sum(seen[0].get(r, {}).values())]
        assert len(grew) == 1, (seen[0], now)
        _sigkill(_replica_pids("Ingress")[grew[0]])
        killed.append((grew[0], now))

    faulted, _ = _parser_stream(app, "affine", prompt, output, on_chunk=kill_holder_half_way, headers={"x-session-id": "affine"})
    assert faulted == clean
    assert killed, "the replica holding the stream was not killed"
    victim, at_kill = killed[0]
    after = _ingress_session_chunks()
    assert victim not in after
    # The fault was observed: a surviving replica took the second half and replayed the carried state.
    misses = {r: after[r].get("miss", 0.0) - at_kill.get(r, {}).get("miss", 0.0) for r in after}
    assert sum(misses.values()) >= 1, (at_kill, after)
    after_parser = parser_derender_chunks(APP)
    assert before and all(after_parser.get(r, n) == n for r, n in before.items()), (before, after_parser)
    assert all(after_parser[r] == 0 for r in after_parser.keys() - before.keys()), (before, after_parser)
    _wait_healthy(app)
    _wait_running("Ingress", 2)


def test_ingress_replica_killed_mid_composed_stream_retry_is_identical(app, tok):
    """Composed streams are derendered in the Ingress: SIGKILL the Ingress replica holding the most of
    four open streams. A stream it served is cut (no ``[DONE]``); retried, it runs on the other replica,
    and every stream's final output equals a clean run's."""
    body = _composed_body(tok, LONG_ANSWER)
    clean, done = _composed_stream(app, body)
    assert done
    _wait_running("Ingress", 2)
    _wait_routed_to_every_ingress(app)  # so the streams spread over both (an earlier test killed one)
    opened = threading.Barrier(4 + 1)
    results: list[tuple[list[dict], bool]] = []

    def on_frame(n: int) -> None:
        if n == 2:
            opened.wait(timeout=120)

    def client() -> tuple[list[dict], bool]:
        return _composed_stream(app, body, on_frame)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client) for _ in range(4)]
        opened.wait(timeout=120)  # four streams are open, spread by the proxy's power-of-two routing
        _sigkill(_busiest_ingress(app))  # the proxy balances by its own view: kill one that holds streams
        results = [f.result() for f in futures]
    cut = [frames for frames, done in results if not done]
    wanted = _joined(clean)
    assert wanted["content"] and wanted["finish_reason"] == ["stop"] and not wanted["errors"]
    for frames, done in results:
        got = _joined(frames)
        assert got == wanted if done else wanted["content"].startswith(got["content"]), (got, wanted)
    for _ in cut:  # the client's retry
        frames, done = _composed_stream(app, body)
        assert done and _joined(frames) == _joined(clean)
    assert cut, "no stream ran on the killed replica"
    _wait_healthy(app)


def test_engine_killed_mid_composed_stream_fails_fast_then_retry_is_identical(app, tok):
    """SIGKILL the Engine replica mid-stream: the open stream ends with vLLM's in-band error frame
    (not a hang), requests while it is replaced are fast 503s with Retry-After, and the retried
    request, once the engine is back, equals a clean run."""
    body = _composed_body(tok, LONG_ANSWER)
    clean, done = _composed_stream(app, body)
    assert done
    (pid,) = _replica_pids("Engine").values()

    def kill_at_third(n: int) -> None:
        if n == 3:
            _sigkill(pid)

    frames, done = _composed_stream(app, body, kill_at_third)
    assert done and "error" in frames[-1], frames[-3:]  # in-band error, then [DONE]
    assert frames[-1]["error"]["code"] in (500, 503), frames[-1]
    # While the replacement starts: 503 + Retry-After. (A call Serve held until the replacement ran
    # would have succeeded instead: the 503 is the answer at once.)
    first, _ = _composed_stream(app, body)
    assert first[0].get("status") == 503 and first[0]["retry_after"], first[:1]
    deadline = time.monotonic() + 300
    while True:  # what the failure-modes table says: a 503, or an in-band error, is retried
        frames, done = _composed_stream(app, body)
        if done and not _joined(frames)["errors"]:
            break
        unavailable = frames[0].get("status") == 503 if not done else frames[-1]["error"]["code"] == 503
        assert unavailable and time.monotonic() < deadline, frames[-1:]
        time.sleep(1)
    assert _joined(frames) == _joined(clean)
    _wait_healthy(app)


# --- drain: scale-down with streams open ----------------------------------------------------------


def test_scale_down_with_streams_open_loses_nothing(app, tok, parser_inputs):
    """Ingress 2 -> 1 and ParserDerender 2 -> 1 while composed streams and parser streams are open:
    a replica going away finishes what it holds (Ingress: graceful_shutdown_timeout_s), parser
    streams continue on the survivor (replaying their carried state), and every output equals a
    clean run's without a single error."""
    prompt, output = parser_inputs
    clean_parser, _ = _parser_stream(app, "drain-clean", prompt, output)
    body = _composed_body(tok, LONG_ANSWER)
    clean_composed, done = _composed_stream(app, body)
    assert done
    _wait_running("Ingress", 2)  # a replica killed by an earlier test may still be starting
    _wait_running("ParserDerender", 2)
    opened = threading.Barrier(4 + 1)
    stop = threading.Event()

    def on_frame(n: int) -> None:
        if n == 2:
            opened.wait(timeout=120)

    def parser_client(n: int) -> list[tuple[list[dict], int]]:
        runs = []
        while not stop.is_set():
            runs.append(_parser_stream(app, f"drain-{n}-{len(runs)}", prompt, output))
        return runs

    with ThreadPoolExecutor(6) as pool:
        parsers = [pool.submit(parser_client, n) for n in range(2)]
        composed = [pool.submit(_composed_stream, app, body, on_frame) for _ in range(4)]
        opened.wait(timeout=120)
        _deploy(ingress_replicas=1, parser_replicas=1)
        deadline = time.monotonic() + 180
        while (_running("Ingress"), _running("ParserDerender")) != (1, 1):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        stop.set()
        composed_results = [f.result() for f in composed]
        parser_runs = [run for f in parsers for run in f.result()]
    for frames, done in composed_results:
        assert done and _joined(frames) == _joined(clean_composed)
    assert parser_runs
    for chunks, unavailable in parser_runs:
        assert chunks == clean_parser and unavailable == 0
    _deploy()  # back to two of each for whatever runs next
    _wait_healthy(app)
