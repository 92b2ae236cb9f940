"""Multi-node autoscaling, proved on one machine: the app on a local cluster grown and shrunk by Ray's autoscaler.

    python -m tests.harness.cluster_scenario --json out.json                  # the test's short ramp
    python -m tests.harness.cluster_scenario --json out.json --profile bench  # bench/cluster_bench.py's

One driver process (this module) starts a :class:`~tests.harness.cluster.LocalAutoscalingCluster`
laid out as ``configs/gpu-layout.yaml`` places the graph: a head (Serve's controller and HTTP proxy,
``proxy_location: HeadOnly``, no tier resource), ``cpu_tier`` nodes (``{"CPU": 2, "cpu_tier": 1}``,
1 to 2 of them) for Ingress, Render, PlainDerender and ParserDerender, each replica asking
``cpu_tier: 0.001``, and one ``engine_node`` node (``{"CPU": 1, "engine_node": 1}``, standing in for a
GPU node) for the Engine, asking ``engine_node: 0.001``. Logical CPUs (0.5 a CPU-tier replica) fill the
first cpu_tier node exactly with one replica of each CPU-tier deployment, so every replica
autoscaling adds (ParserDerender up to 2, 3 in the bench profile; PlainDerender up to 2) needs a second node, which the
autoscaler adds; the second node then holds fewer replicas than the first, so Serve's downscaling
empties it first and the autoscaler removes it once idle.

Load: parser derender HTTP streams (chat, qwen3 reasoning + hermes tool calls, one token per chunk,
``stream_state`` carried) and plain completions derender streams, ramped up in steps and held until the
second node and replicas on it are up, then a trickle (one stream of each) that keeps streams in flight
while replicas and the node go away. Every stream's chunks are compared with an unloaded run's.

Recorded every ``sample_s`` into the JSON: nodes alive by type, RUNNING replicas per deployment, where
each replica runs (the GCS actor table: ``ray._private.state.actors()``; the state API needs the
dashboard, which this cluster does not run), chunks/s and p50 / p99 chunk latency in the window, and
the phase. ``checks`` holds the verdicts the test asserts; ``teardown`` what teardown found and left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.harness.cluster import LocalAutoscalingCluster, NodeType, cluster_processes, node_type_of, teardown_cluster
from tests.harness.derender_stream import chunk, stream_body
from tests.harness.metrics import session_outcomes
from tests.harness.net import free_port
from tests.harness.payloads import MINIMAL_WEATHER_TOOLS

__all__ = ["NODE_TYPES", "PROFILES", "Options", "app_args", "main", "run"]

APP = "serve_app"
_REPO = Path(__file__).resolve().parents[2]
CPU_TIER_DEPLOYMENTS = ("Ingress", "Render", "PlainDerender", "ParserDerender")
SCALED = ("ParserDerender", "PlainDerender")
NODE_TYPES = {
    "cpu_tier": NodeType({"CPU": 2, "cpu_tier": 1}, min_workers=1, max_workers=2),
    "engine_node": NodeType({"CPU": 1, "engine_node": 1}, min_workers=1, max_workers=1),
}
SERVE_ENV = {  # every Serve process: autoscaling metrics each second instead of every 10 s
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_QUIET = {"log_level": "WARNING", "enable_access_log": False}

CHAT_REQUEST: dict[str, Any] = {"messages": [{"role": "user", "content": "Weather in Paris and Tokyo?"}], "tools": MINIMAL_WEATHER_TOOLS}
PARSER_OUTPUT = (
    "<think>\nThe user wants the weather in two cities, so I call the tool twice.\n</think>\n\n"
    "Checking both cities now.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
)
PLAIN_OUTPUT = (
    "The printing press changed how ideas travel: a book once copied by hand, page after page, became "
    "thousands of copies. 印刷术的历史也是思想传播的历史。 Today a page crosses the world in milliseconds 🌍📚, "
    "café, naïve, Zürich."
)


@dataclass
class Options:
    """One scenario run: the ramp, the holds and time-outs, the autoscaling settings of the scaled stages."""

    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 6])  # parser streams per ramp step
    level_s: float = 8.0  # seconds per ramp step
    scale_up_timeout_s: float = 360.0  # hold the peak at most this long for the new node and its replicas
    hold_s: float = 8.0  # and this much longer once they are up
    trickle: int = 1  # streams of each kind while scaling down
    scale_down_timeout_s: float = 240.0
    sample_s: float = 1.0
    parser_max: int = 2
    plain_max: int = 2
    target_ongoing_requests: float = 1.0
    downscale_delay_s: float = 15.0
    idle_timeout_minutes: float = 0.25
    replica_cpus: float = 0.5  # every CPU-tier replica's logical CPUs: 4 of them fill a cpu_tier node

    def plain_streams(self, level: int) -> int:
        return max(1, math.ceil(level / 2))


PROFILES = {
    "test": Options(),
    "bench": Options(levels=[1, 2, 3, 4, 6, 8], level_s=20.0, hold_s=40.0, scale_down_timeout_s=300.0, parser_max=3),
}


def app_args(opts: Options) -> dict[str, Any]:
    """``AppArgs`` of the scenario: qwen3-tiny, hermes + qwen3, the engine, placement by tier resource."""
    tier = {"num_cpus": opts.replica_cpus, "resources": {"cpu_tier": 0.001}}
    scaling = {
        "min_replicas": 1,
        "target_ongoing_requests": opts.target_ongoing_requests,
        "upscale_delay_s": 2,
        "downscale_delay_s": opts.downscale_delay_s,
        "look_back_period_s": 5,
        "metrics_interval_s": 1,  # as the push intervals in SERVE_ENV (and below look_back_period_s)
    }
    return {
        "model": "qwen3-tiny",
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "enable_auto_tool_choice": True,
        # The CPU demo engine, set explicitly (vLLM's defaults are for GPUs), as serve_config.yaml.
        "engine": {"enabled": True, "enforce_eager": True, "max_num_seqs": 16, "tokens_only": True,
                   "kv_cache_memory_bytes": 256 * 1024 * 1024},
        "deployments": {
            "ingress": {"num_replicas": 1, "ray_actor_options": tier},
            "render": {"num_replicas": 1, "ray_actor_options": tier},
            "plain_derender": {"ray_actor_options": tier, "autoscaling_config": {**scaling, "max_replicas": opts.plain_max}},
            "parser_derender": {"ray_actor_options": tier, "autoscaling_config": {**scaling, "max_replicas": opts.parser_max}},
            "engine": {"ray_actor_options": {"num_cpus": 1, "resources": {"engine_node": 0.001}}},
        },
    }


# --- what the cluster looks like -------------------------------------------------------------------


class Observer:
    """Samples nodes, replicas, placement and chunk throughput every ``sample_s`` on its own thread."""

    def __init__(self, opts: Options, t0: float, temp_dir: Path) -> None:
        self.opts, self.t0, self.temp_dir = opts, t0, temp_dir
        self.samples: list[dict[str, Any]] = []
        self.chunks: list[tuple[float, float, str]] = []  # (done at, latency s, kind), appended by the load
        self._phase = "deploy"
        self.phases: list[tuple[float, str]] = [(t0, "deploy")]  # (monotonic time it began, phase)
        self.active = {"parser": 0, "plain": 0}
        self.initial_nodes: dict[str, str] = {}  # node id -> type, when the app was deployed
        self._read = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="observer", daemon=True)
        self.errors: list[str] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        self.phases.append((time.monotonic(), name))

    def phase_stats(self) -> list[dict[str, Any]]:
        """Per phase of the load: how long, chunks, chunks/s, p50 / p99 / max chunk latency, by stream kind too."""
        out = []
        bounds = self.phases + [(time.monotonic(), "end")]
        for (start, name), (end, _) in zip(bounds, bounds[1:], strict=False):
            if name == "deploy":
                continue
            row: dict[str, Any] = {"phase": name, "t0": round(start - self.t0, 1), "seconds": round(end - start, 1)}
            for kind in ("all", "parser", "plain"):
                lat = sorted(c[1] for c in self.chunks if start <= c[0] < end and kind in ("all", c[2]))
                row[kind] = {"chunks": len(lat), "chunks_per_s": round(len(lat) / max(end - start, 1e-3), 1),
                             "p50_ms": _pct_ms(lat, 0.5), "p99_ms": _pct_ms(lat, 0.99), "max_ms": _pct_ms(lat, 1.0)}
            out.append(row)
        return out

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.opts.sample_s):
            try:
                self.samples.append(self.sample())
            except Exception as exc:  # noqa: BLE001 - a failed sample is reported, the run goes on
                self.errors.append(repr(exc)[:300])

    def nodes(self) -> dict[str, str]:
        """Alive node id -> type."""
        import ray

        return {n["NodeID"]: node_type_of(n, NODE_TYPES) for n in ray.nodes() if n["Alive"]}

    def sample(self) -> dict[str, Any]:
        import psutil
        from ray import serve
        from ray._private import state

        started = time.monotonic()
        t = self.now()
        nodes = self.nodes()
        app = serve.status().applications.get(APP)
        deployments = app.deployments if app is not None else {}
        running = {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}
        total = {name: sum(d.replica_states.values()) for name, d in deployments.items()}
        placement: dict[str, dict[str, int]] = {}
        for actor in state.actors().values():
            cls = actor.get("ActorClassName") or ""
            if actor.get("State") != "ALIVE" or not cls.startswith(f"ServeReplica:{APP}:"):
                continue
            node = (actor.get("Address") or {}).get("NodeID") or "?"
            where = placement.setdefault(cls.rsplit(":", 1)[1], {})
            where[node] = where.get(node, 0) + 1
        n = len(self.chunks)
        window = [c for c in self.chunks[self._read : n]]
        self._read = n
        span = self.opts.sample_s if not self.samples else max(1e-3, t - self.samples[-1]["t"])
        lat = sorted(c[1] for c in window)
        by_type: dict[str, int] = {}
        for node_type in nodes.values():
            by_type[node_type] = by_type.get(node_type, 0) + 1
        return {
            "t": t,
            "phase": self.phase,
            "streams": dict(self.active),
            "nodes": by_type,
            "node_ids": nodes,
            "running": running,
            "replicas": total,
            "placement": placement,
            "chunks": len(window),
            "chunks_per_s": round(len(window) / span, 1),
            "parser_chunks_per_s": round(sum(1 for c in window if c[2] == "parser") / span, 1),
            "plain_chunks_per_s": round(sum(1 for c in window if c[2] == "plain") / span, 1),
            "p50_ms": _pct_ms(lat, 0.50),
            "p99_ms": _pct_ms(lat, 0.99),
            "cluster_rss_gib": round(sum(_rss(p) for p in cluster_processes(self.temp_dir)) / 2**30, 2),
            "machine_used_gib": round((lambda m: (m.total - m.available) / 2**30)(psutil.virtual_memory()), 2),
            "sample_ms": round(1000 * (time.monotonic() - started)),
        }

    def latest(self) -> dict[str, Any] | None:
        return self.samples[-1] if self.samples else None


def _rss(p: Any) -> int:
    try:
        return int(p.memory_info().rss)
    except Exception:  # noqa: BLE001 - gone meanwhile
        return 0


def _pct_ms(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return round(1000 * sorted_s[min(len(sorted_s) - 1, max(0, math.ceil(q * len(sorted_s)) - 1))], 2)


def extra_nodes(sample: dict[str, Any], initial: dict[str, str]) -> list[str]:
    return [nid for nid, kind in sample["node_ids"].items() if kind == "cpu_tier" and nid not in initial]


def scaled_up(sample: dict[str, Any] | None, initial: dict[str, str]) -> bool:
    """A second cpu_tier node is up and RUNNING ParserDerender and PlainDerender replicas are on it."""
    if sample is None:
        return False
    extra = set(extra_nodes(sample, initial))
    for name in SCALED:
        placed = sample["placement"].get(name, {})
        if not extra & set(placed) or sample["running"].get(name, 0) < 2 or sample["running"][name] != sum(placed.values()):
            return False
    return True


def scaled_down(sample: dict[str, Any] | None, initial: dict[str, str]) -> bool:
    """Back to one replica of each scaled stage and to the nodes the run started with."""
    if sample is None:
        return False
    back = all(sample["replicas"].get(name) == 1 and sample["running"].get(name) == 1 for name in SCALED)
    return back and not extra_nodes(sample, initial) and sample["nodes"].get("cpu_tier") == 1


# --- the streams -----------------------------------------------------------------------------------


def _normalize(chunk: dict[str, Any], request_id: str) -> str:
    """A chunk as compared across runs: without ``created``, the stream's own id and random tool-call ids."""
    text = json.dumps({k: v for k, v in chunk.items() if k != "created"}, sort_keys=True, ensure_ascii=False)
    return re.sub(r"chatcmpl-tool-[0-9a-f]+", "chatcmpl-tool-X", text.replace(request_id, "RID"))


