"""The light path stays light: importing PlainDerender's modules pulls in no vLLM, torch or transformers."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("vllm", "torch", "transformers")


def test_plain_derender_imports_no_heavy_modules():
    code = (
        "import sys, serve_app.derender.plain, serve_app.ingress, serve_app.protocol;"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
