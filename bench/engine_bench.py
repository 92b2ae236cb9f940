"""Engine benchmark: what the CPU tier adds to time to first token and inter-token latency.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.engine_bench

One run, one machine, the same CPU engine configuration (qwen3-tiny, ``--enforce-eager``, 256 MiB KV
cache, the scripted-output logits processor) everywhere:

* **engine**: our ``Engine`` deployment bare, ``POST /inference/v1/generate`` (stream) through our
  front door and Ingress: the floor the composed path is measured against.
* **engine by handle**: the same engine stream by ``DeploymentHandle`` from this driver (no HTTP).
* **composed**: our ``POST /v1/chat/completions`` (stream): render, engine stream, parser derender
  (hermes + qwen3) in the Ingress replica, SSE.
* **vllm chat**: coupled ``vllm serve`` (same flags and parsers) ``/v1/chat/completions`` (stream).
* **vllm generate**: the same server's ``/inference/v1/generate`` (``--enable-scale-out``).

Every request makes the engine emit the same ``--tokens`` scripted tokens (ordinary English text,
then ``<|im_end|>``) at temperature 0, one client at a time, the systems taking turns each round so
machine drift hits all of them alike. TTFT: request sent -> first event carrying output (token ids, or
non-empty content / reasoning). ITL: gaps between consecutive output-bearing events. Serve runs as
``make run`` does (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1``) unless
``--ray-defaults``.

Results: ``bench/results/engine.md`` and ``.json``; logs in ``bench/results/logs.tmp/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from bench.common.paths import LOGS, RESULTS
from bench.common.serve_cluster import APP_NAME, COLOCATE, haproxy_replicas_up, start_app
from bench.common.servers import SCRIPTED_PROCESSOR, free_port, start_logged, vllm_serve_argv, wait_http_blocking
from bench.common.stats import latency_stats
from bench.common.workloads import has_output

PROCESSOR = SCRIPTED_PROCESSOR
KV_BYTES = 256 * 1024 * 1024
TEXT = (
    "The printing press changed how ideas moved across Europe. Before it, a book was copied by hand, "
    "one page at a time, and a library of a few hundred volumes was a treasure. Within fifty years of "
    "Gutenberg's first Bible, millions of books were in print, and scholars in distant cities could "
    "argue about the same text, line by line, in the same edition. The same thing happened again with "
    "the telegraph, the radio and the internet: each time the cost of sending words fell, more people "
    "joined the conversation, and the conversation itself changed shape."
)
MESSAGES = [{"role": "user", "content": "Tell me about the printing press."}]


def sse_timings(client: Any, url: str, body: dict[str, Any]) -> tuple[float, list[float], int]:
    """(TTFT, inter-event gaps, output events) of one streamed request."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if has_output(event):
                stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], len(stamps)


async def handle_timings(handle: Any, body: dict[str, Any]) -> tuple[float, list[float], int]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    async for chunk in handle.options(stream=True).generate_stream.remote(body):
        if has_output(chunk):
            stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], len(stamps)