class Load:
    """Parser and plain derender streams over HTTP, one token per chunk, ``stream_state`` carried."""

    def __init__(self, base: str, prompt: list[int], parser_ids: list[int], plain_ids: list[int], observer: Observer) -> None:
        self.base, self.prompt, self.observer = base, prompt, observer
        self.outputs = {"parser": parser_ids, "plain": plain_ids}
        self.reference: dict[str, list[str]] = {}
        self.streams: list[dict[str, Any]] = []
        self.target = {"parser": 0, "plain": 0}
        self._n = 0
        self._stopping = False
        self._workers: list[asyncio.Task[None]] = []
        self._session: Any = None

    def _body(self, kind: str, rid: str, ids: list[int], last: bool, state: Any) -> bytes:
        generate_chunk = chunk(ids, rid, finish_reason=("stop" if kind == "parser" else "length") if last else None)
        fields = {"chat_request": CHAT_REQUEST} if kind == "parser" else {"prompt_tokens": len(self.prompt)}
        return json.dumps(stream_body(generate_chunk, state, prompt_token_ids=self.prompt, **fields)).encode()

    async def stream(self, kind: str, rid: str) -> dict[str, Any]:
        """One whole stream; its record: when, how many chunks, identical to the unloaded run or why not."""
        url = self.base + ("/v1/chat/completions/derender" if kind == "parser" else "/v1/completions/derender")
        output = self.outputs[kind]
        record: dict[str, Any] = {"kind": kind, "id": rid, "start": self.observer.now(), "chunks": 0, "error": None}
        got: list[str] = []
        state = None
        try:
            for i, token in enumerate(output):
                t0 = time.monotonic()
                async with self._session.post(url, data=self._body(kind, rid, [token], i == len(output) - 1, state),
                                              headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                    status = resp.status
                done = time.monotonic()
                if status != 200:
                    raise RuntimeError(f"chunk {i}: HTTP {status}: {data[:300]!r}")
                self.observer.chunks.append((done, done - t0, kind))
                out = json.loads(data)
                state = out["stream_state"]
                got.append(_normalize(out["chunk"], rid))
                record["chunks"] += 1
        except Exception as exc:  # noqa: BLE001 - recorded; the checks fail on it
            record["error"] = repr(exc)[:400]
        record["end"] = self.observer.now()
        ref = self.reference.get(kind)
        record["identical"] = record["error"] is None and (ref is None or got == ref)
        if ref is None and record["error"] is None:
            self.reference[kind] = got
        if ref is not None and record["error"] is None and got != ref:
            first = next(i for i, (a, b) in enumerate(zip(got + [""] * len(ref), ref + [""] * len(got), strict=False)) if a != b)
            record["first_difference"] = {"chunk": first, "got": (got + [None])[first], "expected": (ref + [None])[first]}
        return record

    async def open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), timeout=aiohttp.ClientTimeout(total=120))

    async def close(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._workers, return_exceptions=True)
        await self._session.close()

    async def unloaded(self, label: str) -> list[dict[str, Any]]:
        """One stream of each kind with nothing else running (the first such run is the reference)."""
        out = []
        for kind in ("parser", "plain"):
            record = await self.stream(kind, f"{label}-{kind}")
            record["unloaded"] = label
            self.streams.append(record)
            out.append(record)
        return out

    def set_level(self, parser: int, plain: int) -> None:
        """Run ``parser`` and ``plain`` streams at once from now on (a worker above it finishes its stream)."""
        self.target = {"parser": parser, "plain": plain}
        for kind, want in self.target.items():
            have = sum(1 for t in self._workers if t.get_name().startswith(kind))
            for k in range(have, want):
                self._workers.append(asyncio.create_task(self._worker(kind, k), name=f"{kind}-{k}"))

    async def _worker(self, kind: str, k: int) -> None:
        while not self._stopping:
            if k >= self.target[kind]:
                await asyncio.sleep(0.2)
                continue
            self.observer.active[kind] += 1
            self._n += 1
            try:
                self.streams.append(await self.stream(kind, f"load-{kind}-{k}-{self._n}"))
            finally:
                self.observer.active[kind] -= 1


