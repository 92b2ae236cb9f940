"""Soak benchmark: an hour's mixed traffic compressed into ``--minutes`` (10), against our app as ``make run`` starts it.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.soak_bench                   # about 12 minutes
    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.soak_bench --minutes 1 --out /tmp/soak-smoke
    .venv/bin/python -m bench.soak_bench --from-json bench/results/soak.json               # report and plot again

The app: ``serve_config.yaml``'s application args and its per-deployment options (Ingress ×2 with
render and plain derender colocated, ParserDerender 1-2 autoscaled, Render, PlainDerender, Engine with
its 1 GiB KV cache), under ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1`` as ``make
run``, on a local Ray cluster (:func:`bench.common.serve_cluster.start_app`: 127.0.0.1 and a free port
instead of 0.0.0.0:8000). One change, so the parser-session cache's bounds are reached and seen within
minutes: ``parser_sessions`` is lowered (``--max-sessions`` 16, ``--max-tokens`` 3000 and ``--ttl-s``
scaled with the compression, 300 s × minutes / 60).

Traffic: up to ``--workers`` (8) client workers, each running sessions back to back, picked at random
by weight; how many are active follows a load profile shaped like an hour (ramp-up, a first peak inside
warm-up, steady, a quiet spell in which idle sessions expire, the main peak, a dip, a second peak,
wind-down). Sessions:

* render: chat, chat with tools, completions (``/v1/chat/completions/render``, ``/v1/completions/render``);
* plain derender (``/v1/completions/derender``): non-streaming, and short streams carrying ``stream_state``;
* parser derender (``/v1/chat/completions/derender``, hermes + qwen3): streams of tool-and-reasoning
  output of 100-1000 tokens carrying ``stream_state``, 1-4 tokens a chunk; some run to the end, some
  are abandoned half-way (their cached sessions must expire or be evicted), some retry a chunk (sent
  twice, the second answer used, as a client whose first answer was lost); plus non-streaming;
* composed ``/v1/chat/completions``: streaming and not, short ``max_tokens``, with and without tools;
  and streams the client drops after two events (a disconnect: the engine request must be aborted);
* bad requests (malformed JSON, unknown role, out-of-vocabulary ids, unknown route, wrong method,
  invalid ``stream_state``, negative ``max_tokens``, a non-boolean ``stream``): a 4xx expected.

Every request has a client deadline (``--timeout``): one that passes is a hang. Completed streams are
compared with reference outputs taken before the run. Every ``--sample-interval`` seconds (10) the bench
samples the RSS of every Serve process, found by its actor in the GCS actor table
(``ray._private.state.actors()`` → Pid → psutil; replicas by their actor names, the controller, the
HAProxy manager and its ``haproxy`` children, the Engine's ``EngineCore`` child), and the app's own
``/metrics`` (requests by route and status, parser-session cache size, tokens held, evictions,
expirations). Verdicts: every Serve process's RSS flat within ``--tolerance`` (10 %) of its baseline
after warm-up (the first 20 % of the run), the cache at or under its bounds at every sample, zero 5xx,
zero hangs. Results: ``bench/results/soak.md`` / ``.json`` and ``soak_rss.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.common.checked_http import CheckedClient, Tally
from bench.common.kills import parse_kills
from bench.common.load import progress
from bench.common.paths import LOGS, RESULTS
from bench.common.report import cli, machine_info, options_json, rerender, write_results
from bench.common.sampling import haproxy_pids, sampled_run, stop_leftovers
from bench.common.serve_cluster import make_run_env, prepare_driver, replica_counts, shipped_app_args, start_ours
from bench.common.soak_report import plot_file, print_verdicts, render_report
from bench.common.workloads import (
    MODEL,
    chat_prompt,
    chat_variant,
    joined,
    text_output,
    tokenizer,
    tool_reasoning_output,
    without_random_fields,
)

MAKE_RUN_ENV = make_run_env()
VARIANTS = 256  # distinct conversations (prompts): concurrent parser streams never share a state
PARSER_LENGTHS = {100: 4, 200: 4, 400: 2, 1000: 1}  # output tokens of a parser stream: weight
PLAIN_STREAM_LENGTHS = (16, 32, 64)
PLAIN_TEXT_TOKENS = 200  # non-streaming plain derender output

# Session kinds and their weights (per session picked, not per second: a parser stream lasts ~1-5 s,
# a render a few ms, so by time the streams dominate and by count the renders do).
WEIGHTS: dict[str, float] = {
    "render_chat": 40, "render_chat_tools": 20, "render_completion": 20,
    "plain_nonstream": 15, "plain_stream": 10,
    "parser_stream": 5, "parser_nonstream": 3,
    "composed": 4, "composed_stream": 4, "composed_disconnect": 1.5,
    "bad_request": 6,
}
PARSER_MODES = {"complete": 0.65, "abandon": 0.2, "retry": 0.15}

# Active share of the workers over the run (fraction of the run it starts at, share): an hour's shape.
PROFILE: list[tuple[float, float]] = [
    (0.00, 0.25),  # ramp-up
    (0.04, 0.75),
    (0.09, 1.00),  # first peak, inside warm-up: the allocators see peak concurrency before the baseline
    (0.15, 0.50),
    (0.20, 0.60),  # steady (warm-up ends)
    (0.32, 0.15),  # quiet spell: abandoned sessions expire
    (0.40, 0.75),
    (0.52, 1.00),  # main peak
    (0.64, 0.40),  # dip
    (0.72, 0.90),  # second peak
    (0.85, 0.60),
    (0.93, 0.30),  # wind-down
]


def active_workers(frac: float, workers: int) -> int:
    share = PROFILE[0][1]
    for start, s in PROFILE:
        if frac >= start:
            share = s
    return max(1, math.ceil(share * workers))


def app_args_from_yaml(opts: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``serve_config.yaml``'s args (per-deployment options folded in) with the cache bounds lowered.
    Returns (args, what was changed from the YAML)."""
    args = shipped_app_args()
    sessions = {"max_sessions": opts.max_sessions, "max_tokens": opts.max_tokens, "ttl_s": opts.ttl_s}
    changed = {"parser_sessions": {"yaml": args.get("parser_sessions") or "defaults (4096 sessions, 1,000,000 tokens, 300 s)",
                                   "soak": sessions}}
    args["parser_sessions"] = {**(args.get("parser_sessions") or {}), **sessions}
    return args, changed