def vllm_serve(model_dir: str, port: int, log: Path) -> subprocess.Popen:
    return start_logged(vllm_serve_argv(model_dir, port, kv_cache_bytes=KV_BYTES, max_num_seqs=16), log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=20, help="requests per system (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-handle", action="store_true", help="skip the by-handle system")
    parser.add_argument("--ray-defaults", action="store_true", help="Serve's default proxy and transport")
    opts = parser.parse_args()
    if not opts.ray_defaults:
        os.environ.update({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"})
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    LOGS.mkdir(parents=True, exist_ok=True)

    import httpx
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from serve_app.app import build_app
    from serve_app.config import AppArgs
    from serve_app.models import ensure_model

    model_dir = str(ensure_model("qwen3-tiny"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    script = tok.encode(TEXT, add_special_tokens=False)
    while len(script) < opts.tokens - 1:
        script += script
    script = script[: opts.tokens - 1] + [tok.eos_token_id]
    xargs = {"scripted_output": script}

    vport, port = free_port(), free_port()
    t0 = time.monotonic()
    vproc = vllm_serve(model_dir, vport, LOGS / "engine_bench_vllm.log")
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                              "tokens": opts.tokens, "rounds": opts.rounds,
                              "serve_env": "ray-defaults" if opts.ray_defaults else "make-run (throughput-optimized + HAProxy)"}
    try:
        wait_http_blocking(f"http://127.0.0.1:{vport}/health", 300, vproc)
        result["vllm_startup_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        app_args = dict(model="qwen3-tiny", tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True,
                        colocate_in_ingress=COLOCATE,
                        engine={"enabled": True, "enforce_eager": True, "max_num_seqs": 16, "tokens_only": True,
                                "kv_cache_memory_bytes": KV_BYTES, "logits_processors": [PROCESSOR]})
        start_app(lambda: build_app(AppArgs(**app_args)), port=port, namespace="engine_bench")
        base, vbase = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{vport}"
        wait_http_blocking(base + "/health", 120)
        if not opts.ray_defaults:
            deadline = time.monotonic() + 60
            while haproxy_replicas_up() < 1 and time.monotonic() < deadline:
                time.sleep(0.5)
        result["serve_startup_s"] = time.monotonic() - t1

        client = httpx.Client(timeout=120)
        chat_body = {"model": "qwen3-tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": opts.tokens,
                     "stream": True, "vllm_xargs": xargs}
        # The bare engine gets exactly what the composed path sends it: render's GenerateRequest.
        rendered = client.post(base + "/v1/chat/completions/render", json=chat_body).json()
        gen_body = {"token_ids": rendered["token_ids"], "stream": True, "sampling_params": rendered["sampling_params"]}
        engine = serve.get_deployment_handle("Engine", app_name=APP_NAME)
        loop = asyncio.new_event_loop()
        if opts.no_handle:
            engine = None

        systems: dict[str, Callable[[], tuple[float, list[float], int]]] = {
            "engine": lambda: sse_timings(client, base + "/inference/v1/generate", gen_body),
            **({} if engine is None else {
                "engine by handle": lambda: loop.run_until_complete(handle_timings(engine, gen_body))}),
            "composed": lambda: sse_timings(client, base + "/v1/chat/completions", chat_body),
            "vllm chat": lambda: sse_timings(client, vbase + "/v1/chat/completions", chat_body),
            "vllm generate": lambda: sse_timings(client, vbase + "/inference/v1/generate", gen_body),
        }
        ttft: dict[str, list[float]] = {k: [] for k in systems}
        itl: dict[str, list[float]] = {k: [] for k in systems}
        events: dict[str, set[int]] = {k: set() for k in systems}
        names = list(systems)
        for r in range(opts.warmup + opts.rounds):
            # Rotate who goes first each round: no system always follows the same neighbour.
            for name in names[r % len(names):] + names[: r % len(names)]:
                first, gaps, n = systems[name]()
                if r >= opts.warmup:
                    ttft[name].append(first)
                    itl[name].extend(gaps)
                    events[name].add(n)
            print(f"round {r + 1}/{opts.warmup + opts.rounds}", flush=True)
        result["systems"] = {
            name: {"ttft": latency_stats(ttft[name]), "itl": latency_stats(itl[name]), "output_events_per_request": sorted(events[name])}
            for name in systems
        }
        s = result["systems"]
        result["cpu_tier_overhead"] = {
            "ttft_p50_ms": s["composed"]["ttft"]["p50_ms"] - s["engine"]["ttft"]["p50_ms"],
            "itl_p50_ms": s["composed"]["itl"]["p50_ms"] - s["engine"]["itl"]["p50_ms"],
            "itl_p99_ms": s["composed"]["itl"]["p99_ms"] - s["engine"]["itl"]["p99_ms"],
        }
        result["vs_vllm_chat"] = {
            "ttft_p50_ratio": s["composed"]["ttft"]["p50_ms"] / s["vllm chat"]["ttft"]["p50_ms"],
            "itl_p50_ratio": s["composed"]["itl"]["p50_ms"] / s["vllm chat"]["itl"]["p50_ms"],
        }
    finally:
        os.killpg(vproc.pid, signal.SIGINT)
        try:
            vproc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(vproc.pid, signal.SIGKILL)
        try:
            serve.shutdown()
            ray.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    RESULTS.mkdir(exist_ok=True)
    suffix = "-ray-defaults" if opts.ray_defaults else ""
    (RESULTS / f"engine{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"engine{suffix}.md").write_text(render_md(result))
    print(render_md(result))


def render_md(result: dict[str, Any]) -> str:
    lines = [
        f"# Engine benchmark ({result['serve_env']})",
        "",
        f"{result['machine']['cpus']} CPUs; qwen3-tiny on vLLM's CPU engine; {result['tokens']} scripted output tokens "
        f"per request, {result['rounds']} requests per system, one client, systems taking turns.",
        "",
        "| system | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | ITL p99 | output events / request |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["systems"].items():
        t, i = s["ttft"], s["itl"]
        lines.append(
            f"| {name} | {t['p50_ms']:.2f} ms | {t['p90_ms']:.2f} ms | {i['p50_ms']:.3f} ms | {i['p90_ms']:.3f} ms | "
            f"{i['p99_ms']:.3f} ms | {', '.join(map(str, s['output_events_per_request']))} |"
        )
    o, v = result["cpu_tier_overhead"], result["vs_vllm_chat"]
    lines += [
        "",
        f"CPU tier overhead (composed minus bare engine over HTTP): TTFT p50 {o['ttft_p50_ms']:+.2f} ms, "
        f"ITL p50 {o['itl_p50_ms']:+.3f} ms, ITL p99 {o['itl_p99_ms']:+.3f} ms.",
        f"Composed vs coupled vllm serve chat: TTFT p50 {v['ttft_p50_ratio']:.2f}x, ITL p50 {v['itl_p50_ratio']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
