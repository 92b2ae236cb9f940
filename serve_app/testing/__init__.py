"""Test helpers that run inside real engines (no mocks): see :mod:`serve_app.testing.scripted`."""

from __future__ import annotations

__all__ = ["SCRIPT_KEY", "ScriptedOutputLogitsProcessor"]


def __getattr__(name: str):  # lazy: importing the package must not pull in torch or vLLM
    if name in __all__:
        from serve_app.testing import scripted

        return getattr(scripted, name)
    raise AttributeError(name)
