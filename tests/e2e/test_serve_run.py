"""The README's run command: ``serve run serve_config.yaml`` comes up offline and answers.

``serve run`` starts its own Ray here, so the cluster declares this machine's real CPU count: the
shipped resource plan must bring every replica to RUNNING on it (``/ready``). The front door tests
below use the same cluster: raw bytes in headers, trailing slashes, HEAD, slow clients.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:8000"


def _makefile_serve_env() -> dict[str, str]:
    """``make run``'s environment: SERVE_ENV's pairs and FRONT_DOOR_BALANCE (front_door.HAPROXY_BALANCE)."""
    from serve_app.front_door import HAPROXY_BALANCE

    text = (ROOT / "Makefile").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("SERVE_ENV :="))
    assert 'RAY_SERVE_HAPROXY_BALANCE_ALGORITHM="$$($(VENV)/bin/python -m serve_app.front_door)"' in text
    return dict(kv.split("=", 1) for kv in shlex.split(line.split(":=", 1)[1])) | {"RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": HAPROXY_BALANCE}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``serve run serve_config.yaml`` with the Makefile's SERVE_ENV, up and ready (every replica RUNNING);
    the tests of this module share it. Yields the log path."""
    serve_cli = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= _makefile_serve_env()  # exactly what `make run` starts Serve with
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path_factory.mktemp("serve_run") / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(serve_cli), "run", "serve_config.yaml"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                try:
                    if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(1)
            while (ready := httpx.get(f"{URL}/ready", timeout=10)).status_code != 200:
                # 503 + Retry-After, naming the deployments still waiting, until every replica runs.
                assert ready.status_code == 503 and ready.headers["retry-after"], ready.text
                assert time.monotonic() < deadline, ready.text + log_path.read_text()[-4000:]
                time.sleep(1)
            yield log_path
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_serve_run_serve_config(served):
    models = httpx.get(f"{URL}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["qwen3-tiny"]
    messages = [{"role": "user", "content": "Hello"}]
    rendered = _post_until_ready("/v1/chat/completions/render", {"messages": messages})
    assert rendered["token_ids"][-3:] == [151644, 77091, 198]  # "<|im_start|>assistant\n"
    derendered = _post_until_ready(
        "/v1/completions/derender",
        {"generate_responses": [{"request_id": "g", "choices": [{"index": 0, "token_ids": [9707, 1879]}]}]},
    )
    assert derendered["choices"][0]["text"] == "Hello world"
    _parser_streams_stay_on_one_ingress(rendered["token_ids"])
    _headerless_streams_stay_on_one_ingress(rendered["token_ids"])


def _post_until_ready(path: str, body: dict) -> dict:
    # The front door may answer before every replica behind it is serving.
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post(URL + path, json=body, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(1)


def _parser_streams_stay_on_one_ingress(prompt: list[int]) -> None:
    """Two Ingress replicas derender parser streams themselves (colocate_in_ingress): a stream sent with
    ``x-session-id`` keeps reaching the replica holding its live parser because HAProxy hashes the
    header (the Makefile's SERVE_ENV), so its chunks are session-cache hits (a miss would replay)."""
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model
    from tests.integration.test_colocation import session_outcomes
    from tests.integration.test_parser_derender import OUTPUT, _stream_http

    tok = AutoTokenizer.from_pretrained(ensure_model("qwen3-tiny"))
    output = tok.encode(OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]
    outcomes = [session_outcomes("http://127.0.0.1:8000")]
    for stream in range(4):  # several ids: both replicas get some
        chunks = _stream_http("http://127.0.0.1:8000", f"e2e-{stream}", prompt, output, headers={"x-session-id": f"e2e-{stream}"})
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        outcomes.append(session_outcomes("http://127.0.0.1:8000"))
    hits = outcomes[-1].get("hit", 0) - outcomes[0].get("hit", 0)
    misses = outcomes[-1].get("miss", 0) - outcomes[0].get("miss", 0)
    # One miss at most: HAProxy may add the second replica as a backend during the first stream.
    assert hits >= 4 * (len(output) - 1) - 1 and misses <= 1, (hits, misses)


def _session_caches(base_url: str) -> dict[str, float]:
    """Live parser sessions per replica holding them (``Ingress:<id>`` or a ParserDerender replica), from /metrics."""
    prefix = 'serve_app_parser_session_cache_sessions{replica="'
    lines = httpx.get(base_url + "/metrics", timeout=30).text.splitlines()
    return {ln[len(prefix) :].split('"', 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix)}


def _headerless_streams_stay_on_one_ingress(prompt: list[int]) -> None:
    """A client that speaks only vLLM's API (no x-session-id) gets the same: HAProxy hashes each chunk's
    generate_chunk.request_id (front_door.HAPROXY_BALANCE), so every chunk after the first is a hit in
    the cache of the Ingress replica that parsed the first, and ParserDerender holds none of the streams.
    The streams are left unfinished, so their sessions are still cached when /metrics is read."""
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model
    from tests.integration.test_colocation import session_outcomes
    from tests.integration.test_parser_derender import OUTPUT, _chunk_body

    tok = AutoTokenizer.from_pretrained(ensure_model("qwen3-tiny"))
    output = tok.encode(OUTPUT)
    before, caches_before = session_outcomes(URL), _session_caches(URL)
    streams = 6
    with httpx.Client(base_url=URL, timeout=60) as c:  # one client for all: chunks share its connections
        states: dict[str, object] = {}
        for token in output:
            for s in range(streams):  # interleaved, as concurrent streams arrive
                sid = f"e2e-nohdr-{s}"
                r = c.post("/v1/chat/completions/derender", json=_chunk_body(sid, [token], False, states.get(sid), prompt))
                assert r.status_code == 200, r.text
                states[sid] = r.json()["stream_state"]
    after, caches_after = session_outcomes(URL), _session_caches(URL)
    hits = after.get("hit", 0) - before.get("hit", 0)
    misses = after.get("miss", 0) - before.get("miss", 0)
    # One miss at most, as above (a backend HAProxy adds mid-stream); a replay would be a miss.
    assert hits >= streams * (len(output) - 1) - 1 and misses <= 1, (hits, misses)

    def grown(kind: bool) -> float:
        return sum(v - caches_before.get(r, 0) for r, v in caches_after.items() if r.startswith("Ingress:") == kind)

    assert streams <= grown(True) <= streams + misses and grown(False) == 0, (caches_before, caches_after)


# --- the front door as `make run` starts it (issue 19, class 6; docs/operations.md, "Front door") ---

HANG_GUARD_S = 180  # a client gives up after this long: only a hang reaches it


def _raw(request: bytes, *, trickle: bytes = b"", every_s: float = 0.5) -> tuple[bytes, int]:
    """Send ``request`` on a fresh connection, then ``trickle`` one byte every ``every_s`` until the
    server answers; read the answer until the server closes. Returns (answer, trickle bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", 8000), timeout=HANG_GUARD_S)
    with sock:
        sock.sendall(request)
        sent, deadline = 0, time.monotonic() + HANG_GUARD_S
        while sent < len(trickle) and not select.select([sock], [], [], every_s)[0]:
            assert time.monotonic() < deadline, "the server held a trickling client"
            sock.sendall(trickle[sent : sent + 1])
            sent += 1
        answer = b""
        while chunk := sock.recv(65536):  # to the server's close (socket timeout: the hang guard)
            answer += chunk
        return answer, sent


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _envelope(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer
    return json.loads(body)["error"]


def _request(method: str, path: str, *headers: bytes, body: bytes = b"") -> bytes:
    """Raw HTTP/1.1 bytes (the connection closes after the answer)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: t", *headers, b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


STRICT = [b"x-request-id", b"x-session-id", b"x-request-timeout-seconds", b"x-request-disconnect-disabled", b"serve_multiplexed_model_id"]


@pytest.mark.parametrize("name", STRICT)
@pytest.mark.parametrize("value", [b"\xff", b"a\x80b", b"caf\xe9", b"\xed\xa0\x80"])  # not UTF-8: stray, latin-1, a surrogate
def test_a_raw_byte_in_a_header_ray_decodes_is_a_400_envelope(served, name, value):
    body = b'{"messages": [{"role": "user", "content": "Hi"}]}'
    for request in (
        _request("GET", "/v1/models", name + b": " + value),
        _request("POST", "/v1/chat/completions/render", b"Content-Type: application/json", name + b": " + value, body=body),
    ):
        answer, _ = _raw(request)
        assert _status(answer) == 400, answer
        error = _envelope(answer)
        assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, name.decode())


def test_a_raw_byte_in_a_header_name_is_haproxys_400(served):
    answer, _ = _raw(_request("GET", "/health", b"X-\xff: 1"))
    assert _status(answer) == 400  # HAProxy's own page (HTML: docs/operations.md, "Front door")
    assert httpx.get(f"{URL}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/health/", "/v1/models/", "/ready/", "/v1/chat/completions/render/"])
