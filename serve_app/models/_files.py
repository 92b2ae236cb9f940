"""Shared pieces of the builtin model builders: JSON files, templates, tiny configs, weights."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

__all__ = ["package_file", "read_template", "write_json", "write_random_weights"]


def package_file(package: str, *parts: str) -> Path:
    """Path of a data file shipped inside an installed PyPI package."""
    return Path(str(files(package).joinpath(*parts)))


def read_template(name: str) -> str:
    return files("serve_app.models").joinpath("templates", name).read_text(encoding="utf-8")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def write_random_weights(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """Seeded normal(0, 0.02) float16 tensors; names ending in ``norm.weight`` are ones.

    float16 keeps the file small; vLLM casts to the configured dtype on load.
    """
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float16)
        else:
            tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
    save_file(tensors, str(path), metadata={"format": "pt"})