# --- the run ---------------------------------------------------------------------------------------


async def _wait(cond: Any, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(poll_s)
    return bool(cond())


async def _drive(opts: Options, observer: Observer, load: Load, result: dict[str, Any]) -> None:
    await load.open()
    try:
        observer.phase = "reference"
        result["unloaded_before"] = await load.unloaded("reference")
        observer.phase = "ramp"
        t_ramp = observer.now()
        for level in opts.levels:
            load.set_level(level, opts.plain_streams(level))
            await asyncio.sleep(opts.level_s)
        observer.phase = "peak"
        ok = await _wait(lambda: scaled_up(observer.latest(), observer.initial_nodes), opts.scale_up_timeout_s)
        result["timing"]["scale_up_s"] = round(observer.now() - t_ramp, 1) if ok else None
        await asyncio.sleep(opts.hold_s)
        observer.phase = "trickle"
        t_trickle = observer.now()
        load.set_level(opts.trickle, opts.trickle)
        ok = await _wait(lambda: scaled_down(observer.latest(), observer.initial_nodes), opts.scale_down_timeout_s)
        result["timing"]["scale_down_s"] = round(observer.now() - t_trickle, 1) if ok else None
        observer.phase = "idle"
        load.set_level(0, 0)
        await _wait(lambda: observer.active["parser"] + observer.active["plain"] == 0, 120)
        result["unloaded_after"] = await load.unloaded("after")
    finally:
        await load.close()


def _engine_generate(base: str, prompt: list[int]) -> dict[str, Any]:
    import httpx

    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
    t0 = time.monotonic()
    r = httpx.post(base + "/inference/v1/generate", json=body, timeout=120)
    out: dict[str, Any] = {"status": r.status_code, "seconds": round(time.monotonic() - t0, 2)}
    if r.status_code == 200:
        out["token_ids"] = r.json()["choices"][0]["token_ids"]
    else:
        out["body"] = r.text[:300]
    return out


def _session_outcomes(base: str) -> dict[str, float] | None:
    """ParserDerender chunks by session-cache outcome (hit: its live parser; miss: a replay of the carried
    state on a replica that had none, e.g. after the hash ring changed with the replicas; new: a stream's first)."""
    import httpx

    try:
        return session_outcomes(httpx.get(base + "/metrics", timeout=30).text)
    except Exception:  # noqa: BLE001 - informational
        return None


def _intervals(samples: list[dict[str, Any]], value: Any) -> list[dict[str, Any]]:
    """Sample-to-sample intervals in which ``value(sample)`` changed: (t0, t1, before, after)."""
    out = []
    for a, b in zip(samples, samples[1:], strict=False):
        if value(a) != value(b):
            out.append({"t0": a["t"], "t1": b["t"], "before": value(a), "after": value(b)})
    return out


def milestones(result: dict[str, Any]) -> dict[str, Any]:
    """When (seconds since the scenario started) the load rose and fell, the node came and went, and the
    added replicas ran; from the result's phases and events (so also from an older results JSON)."""
    starts = {p["phase"]: p["t0"] for p in result.get("phases", [])}
    ev = result.get("events", {})

    def first(events: list[dict[str, Any]], up: bool, after: float | None = None) -> float | None:
        ts = [e["t1"] for e in events if (e["after"] > e["before"]) == up and (after is None or e["t1"] >= after)]
        return min(ts) if ts else None

    node_added = first(ev.get("cpu_tier_nodes", []), True)
    at = next((s for s in result.get("samples", []) if node_added is not None and s["t"] >= node_added), None)
    trickle = starts.get("trickle")
    downs = [e["t1"] for name in SCALED for e in ev.get(name, [])
             if e["after"] < e["before"] and trickle is not None and e["t1"] >= trickle]
    return {
        "ramp_start": starts.get("ramp"),
        "node_added": node_added,
        "streams_open_when_node_added": at["streams"] if at else None,
        "parser_replica_added_running": first(ev.get("ParserDerender", []), True),
        "plain_replica_added_running": first(ev.get("PlainDerender", []), True),
        "load_dropped": trickle,
        "replicas_back_to_one": max(downs) if downs else None,
        "node_removed": first(ev.get("cpu_tier_nodes", []), False, trickle),
    }


def analyse(result: dict[str, Any], opts: Options) -> dict[str, Any]:
    """Events and the verdicts (``checks``) from the samples and stream records."""
    samples = [s for s in result["samples"] if s["phase"] != "deploy"]
    initial = result["initial_nodes"]
    streams = result["streams"]
    nodes_ever: dict[str, str] = {}
    for s in result["samples"]:
        nodes_ever.update(s["node_ids"])
    extra = sorted({nid for s in samples for nid in extra_nodes(s, initial)})
    events = {
        "cpu_tier_nodes": _intervals(samples, lambda s: s["nodes"].get("cpu_tier", 0)),
        **{name: _intervals(samples, lambda s, n=name: s["running"].get(n, 0)) for name in SCALED},
    }
    ups = [e for name in SCALED for e in events[name] if e["after"] > e["before"]]
    downs = [e for name in SCALED for e in events[name] if e["after"] < e["before"]]
    node_up = [e for e in events["cpu_tier_nodes"] if e["after"] > e["before"]]
    node_down = [e for e in events["cpu_tier_nodes"] if e["after"] < e["before"]]

    def in_flight(intervals: list[dict[str, Any]]) -> int:
        return sum(1 for r in streams if any(r["start"] < e["t1"] and r["end"] > e["t0"] for e in intervals))

    def on_extra(name: str) -> int:
        return max((sum(n for nid, n in s["placement"].get(name, {}).items() if nid in extra) for s in samples), default=0)

    def placed_only_on(names: tuple[str, ...], kind: str) -> bool:
        return all(nodes_ever.get(nid) == kind for s in samples for name in names for nid in s["placement"].get(name, {}))

    final = samples[-1] if samples else None
    result["events"] = {**events, "replicas_up": ups, "replicas_down": downs, "node_up": node_up, "node_down": node_down}
    result["extra_nodes"] = extra
    bad = [r for r in streams if not r["identical"]]
    summary = {
        "total": len(streams),
        "identical": len(streams) - len(bad),
        "failed": [r for r in bad][:5],
        "across_scale_up": in_flight(ups + node_up),
        "across_scale_down": in_flight(downs + node_down),
        "chunks": sum(r["chunks"] for r in streams),
    }
    result["stream_summary"] = summary
    result["milestones"] = milestones(result)
    peak = {name: max((s["running"].get(name, 0) for s in samples), default=0) for name in SCALED}
    result["peak_running"] = peak
    result["memory"] = {
        "peak_cluster_rss_gib": max((s.get("cluster_rss_gib", 0) for s in result["samples"]), default=None),
        "peak_machine_used_gib": max((s.get("machine_used_gib", 0) for s in result["samples"]), default=None),
    }
    engine_nodes = {nid for s in samples for nid in s["placement"].get("Engine", {})}
    checks = {
        "started_with_one_node_of_each_type": sorted(initial.values()) == ["cpu_tier", "engine_node", "head"],
        "second_cpu_tier_node_joined": max((s["nodes"].get("cpu_tier", 0) for s in samples), default=0) >= 2 and bool(extra),
        "parser_derender_scaled_up": peak["ParserDerender"] >= 2,
        "plain_derender_scaled_up": peak["PlainDerender"] >= 2,
        "parser_derender_replica_on_new_node": on_extra("ParserDerender") >= 1,
        "plain_derender_replica_on_new_node": on_extra("PlainDerender") >= 1,
        "scaled_down_to_one_replica": final is not None
        and all(final["running"].get(n) == 1 and final["replicas"].get(n) == 1 for n in SCALED),
        "extra_node_removed": bool(node_down) and final is not None and not extra_nodes(final, initial)
        and final["nodes"].get("cpu_tier") == 1,
        "engine_on_engine_node": bool(engine_nodes) and all(nodes_ever.get(nid) == "engine_node" for nid in engine_nodes),
        "cpu_tier_replicas_on_cpu_tier_nodes": placed_only_on(CPU_TIER_DEPLOYMENTS, "cpu_tier"),
        "engine_serves": all(e.get("status") == 200 for e in result["engine_calls"]) and len(result["engine_calls"]) == 2,
        "every_stream_identical": bool(streams) and not bad,
        "streams_in_flight_across_scale_up": summary["across_scale_up"] > 0,
        "streams_in_flight_across_scale_down": summary["across_scale_down"] > 0,
    }
    return checks


def run(opts: Options, out_path: Path, logs_dir: Path | None = None) -> dict[str, Any]:
    """Start the cluster, deploy, drive the load, analyse, tear down; the result is also written to ``out_path``
    (and the autoscaler's, the Serve controller's and the replicas' logs copied to ``logs_dir``)."""
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    t0 = time.monotonic()
    cluster = LocalAutoscalingCluster(NODE_TYPES, head_resources={"CPU": 1}, idle_timeout_minutes=opts.idle_timeout_minutes,
                                      env=SERVE_ENV)
    result: dict[str, Any] = {
        "status": "running", "options": asdict(opts), "temp_dir": str(cluster.temp_dir), "pid": os.getpid(),
        "node_types": {k: asdict(v) for k, v in NODE_TYPES.items()}, "timing": {}, "samples": [], "streams": [],
        "engine_calls": [], "initial_nodes": {},
    }
    _write(out_path, result)  # the temp dir, at once: a parent that has to kill this process cleans up by it
    observer = Observer(opts, t0, cluster.temp_dir)
    load: Load | None = None
    try:
        address = cluster.start()
        result["address"] = address
        result["timing"]["ray_start_s"] = round(time.monotonic() - t0, 1)
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", namespace="cluster_scenario")
        deadline = time.monotonic() + 180
        while sorted(observer.nodes().values()) != ["cpu_tier", "engine_node", "head"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"min_workers did not come up: {observer.nodes()}")
            time.sleep(1)
        result["timing"]["min_workers_up_s"] = round(time.monotonic() - t0, 1)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port}, logging_config=_QUIET)
        args = AppArgs(**app_args(opts))
        observer.start()
        serve.run(build_app(args), name=APP, route_prefix="/", logging_config=_QUIET)
        observer.initial_nodes = result["initial_nodes"] = observer.nodes()
        result["timing"]["deployed_s"] = round(time.monotonic() - t0, 1)
        base = f"http://127.0.0.1:{port}"
        model = args.resolve()
        tok = AutoTokenizer.from_pretrained(model.tokenizer_dir)
        import httpx

        prompt = httpx.post(base + "/v1/chat/completions/render", json=CHAT_REQUEST, timeout=60).json()["token_ids"]
        parser_ids = tok.encode(PARSER_OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]
        plain_ids = tok.encode(PLAIN_OUTPUT)
        result["stream_tokens"] = {"parser": len(parser_ids), "plain": len(plain_ids), "prompt": len(prompt)}
        result["engine_calls"].append(_engine_generate(base, prompt))
        load = Load(base, prompt, parser_ids, plain_ids, observer)
        t_load = time.monotonic()
        asyncio.run(_drive(opts, observer, load, result))
        result["timing"]["load_s"] = round(time.monotonic() - t_load, 1)
        result["engine_calls"].append(_engine_generate(base, prompt))
        result["parser_session_chunks"] = _session_outcomes(base)
        time.sleep(2 * opts.sample_s)
        observer.stop()
        result["streams"] = load.streams
        result["samples"] = observer.samples
        result["phases"] = observer.phase_stats()
        result["observer_errors"] = observer.errors
        result["autoscaler_log"] = cluster.log_lines("monitor.log", ":event_summary:", "Terminating the node")
        result["checks"] = analyse(result, opts)
        result["status"] = "done"
    except BaseException as exc:
        result["status"] = "error"
        result["error"] = repr(exc)[:2000]
        result["samples"] = result["samples"] or observer.samples
        result["streams"] = result["streams"] or (load.streams if load is not None else [])
        result["observer_errors"] = observer.errors
        raise
    finally:
        observer.stop()
        try:
            ray.shutdown()
        finally:
            if logs_dir is not None:
                try:
                    result["logs_saved"] = {"dir": str(logs_dir), "files": cluster.save_logs(logs_dir)}
                except Exception as exc:  # noqa: BLE001 - never in the way of the teardown
                    result["logs_saved"] = {"dir": str(logs_dir), "error": repr(exc)}
            report = cluster.teardown()
            result["teardown"] = report.as_dict()
            result.setdefault("checks", {})["teardown_left_nothing"] = not report.left
            result["timing"]["total_s"] = round(time.monotonic() - t0, 1)
            _write(out_path, result)
    return result