def test_a_trailing_slash_is_the_404_envelope_not_a_redirect_to_the_clients_host(served, path):
    r = httpx.request("GET", URL + path, headers={"host": "evil.example"}, timeout=10, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"] == {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}


@pytest.mark.parametrize("path", ["/health", "/ready", "/version", "/v1/models"])
def test_head_answers_200_like_get(served, path):
    r = httpx.head(URL + path, timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_slow_clients_are_answered_and_closed_not_held(served):
    """Three slow clients at once, each waiting at most the hang guard: a body trickled at 2 B/s gets the
    408 envelope while it is still trickling (HAProxy, which waits for a body to hash its stream id,
    bounds the whole request's arrival: `timeout http-request 20s` with a JSON errorfile,
    serve_app/front_door.py; a body past its buffer reaches BodyDeadlineMiddleware's same 20 s); a
    client that stops in the middle of its headers, and one that sends nothing, get HAProxy's 408 too.
    Each connection is then closed by the server."""
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 10_000 + b'"}]}'
    head = b"POST /v1/chat/completions/render HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    trickled_body = head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    with ThreadPoolExecutor(3) as pool:
        body_client = pool.submit(_raw, trickled_body, trickle=body)
        stalled_headers = pool.submit(_raw, head + b"X-Slow: ab")
        silent = pool.submit(_raw, b"")
        (body_answer, sent), (headers_answer, _), (silent_answer, _) = (f.result() for f in (body_client, stalled_headers, silent))
    assert _status(body_answer) == 408 and sent < len(body), (body_answer, sent)
    error = _envelope(body_answer)
    assert (error["type"], error["code"]) == ("RequestTimeoutError", 408)
    assert _status(headers_answer) == 408 and _status(silent_answer) == 408
    assert httpx.get(f"{URL}/health", timeout=10).status_code == 200


def _ray_series(name: str, **labels: str) -> float:
    """The sum of one of Ray's series over every metrics target this node's Ray lists for Prometheus
    (``prom_metrics_service_discovery.json``, the file Ray's docs point Prometheus at)."""
    from prometheus_client.parser import text_string_to_metric_families

    (group,) = json.loads(Path("/tmp/ray/session_latest/prom_metrics_service_discovery.json").read_text())
    total = 0.0
    for target in group["targets"]:
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
        except httpx.TransportError:
            continue
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == name and labels.items() <= s.labels.items())
    return total


def test_serves_http_series_count_requests_with_haproxys_metrics_log_off(served):
    """make run turns off HAProxy's per-request metrics log line (the Makefile's SERVE_ENV): the Ingress
    replicas then count Serve's HTTP series themselves, under the names the dashboard and alerts query."""
    assert _makefile_serve_env()["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == "0"
    series = {"application": "serve_app", "route": "/tokenize", "method": "POST"}
    before = _ray_series("ray_serve_num_http_requests_total", **series)
    bad_before = _ray_series("ray_serve_num_http_error_requests_total", **series)
    for _ in range(3):
        assert httpx.post(f"{URL}/tokenize", json={"model": "qwen3-tiny", "prompt": "hi"}, timeout=30).status_code == 200
    assert httpx.post(f"{URL}/tokenize", json={"model": "qwen3-tiny"}, timeout=30).status_code == 400
    # Replicas push each second and Ray's agent exports on its own cycle, so `before` may still lack an
    # earlier test's requests: at least these, then.
    deadline = time.monotonic() + 60
    while True:
        counts = [_ray_series(f"ray_serve_num_http_{kind}_total", **series) for kind in ("requests", "error_requests")]
        if counts[0] >= before + 4 and counts[1] >= bad_before + 1:
            break
        assert time.monotonic() < deadline, (before, bad_before, counts)
        time.sleep(1)


# --- the composed API as make run serves it: the Ingress reaches the Engine over Serve's gRPC ---


def _metric(name: str) -> float:
    """One unlabelled-sum series of the app's /metrics (the Engine's vLLM series, asked at the scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{URL}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_composed_stream_the_client_leaves_is_aborted_in_the_engine(served):
    """Under make run's Serve settings (user code on the replica's loop, the router on it too, gRPC between
    replicas): a composed stream runs to [DONE]; one whose client hangs up is aborted in the engine,
    which then generated far fewer than the max_tokens it would have run to."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=URL, timeout=120) as c:
        # Each Ingress replica's first composed request after /ready: not a 503 from an answer the
        # replica got while the Engine was still loading (health.StageHealth.down).
        for _ in range(4):
            r = c.post("/v1/chat/completions", json={**chat, "max_tokens": 8, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
        before = _metric("vllm:generation_tokens_total")
        with c.stream("POST", "/v1/chat/completions", json={**chat, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(5):
                next(events)
            assert _metric("vllm:num_requests_running") == 1
        deadline = time.monotonic() + 120  # a hang guard: an unaborted request runs all its 3000 tokens
        while _metric("vllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the engine still runs the stream the client left"
            time.sleep(0.2)
        added = _metric("vllm:generation_tokens_total") - before
        assert 5 <= added < 3000, added


def test_a_body_over_grpcs_default_message_cap_gets_the_engines_answer(served):
    """Under make run's settings the Ingress calls the Engine over Serve's gRPC, which caps a message at
    4 MiB unless told otherwise (the Makefile's SERVE_ENV: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=-1):
    a 9.6 MB generate body, under limits.max_body_bytes, whose call to the Engine pickles to 6 MB, gets
    the engine's own 400, not a 503 or gRPC's RESOURCE_EXHAUSTED as a 500."""
    import pickle

    ids = [151643] * 1_200_000
    assert len(pickle.dumps(ids, protocol=5)) > 5 << 20
    r = httpx.post(f"{URL}/inference/v1/generate", json={"token_ids": ids, "sampling_params": {"max_tokens": 2}}, timeout=120)
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert message.startswith("The decoder prompt (length 1200000) is longer than the maximum model length"), message
