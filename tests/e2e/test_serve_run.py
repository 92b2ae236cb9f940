"""The README's run command: ``serve run serve_config.yaml`` comes up offline and answers.

``serve run`` starts its own Ray here, so the cluster declares this machine's real CPU count: the
shipped resource plan must bring every replica to RUNNING on it (``/ready``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _makefile_serve_env() -> dict[str, str]:
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("SERVE_ENV :="))
    return dict(kv.split("=", 1) for kv in shlex.split(line.split(":=", 1)[1]))


def test_serve_run_serve_config(tmp_path: Path):
    serve_cli = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= _makefile_serve_env()  # exactly what `make run` starts Serve with
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(serve_cli), "run", "serve_config.yaml"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                try:
                    if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(1)
            while (ready := httpx.get("http://127.0.0.1:8000/ready", timeout=10)).status_code != 200:
                # 503 + Retry-After, naming the deployments still waiting, until every replica runs.
                assert ready.status_code == 503 and ready.headers["retry-after"], ready.text
                assert time.monotonic() < deadline, ready.text + log_path.read_text()[-4000:]
                time.sleep(1)
            models = httpx.get("http://127.0.0.1:8000/v1/models", timeout=10).json()
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
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _post_until_ready(path: str, body: dict) -> dict:
    # The front door may answer before every replica behind it is serving.
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post("http://127.0.0.1:8000" + path, json=body, timeout=30)
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

