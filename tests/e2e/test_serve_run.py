"""The README's run command: ``serve run serve_config.yaml`` comes up offline and answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def test_serve_run_serve_config(tmp_path: Path):
    serve_cli = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
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
            models = httpx.get("http://127.0.0.1:8000/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["qwen3-tiny"]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
