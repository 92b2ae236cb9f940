"""Parser derender benchmark: serve_app's ParserDerender next to vLLM 0.32's ``vllm launch render``.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.parser_bench

Both servers run qwen3-tiny with ``--tool-call-parser hermes --reasoning-parser qwen3
--enable-auto-tool-choice`` on this machine, in one run. The workload is a realistic
tool-and-reasoning output (a long ``<think>`` block, an answer, then two ``<tool_call>`` blocks, then
``<|im_end|>``), streamed one token per chunk as the protocol says (each call carries the previous
response's ``stream_state``, ``chat_request`` and the full ``prompt_token_ids``).

* **Ours**, over HTTP through Serve's front door with the settings of ``make run``: one stream of
  ``--tokens`` chunks (8000 by default). Per-chunk latency by position window; the total of the first
  1000 and first 4000 chunks (what a 1000- and a 4000-token stream cost); session-cache outcomes
  read from the ingress's ``/metrics`` (hits, misses); and the ParserDerender replica's cache size.
* **vLLM**: one call per sampled position (a state carrying that many output tokens, median of
  ``--reps`` calls), since its per-chunk cost grows with the position (it replays the whole history
  on every chunk). Totals for 1000 and 4000 tokens are the trapezoid integral of those samples.
  ``--vllm-full`` also streams the 1000-token case end to end.
* **Memory**: in this process, the bytes a cached session holds per token (``tracemalloc``), which
  with the configured ``parser_sessions.max_tokens`` bounds the cache's memory per replica.

``max_model_len`` is raised to 16384 on both sides (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``): no model
runs here, only tokenizer and parser work. Results: ``bench/results/parser.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")  # as `make run`
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import orjson  # noqa: E402

from bench.common.paths import LOGS, REPO, RESULTS  # noqa: E402
from bench.common.report import machine_info  # noqa: E402
from bench.common.serve_cluster import haproxy_replicas_up  # noqa: E402
from bench.common.servers import free_port, kill_group, vllm_render_argv, wait_http_blocking  # noqa: E402
from bench.common.workloads import CHAT_REQUEST, chat_prompt, joined, tokenizer, tool_reasoning_output  # noqa: E402

MAX_MODEL_LEN = 16384
APP = dict(
    model="qwen3-tiny",
    tool_call_parser="hermes",
    reasoning_parser="qwen3",
    enable_auto_tool_choice=True,
    max_model_len=MAX_MODEL_LEN,
)
POSITIONS = [0, 250, 500, 750, 1000, 2000, 3000, 4000]
WINDOWS = [0, 250, 500, 1000, 2000, 4000, 6000, 7900]


def workload(tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids): ``tokens`` output ids of reasoning, answer and two tool calls, then EOS."""
    tok = tokenizer(str(APP["model"]))
    return chat_prompt(tok, CHAT_REQUEST), tool_reasoning_output(tok, tokens)


def chunk_body(i: int, output: list[int], state: Any, prompt: list[int], request_id: str) -> bytes:
    # The client encodes and decodes with orjson: at 8000 positions the carried state is ~70 KB each
    # way, and a stdlib-json client would spend ~1 ms per chunk on it (for vLLM and for us alike).
    last = i == len(output) - 1
    return orjson.dumps(
        {
            "stream": True,
            "model": "qwen3-tiny",
            "generate_chunk": {
                "request_id": request_id,
                "choices": [{"index": 0, "token_ids": [output[i]], "finish_reason": "stop" if last else None}],
            },
            "stream_state": state,
            "chat_request": CHAT_REQUEST,
            "prompt_token_ids": prompt,
        }
    )


def positioned_body(pos: int, output: list[int], prompt: list[int]) -> bytes:
    """The chunk at ``pos`` with the state a client would carry there (vLLM's state fields)."""
    state = {
        "role_sent": pos > 0,
        "output_token_ids": output[:pos],
        "output_chunk_lens": [1] * pos,
        "tools_streamed": False,
        "last_tool_call_ids": [],
    }
    return chunk_body(pos, output, state if pos else None, prompt, "positioned")


