"""Load benchmark: serve_app next to vLLM 0.32 at concurrency 1 to 32, one run, one machine.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.load_bench              # about 12-15 minutes
    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.load_bench --quick      # smoke: c=1,4, about 4 minutes
    .venv/bin/python -m bench.load_bench --from-json bench/results/load.json          # report and plots again

Three servers run for the whole run, all with qwen3-tiny, ``--tool-call-parser hermes
--reasoning-parser qwen3 --enable-auto-tool-choice``:

* **vLLM render**: ``vllm launch render`` (the reference for workloads 1-3);
* **vLLM serve**: coupled ``vllm serve`` (the reference for workload 4): eager CPU engine, a fixed
  KV cache, ``--max-num-seqs`` = the highest concurrency, the scripted-output logits processor;
* **ours**: the Serve app as ``make run`` serves it (the Makefile's Serve flags: throughput-optimized
  Serve, HAProxy hashing ``x-session-id``; the stages ``serve_config.yaml`` colocates in two Ingress
  replicas, ParserDerender one replica), with the Engine deployment configured as vLLM serve's engine.

Workloads, each at every ``--concurrency`` (c workers, each running sessions back to back), the two
systems taking turns per concurrency (who goes first alternates):

1. **parser**: chat derender streams through the parsers, one token per chunk, each call carrying
   the previous ``stream_state``, ``chat_request`` and the full ``prompt_token_ids`` (as
   ``parser_bench``), with the stream's id as ``x-session-id`` (vLLM ignores it): a
   ``--stream-tokens`` output of reasoning, answer and two hermes tool calls.
   Every stream is run to its end, so every position 0..N-1 is sampled equally (vLLM's per-chunk
   cost grows with the position). Aggregate chunks/s, per-chunk p50 / p99, p50 by position.
2. **plain**: completions derender streams (no parser on either side), one token per chunk of
   English / CJK / emoji text, carrying ``stream_state``. Chunks/s, per-chunk p50 / p99.
3. **render**: chat render of the tool chat (``/v1/chat/completions/render``). Requests/s, p50 / p99.
4. **composed**: streamed ``/v1/chat/completions`` (tool chat, temperature 0) against coupled
   ``vllm serve``: each request makes the engine say a scripted tool-and-reasoning output of
   ``--composed-tokens`` tokens (or, ``--composed-output model``, the random model's own greedy
   output with ``ignore_eos``). Output tok/s (usage), TTFT and ITL p50 / p99.

Concurrent sessions use distinct prompts (the user message is tagged ``(conversation k)``).
Parity before timing, at c=1: every parser and plain stream chunk and carried state (``created``
and random tool-call ids aside), the render response (same ``X-Request-Id``) and the composed
output (content, reasoning, tool calls, finish reason) must equal vLLM's; under load every
stream's and request's joined output is compared to vLLM's and mismatches are counted (reported,
never fatal). Progress goes to stderr; results to ``bench/results/load.md`` / ``.json`` and PNG plots
(``bench/plots.py``) in ``bench/results/``; server logs to ``bench/results/logs.tmp/``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import orjson

from bench.common.load import Recorder, Session, client_session, progress, run_sessions, sse_events
from bench.common.load_report import KV_BYTES, SYSTEMS, UNIT, WORKLOADS, plots, render_report, summary_line
from bench.common.paths import LOGS, RESULTS
from bench.common.report import cli, diff_keys, listed, machine_info, options_json, rerender, write_results
from bench.common.serve_cluster import make_run_env, prepare_driver, session_outcomes, shipped_colocate, vllm_and_ours
from bench.common.servers import SCRIPTED_PROCESSOR, VllmRender, VllmServe
from bench.common.workloads import (
    MODEL,
    chat_prompt,
    chat_variant,
    compare_calls,
    has_output,
    joined,
    text_output,
    tokenizer,
    tool_reasoning_output,
)
from tests.harness.derender_stream import acarry_state, split, token_chunks

APP_ARGS: dict[str, Any] = {"model": MODEL, "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
VARIANTS = 64  # distinct prompts, more than the highest concurrency
JSON_HEADERS = {"content-type": "application/json"}
QUICK = {"concurrency": "1,4", "stream_tokens": 100, "streams_per_worker": 1, "min_chunks": 100, "duration": 1.5,
         "composed_duration": 3.0, "composed_tokens": 96}


# --------------------------------------------------------------------------------------------
# Workload data and request bodies
# --------------------------------------------------------------------------------------------


def build_workload(opts: argparse.Namespace) -> dict[str, Any]:
    """Chat variants and their prompt ids, the parser and plain stream outputs, the composed request bodies."""
    tok = tokenizer(MODEL)
    requests = [chat_variant(k) for k in range(VARIANTS)]
    script = tool_reasoning_output(tok, opts.composed_tokens)
    composed = []
    for req in requests:
        body = {**req, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if opts.composed_output == "scripted":
            body.update(max_tokens=len(script), vllm_xargs={"scripted_output": script})
        else:
            body.update(max_tokens=opts.composed_tokens, ignore_eos=True)
        composed.append(orjson.dumps(body))
    return {
        "requests": requests,
        "prompts": [chat_prompt(tok, r) for r in requests],
        "parser_output": tool_reasoning_output(tok, opts.stream_tokens),
        "plain_output": text_output(tok, opts.stream_tokens),
        "composed_bodies": composed,
        "composed_max_tokens": len(script) if opts.composed_output == "scripted" else opts.composed_tokens,
    }


def _timed_post(http: Any, url: str, headers: dict[str, str], rec: Recorder) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """A stream's ``post`` for :func:`acarry_state`: each call timed into ``rec`` by its position in the
    stream (the body is encoded before the clock starts), a non-200 an error."""
    position = 0

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        nonlocal position
        i, position, data = position, position + 1, orjson.dumps(body)
        t0 = time.perf_counter()
        async with http.post(url, data=data, headers=headers) as resp:
            raw, status = await resp.read(), resp.status
        rec.add("chunk", time.perf_counter() - t0, i)
        if status != 200:
            raise RuntimeError(f"chunk {i}: HTTP {status}: {raw[:300]!r}")
        return orjson.loads(raw)

    return post


Keep = list[tuple[Any, Any]]  # (chunk, stream_state) per call, for the parity check


def parser_session(http: Any, base: str, wl: dict[str, Any], ref: dict[str, Any] | None, *, tokens: int | None = None,
                   keep: Keep | None = None) -> Session:
    """One parser derender stream per session, chunk after chunk, carrying stream_state."""
    url = base + "/v1/chat/completions/derender"
    output = wl["parser_output"][:tokens]

    async def run(rec: Recorder, k: int) -> None:
        v = k % VARIANTS
        req, prompt, rid = wl["requests"][v], wl["prompts"][v], f"load-parser-{k}"
        # The stream's id as x-session-id, as an orchestrator sends it: the front door keeps the stream
        # on one Ingress replica, the one holding its parser (vLLM ignores the header).
        headers = {**JSON_HEADERS, "x-session-id": rid}
        chunks = []
        async for out in acarry_state(_timed_post(http, url, headers, rec), token_chunks(split(output), rid), model=MODEL,
                                      chat_request=req, prompt_token_ids=prompt):
            chunks.append(out["chunk"])
            rec.count("chunks")
            if keep is not None:
                keep.append((out["chunk"], out["stream_state"]))
        if ref is not None and joined(chunks) != ref:
            rec.count("mismatches")

    return run


def plain_session(http: Any, base: str, wl: dict[str, Any], ref: str | None, *, tokens: int | None = None,
                  keep: Keep | None = None) -> Session:
    """One completions derender stream per session (plain detokenization), carrying stream_state."""
    url = base + "/v1/completions/derender"
    output = wl["plain_output"][:tokens]

    async def run(rec: Recorder, k: int) -> None:
        prompt, rid = wl["prompts"][k % VARIANTS], f"load-plain-{k}"
        text = []
        parts = token_chunks(split(output), rid, "length")
        async for out in acarry_state(_timed_post(http, url, JSON_HEADERS, rec), parts, model=MODEL,
                                      prompt_tokens=len(prompt), prompt_token_ids=prompt):
            text += [c.get("text") or "" for c in out["chunk"]["choices"]]
            rec.count("chunks")
            if keep is not None:
                keep.append((out["chunk"], out["stream_state"]))
        if ref is not None and "".join(text) != ref:
            rec.count("mismatches")

    return run


def render_session(http: Any, base: str, wl: dict[str, Any], ref: Any = None, **_: Any) -> Session:
    """One chat render per session: the composed workload's request, as the composed path renders it."""
    url = base + "/v1/chat/completions/render"

    async def run(rec: Recorder, k: int) -> None:
        t0 = time.perf_counter()
        async with http.post(url, data=wl["composed_bodies"][k % VARIANTS], headers=JSON_HEADERS) as resp:
            data, status = await resp.read(), resp.status
        rec.add("request", time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        rec.count("requests")

    return run


def composed_session(http: Any, base: str, wl: dict[str, Any], ref: dict[str, Any] | None, *, keep: list[Any] | None = None,
                     **_: Any) -> Session:
    """One streamed chat completion per session: TTFT (sent -> first event with output), ITL (gaps between
    output events), the request's time, output tokens from the usage chunk."""
    url = base + "/v1/chat/completions"

    async def run(rec: Recorder, k: int) -> None:
        stamps: list[float] = []
        events: list[dict[str, Any]] = []
        usage = None
        t0 = time.perf_counter()
        async with http.post(url, data=wl["composed_bodies"][k % VARIANTS], headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for data in sse_events(resp):
                now = time.perf_counter()
                event = orjson.loads(data)
                if "error" in event:
                    raise RuntimeError(f"in-band error: {event['error']}")
                if has_output(event):
                    stamps.append(now)
                usage = event.get("usage") or usage
                if event.get("choices"):
                    events.append(event)
        end = time.perf_counter()
        if not stamps:
            raise RuntimeError("no output event")
        rec.add("ttft", stamps[0] - t0)
        for a, b in zip(stamps, stamps[1:], strict=False):
            rec.add("itl", b - a)
        rec.add("request", end - t0)
        if len(stamps) >= 10 and stamps[0] - t0 > (end - t0) / 2:
            rec.count("burst_requests")  # most of the output arrived at once, after the first half of the request
        rec.count("tokens", usage["completion_tokens"] if usage else len(stamps))
        rec.count("requests")
        got = joined(events)
        if ref is not None and got != ref:
            rec.count("mismatches")
        if keep is not None:
            keep.append(got)

    return run


FACTORIES: dict[str, Callable[..., Session]] = {
    "parser": parser_session, "plain": plain_session, "render": render_session, "composed": composed_session,
}


# --------------------------------------------------------------------------------------------
# Parity at c=1, before anything is timed
# --------------------------------------------------------------------------------------------


async def _parity_outputs(http: Any, bases: dict[str, dict[str, str]], wl: dict[str, Any], workload: str) -> dict[str, Any]:
    """Each system's output for the first variant: (chunk, state) per call, the render response, or the joined stream."""
    kept: dict[str, Any] = {}
    for system, base in bases.items():
        rec = Recorder()
        if workload in ("parser", "plain"):
            keep: Keep = []
            await FACTORIES[workload](http, base["render"], wl, None, keep=keep)(rec, 0)
            kept[system] = keep
        elif workload == "render":
            async with http.post(base["render"] + "/v1/chat/completions/render", data=wl["composed_bodies"][0],
                                 headers={**JSON_HEADERS, "x-request-id": "load-parity"}) as resp:
                kept[system] = {"status": resp.status, "body": orjson.loads(await resp.read())}
        else:
            got: list[Any] = []
            await composed_session(http, base["serve"], wl, None, keep=got)(rec, 0)
            kept[system] = got[0]
        if rec.errors:
            raise RuntimeError(rec.errors[0])
    return kept


async def parity(http: Any, bases: dict[str, dict[str, str]], wl: dict[str, Any],
                 workloads: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parity results, reference outputs per workload: what every later stream or request must join up to)."""
    results: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    first = "vllm" if "vllm" in bases else "ours"
    for workload in workloads:
        try:
            kept = await _parity_outputs(http, bases, wl, workload)
        except Exception as exc:  # noqa: BLE001 - reported; the load cases still run (without a reference)
            results[workload] = {"result": f"error: {exc!r}"[:500]}
            progress(f"  parity {workload}: {results[workload]['result']}")
            continue
        ref = kept[first]
        if workload == "parser":
            refs[workload] = joined([c for c, _ in ref])
        elif workload == "plain":
            refs[workload] = "".join(c2.get("text") or "" for c, _ in ref for c2 in c["choices"])
        elif workload == "composed":
            refs[workload] = ref
        if len(kept) < 2:
            results[workload] = {"result": "not compared (one system)"}
        elif workload in ("parser", "plain"):
            results[workload] = compare_calls(kept["vllm"], kept["ours"])
        elif workload == "render":
            v, o = kept["vllm"], kept["ours"]
            same_status = v["status"] == o["status"]
            results[workload] = {"result": diff_keys(v["body"], o["body"]) if same_status else f"status {v['status']} / {o['status']}"}
        else:
            v, o = kept["vllm"], kept["ours"]
            results[workload] = {"result": diff_keys(v, o), **({"vllm": v, "ours": o} if v != o else {})}
        progress(f"  parity {workload}: {results[workload]['result']}")
    return results, refs


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------


def plan(workload: str, c: int, opts: argparse.Namespace) -> dict[str, Any]:
    """run_sessions' stopping rule for a case: whole streams for the stream workloads (every position
    sampled equally), a duration for render and composed."""
    if workload in ("parser", "plain"):
        per_worker = max(opts.streams_per_worker, math.ceil(opts.min_chunks / (c * opts.stream_tokens)))
        return {"min_sessions_per_worker": per_worker, "duration": 0.0}
    if workload == "render":
        return {"min_sessions_per_worker": 1, "duration": opts.duration}
    return {"min_sessions_per_worker": 1, "duration": opts.composed_duration}


async def warm_up(http: Any, workload: str, base: str, wl: dict[str, Any], c: int, opts: argparse.Namespace) -> None:
    """Open c connections and warm the path: c short streams (20 chunks), 0.5 s of renders, or one
    request per worker (composed)."""
    if workload in ("parser", "plain"):
        session = FACTORIES[workload](http, base, wl, None, tokens=20)
        await run_sessions(session, concurrency=c, unit="chunks", min_sessions_per_worker=1, progress_interval=0)
    elif workload == "render":
        await run_sessions(render_session(http, base, wl), concurrency=c, unit="requests", duration=opts.warmup, progress_interval=0)
    else:
        await run_sessions(composed_session(http, base, wl, None), concurrency=c, unit="tokens", min_sessions_per_worker=1,
                           progress_interval=0)


async def parser_cache_stats(http: Any, base: str) -> dict[str, float] | None:
    """Our parser-session outcomes so far (hits, misses) from ``/metrics``: every Ingress replica's
    counters, whether it parsed a chunk itself or passed it to ParserDerender; None if unavailable."""
    try:
        async with http.get(base + "/metrics") as resp:
            counts = session_outcomes(await resp.text())
        return {"hits": counts.get("hit", 0.0), "misses": counts.get("miss", 0.0)}
    except Exception as exc:  # noqa: BLE001 - informational only
        progress(f"  (no session-cache counts: {exc!r})"[:300])
        return None


async def run_cases(bases: dict[str, dict[str, str]], wl: dict[str, Any], opts: argparse.Namespace, data: dict[str, Any],
                    run_start: float) -> None:
    async with client_session(max(opts.concurrency)) as http:
        progress(f"[run {time.perf_counter() - run_start:5.0f} s] parity at c=1")
        data["parity"], refs = await parity(http, bases, wl, opts.workloads)
        for workload in opts.workloads:
            for ci, c in enumerate(opts.concurrency):
                systems = list(bases) if ci % 2 == 0 else list(reversed(bases))
                for system in systems:
                    base = bases[system]["serve" if workload == "composed" else "render"]
                    label = f"{workload} · {system} · c={c}"
                    progress(f"[run {time.perf_counter() - run_start:5.0f} s] {label}: warm-up")
                    await warm_up(http, workload, base, wl, c, opts)
                    progress(f"[run {time.perf_counter() - run_start:5.0f} s] {label}: measuring")
                    session = FACTORIES[workload](http, base, wl, refs.get(workload))
                    before = await parser_cache_stats(http, base) if (workload, system) == ("parser", "ours") else None
                    res = await run_sessions(session, concurrency=c, unit=UNIT[workload], label=label, run_start=run_start,
                                             progress_interval=opts.progress_interval, **plan(workload, c, opts))
                    row = {"workload": workload, "system": system, **res}
                    if before is not None and (after := await parser_cache_stats(http, base)) is not None:
                        row["parser_sessions"] = {k: after[k] - before[k] for k in ("hits", "misses")}
                    data["cases"].append(row)
                    print(summary_line(row), flush=True)


# --------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------


def ours_app_args(opts: argparse.Namespace) -> dict[str, Any]:
    return {**APP_ARGS, "colocate_in_ingress": shipped_colocate(),
            "deployments": {"ingress": {"num_replicas": opts.ingress_replicas},
                            "parser_derender": {"num_replicas": opts.parser_replicas}},
            "engine": {"enabled": True, "enforce_eager": True, "tokens_only": True,
                       "kv_cache_memory_bytes": KV_BYTES, "logits_processors": [SCRIPTED_PROCESSOR],
                       "max_num_seqs": max(opts.concurrency)}}


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.load_bench", __doc__)
    ap.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated concurrencies (default: %(default)s)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, from %(default)s")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from %(default)s (one alone: no ratios, no parity)")
    ap.add_argument("--stream-tokens", type=int, default=200, help="chunks (tokens) per parser and plain stream (default: %(default)s)")
    ap.add_argument("--streams-per-worker", type=int, default=2, help="whole streams each worker runs, at least (default: %(default)s)")
    ap.add_argument("--min-chunks", type=int, default=2000, help="chunks per stream case, at least (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per render case (default: %(default)s)")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds of render warm-up per case (default: %(default)s)")
    ap.add_argument("--composed-duration", type=float, default=15.0, help="seconds per composed case (default: %(default)s)")
    ap.add_argument("--composed-tokens", type=int, default=128, help="output tokens per composed request (default: %(default)s)")
    ap.add_argument("--composed-output", choices=("scripted", "model"), default="scripted",
                    help="scripted tool-and-reasoning output, or the random model's own (ignore_eos) (default: %(default)s)")
    ap.add_argument("--ingress-replicas", type=int, default=2)
    ap.add_argument("--parser-replicas", type=int, default=1)
    ap.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines on stderr")
    quick = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {quick} (unless given)")
    ap.add_argument("--out", type=Path, default=RESULTS / "load", help="output path without extension (default: %(default)s)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--from-json", type=Path, help="only re-render the markdown report and the plots from a results JSON")
    opts = ap.parse_args(argv)
    if opts.from_json:
        rerender(opts.from_json, render_report)
        if not opts.no_plots:
            plots(opts.from_json)
        return
    if opts.quick:
        for k, v in QUICK.items():
            if getattr(opts, k) == ap.get_default(k):
                setattr(opts, k, v)
    opts.concurrency = [int(x) for x in listed(ap, opts.concurrency)]
    opts.workloads, systems = listed(ap, opts.workloads, WORKLOADS), listed(ap, opts.systems, SYSTEMS)

    os.environ.update(make_run_env())  # as `make run`
    prepare_driver()
    run_start = time.perf_counter()
    LOGS.mkdir(parents=True, exist_ok=True)
    wl = build_workload(opts)
    options = options_json(opts)
    data: dict[str, Any] = {"machine": machine_info(), "options": options,
                            "workload": {"prompt_tokens": [len(wl["prompts"][0]), len(wl["prompts"][-1])],
                                         "parser_output_tokens": len(wl["parser_output"]), "plain_output_tokens": len(wl["plain_output"]),
                                         "composed_max_tokens": wl["composed_max_tokens"]},
                            "setup": {}, "cases": []}
    setup = data["setup"]
    from serve_app.models import ensure_model

    vllm = {"render": VllmRender(APP_ARGS, "load-vllm-render.log"),
            "serve": VllmServe(str(ensure_model(MODEL)), "load-vllm-serve.log", kv_cache_bytes=KV_BYTES,
                               max_num_seqs=max(opts.concurrency), scale_out=False)} if "vllm" in systems else {}
    ours = ours_app_args(opts) if "ours" in systems else None
    with vllm_and_ours(vllm, ours, setup, namespace="load_bench", ingress=opts.ingress_replicas) as base:
        bases = {**({"vllm": {k: v.base for k, v in vllm.items()}} if vllm else {}),
                 **({"ours": {"render": base, "serve": base}} if base else {})}
        setup["ready_s"] = time.perf_counter() - run_start
        asyncio.run(run_cases(bases, wl, opts, data, run_start))
    data["total_s"] = time.perf_counter() - run_start
    write_results(opts.out, data, render_report)
    if not opts.no_plots:
        plots(opts.out.with_suffix(".json"))


if __name__ == "__main__":
    main()
