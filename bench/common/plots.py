"""What the benchmarks' plots share: matplotlib without a display, the systems' colours, a log axis
in plain numbers, a title line from the machine info, a rolling median. Needs matplotlib
(``pip install -e '.[bench]'``), imported only when a plot is drawn."""

from __future__ import annotations

import statistics
from typing import Any

COLORS = {"vllm": "#d62728", "ours": "#1f77b4"}
LABELS = {"vllm": "vLLM 0.32", "ours": "serve_app"}


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:  # the results are written before any plot: say how to draw them, not a traceback
        raise SystemExit("matplotlib is not installed, so no PNG was drawn: pip install -e '.[bench]', then "
                         "redraw from the results JSON (bench/README.md)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_y(ax: Any) -> None:
    """A log y axis labelled in plain numbers (0.5, 2, 10), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def run_title(data: dict[str, Any]) -> str:
    """Date, CPUs and commit of a results JSON's ``machine``."""
    m = data.get("machine", {})
    return f"{m.get('date_utc', '')} · {m.get('logical_cpus', '?')} CPUs · serve_app {m.get('git_commit', '')}"


def rolling_median(vals: list[float], window: int) -> tuple[list[int], list[float]]:
    """Medians (in ms, of values in s) of ``window`` values, every half window: (centre positions, medians)."""
    xs, ys = [], []
    for start in range(0, max(0, len(vals) - window) + 1, max(1, window // 2)):
        xs.append(start + window // 2)
        ys.append(statistics.median(vals[start:start + window]) * 1e3)
    return xs, ys