def stream(client: httpx.Client, url: str, prompt: list[int], output: list[int], request_id: str) -> tuple[list[float], list[dict]]:
    lat, chunks, state = [], [], None
    headers = {"content-type": "application/json"}
    for i in range(len(output)):
        body = chunk_body(i, output, state, prompt, request_id)
        t = time.perf_counter()
        r = client.post(url, content=body, headers=headers)
        lat.append(time.perf_counter() - t)
        if r.status_code != 200:
            raise RuntimeError(f"chunk {i}: HTTP {r.status_code}: {r.text[:300]}")
        data = orjson.loads(r.content)
        state = data["stream_state"]
        chunks.append(data["chunk"])
    return lat, chunks


def windows(lat: list[float]) -> list[dict[str, Any]]:
    rows = []
    for start in WINDOWS:
        part = sorted(lat[start : start + 100])
        if part:
            rows.append({"positions": f"{start}-{start + len(part) - 1}", "p50_ms": 1000 * statistics.median(part),
                         "p99_ms": 1000 * part[min(len(part) - 1, int(0.99 * len(part)))]})
    return rows


def trapezoid(samples: dict[int, float], n: int) -> float:
    """Total seconds of an n-chunk stream from per-chunk costs sampled at positions (linear between)."""
    pts = sorted((p, s) for p, s in samples.items() if p <= n)
    total = 0.0
    for (p0, s0), (p1, s1) in zip(pts, pts[1:], strict=False):
        total += (s0 + s1) / 2 * (p1 - p0)
    return total


# --- the systems ------------------------------------------------------------------------------


def run_vllm(opts: argparse.Namespace, prompt: list[int], output: list[int]) -> dict[str, Any]:
    port = free_port()
    cmd = [*vllm_render_argv(APP), "--port", str(port)]
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / "parser-vllm.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http_blocking(f"{base}/health", 300, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError("vllm launch render did not start; see bench/results/logs.tmp/parser-vllm.log") from exc
        url = f"{base}/v1/chat/completions/derender"
        samples: dict[int, float] = {}
        with httpx.Client(timeout=600) as c:
            for pos in POSITIONS:
                body = positioned_body(pos, output, prompt)
                times = []
                for _ in range(opts.reps):
                    t = time.perf_counter()
                    r = c.post(url, content=body, headers={"content-type": "application/json"})
                    times.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text[:300]
                samples[pos] = statistics.median(times)
                print(f"vLLM per-chunk at position {pos}: {1000 * samples[pos]:.1f} ms", flush=True)
            out: dict[str, Any] = {"per_chunk_s": samples}
            if opts.vllm_full:
                lat, _ = stream(c, url, prompt, output[:1000], "vllm-full")
                out["full_1000_total_s"] = sum(lat)
                print(f"vLLM full 1000-token stream: {sum(lat):.1f} s", flush=True)
        out["total_1000_s"] = trapezoid(samples, 1000)
        out["total_4000_s"] = trapezoid(samples, 4000)
        return out
    finally:
        kill_group(proc)


