"""Each builtin model directory starts vLLM's own reference server, ``vllm launch render DIR``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import BUILTINS
from tests.harness.net import free_port


@pytest.mark.parametrize("name", BUILTINS)
def test_launch_render_serves_the_builtin(name: str, model_dirs: dict[str, Path], tmp_path: Path):
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    cmd = [sys.executable, "-m", "serve_app.vllm_cli", "launch", "render", str(model_dirs[name]), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vllm launch render did not come up"
            time.sleep(1)
        messages = [{"role": "user", "content": "Hello there"}]
        rendered = httpx.post(f"{url}/v1/chat/completions/render", json={"messages": messages}, timeout=30).json()
        tok = AutoTokenizer.from_pretrained(model_dirs[name])
        expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert rendered["token_ids"] == list(expected)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
