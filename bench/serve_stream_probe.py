"""Serve's streaming delivery on its own: how late a replica's yielded items reach a handle caller.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.serve_stream_probe

No vLLM and none of our code in the path: a local Ray cluster with ``make run``'s Serve flags (gRPC
between handle and replica), one ``Ticker`` deployment whose streaming method yields a small dict
stamped with ``time.time()`` every ``--period`` seconds, and this driver reading ``--streams``
such streams at once by handle, as the Ingress reads the Engine's. Each item's lateness is its
arrival time minus its stamp (one machine, one clock). The same load runs with and without
``--hogs`` busy-loop processes (at niceness 0, like a client or a co-located server, and at 15, the
niceness Ray starts its workers at), over both of Serve's transports, the cases taking turns.

It separates Serve's own part in the hold issue 21 chases in the composed API (streams whose items
the Engine yields at an even pace reach their reader in bursts, seconds late). Every process here,
the busy loops included, runs in this driver's session: the kernel may share CPU between sessions
first (``sched_autogroup_enabled``), in which case a busy loop started from another shell takes its
session's share whatever its niceness, and only this same-session layout lets niceness decide.

Results: ``bench/results/serve_stream.md`` and ``.json``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.load import progress
from bench.common.paths import RESULTS
from bench.common.report import cli, machine_info, machine_line, options_json, rerender, write_results
from bench.common.serve_cluster import QUIET_LOGS, make_run_env
from bench.common.stats import latency_stats, percentile


def hogs(n: int, niceness: int) -> list[subprocess.Popen]:
    # Plain Popen, not servers.spawn_group: a new session would be a CPU group of its own (autogroup).
    code = f"import os; os.nice({niceness})\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


async def one_stream(handle: Any, items: int, period: float, work_s: float) -> dict[str, Any]:
    lates, arrivals = [], []
    async for item in handle.remote(items, period, work_s):
        now = time.time()
        arrivals.append(now)
        lates.append(now - item["t"])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"late": lates, "max_gap": max(gaps) if gaps else 0.0}


async def run_case(handle: Any, streams: int, items: int, period: float, rounds: int, work_s: float = 0.0) -> dict[str, Any]:
    lates: list[float] = []
    max_gaps: list[float] = []
    for r in range(rounds):
        results = await asyncio.gather(*(one_stream(handle, items, period, work_s) for _ in range(streams)))
        for res in results:
            lates += res["late"]
            max_gaps.append(res["max_gap"])
        progress(f"  round {r + 1}/{rounds}: worst lateness {max(x for res in results for x in res['late']):.3f} s")
    max_gaps.sort()
    return {
        "late": latency_stats(lates),
        "late_max_ms": 1000 * max(lates),
        "late_over_250ms": sum(1 for x in lates if x > 0.25) / len(lates),
        "stream_max_gap_p50_ms": 1000 * percentile(max_gaps, 0.5),
        "stream_max_gap_max_ms": 1000 * max_gaps[-1],
    }


def render_md(result: dict[str, Any]) -> str:
    o = result["opts"]
    lines = [
        "# Serve's streaming delivery under CPU contention (no vLLM, no app code)",
        "",
        machine_line(result["machine"], ("ray",)),
        "",
        f"`python -m bench.serve_stream_probe` · a `Ticker` replica (Ray's worker niceness, 15) yields a stamped dict "
        f"every {o['period'] * 1000:.0f} ms on each of {o['streams']} concurrent handle streams ({o['items']} items each, "
        f"{o['rounds']} rounds; {o['streams'] / o['period']:.0f} items/s in all, about what the Engine sends the Ingress at c=16) · "
        "Serve as `make run` starts it (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: gRPC between handle and replica) · "
        "lateness: arrival at this driver minus the replica's stamp · hogs: busy-loop processes, at niceness 0 "
        "(a client or a co-located server) or 15 (Ray's workers' own).",
        "",
        "| transport | replica CPU per item ms | busy-loop hogs (niceness) | items | late p50 ms | late p99 ms | late max ms "
        "| items > 250 ms late "
        "| per-stream max gap p50 / max ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        c = case["result"]
        lines.append(
            f"| {case['transport']} | {case['work_ms']} | {case['hogs']} ({case['hog_niceness']}) | {c['late']['n']} "
            f"| {c['late']['p50_ms']:.1f} | {c['late']['p99_ms']:.1f} | {c['late_max_ms']:.0f} | "
            f"{100 * c['late_over_250ms']:.1f} % | {c['stream_max_gap_p50_ms']:.0f} / {c['stream_max_gap_max_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = cli("bench.serve_stream_probe", __doc__ or "")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--period", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work-ms", type=float, default=0.5, help="replica CPU per item in the busy cases")
    parser.add_argument("--hogs", type=int, default=3, help="busy-loop processes in the loaded case")
    parser.add_argument("--from-json", type=Path, help="re-render the report from a results JSON and exit")
    opts = parser.parse_args()
    if opts.from_json:
        rerender(opts.from_json, render_md)
        return

    os.environ.update(make_run_env())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=256)
    class Ticker:
        async def ticks(self, items: int, period: float, work_s: float):  # type: ignore[no-untyped-def]
            for i in range(items):
                await asyncio.sleep(period)
                end = time.perf_counter() + work_s
                while time.perf_counter() < end:  # the event loop's own work per item, GIL held
                    pass
                yield {"i": i, "t": time.time(), "pad": "x" * 200}

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    base = serve.run(Ticker.bind(), name="probe", route_prefix=None, logging_config=QUIET_LOGS).options(stream=True, method_name="ticks")
    # Serve's gRPC (the flag's default) or its Ray actor calls, the two transports an app's handles use.
    handles = {"gRPC": base.options(_by_reference=False), "actor calls": base.options(_by_reference=True)}

    async def go() -> list[dict[str, Any]]:
        # (replica's CPU per item in ms, hogs, their niceness), each idle case beside its loaded ones
        CASES = [(0, 0, 0), (0, opts.hogs, 0), (0, opts.hogs, 15),
                 (opts.work_ms, 0, 0), (opts.work_ms, opts.hogs, 0), (opts.work_ms, opts.hogs, 15)]
        cases = []
        for transport, handle in handles.items():
            await run_case(handle, 2, 10, opts.period, 1)  # warm the channel
            for work_ms, n, niceness in CASES:
                progress(f"case: {transport}, {work_ms} ms of work per item, {n} hogs at niceness {niceness}")
                procs = hogs(n, niceness)
                try:
                    await asyncio.sleep(1)
                    res = await run_case(handle, opts.streams, opts.items, opts.period, opts.rounds, work_ms / 1000)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                cases.append({"transport": transport, "work_ms": work_ms, "hogs": n, "hog_niceness": niceness, "result": res})
        return cases

    t0 = time.monotonic()
    cases = asyncio.run(go())
    serve.shutdown()
    ray.shutdown()
    data = {"machine": machine_info(), "opts": options_json(opts, "from_json"), "cases": cases, "total_s": time.monotonic() - t0}
    write_results(RESULTS / "serve_stream", data, render_md)


if __name__ == "__main__":
    main()
