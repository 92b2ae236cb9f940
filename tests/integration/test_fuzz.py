"""Property-based fuzzing of every route over real HTTP: hostile input never gets a 5xx.

Valid bodies for each route (``tests/hostile.py``: chat_request tools and tool_choice, logprob
entries, prompt_logprobs, stream_state, every depth a client can send) are mutated one value at a
time, wherever it sits (wrong types, huge and deeply nested values, out-of-range numbers, lone
surrogates, dropped fields, unknown keys and list entries), and raw random bytes are posted too. Every
answer must be a 2xx (for the harmless mutations) or a 4xx in vLLM's error envelope: never a 5xx,
a hang or a dropped connection. Afterwards the app is still healthy and still answers correctly.

Below the body: byte-level headers and raw HTTP framing over a socket, and aborts sent concurrently
with many streams in flight (every stream still ends properly, the engine ends up holding nothing).
Some hostile bytes never reach the app: Serve's Python proxy (uvicorn, httptools) answers a request
that is not valid HTTP with its own plain-text 400, and Serve decodes some headers as UTF-8 before
the app runs (see ``proxy_answer_expected``); for those the test asserts an answer or a close, never
a hang, and that the app still answers afterwards.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import EXAMPLES, HEADER_NAME, HEADER_VALUE, MESSAGES, PROMPT, PROXY_DECODED_VALUES, ROUTES, mutations

RAW = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"NaN", b'{"messages": NaN}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000]),
)


def _post(client: httpx.Client, route: str, body: Any) -> httpx.Response:
    # json.dumps escapes to ASCII, so lone surrogates travel as valid JSON text; huge ints are written
    # out in full here (the server's own limit is what is under test).
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        content = json.dumps(body).encode()
    finally:
        sys.set_int_max_str_digits(limit)
    return client.post(route, content=content, headers={"content-type": "application/json"})


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str) and error["type"]


@pytest.fixture(scope="module")
def client(engine_app_url: str):
    with httpx.Client(base_url=engine_app_url, timeout=120) as c:
        yield c


FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize(("route", "body"), EXAMPLES, ids=[f"{r}{' stream' if b.get('stream') else ''}" for r, b in EXAMPLES])
@FUZZ
@given(data=st.data())
def test_mutated_bodies_never_get_a_5xx(client, route, body, data):
    _check(_post(client, route, data.draw(mutations(body))))


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(raw=RAW)
def test_raw_bytes_never_get_a_5xx(client, route, raw):
    _check(client.post(route, content=raw, headers={"content-type": "application/json"}))


def test_the_app_is_healthy_and_correct_afterwards(client):
    assert client.get("/health").status_code == 200
    rendered = client.post("/v1/chat/completions/render", json={"messages": MESSAGES}).json()
    assert rendered["token_ids"][-3:] == [151644, 77091, 198]
    out = client.post("/v1/completions/derender", json=ROUTES["/v1/completions/derender"]).json()
    assert out["choices"][0]["text"] == "Hello world"


# --- byte-level headers and raw framing, over a socket -------------------------------------------

HANG_GUARD_S = 120  # a socket read this long without a byte is a hang (generous: a loaded CI machine)
PARSER_400 = b"Invalid HTTP request received."  # uvicorn's own answer to bytes that are not HTTP


def _address(url: str) -> tuple[str, int, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/")


def _exchange(url: str, data: bytes, half_close: bool = False) -> bytes:
    """Send raw bytes, read until the server closes (every request here says ``Connection: close``,
    or is one the server must close on). A read that stalls past the guard fails the test as a hang."""
    host, port, _ = _address(url)
    with socket.create_connection((host, port), timeout=HANG_GUARD_S) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                pytest.fail(f"no answer and no close within {HANG_GUARD_S}s: {data[:200]!r}")
            except ConnectionResetError:
                return out
            if not piece:
                return out
            out += piece


def _responses(raw: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Parse the HTTP/1.1 responses in ``raw``, in order: (status, headers, decoded body)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                body, rest = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
        else:
            size = int(headers.get(b"content-length", len(rest)))
            body, rest = rest[:size], rest[size:]
        out.append((status, headers, body))
        raw = rest
    return out


def _check_raw(status: int, headers: dict[bytes, bytes], body: bytes, proxy_may_answer: bool) -> None:
    assert status < 500 or proxy_may_answer, (status, body[:500])
    if status >= 400 and body != PARSER_400 and status < 500:  # the app's own 4xx: vLLM's envelope
        error = json.loads(body)["error"]
        assert error["code"] == status and isinstance(error["message"], str) and error["type"], body[:500]
        assert set(error) >= {"message", "type", "param", "code"}
    if body == PARSER_400:
        assert status == 400


def proxy_answer_expected(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when Serve's proxy, not the app, may answer: a header name that is not UTF-8, or a
    non-UTF-8 value in a header Serve decodes (``PROXY_DECODED_VALUES``). Serve raises
    ``UnicodeDecodeError`` there before routing; it is Ray's code, the app never sees the request."""

    def utf8(b: bytes) -> bool:
        try:
            b.decode()
        except UnicodeDecodeError:
            return False
        return True

    return any(not utf8(n) or (n.lower() in PROXY_DECODED_VALUES and not utf8(v)) for n, v in headers)


