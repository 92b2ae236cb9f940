"""Where the benchmarks write: results in ``bench/results/``, server logs in ``bench/results/logs.tmp/`` (git-ignored)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
LOGS = RESULTS / "logs.tmp"
