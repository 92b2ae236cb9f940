"""Parser streams: serve_app as ``make run`` serves them next to vLLM 0.32's ``vllm launch render``,
with and without the ``x-session-id`` header (issue 21, goal 1).

    flock /tmp/heavy.lock .venv/bin/python -m bench.parser_bench            # profile, vllm, ours, report
    .venv/bin/python -m bench.parser_bench --parts profile                   # no Ray, no server: no lock
    flock /tmp/heavy.lock .venv/bin/python -m bench.parser_bench --parts vllm,ours
    .venv/bin/python -m bench.parser_bench --parts report                    # rewrite .md / .png from .json

Both sides run qwen3-tiny with ``--tool-call-parser hermes --reasoning-parser qwen3
--enable-auto-tool-choice``. The workload is a tool-and-reasoning output (a ``<think>`` block, an
answer, two ``<tool_call>`` blocks, ``<|im_end|>``) streamed one token per chunk as vLLM's API document
says: each call carries the previous answer's ``stream_state``, ``chat_request`` and ``prompt_token_ids``,
``generate_chunk`` first (the field order of vLLM's request model and of the document's example).

* **vllm**: ``vllm launch render``: one 1000-token stream end to end (three in a row, the median), 8
  concurrent 1000-token streams (chunks/s), and the per-chunk cost at positions 0..4000 (median of 3), whose integral is its
  4000-token total (it replays the whole history on every chunk: 4000 end to end would take ~4 min).
  CPU of its process per call at each position.
* **ours**: in this process, the app as serve_config.yaml lays it out (two Ingress replicas holding
  render, plain and parser derender; ParserDerender apart), engine off, behind Ray's HAProxy with
  ``make run``'s front door (``serve_app.front_door.HAPROXY_BALANCE``: chunks hashed by their
  ``generate_chunk.request_id``). Each case with and without ``x-session-id``: one 1000-token stream
  (three in a row, the median), 8 concurrent ones, one 4000-token stream; session-cache outcomes from ``/metrics``; CPU (all server
  processes, /proc) per chunk by stream position on the 4000-token stream.
* **profile**: the parser service in this process (no Ray, no HTTP): process CPU per chunk by position
  on a 4000-token stream, and cProfile's top functions at three positions, to show what grows.

Results: ``bench/results/parser.md``, ``parser.json``, ``parser_cpu.png``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common.parser_stream import PARSER_APP, set_parser_env

set_parser_env()  # make run's Serve flags, before anything imports Ray (its constants are read at import)

import httpx  # noqa: E402
import orjson  # noqa: E402

from bench.common.cpu import cpu_by_role, proc_cpu  # noqa: E402
from bench.common.parser_stream import chunk_body as _chunk_body  # noqa: E402
from bench.common.parser_stream import parser_workload as workload  # noqa: E402
from bench.common.paths import LOGS, REPO, RESULTS  # noqa: E402
from bench.common.report import machine_info  # noqa: E402
from bench.common.serve_cluster import session_outcomes as parse_outcomes  # noqa: E402
from bench.common.servers import free_port, kill_group, spawn_group, vllm_render_argv, wait_http_blocking  # noqa: E402
from bench.common.workloads import CHAT_REQUEST, joined  # noqa: E402

APP: dict[str, Any] = PARSER_APP
POSITIONS = [0, 250, 500, 1000, 2000, 3000, 4000]
WINDOW = 250  # chunks per CPU-by-position window
CONCURRENT = 8
ONE_STREAM_RUNS = 3  # the one 1000-token stream, each side: its median is the figure (one run varies ~10 %)
SERVER_ROLES = ("Ingress", "ParserDerender", "haproxy", "proxy", "controller", "ray-system", "Render", "PlainDerender")


def log(msg: str) -> None:
    print(f"[parser_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chunk_body(i: int, output: list[int], state: Any, prompt: list[int], request_id: str) -> bytes:
    return _chunk_body(i, output, state, prompt, request_id, prompt_tokens=True)


def positioned_body(pos: int, output: list[int], prompt: list[int]) -> bytes:
    """The chunk at ``pos`` with the state a client would carry there (vLLM's state fields)."""
    state = {"role_sent": True, "output_token_ids": output[:pos], "output_chunk_lens": [1] * pos}
    state |= {"tools_streamed": False, "last_tool_call_ids": []}
    return chunk_body(min(pos, len(output) - 1), output, state if pos else None, prompt, "positioned")


def stream(
    url: str, prompt: list[int], output: list[int], request_id: str, headers: dict[str, str] | None = None, on_chunk: Any = None
) -> tuple[list[float], list[dict], int]:
    """One stream, one chunk per call, on its own connection. (per-chunk seconds, chunks, bytes sent)."""
    lat, chunks, state, sent = [], [], None, 0
    with httpx.Client(timeout=600, headers={"content-type": "application/json", **(headers or {})}) as client:
        for i in range(len(output)):
            if on_chunk is not None:
                on_chunk(i)
            body = chunk_body(i, output, state, prompt, request_id)
            sent += len(body)
            t = time.perf_counter()
            r = client.post(url, content=body)
            lat.append(time.perf_counter() - t)
            if r.status_code != 200:
                raise RuntimeError(f"chunk {i}: HTTP {r.status_code}: {r.text[:300]}")
            data = orjson.loads(r.content)
            state = data["stream_state"]
            chunks.append(data["chunk"])
    return lat, chunks, sent


def one_stream_runs(runs: list[tuple[list[float], list[dict], int]]) -> dict[str, Any]:
    """ONE_STREAM_RUNS streams in a row (:func:`stream`'s results): their median total is the figure; every
    answer is kept for the parity check, the first run's per-chunk p50 and bytes sent."""
    totals = [sum(lat) for lat, _, _ in runs]
    lat, chunks, sent = runs[0]
    return {"total_s": statistics.median(totals), "runs_s": totals, "p50_ms": 1000 * statistics.median(lat),
            "bytes_sent": sent, "answer": joined(chunks), "answers": [joined(c) for _, c, _ in runs]}


def concurrent(url: str, prompt: list[int], output: list[int], tag: str, headers_for: Any) -> dict[str, Any]:
    """CONCURRENT streams at once, each on its own connection: chunks/s over the whole run."""
    t = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(stream, url, prompt, output, f"{tag}-{k}", headers_for(f"{tag}-{k}")) for k in range(CONCURRENT)]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t
    return {"wall_s": wall, "chunks_per_s": CONCURRENT * len(output) / wall, "outputs": [joined(r[1]) for r in results]}