def run_ours(opts: argparse.Namespace, prompt: list[int], output: list[int]) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # As serve_config.yaml: render and plain derender in two Ingress replicas, ParserDerender apart.
        app_args = AppArgs(
            **APP, colocate_in_ingress=["render", "plain_derender"], deployments={"ingress": {"num_replicas": 2}}
        )
        serve.run(build_app(app_args), name="bench", route_prefix="/")
        deadline = time.monotonic() + 120
        while os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and haproxy_replicas_up() < 2 and time.monotonic() < deadline:
            time.sleep(1)
        base = f"http://127.0.0.1:{port}"
        url = f"{base}/v1/chat/completions/derender"

        # One ParserDerender replica holds every session (each Ingress replica has its own /metrics).
        # Throughput-optimized Serve routes handle calls on the caller's event loop, which must keep
        # running: one loop in a thread for every call.
        import threading

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        handle = serve.get_deployment_handle("ParserDerender", app_name="bench")

        def replica_stats() -> dict[str, Any]:
            async def call() -> dict[str, Any]:
                return await handle.stats.remote()

            return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=60)

        with httpx.Client(timeout=120) as c:
            stream(c, url, prompt, output[:50], "warmup")
            before = replica_stats()
            lat, chunks = stream(c, url, prompt, output, "ours")
            after = replica_stats()
            whole = c.post(
                url,
                json={
                    "model": "qwen3-tiny",
                    "generate_response": {"request_id": "whole", "choices": [{"index": 0, "token_ids": output}]},
                    "chat_request": CHAT_REQUEST,
                    "prompt_token_ids": prompt,
                },
            ).json()["choices"][0]
        stats = after
        got = joined(chunks)
        msg = whole["message"]
        stream_equals_whole = (
            got["content"] == (msg["content"] or "")
            and got["reasoning_chars"] == len(msg["reasoning"] or "")
            and got["tool_arguments"] == [t["function"]["arguments"] for t in msg["tool_calls"]]
            and got["finish_reason"] == whole["finish_reason"]
        )
        counts = {k: after[k] - before[k] for k in ("hits", "misses")}
        return {
            "per_chunk_all_s": lat,
            "windows": windows(lat),
            "total_1000_s": sum(lat[:1000]),
            "total_4000_s": sum(lat[:4000]),
            "sessions": counts,
            "hit_rate": counts["hits"] / max(1, counts["hits"] + counts["misses"]),
            "replica_stats": stats,
            "stream_equals_nonstream": stream_equals_whole,
            "finish_reason": got["finish_reason"],
            "tool_calls": len(got["tool_arguments"]),
        }
    finally:
        ray.shutdown()  # takes Serve down with the cluster (serve.shutdown trips on the closed handle loop)


def session_memory(prompt: list[int], output: list[int]) -> dict[str, Any]:
    """Bytes the session cache holds per token, measured with tracemalloc on the real service: five
    streams (distinct prompts) are streamed through ``chat_with_outcome`` and left in the cache."""
    import gc
    import tracemalloc

    from serve_app.config import AppArgs
    from serve_app.derender.parser import build_parser_service

    args = AppArgs(**APP)
    service = asyncio.run(build_parser_service(args, args.resolve()))
    out = {}
    for n in (1000, 4000):
        service.sessions.clear()
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for k in range(5):
            state = None
            own_prompt = prompt + [k]
            for i in range(n):
                body = chunk_body(i, output[:n], state, own_prompt, f"mem-{k}")
                state = json.loads(service.chat_with_outcome(body)[0])["stream_state"]
        del state
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        tokens = service.sessions.tokens
        out[n] = {"sessions": len(service.sessions), "tokens": tokens, "bytes": held, "bytes_per_token": held / tokens}
    worst = max(v["bytes_per_token"] for v in out.values())
    cap = args.parser_sessions.max_tokens
    return {"by_length": out, "max_tokens": cap, "bound_bytes": worst * cap}


