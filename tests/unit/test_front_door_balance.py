"""make run's front-door hash (serve_app.front_door.HAPROXY_BALANCE) on the HAProxy Ray 2.60 ships.

No Ray here: Ray writes RAY_SERVE_HAPROXY_BALANCE_ALGORITHM verbatim after ``balance`` in its config's
``defaults`` section (checked on Ray's template), so the same ``defaults`` lines are put in front of three
tiny HTTP backends that answer their own name. The end to end proof on ``serve run`` is
tests/e2e/test_serve_run.py (header-less chunks are session-cache hits on the Ingress replicas).
"""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from serve_app.errors import RETRY_AFTER_S
from serve_app.front_door import HAPROXY_BALANCE, hashes_stream_id
from tests.harness.net import free_port


def _haproxy() -> str:
    from ray.serve._private.haproxy import get_haproxy_binary

    return get_haproxy_binary()


def test_ray_writes_the_setting_verbatim_into_defaults():
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    defaults = HAPROXY_CONFIG_TEMPLATE.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "    balance {{ config.balance_algorithm }}" in defaults.splitlines()


def test_hashes_stream_id_reads_make_runs_environment():
    assert hashes_stream_id({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": HAPROXY_BALANCE})
    assert not hashes_stream_id({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-session-id)"})
    assert not hashes_stream_id({"RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": HAPROXY_BALANCE})  # no HAProxy: Serve's proxy


def _backend(name: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = name.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def front_door(tmp_path_factory):
    backends = {name: _backend(name) for name in ("r1", "r2", "r3")}
    port, down_port, closed_port = (free_port() for _ in range(3))
    plain_500 = tmp_path_factory.mktemp("errors") / "500.http"  # what Ray writes (haproxy.py, 500.http)
    plain_500.write_text(
        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n\r\nInternal Server Error"
    )
    servers = "\n".join(f"    server {n} 127.0.0.1:{b.server_address[1]}" for n, b in backends.items())
    config = (
        "global\n    maxconn 100\n    tune.bufsize 16384\n"  # Ray's default bufsize
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n"
        + "".join(f"    errorfile {code} {plain_500}\n" for code in (502, 503, 504))  # Ray's, before `balance`
        + f"    balance {HAPROXY_BALANCE}\n"  # as Ray's template writes it
        f"frontend fe\n    bind 127.0.0.1:{port}\n    default_backend be\nbackend be\n{servers}\n"
        f"frontend fe_down\n    bind 127.0.0.1:{down_port}\n    default_backend down\n"
        f"backend down\n    server gone 127.0.0.1:{closed_port}\n"  # no replica listening
    )
    path: Path = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    path.write_text(config)
    check = subprocess.run([_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([_haproxy(), "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/chat/completions/derender"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.post(url, content=b"{}", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
    try:
        yield url, down_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for b in backends.values():
            b.shutdown()


def _chunk(stream: str, carried_tokens: int, state_first: bool = False) -> bytes:
    """A streaming derender body as vLLM's API document lays it out (generate_chunk before the growing
    stream_state), or with the state first."""
    chunk = {"request_id": stream, "choices": [{"index": 0, "token_ids": [9707], "finish_reason": None}]}
    state = {"output_token_ids": [151667] * carried_tokens, "output_chunk_lens": [1] * carried_tokens}
    body = {"stream": True, "model": "qwen3-tiny", "generate_chunk": chunk, "stream_state": state}
    if state_first:
        body = {"stream": True, "stream_state": state, "generate_chunk": chunk}
    return json.dumps({**body, "prompt_token_ids": [1] * 300, "chat_request": {"messages": []}}).encode()


def test_every_chunk_of_a_stream_reaches_one_backend_at_any_body_size(front_door):
    """Bodies from a few hundred bytes to well past HAProxy's 16 KiB buffer (a long stream's state):
    each stream's chunks land on one backend, and different streams spread over all three."""
    url, _ = front_door
    landed: dict[str, set[str]] = collections.defaultdict(set)
    with httpx.Client(timeout=30) as c:  # one client, one connection: only the body tells streams apart
        for carried in (0, 100, 1000, 5000, 20000):
            for s in range(24):
                landed[f"chatcmpl-{s}"].add(c.post(url, content=_chunk(f"chatcmpl-{s}", carried)).text)
    assert all(len(backends) == 1 for backends in landed.values()), landed
    assert set().union(*landed.values()) == {"r1", "r2", "r3"}


def test_a_body_without_the_id_in_the_buffer_is_balanced_not_refused(front_door):
    """State first and past the buffer: the id is not seen, HAProxy falls back to round-robin (the
    Ingress then misses and replays: right, slower); nothing is refused."""
    url, _ = front_door
    with httpx.Client(timeout=30) as c:
        answers = [c.post(url, content=_chunk("late-id", 20000, state_first=True)) for _ in range(6)]
        other = c.post(url.replace("/v1/chat/completions/derender", "/v1/chat/completions/render"), content=b'{"messages": []}')
    assert all(a.status_code == 200 for a in answers) and other.status_code == 200
    assert len({a.text for a in answers}) > 1


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    return int(status_line.split()[1]), {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}, body


def test_haproxys_own_answers_are_vllms_envelope(front_door):
    """No replica to take a request: HAProxy's own answer is vLLM's envelope, a 503 with Retry-After,
    over Ray's plain-text `errorfile` 500. (A request that is not HTTP at all still gets HAProxy's
    HTML 400: its parser answers before `http-error` applies. Checked here so a change shows.)"""
    url, down_port = front_door
    port = httpx.URL(url).port
    status, headers, body = _raw(port, b"GET /health HTTP/1.1\r\nHost: a\r\nno colon here\r\n\r\n")
    assert status == 400 and headers["content-type"] == "text/html", (status, headers, body)
    status, headers, body = _raw(down_port, b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S), (status, headers, body)
    assert json.loads(body)["error"] == {
        "message": "No Ingress replica is available, retry later.", "type": "ServiceUnavailableError", "param": None, "code": 503
    }