def trapezoid(samples: dict[int, float], n: int) -> float:
    """Total of an n-chunk stream from per-chunk costs sampled at positions (linear between)."""
    pts = sorted((p, s) for p, s in samples.items() if p <= n)
    return sum((s0 + s1) / 2 * (p1 - p0) for (p0, s0), (p1, s1) in zip(pts, pts[1:], strict=False))


def same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in ("content", "reasoning_chars", "tool_arguments", "finish_reason"))


# --- vLLM ---------------------------------------------------------------------------------------


def run_vllm(w1000: tuple[list[int], list[int]], w4000: tuple[list[int], list[int]]) -> dict[str, Any]:
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / "parser-vllm.log").open("w") as out:
        argv = [*vllm_render_argv(APP), "--port", str(port)]
        proc = spawn_group(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/v1/chat/completions/derender"
    try:
        wait_http_blocking(f"{base}/health", 300, proc)
        log("vllm launch render up")
        prompt, output = w1000
        stream(url, prompt, output[:20], "warm")
        one = one_stream_runs([stream(url, prompt, output, f"vllm-1000-{k}") for k in range(ONE_STREAM_RUNS)])
        log(f"vLLM one 1000-token stream: {one['total_s']:.1f} s (median of {runs_text(one)})")
        many = concurrent(url, prompt, output, "vllm-c", lambda sid: None)
        log(f"vLLM {CONCURRENT} concurrent: {many['chunks_per_s']:.1f} chunks/s")
        prompt4, output4 = w4000
        samples: dict[int, float] = {}
        cpu: dict[int, float] = {}
        with httpx.Client(timeout=600) as c:
            for pos in POSITIONS:
                body = positioned_body(pos, output4, prompt4)
                times = []
                before = proc_cpu()
                for _ in range(3):
                    t = time.perf_counter()
                    r = c.post(url, content=body, headers={"content-type": "application/json"})
                    times.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text[:300]
                samples[pos] = statistics.median(times)
                cpu[pos] = cpu_by_role(before, proc_cpu()).get("vllm", 0.0) / 3
                log(f"vLLM chunk at position {pos}: {1000 * samples[pos]:.1f} ms, {1000 * cpu[pos]:.1f} ms CPU")
        return {
            "one_1000": one,
            "concurrent_1000": many,
            "per_chunk_s": samples,
            "cpu_per_chunk_s": cpu,
            "total_4000_s": trapezoid(samples, 4000),
            "total_1000_s_integrated": trapezoid(samples, 1000),
        }
    finally:
        kill_group(proc)


# --- ours ---------------------------------------------------------------------------------------


def session_outcomes(base: str) -> dict[str, float]:
    return parse_outcomes(httpx.get(base + "/metrics", timeout=30).text)


def run_ours(w1000: tuple[list[int], list[int]], w4000: tuple[list[int], list[int]]) -> dict[str, Any]:
    from bench.common.serve_cluster import QUIET_LOGS, haproxy_replicas_up, make_run_env

    # make run's environment (SERVE_ENV and its front door), set before Ray starts: Ray's HAProxy manager
    # and the Ingress replicas, in processes of the cluster started below, read it from the environment.
    os.environ.update(make_run_env())
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        # Logs as serve_config.yaml sets them: an access log line per chunk is ~2 % of the Ingress's CPU.
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET_LOGS)
        app_args = AppArgs(
            **APP,
            colocate_in_ingress=["render", "plain_derender", "parser_derender"],
            deployments={"ingress": {"num_replicas": 2}},
        )
        serve.run(build_app(app_args), name="bench", route_prefix="/", logging_config=QUIET_LOGS)
        deadline = time.monotonic() + 180
        while haproxy_replicas_up() < 2 and time.monotonic() < deadline:
            time.sleep(1)
        base = f"http://127.0.0.1:{port}"
        url = f"{base}/v1/chat/completions/derender"
        log("serve_app up behind HAProxy")
        prompt, output = w1000
        prompt4, output4 = w4000
        for k in range(4):
            stream(url, prompt, output[:30], f"warm-{k}")
        out: dict[str, Any] = {}
        for mode in ("no header", "x-session-id"):
            def hdr(sid: str, mode: str = mode) -> dict[str, str] | None:
                return {"x-session-id": sid} if mode == "x-session-id" else None

            tag = "h" if mode == "x-session-id" else "n"
            before = session_outcomes(base)
            cpu0, client0 = proc_cpu(), time.thread_time()
            runs = [stream(url, prompt, output, f"{tag}-1000-{k}", hdr(f"{tag}-1000-{k}")) for k in range(ONE_STREAM_RUNS)]
            # Process CPU per chunk over the runs: the client is this thread (the streams' whole loop), the servers by role.
            sent_chunks = ONE_STREAM_RUNS * len(output)
            client_ms, roles = 1000 * (time.thread_time() - client0) / sent_chunks, cpu_by_role(cpu0, proc_cpu())
            one = one_stream_runs(runs) | {
                "cpu_ms_per_chunk": {"client": client_ms} | {r: 1000 * v / sent_chunks for r, v in roles.items() if r in SERVER_ROLES}
            }
            log(f"ours ({mode}) one 1000-token stream: {one['total_s']:.2f} s (median of {runs_text(one)})")
            many = concurrent(url, prompt, output, f"{tag}-c", hdr)
            log(f"ours ({mode}) {CONCURRENT} concurrent: {many['chunks_per_s']:.0f} chunks/s")
            snaps: list[dict[int, tuple[str, float]]] = []

            def snap(i: int, snaps: list[dict[int, tuple[str, float]]] = snaps) -> None:
                if i % WINDOW == 0:
                    snaps.append(proc_cpu())

            lat4, chunks4, sent4 = stream(url, prompt4, output4, f"{tag}-4000", hdr(f"{tag}-4000"), on_chunk=snap)
            snaps.append(proc_cpu())
            windows = []
            for w, (a, b) in enumerate(zip(snaps, snaps[1:], strict=False)):
                roles = cpu_by_role(a, b)
                n = min(WINDOW, len(output4) - w * WINDOW)
                windows.append({"start": w * WINDOW, "server_ms": 1000 * sum(roles.get(r, 0.0) for r in SERVER_ROLES) / n,
                                "by_role_ms": {r: 1000 * v / n for r, v in roles.items() if r in SERVER_ROLES}})
            after = session_outcomes(base)
            out[mode] = {
                "one_1000": one,
                "concurrent_1000": many,
                "one_4000": {"total_s": sum(lat4), "bytes_sent": sent4, "answer": joined(chunks4), "cpu_windows": windows},
                "sessions": {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss", "new", "none")},
            }
            log(f"ours ({mode}) one 4000-token stream: {sum(lat4):.2f} s; sessions {out[mode]['sessions']}")
        out["handle"] = handle_stream(prompt, output)
        log(f"ours by handle (ServeAppClient.derender_chat_stream): {out['handle']['total_s']:.2f} s")
        out["handle_ray_defaults"] = handle_stream_in_default_process()
        log(f"ours by handle, caller under Ray's default Serve settings: {out['handle_ray_defaults']['total_s']:.2f} s")
        return out
    finally:
        ray.shutdown()


def handle_stream(prompt: list[int], output: list[int]) -> dict[str, Any]:
    """One 1000-token stream by handle, no HTTP: ``ServeAppClient.derender_chat_stream`` to ParserDerender
    (its routing session keeps the stream on one replica). One event loop runs the whole stream: Serve
    routes a handle's calls on the caller's loop."""
    from serve_app.client import ServeAppClient

    async def run() -> tuple[float, list[dict], dict[str, float]]:
        client = ServeAppClient("bench")
        for k in range(2):  # warm: the handle's first calls set up its router
            warm = client.derender_chat_stream(chat_request=CHAT_REQUEST, prompt_token_ids=prompt)
            for tid in output[:20]:
                await warm.derender({"request_id": f"handle-warm-{k}", "choices": [{"index": 0, "token_ids": [tid]}]})
        s = client.derender_chat_stream(chat_request=CHAT_REQUEST, prompt_token_ids=prompt)
        chunks, cpu0, caller0, t = [], proc_cpu(), time.process_time(), time.perf_counter()
        for i, tid in enumerate(output):
            last = "stop" if i == len(output) - 1 else None
            out = await s.derender({"request_id": "handle", "choices": [{"index": 0, "token_ids": [tid], "finish_reason": last}]})
            chunks.append(out["chunk"])
        total, caller = time.perf_counter() - t, time.process_time() - caller0
        # The caller: this whole process (Serve's router and gRPC run on its loop and in its gRPC threads).
        # The servers have roles only where this process started them (not in --handle-worker).
        cpu = {"caller": caller} | {r: v for r, v in cpu_by_role(cpu0, proc_cpu()).items() if r in SERVER_ROLES}
        return total, chunks, {r: 1000 * v / len(output) for r, v in cpu.items()}

    total, chunks, cpu_ms = asyncio.run(run())
    return {"total_s": total, "answer": joined(chunks), "cpu_ms_per_chunk": cpu_ms}


def handle_stream_in_default_process() -> dict[str, Any]:
    """:func:`handle_stream` from a separate caller process under Ray's default Serve settings (no
    ``RAY_SERVE_THROUGHPUT_OPTIMIZED``: a handle call is a Ray actor call routed on a separate loop),
    as a user's own driver or deployment gets unless it sets the flag; this process runs make run's."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    argv = [sys.executable, "-m", "bench.parser_bench", "--handle-worker"]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"handle worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def handle_worker() -> None:
    """``--handle-worker``: :func:`handle_stream` against the bench's cluster (``RAY_ADDRESS``), JSON on stdout."""
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], namespace="serve", log_to_driver=False)
    prompt, output = workload(1000)
    print(json.dumps(handle_stream(prompt, output)))