def launch_ours(args: dict[str, Any], setup: dict[str, Any]) -> str:
    ingress = args["deployments"].get("ingress", {}).get("num_replicas", 1)
    base, up = start_ours(args, namespace="soak_bench", ingress=ingress, ready_timeout=600)
    setup.update(haproxy_replicas_up=up["haproxy_replicas_up"], startup_s=up["startup_s"], deployments_at_start=up["deployments"])
    return base


def build_workload() -> dict[str, Any]:
    tok = tokenizer(MODEL)
    tool_chats = [chat_variant(k) for k in range(VARIANTS)]
    plain_chats = [{"model": MODEL, "messages": r["messages"]} for r in tool_chats]
    return {
        "tool_chats": tool_chats,
        "prompts": [chat_prompt(tok, r) for r in tool_chats],
        "plain_chats": plain_chats,
        "parser_outputs": {n: tool_reasoning_output(tok, n) for n in PARSER_LENGTHS},
        "plain_outputs": {n: text_output(tok, n) for n in (*PLAIN_STREAM_LENGTHS, PLAIN_TEXT_TOKENS)},
        "completion_prompts": [f"Write a short story about lighthouse number {k}, in three sentences." for k in range(VARIANTS)],
        "vocab_size": len(tok),
    }


def bad_requests(wl: dict[str, Any]) -> list[tuple[str, str, str, bytes | None]]:
    """(name, method, path, body): each must answer a 4xx in the error envelope."""
    msgs = [{"role": "user", "content": "hi"}]
    oov = wl["vocab_size"] + 1000
    chunk = {"request_id": "bad", "choices": [{"index": 0, "token_ids": [9707], "finish_reason": None}]}
    return [
        ("malformed JSON", "POST", "/v1/chat/completions/render", b'{"messages": [{"role": "user", "content": '),
        ("unknown role", "POST", "/v1/chat/completions/render", orjson.dumps({"messages": [{"role": "wizard", "content": "hi"}]})),
        ("out-of-vocabulary prompt id", "POST", "/v1/completions/render", orjson.dumps({"model": MODEL, "prompt": [1, oov]})),
        ("out-of-vocabulary id, composed", "POST", "/v1/completions", orjson.dumps({"model": MODEL, "prompt": [oov], "max_tokens": 4})),
        ("unknown route", "GET", "/v1/nothing-here", None),
        ("wrong method", "GET", "/v1/chat/completions/render", None),
        ("invalid stream_state", "POST", "/v1/completions/derender",
         orjson.dumps({"stream": True, "generate_chunk": chunk, "stream_state": {"prev_tokens": "x"}})),
        ("empty generate_responses", "POST", "/v1/completions/derender", orjson.dumps({"generate_responses": []})),
        ("negative max_tokens", "POST", "/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": msgs, "max_tokens": -1})),
        ("non-boolean stream", "POST", "/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": msgs, "stream": "yes"})),
    ]