def serve_timeout(headers: list[tuple[bytes, bytes]]) -> bool:
    """A positive ``x-request-timeout-seconds``: Serve's proxy times the request out itself (its own 408)."""
    for name, value in headers:
        if name.lower() == b"x-request-timeout-seconds":
            try:
                return float(value.decode()) > 0
            except ValueError:
                return False
    return False


def _request(base: str, route: str, body: bytes, headers: list[tuple[bytes, bytes]], method: bytes = b"POST") -> bytes:
    _, _, prefix = _address(base)
    names = {n.lower() for n, _ in headers}
    fixed = [(b"host", b"127.0.0.1"), (b"connection", b"close"), (b"content-length", str(len(body)).encode())]
    if b"content-type" not in names:
        fixed.append((b"content-type", b"application/json"))
    lines = [method + b" " + (prefix + route).encode() + b" HTTP/1.1"] + [n + b": " + v for n, v in fixed + headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


HEADERS = st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), min_size=1, max_size=3, unique_by=lambda h: h[0].lower())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from([*ROUTES, "/health", "/v1/models"]), headers=HEADERS)
def test_byte_level_headers_never_get_a_5xx_from_the_app(engine_app_url, route, headers):
    method = b"GET" if route in ("/health", "/v1/models") else b"POST"
    body = json.dumps(ROUTES.get(route, {})).encode() if method == b"POST" else b""
    raw = _exchange(engine_app_url, _request(engine_app_url, route, body, headers, method))
    proxy = proxy_answer_expected(headers)
    if not raw:  # closed without an answer: only acceptable where the proxy, not the app, has the request
        assert proxy
        return
    (status, resp_headers, resp_body), *_ = _responses(raw)
    if status == 408:  # Serve's request timeout, its plain-text page; only when the client asked for one
        assert serve_timeout(headers), resp_body[:500]
        return
    _check_raw(status, resp_headers, resp_body, proxy)
    if status >= 500:  # the proxy's own 500 (Ray decodes the header as UTF-8), not the app's envelope
        assert b'"error"' not in resp_body, resp_body[:500]


def _bad_chunks() -> list[bytes]:
    return [b"zz\r\n{}\r\n0\r\n\r\n", b"-1\r\n{}\r\n0\r\n\r\n", b"ffffffffffffffffffff\r\n{}\r\n0\r\n\r\n", b"5\r\n{}\r\n0\r\n\r\n",
            b"2\r\n{}\r\n", b"2;ext=\xff\r\n{}\r\n0\r\n\r\n"]