# --- in-process CPU profile ---------------------------------------------------------------------


def run_profile(_w1000: tuple[list[int], list[int]], w4000: tuple[list[int], list[int]]) -> dict[str, Any]:
    """The parser service alone: process CPU per chunk by position, and where it goes (cProfile)."""
    from serve_app.config import AppArgs
    from serve_app.derender.parser import build_parser_service

    args = AppArgs(**APP)
    service = asyncio.run(build_parser_service(args, args.resolve()))
    prompt, output = w4000
    state: Any = None
    cpu_windows: list[dict[str, Any]] = []
    profiles: dict[int, list[dict[str, Any]]] = {}
    profile_at = {250, 1250, 3500}  # profiled windows: their CPU is measured in the neighbouring ones
    spent = 0.0  # process CPU inside the service call only (the client's encoding is left out)
    prof: cProfile.Profile | None = None
    for i in range(len(output)):
        if i % WINDOW == 0:
            if prof is not None:
                profiles[i - WINDOW] = top_functions(prof, WINDOW)
                prof = None
            elif i:
                cpu_windows.append({"start": i - WINDOW, "cpu_ms": 1000 * spent / WINDOW})
            spent = 0.0
            if i in profile_at:
                prof = cProfile.Profile()
        body = chunk_body(i, output, state, prompt, "profile")
        if prof is not None:  # a profiled window: its CPU is not counted (cProfile's own cost)
            prof.enable()
            out, outcome = service.chat_with_outcome(body)
            prof.disable()
        else:
            t = time.process_time()
            out, outcome = service.chat_with_outcome(body)
            spent += time.process_time() - t
        assert outcome in ("new", "hit"), outcome
        state = orjson.loads(out)["stream_state"]
    if prof is not None:
        profiles[len(output) - WINDOW] = top_functions(prof, WINDOW)
    else:
        cpu_windows.append({"start": len(output) - WINDOW, "cpu_ms": 1000 * spent / WINDOW})
    log("profile: " + ", ".join(f"{w['start']}: {w['cpu_ms']:.2f} ms" for w in cpu_windows))
    return {"cpu_windows": cpu_windows, "profiles": profiles}