class Traffic(CheckedClient):
    """The soak's sessions over the checking client; ``refs``: reference outputs from the preflight."""

    def __init__(self, http: Any, base: str, wl: dict[str, Any], opts: argparse.Namespace, tally: Tally) -> None:
        super().__init__(http, base, tally, timeout=opts.timeout, stream_timeout=opts.composed_timeout)
        self.wl, self.opts = wl, opts
        self.refs: dict[str, Any] = {}
        self.numbers = itertools.count()
        self.bad = bad_requests(wl)

    # --- sessions -------------------------------------------------------------------------------

    async def session(self, kind: str, rng: random.Random) -> None:
        k = next(self.numbers)
        v = k % VARIANTS
        wl = self.wl
        if kind == "render_chat":
            await self.request(kind, "POST", "/v1/chat/completions/render", orjson.dumps(wl["plain_chats"][v]))
        elif kind == "render_chat_tools":
            await self.request(kind, "POST", "/v1/chat/completions/render", orjson.dumps(wl["tool_chats"][v]))
        elif kind == "render_completion":
            completion = {"model": MODEL, "prompt": wl["completion_prompts"][v], "max_tokens": 32}
            await self.request(kind, "POST", "/v1/completions/render", orjson.dumps(completion))
        elif kind == "plain_nonstream":
            await self.plain_nonstream(k, v)
        elif kind == "plain_stream":
            await self.plain_stream(k, v, rng.choice(PLAIN_STREAM_LENGTHS))
        elif kind == "parser_stream":
            n = rng.choices(list(PARSER_LENGTHS), list(PARSER_LENGTHS.values()))[0]
            mode = rng.choices(list(PARSER_MODES), list(PARSER_MODES.values()))[0]
            await self.parser_stream(k, v, n, mode=mode, chunk=rng.choice((1, 1, 1, 2, 4)), rng=rng)
        elif kind == "parser_nonstream":
            await self.parser_nonstream(k, v, rng.choice((100, 200)))
        elif kind in ("composed", "composed_stream"):
            req = wl["tool_chats"][v] if rng.random() < 0.5 else wl["plain_chats"][v]
            body: dict[str, Any] = {**req, "max_tokens": rng.randint(4, 24)}
            if kind == "composed":
                res = await self.request(kind, "POST", "/v1/chat/completions", orjson.dumps(body), timeout=self.opts.composed_timeout)
                if res and res[0] == 200 and not orjson.loads(res[1]).get("choices"):
                    self.t.mismatches[kind] += 1
            else:
                body.update(stream=True, stream_options={"include_usage": True})
                events = await self.sse(kind, orjson.dumps(body))
                if events is not None and not (events and events[-1].get("usage")):
                    self.t.mismatches[kind + " (no usage chunk)"] += 1
        elif kind == "composed_disconnect":
            body = {**wl["plain_chats"][v], "max_tokens": 256, "ignore_eos": True, "stream": True}
            if await self.sse(kind, orjson.dumps(body), drop_after=2) is not None:
                self.t.events["client disconnects mid-stream"] += 1
        elif kind == "bad_request":
            name, method, path, raw = rng.choice(self.bad)
            await self.request("bad: " + name, method, path, raw, bad=True)
        else:
            raise ValueError(kind)

    async def plain_nonstream(self, k: int, v: int) -> None:
        ids = self.wl["plain_outputs"][PLAIN_TEXT_TOKENS]
        gen = {"request_id": f"soak-plain-{k}", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]}
        body = {"generate_responses": [gen], "prompt_tokens": [len(self.wl["prompts"][v])]}
        res = await self.request("plain_nonstream", "POST", "/v1/completions/derender", orjson.dumps(body))
        if res and res[0] == 200 and "plain_nonstream" in self.refs:
            if orjson.loads(res[1])["choices"][0]["text"] != self.refs["plain_nonstream"]:
                self.t.mismatches["plain_nonstream"] += 1

    async def plain_stream(self, k: int, v: int, n: int) -> str | None:
        output, prompt = self.wl["plain_outputs"][n], self.wl["prompts"][v]
        state, text = None, []
        for i, token in enumerate(output):
            chunk = {"request_id": f"soak-plain-{k}", "choices": [{"index": 0, "token_ids": [token],
                                                                  "finish_reason": "length" if i == n - 1 else None}]}
            body = {"stream": True, "model": MODEL, "generate_chunk": chunk, "stream_state": state, "prompt_tokens": len(prompt),
                    "prompt_token_ids": prompt}
            res = await self.request("plain_stream_chunk", "POST", "/v1/completions/derender", orjson.dumps(body))
            if not res or res[0] != 200:
                return None
            out = orjson.loads(res[1])
            state = out["stream_state"]
            text += [c.get("text") or "" for c in out["chunk"]["choices"]]
        joined_text = "".join(text)
        ref = self.refs.get(f"plain_stream_{n}")
        if ref is not None and joined_text != ref:
            self.t.mismatches["plain_stream"] += 1
        self.t.events["plain streams completed"] += 1
        return joined_text

    async def parser_stream(self, k: int, v: int, n: int, *, mode: str = "complete", chunk: int = 1,
                            rng: random.Random | None = None) -> dict[str, Any] | None:
        """One parser derender stream; ``abandon``: stop between 20 and 80 % of it; ``retry``: send one chunk twice."""
        rng = rng or random.Random(k)
        output, req, prompt = self.wl["parser_outputs"][n], self.wl["tool_chats"][v], self.wl["prompts"][v]
        starts = list(range(0, n, chunk))
        stop = len(starts) if mode != "abandon" else rng.randint(max(1, len(starts) // 5), max(1, 4 * len(starts) // 5))
        retry_at = rng.randrange(1, max(2, len(starts) - 1)) if mode == "retry" else -1
        rid = f"soak-parser-{k}"
        state, chunks = None, []
        for ci, start in enumerate(starts[:stop]):
            ids = output[start:start + chunk]
            last = start + chunk >= n
            gen = {"request_id": rid, "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop" if last else None}]}
            body = orjson.dumps({"stream": True, "model": MODEL, "generate_chunk": gen, "stream_state": state,
                                 "chat_request": req, "prompt_token_ids": prompt})
            res = await self.request("parser_stream_chunk", "POST", "/v1/chat/completions/derender", body)
            if not res or res[0] != 200:
                return None
            out = orjson.loads(res[1])
            if ci == retry_at:
                again = await self.request("parser_stream_chunk (retried)", "POST", "/v1/chat/completions/derender", body)
                if not again or again[0] != 200:
                    return None
                out2 = orjson.loads(again[1])
                if without_random_fields(out2["chunk"]) != without_random_fields(out["chunk"]):
                    self.t.mismatches["parser retried chunk"] += 1
                    self.t.note(f"retried chunk differs: {out['chunk']} / {out2['chunk']}")
                out = out2  # the client lost the first answer
            state = out["stream_state"]
            chunks.append(out["chunk"])
        self.t.events[f"parser streams {mode}"] += 1
        got = joined(chunks)
        if mode != "abandon" and (ref := self.refs.get(f"parser_stream_{n}")) is not None and got != ref:
            self.t.mismatches["parser_stream"] += 1
            self.t.note(f"parser stream {n} tokens, chunk {chunk}, {mode}: {got} != {ref}")
        return got

    async def parser_nonstream(self, k: int, v: int, n: int) -> None:
        ids = self.wl["parser_outputs"][n]
        gen = {"request_id": f"soak-parser-ns-{k}", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
        body = {"generate_response": gen, "chat_request": self.wl["tool_chats"][k % VARIANTS], "prompt_token_ids": self.wl["prompts"][v]}
        await self.request("parser_nonstream", "POST", "/v1/chat/completions/derender", orjson.dumps(body))

    # --- before the run -------------------------------------------------------------------------

    async def preflight(self) -> dict[str, Any]:
        """Reference outputs (one clean stream per length) and one of each bad request; warms every path."""
        out: dict[str, Any] = {"bad_requests": {}}
        for n in PARSER_LENGTHS:
            ref = await self.parser_stream(next(self.numbers), 0, n)
            if ref is None:
                raise RuntimeError(f"preflight: parser stream of {n} tokens failed: {self.t.samples[-1:]}")
            self.refs[f"parser_stream_{n}"] = ref
        for n in PLAIN_STREAM_LENGTHS:
            self.refs[f"plain_stream_{n}"] = await self.plain_stream(next(self.numbers), 0, n)
        ids = self.wl["plain_outputs"][PLAIN_TEXT_TOKENS]
        res = await self.request("plain_nonstream", "POST", "/v1/completions/derender",
                                 orjson.dumps({"generate_responses": [{"request_id": "ref", "choices": [{"index": 0, "token_ids": ids}]}]}))
        if res and res[0] == 200:
            self.refs["plain_nonstream"] = orjson.loads(res[1])["choices"][0]["text"]
        for name, method, path, raw in self.bad:
            res = await self.request("bad: " + name, method, path, raw, bad=True)
            out["bad_requests"][name] = res[0] if res else None
        rng = random.Random(0)
        for kind in WEIGHTS:
            if kind not in ("parser_stream", "bad_request"):
                await self.session(kind, rng)
        out["references"] = {k: (v if isinstance(v, dict) else f"{len(v or '')} chars") for k, v in self.refs.items()}
        return out

    # --- the run --------------------------------------------------------------------------------

    async def run(self, duration: float, t0: float) -> None:
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())

        async def worker(i: int) -> None:
            rng = random.Random(self.opts.seed * 1000 + i)
            while (now := time.perf_counter()) < t0 + duration:
                if i >= active_workers((now - t0) / duration, self.opts.workers):
                    await asyncio.sleep(0.25)
                    continue
                kind = rng.choices(kinds, weights)[0]
                self.t.events["sessions " + kind] += 1
                try:
                    await self.session(kind, rng)
                except Exception as exc:  # noqa: BLE001 - a bench bug or an unparsable answer: counted, the soak goes on
                    self.t.errors["session " + kind] += 1
                    self.t.note(f"session {kind} raised {exc!r}")

        await asyncio.gather(*(worker(i) for i in range(self.opts.workers)))