def report(data: dict[str, Any]) -> str:
    ours, vllm, mem = data["ours"], data["vllm"], data["memory"]
    m = data["machine"]
    lines = [
        "# Parser derender: serve_app ParserDerender vs `vllm launch render` (hermes + qwen3, qwen3-tiny)",
        "",
        f"{m['date_utc']}, {m['cpu']}, {m['logical_cpus']} vCPU, commit {m['git_commit']}. "
        + (
            "vLLM samples reused from the previous run on this machine (--reuse-vllm); "
            if data["opts"].get("reuse_vllm")
            else "One run, one machine; "
        )
        + "ours over HTTP through Serve's front door as `make run` serves it (HAProxy, throughput-optimized "
        "Serve, two Ingress replicas with render colocated, ParserDerender 1 replica), one token per chunk.",
        "",
        "## Per-chunk latency by position (ours, one stream of %d chunks)" % len(ours["per_chunk_all_s"]),
        "",
        "| positions | ours p50 ms | ours p99 ms |",
        "|---|---|---|",
    ]
    lines += [f"| {w['positions']} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} |" for w in ours["windows"]]
    lines += [
        "",
        "## vLLM per-chunk latency at sampled positions (median of %d calls)" % data["opts"]["reps"],
        "",
        "| position | vLLM ms | ours p50 ms (window) |",
        "|---|---|---|",
    ]
    lat = ours["per_chunk_all_s"]
    for pos, s in sorted(vllm["per_chunk_s"].items(), key=lambda kv: int(kv[0])):
        pos = int(pos)
        ours_ms = 1000 * statistics.median(lat[pos : pos + 100]) if pos < len(lat) else float("nan")
        lines.append(f"| {pos} | {1000 * s:.1f} | {ours_ms:.2f} |")
    r1 = vllm["total_1000_s"] / ours["total_1000_s"]
    r4 = vllm["total_4000_s"] / ours["total_4000_s"]
    lines += [
        "",
        "## Total derender time of one stream",
        "",
        "| stream | vLLM s | ours s | vLLM / ours | goal |",
        "|---|---|---|---|---|",
        f"| 1000 tokens | {vllm['total_1000_s']:.2f} | {ours['total_1000_s']:.3f} | {r1:.0f}x | >= 10x |",
        f"| 4000 tokens | {vllm['total_4000_s']:.2f} | {ours['total_4000_s']:.3f} | {r4:.0f}x | >= 40x |",
    ]
    if "full_1000_total_s" in vllm:
        lines.append(f"\nvLLM's 1000-token stream measured end to end: {vllm['full_1000_total_s']:.1f} s.")
    s = ours["sessions"]
    st = ours["replica_stats"]
    lines += [
        "",
        "vLLM totals integrate its per-chunk samples (trapezoid); ours are the sums of the first 1000 / 4000 "
        "measured chunks of the stream above.",
        "",
        "## Session cache",
        "",
        f"- Outcomes over the measured stream (ParserDerender replica counters): {s['hits']} hits, "
        f"{s['misses']} misses: **{100 * ours['hit_rate']:.2f}% hits**.",
        f"- Replica after the run: {st['sessions']} cached sessions holding {st['session_tokens']} tokens; "
        f"peak RSS {st['max_rss_bytes'] / 2**20:.0f} MiB.",
        "- Memory per cached token (tracemalloc, live sessions of 1000 / 4000 output tokens): "
        + ", ".join(f"{v['bytes_per_token']:.0f} B" for v in mem["by_length"].values())
        + f". With `parser_sessions.max_tokens` = {mem['max_tokens']:,} the cache holds at most "
        f"~{mem['bound_bytes'] / 2**20:.0f} MiB per replica (plus LRU and TTL bounds on entries).",
        f"- Streamed output equals the non-streaming answer: {ours['stream_equals_nonstream']} "
        f"(finish_reason {ours['finish_reason']}, {ours['tool_calls']} tool calls).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--vllm-full", action="store_true", help="also stream vLLM's 1000-token case end to end")
    p.add_argument("--reuse-vllm", action="store_true", help="reuse the vLLM samples of the last run (logs.tmp)")
    opts = p.parse_args()
    prompt, output = workload(opts.tokens)
    print(f"prompt {len(prompt)} tokens, output {len(output)} tokens", flush=True)
    cached = LOGS / "parser-vllm.json"
    if opts.reuse_vllm and cached.exists():
        vllm = json.loads(cached.read_text())
        vllm["per_chunk_s"] = {int(k): v for k, v in vllm["per_chunk_s"].items()}
    else:
        vllm = run_vllm(opts, prompt, output)
        cached.write_text(json.dumps(vllm))
    ours = run_ours(opts, prompt, output)
    print(f"ours: {ours['windows']}", flush=True)
    memory = session_memory(prompt, output)
    data = {"machine": machine_info(), "opts": vars(opts), "vllm": vllm, "ours": ours, "memory": memory}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "parser.json").write_text(json.dumps(data, indent=1, default=str))
    text = report(json.loads(json.dumps(data, default=str)))
    (RESULTS / "parser.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