def _framing_cases(prefix: str) -> list[tuple[str, bytes, bool]]:
    """(name, bytes, half-close after sending)."""
    body = json.dumps(ROUTES["/tokenize"]).encode()
    head = f"POST {prefix}/tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
    cases = [
        ("truncated body", head + b"content-length: 1000\r\n\r\n" + body[:20], True),
        ("content-length smaller than the body", head + b"connection: close\r\ncontent-length: 5\r\n\r\n" + body, True),
        ("two differing content-lengths", head + b"content-length: 5\r\ncontent-length: 9\r\n\r\n" + body, True),
        ("content-length and chunked", head + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", True),
        ("negative content-length", head + b"content-length: -1\r\n\r\n" + body, True),
        ("body without content-type", f"POST {prefix}/tokenize HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".encode()
         + f"content-length: {len(body)}\r\n\r\n".encode() + body, False),
        ("garbage request line", b"GARBAGE\r\n\r\n", True),
        ("binary request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", True),
        ("unknown HTTP version", f"GET {prefix}/health HTTP/9.9\r\nhost: x\r\n\r\n".encode(), True),
        ("long path", f"GET {prefix}/{'a' * 20000} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(), False),
        ("header line without a colon", f"GET {prefix}/health HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n".encode(), True),
        ("absolute-form target",
         f"GET http://evil.example{prefix}/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(), False),
        ("headers never finished", head + b"content-length: 2\r\n", True),
    ]
    cases += [(f"bad chunked body {i}", head + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + c, True)
              for i, c in enumerate(_bad_chunks())]
    return cases


def _alive(engine_app_url: str) -> None:
    assert httpx.get(engine_app_url + "/health", timeout=60).status_code == 200
    resp = httpx.post(engine_app_url + "/tokenize", json=ROUTES["/tokenize"], timeout=60)
    assert resp.status_code == 200 and resp.json()["tokens"][-3:] == [151644, 77091, 198]


@pytest.mark.parametrize("index", range(len(_framing_cases(""))), ids=[c[0] for c in _framing_cases("")])
def test_raw_framing_never_gets_a_5xx_or_hangs(engine_app_url, index):
    _, data, half_close = _framing_cases(_address(engine_app_url)[2])[index]
    for status, headers, body in _responses(_exchange(engine_app_url, data, half_close)):
        _check_raw(status, headers, body, proxy_may_answer=False)
    _alive(engine_app_url)


def test_pipelined_requests_are_answered_in_order(engine_app_url):
    prefix = _address(engine_app_url)[2]
    tokenize, detokenize = (json.dumps(ROUTES[r]).encode() for r in ("/tokenize", "/detokenize"))
    data = (f"GET {prefix}/health HTTP/1.1\r\nhost: x\r\n\r\n".encode()
            + f"POST {prefix}/tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
            + f"content-length: {len(tokenize)}\r\n\r\n".encode()
            + tokenize
            + f"POST {prefix}/detokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
            + f"content-length: {len(detokenize)}\r\nconnection: close\r\n\r\n".encode() + detokenize)
    answers = _responses(_exchange(engine_app_url, data))
    assert [a[0] for a in answers] == [200, 200, 200]
    assert json.loads(answers[1][2])["tokens"][-3:] == [151644, 77091, 198]
    assert json.loads(answers[2][2])["prompt"] == "Hello world"


# --- concurrent aborts --------------------------------------------------------------------------

LONG = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}  # runs until aborted (seconds of CPU decoding)


def _engine_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Engine", app_name="engine_app").stats.remote().result(timeout_s=30)


def _wait_idle(timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _engine_stats()["num_unfinished_requests"]:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.2)


def _stream_spec(kind: str, rid: str, long: bool) -> tuple[str, dict[str, Any], list[str]]:
    """(route, body, the ids the engine knows the request by) for a stream with ``X-Request-Id: rid``."""
    if kind == "generate":
        params = LONG if long else {"temperature": 0, "max_tokens": 3}
        return "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": params, "stream": True}, [f"generate-tokens-{rid}"]
    extra = {k: v for k, v in LONG.items()} if long else {"max_tokens": 3, "temperature": 0}
    body = {"messages": MESSAGES, "stream": True, **extra}
    return "/v1/chat/completions", body, [f"generate-tokens-chatcmpl-{rid}"]


def _read_stream(url: str, route: str, body: dict[str, Any], rid: str, started: threading.Event) -> list[Any]:
    """Every SSE event of one stream; ``started`` is set once its first event arrived (it is in the engine)."""
    events: list[Any] = []
    try:
        with httpx.stream("POST", url + route, json=body, headers={"X-Request-Id": rid}, timeout=HANG_GUARD_S) as resp:
            assert resp.status_code == 200, resp.read()[:500]
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
    finally:
        started.set()
    return events


def _finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", []) if c.get("finish_reason")]


ID_TEXT = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=40)
NOISE_IDS = st.lists(st.one_of(ID_TEXT, st.sampled_from(["generate-tokens-unknown", "x" * 256])), max_size=5)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(["generate", "chat"]), min_size=2, max_size=6),
    short=st.lists(st.sampled_from(["generate", "chat"]), max_size=3),
    noise=st.lists(NOISE_IDS, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_concurrent_aborts_end_every_stream(engine_app_url, kinds, short, noise, seed):
    """Long streams (generate and composed chat) are aborted by id while short ones run and abort
    requests with unknown, duplicate, empty and maximal id lists come in from other threads: every
    stream ends with a finish and ``[DONE]``, the long ones with ``abort``; no 5xx; the engine is left
    holding nothing and still answers."""
    rng = random.Random(seed)
    run = f"{seed}-{time.monotonic_ns()}"
    specs = [(f"long-{run}-{i}", *_stream_spec(k, f"long-{run}-{i}", True)) for i, k in enumerate(kinds)]
    specs += [(f"short-{run}-{i}", *_stream_spec(k, f"short-{run}-{i}", False)) for i, k in enumerate(short)]
    started = {rid: threading.Event() for rid, *_ in specs}
    with ThreadPoolExecutor(len(specs) + 8) as pool:
        streams = {rid: pool.submit(_read_stream, engine_app_url, route, body, rid, started[rid]) for rid, route, body, _ in specs}
        for rid, *_ in specs:
            if rid.startswith("long"):
                assert started[rid].wait(HANG_GUARD_S), f"{rid} never started"
        # abort bodies: every long stream's id (some twice, in several requests), the short ones' ids
        # (they may or may not have finished), unknown ids, an empty list, and the largest list allowed
        targets = [i for rid, _, _, ids in specs for i in ids * rng.randint(1, 2)]
        rng.shuffle(targets)
        bodies = [{"request_ids": targets[i::3]} for i in range(3)] + [{"request_ids": n} for n in noise]
        bodies += [{"request_ids": []}, {"request_ids": [f"unknown-{i}" for i in range(1024)]}]
        rng.shuffle(bodies)
        paths = ["/inference/v1/abort_requests", "/abort_requests"]
        aborts = [pool.submit(httpx.post, engine_app_url + rng.choice(paths), json=b, timeout=HANG_GUARD_S) for b in bodies]
        answers = [a.result() for a in aborts]
        results = {rid: f.result(timeout=HANG_GUARD_S) for rid, f in streams.items()}
    for resp in answers:
        assert resp.status_code == 200 and resp.content == b"", resp.text[:500]
    for rid, events in results.items():
        assert events and events[-1] == "[DONE]", (rid, events[-3:])
        reasons = _finish_reasons(events)
        assert reasons, (rid, events[-3:])
        assert reasons[-1] == "abort" if rid.startswith("long") else reasons[-1] in ("length", "abort"), (rid, reasons)
    _wait_idle()
    out = httpx.post(engine_app_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=HANG_GUARD_S)
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"


def test_an_abort_before_the_first_token_finishes_the_stream(engine_app_url):
    """The engine runs at most 16 sequences (``max_num_seqs``): with 16 long streams running, a 17th
    waits for a slot and gets no token. Aborted by id while it waits, its stream (generate and the
    composed chat) is a finished stream, ``finish_reason: "abort"`` and ``[DONE]``, not a 400."""
    max_num_seqs = 16  # tests/conftest.py CPU_ENGINE
    run = str(time.monotonic_ns())
    fillers = [(f"fill-{run}-{i}", *_stream_spec("generate", f"fill-{run}-{i}", True)) for i in range(max_num_seqs)]
    held = [(f"held-{run}-{k}", *_stream_spec(k, f"held-{run}-{k}", True)) for k in ("generate", "chat")]
    started = {rid: threading.Event() for rid, *_ in fillers + held}
    with ThreadPoolExecutor(len(started)) as pool:
        streams = {rid: pool.submit(_read_stream, engine_app_url, route, body, rid, started[rid])
                   for rid, route, body, _ in fillers}
        for rid, *_ in fillers:
            assert started[rid].wait(HANG_GUARD_S), f"{rid} never started"
        streams |= {rid: pool.submit(_read_stream, engine_app_url, route, body, rid, started[rid]) for rid, route, body, _ in held}
        deadline = time.monotonic() + HANG_GUARD_S
        while _engine_stats()["num_unfinished_requests"] < max_num_seqs + len(held):  # both are in the engine, waiting
            assert time.monotonic() < deadline, _engine_stats()
            time.sleep(0.1)
        assert not any(started[rid].is_set() for rid, *_ in held)  # held back: no first frame yet
        held_ids = [i for *_, ids in held for i in ids]
        assert httpx.post(engine_app_url + "/abort_requests", json={"request_ids": held_ids}, timeout=60).status_code == 200
        held_events = {rid: streams[rid].result(timeout=HANG_GUARD_S) for rid, *_ in held}
        fill_ids = [i for *_, ids in fillers for i in ids]
        assert httpx.post(engine_app_url + "/abort_requests", json={"request_ids": fill_ids}, timeout=60).status_code == 200
        for rid, *_ in fillers:
            streams[rid].result(timeout=HANG_GUARD_S)
    for rid, events in held_events.items():
        assert events[-1] == "[DONE]", (rid, events)
        assert _finish_reasons(events) == ["abort"], (rid, events)
        tokens = [t for e in events if isinstance(e, dict) for c in e["choices"] for t in (c.get("token_ids") or [])]
        text = "".join((c.get("delta") or {}).get("content") or "" for e in events if isinstance(e, dict) for c in e["choices"])
        assert tokens == [] and text == "", (rid, events)  # it never got a token
    _wait_idle()
