"""``python -m serve_app check CONFIG.yaml``: see :mod:`serve_app.check`."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "check":
        print("usage: python -m serve_app check CONFIG.yaml", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury the report
    from serve_app.check import main as check_main

    return check_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