async def soak(base: str, wl: dict[str, Any], opts: argparse.Namespace, data: dict[str, Any]) -> None:
    import aiohttp

    tally = Tally()
    connector = aiohttp.TCPConnector(limit=opts.workers * 4, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=opts.composed_timeout + 60)) as http:
        traffic = Traffic(http, base, wl, opts, tally)
        progress("preflight: reference outputs, one of each request kind")
        data["preflight"] = await traffic.preflight()
        duration = opts.minutes * 60

        def level_of(t: float) -> int:
            return active_workers(min(max(t, 0.0), duration) / duration, opts.workers) if 0 <= t < duration else 0

        progress(f"soak: {opts.minutes:g} minutes, up to {opts.workers} workers, sampling every {opts.sample_interval:g} s")
        data["kills"] = []
        data["traffic_s"] = await sampled_run(traffic, data["samples"], partial(traffic.run, duration), duration=duration,
                                              interval=opts.sample_interval, level_of=level_of, kills=parse_kills(opts.kill or ""),
                                              kill_events=data["kills"])
        data["client"] = tally.summary()


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.soak_bench", __doc__)
    ap.add_argument("--minutes", type=float, default=10.0, help="traffic time (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=8, help="client workers at the peaks (default: %(default)s)")
    ap.add_argument("--sample-interval", type=float, help="seconds between samples (default: 10, or a twelfth of a shorter run)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="RSS flatness after warm-up, as a fraction (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=30.0, help="client deadline per request or chunk, seconds (default: %(default)s)")
    ap.add_argument("--composed-timeout", type=float, default=60.0, help="client deadline per composed request (default: %(default)s)")
    ap.add_argument("--max-sessions", type=int, default=16, help="parser_sessions.max_sessions for the soak (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=3000, help="parser_sessions.max_tokens for the soak (default: %(default)s)")
    ap.add_argument("--ttl-s", type=float,
                    help="parser_sessions.ttl_s (default: 300 s scaled by the compression, minutes / 60, 5 s at least)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--kill", default="",
                    help="replicas to SIGKILL during the traffic, as share:Deployment pairs, e.g. "
                         "0.3:Ingress,0.5:ParserDerender,0.7:Engine (default: none)")
    ap.add_argument("--kill-window", type=float, default=30.0,
                    help="seconds after a kill in which failed requests are counted as that kill's (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak", help="output path without extension (default: %(default)s)")
    ap.add_argument("--from-json", type=Path, help="only re-render the report and the plot from a results JSON")
    opts = ap.parse_args(argv)
    if opts.from_json:
        rerender(opts.from_json, partial(render_report, profile=PROFILE))
        plot_file(opts.from_json)
        return
    if opts.ttl_s is None:
        opts.ttl_s = max(5.0, round(300 * opts.minutes / 60, 1))
    if opts.sample_interval is None:
        opts.sample_interval = min(10.0, opts.minutes * 60 / 12)
    os.environ.update(MAKE_RUN_ENV)  # before Ray starts: every Ray process reads them at import
    prepare_driver()
    run_start = time.perf_counter()
    LOGS.mkdir(parents=True, exist_ok=True)
    args, changed = app_args_from_yaml(opts)
    options = options_json(opts)
    options["plot_name"] = opts.out.name + "_rss.png"
    shown_argv = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.soak_bench {shown_argv}".strip()
    data: dict[str, Any] = {"machine": machine_info(), "options": options,
                            "setup": {"app_args": args, "changed": changed, "env": MAKE_RUN_ENV,
                                      "command": command},
                            "samples": []}
    wl = build_workload()
    progress("starting the app (serve_config.yaml, as make run)")
    haproxies: set[int] = set()
    try:
        base = launch_ours(args, data["setup"])
        progress(f"  up in {data['setup']['startup_s']:.0f} s: {data['setup']['deployments_at_start']}")
        asyncio.run(soak(base, wl, opts, data))
        data["setup"]["deployments_at_end"] = replica_counts()
        haproxies = haproxy_pids(data["samples"])
    finally:
        import ray

        ray.shutdown()  # takes Serve down with the local cluster
        stop_leftovers(haproxies)
    data["total_s"] = time.perf_counter() - run_start
    write_results(opts.out, data, partial(render_report, profile=PROFILE))
    plot_file(opts.out.with_suffix(".json"))
    print_verdicts(data)

if __name__ == "__main__":
    main()