def top_functions(prof: cProfile.Profile, chunks: int, n: int = 14) -> list[dict[str, Any]]:
    """The functions with the most own time, per chunk, with their cumulative time per chunk."""
    stats = pstats.Stats(prof)

    def named(key: tuple[str, int, str]) -> str:
        file, line, name = key
        return f"{file.split('site-packages/')[-1].split('/wt/f/')[-1]}:{line}({name})"

    rows = []
    for key, (_cc, calls, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        per_chunk = {"calls_per_chunk": calls / chunks, "own_ms": 1000 * tt / chunks, "cum_ms": 1000 * ct / chunks}
        by_caller = sorted(callers.items(), key=lambda kv: -kv[1][2])[:3]  # (caller, (cc, calls, tt, ct))
        rows.append({"function": named(key), **per_chunk, "callers": [f"{named(c)} {1000 * v[2] / chunks:.3f} ms" for c, v in by_caller]})
    return sorted(rows, key=lambda r: -r["own_ms"])[:n]


# --- report -------------------------------------------------------------------------------------


def report(data: dict[str, Any]) -> str:
    m, v, ours = data["machine"], data["vllm"], data["ours"]
    lines = [
        "# Parser streams, with and without x-session-id: serve_app vs `vllm launch render` (hermes + qwen3, qwen3-tiny)",
        "",
        f"{m['date_utc']} · {m['cpu']} · {m['logical_cpus']} vCPU · commit {m['git_commit']} · `python -m bench.parser_bench` "
        "(vLLM and ours one after the other in one run). Ours: two Ingress replicas holding render, plain and parser "
        "derender, ParserDerender apart (by handle), engine off, behind Ray's HAProxy with `make run`'s front door "
        "(`serve_app/front_door.py` `HAPROXY_BALANCE`: chunks hashed by `generate_chunk.request_id`). One token per "
        "chunk; the client sends what vLLM's API document shows (stream_state, chat_request, prompt_token_ids).",
        "",
        "| case | vLLM | ours, no header | ratio | ours, x-session-id | ratio | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    n, h = ours["no header"], ours["x-session-id"]
    v1, vc, v4 = v["one_1000"]["total_s"], v["concurrent_1000"]["chunks_per_s"], v["total_4000_s"]
    median_note = f" (median of {len(v['one_1000']['runs_s'])})" if "runs_s" in v["one_1000"] else ""
    lines += [
        f"| one 1000-token stream, s{median_note} | {v1:.2f} | {n['one_1000']['total_s']:.2f} | **{v1 / n['one_1000']['total_s']:.1f}x** | "
        f"{h['one_1000']['total_s']:.2f} | {v1 / h['one_1000']['total_s']:.1f}x | >= 10x |",
        f"| {CONCURRENT} concurrent 1000-token streams, chunks/s | {vc:.1f} | {n['concurrent_1000']['chunks_per_s']:.0f} | "
        f"**{n['concurrent_1000']['chunks_per_s'] / vc:.1f}x** | {h['concurrent_1000']['chunks_per_s']:.0f} | "
        f"{h['concurrent_1000']['chunks_per_s'] / vc:.1f}x | >= 10x |",
        f"| one 4000-token stream, s | {v4:.1f} (integrated) | {n['one_4000']['total_s']:.2f} | **{v4 / n['one_4000']['total_s']:.1f}x** | "
        f"{h['one_4000']['total_s']:.2f} | {v4 / h['one_4000']['total_s']:.1f}x | >= 40x |",
    ]
    same = all(
        same_answer(a, v["one_1000"]["answer"]) for o in (n, h, v) for a in o["one_1000"].get("answers", [o["one_1000"]["answer"]])
    ) and all(same_answer(a, v["one_1000"]["answer"]) for o in (n, h, v) for a in o["concurrent_1000"]["outputs"])
    if "handle" in ours:
        hs = ours["handle"]["total_s"]
        row = f"| one 1000-token stream by handle (`ServeAppClient.derender_chat_stream`), s | {v1:.2f} | {hs:.2f} | {v1 / hs:.1f}x"
        lines.append(row + " | | | >= 10x |")
        same = same and same_answer(ours["handle"]["answer"], v["one_1000"]["answer"])
    if "handle_ray_defaults" in ours:
        hd = ours["handle_ray_defaults"]["total_s"]
        lines.append(f"| the same, the caller under Ray's default Serve settings (no `RAY_SERVE_THROUGHPUT_OPTIMIZED`), s | {v1:.2f} | "
                     f"{hd:.2f} | {v1 / hd:.1f}x | | | >= 10x |")
        same = same and same_answer(ours["handle_ray_defaults"]["answer"], v["one_1000"]["answer"])
    handle_cpu = [handle_cpu_line(label, ours[key]) for key, label in (("handle", "caller under make run's settings"),
                  ("handle_ray_defaults", "caller under Ray's defaults")) if "cpu_ms_per_chunk" in ours.get(key, {})]
    lines += [
        "",
        f"- Outputs (content, reasoning, tool-call arguments, finish_reason) equal vLLM's for every 1000-token stream: {same}.",
        *([f"- One 1000-token stream, each side: the median of {len(v['one_1000']['runs_s'])} in a row (s): vLLM "
           f"{runs_text(v['one_1000'])}; ours no header {runs_text(n['one_1000'])}; x-session-id {runs_text(h['one_1000'])}."]
          if "runs_s" in v["one_1000"] else []),
        f"- Session cache outcomes (Ingress /metrics) — no header: {fmt_sessions(n['sessions'])}; "
        f"x-session-id: {fmt_sessions(h['sessions'])}.",
        *[cpu_line(mode, o["one_1000"]) for mode, o in (("no header", n), ("x-session-id", h)) if "cpu_ms_per_chunk" in o["one_1000"]],
        *handle_cpu,
        f"- Bytes a client sends: 1000-token stream {n['one_1000']['bytes_sent'] / 1e6:.1f} MB, "
        f"4000-token {n['one_4000']['bytes_sent'] / 1e6:.1f} MB.",
        f"- vLLM's 4000-token total integrates its per-chunk cost at positions {', '.join(map(str, POSITIONS))} (median of 3); "
        f"the same integral for 1000 tokens is {v['total_1000_s_integrated']:.2f} s against {v1:.2f} s measured end to end.",
        "",
        "## CPU per chunk against stream position (4000-token stream; `bench/results/parser_cpu.png`)",
        "",
        "Ours: CPU of every server process (Ingress, ParserDerender, HAProxy, Ray) over each window of "
        f"{WINDOW} chunks, from /proc. vLLM: its process's CPU per call at the position. Profile: the parser "
        "service alone in one process (no HTTP, no Ray), `time.process_time` around `chat_with_outcome` "
        "(windows that were profiled are left out).",
        "",
        "| position | vLLM ms | ours no header ms | ours x-session-id ms | parser service alone ms |",
        "|---|---|---|---|---|",
    ]
    prof = data.get("profile", {})
    pw = {w["start"]: w["cpu_ms"] for w in prof.get("cpu_windows", [])}
    nw = {w["start"]: w["server_ms"] for w in n["one_4000"]["cpu_windows"]}
    hw = {w["start"]: w["server_ms"] for w in h["one_4000"]["cpu_windows"]}
    vcpu = {int(k): s for k, s in v["cpu_per_chunk_s"].items()}
    for start in sorted(nw):
        vv = f"{1000 * vcpu[start]:.1f}" if start in vcpu else ""
        nan = float("nan")
        lines.append(f"| {start}-{start + WINDOW - 1} | {vv} | {nw[start]:.2f} | {hw.get(start, nan):.2f} | {pw.get(start, nan):.2f} |")
    for pos, rows in sorted(prof.get("profiles", {}).items(), key=lambda kv: int(kv[0])):
        lines += [
            "",
            f"### Parser service alone, chunks {pos}-{int(pos) + WINDOW - 1}: top functions by own CPU (cProfile, per chunk)",
            "",
            "| function | calls/chunk | own ms | cumulative ms | own ms by caller |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            callers = "; ".join(r.get("callers") or ())
            lines.append(f"| `{r['function']}` | {r['calls_per_chunk']:.1f} | {r['own_ms']:.3f} | {r['cum_ms']:.3f} | {callers} |")
    return "\n".join(lines) + "\n"


def roles_text(cpu_ms_per_chunk: dict[str, float]) -> str:
    """CPU per chunk by process role, largest first (roles under 0.005 ms left out)."""
    roles = sorted(cpu_ms_per_chunk.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{role} {ms:.2f} ms" for role, ms in roles if ms >= 0.005)


def cpu_line(mode: str, one: dict[str, Any]) -> str:
    """The one 1000-token stream's CPU per chunk by process role."""
    shown = roles_text(one["cpu_ms_per_chunk"])
    return (f"- CPU per chunk over the one 1000-token stream ({mode}; the stream is serial, but on two cores each process's "
            f"work after its part of a chunk overlaps the others', so these add up to more than its time per chunk): {shown}.")


def runs_text(one: dict[str, Any]) -> str:
    """The one stream's run totals in seconds (one value for a results file from before the runs)."""
    return ", ".join(f"{t:.2f}" for t in one.get("runs_s", [one["total_s"]]))


def handle_cpu_line(label: str, one: dict[str, Any]) -> str:
    """The by-handle stream's CPU per chunk: the calling process (all its threads) and the servers."""
    return f"- CPU per chunk over the one 1000-token stream by handle ({label}): {roles_text(one['cpu_ms_per_chunk'])}."


def fmt_sessions(s: dict[str, float]) -> str:
    hits, misses = s.get("hit", 0), s.get("miss", 0)
    return f"{hits:.0f} hits, {misses:.0f} misses, {s.get('new', 0):.0f} new ({100 * hits / max(1, hits + misses):.2f}% hits)"


def plot(data: dict[str, Any]) -> None:
    from bench.common.plots import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    v = data["vllm"]["cpu_per_chunk_s"]
    ax.plot([int(k) for k in v], [1000 * s for s in v.values()], "o-", label="vllm launch render")
    for mode in ("no header", "x-session-id"):
        w = data["ours"][mode]["one_4000"]["cpu_windows"]
        ax.plot([x["start"] + WINDOW / 2 for x in w], [x["server_ms"] for x in w], "s-", label=f"serve_app, {mode} (all server processes)")
    if "profile" in data:
        w = data["profile"]["cpu_windows"]
        ax.plot([x["start"] + WINDOW / 2 for x in w], [x["cpu_ms"] for x in w], "^--", label="parser service alone (one process)")
    ax.set_yscale("log")
    ax.set_xlabel("position in the stream (output tokens so far)")
    ax.set_ylabel("CPU ms per chunk")
    ax.set_title("Parser stream: CPU per chunk against position (one token per chunk)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "parser_cpu.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="profile,vllm,ours,report", help="comma-separated: profile, vllm, ours, report")
    p.add_argument("--handle-worker", action="store_true", help=argparse.SUPPRESS)  # see handle_stream_in_default_process
    opts = p.parse_args()
    if opts.handle_worker:
        handle_worker()
        return
    parts = set(opts.parts.split(","))
    path = RESULTS / "parser.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() and parts != {"profile", "vllm", "ours", "report"} else {}
    w1000, w4000 = workload(1000), workload(4000)
    log(f"prompt {len(w1000[0])} tokens; outputs {len(w1000[1])} and {len(w4000[1])} tokens")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if parts & {"vllm", "ours"} or "machine" not in data:
        data["machine"] = machine_info()
    for part, run in (("profile", run_profile), ("vllm", run_vllm), ("ours", run_ours)):
        if part in parts:
            data[part] = run(w1000, w4000)
            path.write_text(json.dumps(data, indent=1, default=str))  # each part kept as soon as it is measured
    if "report" in parts and "vllm" in data and "ours" in data:
        data = json.loads(path.read_text())
        (RESULTS / "parser.md").write_text(report(data))
        plot(data)
        print(report(data))


if __name__ == "__main__":
    main()