def run_in_subprocess(
    out: Path, *args: str, timeout_s: float = 900, log: Path | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None, int | None]:
    """The scenario as its own driver process (``python -m tests.harness.cluster_scenario --json out
    *args``), so that no Ray already initialised in the caller is in the way. Returns its JSON, the
    safety net's teardown report and its exit status (None: stopped at ``timeout_s``).

    Stopping it sends SIGTERM (its ``finally`` tears the cluster down), then SIGKILL to its process
    group. Either way the safety net then runs :func:`teardown_cluster` on the temp dir the JSON names
    (written before the cluster starts): in a clean run it finds nothing (``found == 0``).
    """
    import subprocess

    # ``-m`` from the repository root: the driver imports tests.harness as this process does.
    argv = [sys.executable, "-m", "tests.harness.cluster_scenario", "--json", str(out.resolve()), *args]
    log = log or out.with_suffix(".log")
    rc: int | None
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=_REPO)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result = json.loads(out.read_text()) if out.exists() else {}
    safety = teardown_cluster(result["temp_dir"]).as_dict() if result.get("temp_dir") else None
    return result, safety, rc


def _write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False, default=str))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="where to write the result")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="test")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], help="parser streams per ramp step, e.g. 1,2,4")
    ap.add_argument("--level-s", type=float)
    ap.add_argument("--hold-s", type=float)
    ap.add_argument("--logs-dir", type=Path, help="copy the cluster's autoscaler and Serve logs here before teardown")
    a = ap.parse_args(argv)
    opts = PROFILES[a.profile]
    opts = replace(opts, **{k: v for k, v in (("levels", a.levels), ("level_s", a.level_s), ("hold_s", a.hold_s)) if v is not None})
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM (a parent's time-out) unwinds through run()'s finally: the cluster is torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(opts, a.json, a.logs_dir)
    failed = [k for k, v in result.get("checks", {}).items() if not v]
    print(json.dumps({"status": result["status"], "failed_checks": failed, "timing": result["timing"],
                      "streams": {k: v for k, v in result.get("stream_summary", {}).items() if k != "failed"}}), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
