"""PNG plots from the benchmarks' results JSON, so they can be drawn again without running anything.

    .venv/bin/python -m bench.plots                       # from bench/results/load.json and parser.json
    .venv/bin/python -m bench.plots --load /tmp/x.json --out-dir /tmp

* ``load_throughput.png`` (``load.json``): throughput against concurrency, one panel per workload,
  ours against vLLM.
* ``load_latency.png`` (``load.json``): p50 and p99 against concurrency (per chunk, per render, ITL).
* ``parser_position.png``: per-chunk cost of a parser derender stream against its position, ours
  against vLLM: over 8000 positions from ``parser.json`` (one stream at a time: vLLM's sampled
  positions, ours as a rolling median of 100 chunks), and over the load benchmark's short streams at
  the lowest and highest concurrency (``load.json``, p50 per 10 positions).

Needs matplotlib (``pip install -e '.[bench]'``); a file that is missing is skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common.load_report import render_all
from bench.common.paths import RESULTS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=Path, default=RESULTS / "load.json")
    ap.add_argument("--parser", type=Path, default=RESULTS / "parser.json")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    opts = ap.parse_args(argv)
    for p in render_all(opts.load, opts.parser, opts.out_dir):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
