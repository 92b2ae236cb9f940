"""GPU-less render / derender tier for disaggregated LLM serving, on Ray Serve.

Wire-compatible with ``vllm launch render`` 0.32. The deployment graph is bound in
:mod:`serve_app.app`; ``serve run serve_config.yaml`` starts it.
"""

from __future__ import annotations

__all__ = ["AppArgs", "build_app"]


def __getattr__(name: str):  # lazy: importing the package must not pull in Ray or vLLM
    if name == "AppArgs":
        from serve_app.config import AppArgs

        return AppArgs
    if name == "build_app":
        from serve_app.app import build_app

        return build_app
    raise AttributeError(name)
