"""Capacity model of the ParserDerender deployment, measured in-process (issue 13, item 4).

    .venv/bin/python -m bench.capacity_bench            # full run, N = 4000 (about a minute after imports)
    .venv/bin/python -m bench.capacity_bench --quick    # smoke run, N = 300, written under logs.tmp/
    .venv/bin/python -m bench.capacity_bench --from-json bench/results/capacity.json   # report, plot, YAML again
    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.capacity_bench   # as the results were made

With the real ``ParserDerenderService`` (no Ray, no HTTP; qwen3-tiny, hermes + qwen3 as
``parser_bench``) and its streams of one token per chunk (``bench.common.parser_stream.chunk_body``: the client
carries ``stream_state``), it measures CPU time of the calling thread (``time.thread_time``) and wall
time per ``chat_with_outcome`` call. The sync call runs all of a chunk's work in this thread (the
replica's async twin would move long replays to a worker thread: the same work).

1. **Hit cost**: every chunk of ``--streams`` streams over positions 0..N, the session cached.
2. **Miss cost by position**: one chunk at position p with the session cache cleared, so the service
   replays the carried state; median of ``--reps``. Twice: with the stream's request configuration
   cached, and as a conversation new to the replica (a distinct ``chat_request``), which is what a
   session moved to another replica meets. Least squares miss_ms(p) = a + b * p.
3. **Sessions moved by a scale event**: Ray's own ``ConsistentHashRouter`` ring (built in-process,
   no cluster), as ``ParserDerender.deployment_options`` configures it, over 1000 session ids and
   replica ids made by Ray's own id generator: the fraction whose owner changes from N to N + 1
   replicas and back.
4. **The model**: cores and Ingress replicas per engine token rate (the CPU tier's CPU per parser chunk
   and per composed token read from ``bench/results/load.json``), and ``target_ongoing_requests``
   for chunk requests and for composed streams. ``--from-json`` recomputes it after a new load run.

Results: ``bench/results/capacity.md`` / ``.json`` / ``capacity_miss.png`` and the constants in
``bench/results/capacity.yaml`` (``--quick``: the same names under ``bench/results/logs.tmp/``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, cast

import orjson

from bench.common.capacity_report import plot, render, write_yaml
from bench.common.cpu import idle_cpu_util
from bench.common.parser_stream import PARSER_APP, chunk_body, parser_workload, set_parser_env, windows
from bench.common.paths import LOGS, REPO, RESULTS
from bench.common.ray_internals import HashRing
from bench.common.report import machine_info, rerender, write_results
from bench.common.stats import percentile
from bench.common.workloads import chat_variant

MISS_POSITIONS = [0, 250, 500, 1000, 2000, 3000, 4000]
UTILISATION = 0.7
TOKEN_RATES = [1000, 5000, 20000]  # engine output tokens/s to size for (one token per chunk)
STREAM_RATES = [20, 50, 100]  # decode tokens/s of one stream, for target_ongoing_requests
STREAM_LENGTHS = [200, 1000, 4000]  # L, for the hit rate over a scale event
SESSIONS, RING_TRIALS, MAX_REPLICAS = 1000, 20, 4


def timed(service: Any, body: bytes) -> tuple[float, float, bytes, str]:
    """(CPU ms of this thread, wall ms, response, outcome) of one chunk."""
    w0, c0 = time.perf_counter(), time.thread_time()
    out, outcome = service.chat_with_outcome(body)
    return (time.thread_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3, out, outcome


def summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "mean_ms": statistics.fmean(s), "p50_ms": percentile(s, 0.5), "p99_ms": percentile(s, 0.99)}


# --- 1. hits ----------------------------------------------------------------------------------


def stream(service: Any, prompt: list[int], output: list[int], request_id: str, keep: set[int]) -> dict[str, Any]:
    """One stream, every chunk timed; the states carried into the positions in ``keep``."""
    cpu, wall, outcomes, state = [], [], [], None
    states: dict[int, Any] = {}
    for i in range(len(output)):
        if i in keep:
            states[i] = state
        c, w, out, outcome = timed(service, chunk_body(i, output, state, prompt, request_id))
        cpu.append(c)
        wall.append(w)
        outcomes.append(outcome)
        state = orjson.loads(out)["stream_state"]
    return {"cpu_ms": cpu, "wall_ms": wall, "outcomes": outcomes, "states": states}


def measure_hits(service: Any, prompt: list[int], output: list[int], opts: argparse.Namespace, keep: set[int]) -> dict[str, Any]:
    stream(service, prompt, output[:200], "capacity-warmup", set())
    runs = []
    for k in range(opts.streams):
        t = time.monotonic()
        runs.append(stream(service, prompt, output, f"capacity-{k}", keep))
        hits = runs[-1]["outcomes"][1:]
        assert hits.count("hit") == len(hits), f"stream {k}: not all hits: {set(hits)}"
        print(f"  stream {k + 1}/{opts.streams}: {len(output)} chunks in {time.monotonic() - t:.1f} s, "
              f"mean {statistics.fmean(runs[-1]['cpu_ms'][1:]):.3f} CPU ms/chunk", flush=True)
    cpu = [c for r in runs for c in r["cpu_ms"][1:]]  # position 0 opens the stream ("new"), not a hit
    wall = [w for r in runs for w in r["wall_ms"][1:]]
    by_pos = [statistics.median(r["cpu_ms"][i] for r in runs) for i in range(len(output))]
    slope, intercept = statistics.linear_regression(range(1, len(output)), by_pos[1:])
    return {
        "cpu": summary(cpu), "wall": summary(wall), "cpu_ms_by_position": by_pos,
        "windows_cpu": windows([ms / 1e3 for ms in by_pos]),
        "mean_cpu_ms_by_length": {n: statistics.fmean(by_pos[1:n]) for n in STREAM_LENGTHS if n <= len(by_pos)},
        "fit_a_ms": intercept, "fit_b_ms_per_token": slope, "states": runs[0]["states"],
    }


# --- 2. misses --------------------------------------------------------------------------------


def measure_misses(service: Any, prompt: list[int], output: list[int], states: dict[int, Any], reps: int) -> dict[str, Any]:
    rows, conversation = [], 0
    for p in sorted(states):
        body = chunk_body(p, output, states[p], prompt, "capacity-0")
        row: dict[str, Any] = {"position": p}
        for variant in ("config_cached", "new_conversation"):
            cpu, wall = [], []
            for _ in range(reps):
                service.sessions.clear()
                if variant == "new_conversation":  # a chat_request this replica has not validated yet
                    conversation += 1
                    body = orjson.dumps({**orjson.loads(body), "chat_request": chat_variant(conversation)})
                c, w, _, outcome = timed(service, body)
                assert outcome == ("miss" if p else "new"), outcome
                cpu.append(c)
                wall.append(w)
            row[variant] = {"cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall), "cpu_ms_all": cpu}
        print(f"  miss at {p}: {row['config_cached']['cpu_ms']:.2f} CPU ms (config cached), "
              f"{row['new_conversation']['cpu_ms']:.2f} (new conversation)", flush=True)
        rows.append(row)
    fits = {}
    for variant in ("config_cached", "new_conversation"):
        b, a = statistics.linear_regression([r["position"] for r in rows], [r[variant]["cpu_ms"] for r in rows])
        fits[variant] = {"a_ms": a, "b_ms_per_token": b}
    return {"rows": rows, "fit": fits}


# --- 3. the ring ------------------------------------------------------------------------------


def ring_moves(router_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fractions of sessions whose owner changes when a replica joins (N -> N + 1) and when one of
    the N + 1 leaves (back to N), over ``RING_TRIALS`` draws of replica ids. The ring and the lookup
    are Ray's own code (``_rebuild_ring``, ``_lookup_ranked_replicas``: mmh3, its seed, vnode keys
    ``f"{unique_id}:{i}"``) on a router built without a cluster; replica ids come from Ray's generator."""
    ring = HashRing("ParserDerender", "serve_app", router_kwargs)
    rng = random.Random(13)
    sessions = [f"chatcmpl-{rng.getrandbits(128):032x}" for _ in range(SESSIONS)]  # stream ids, as the ingress keys on

    def owners(replicas: list[Any]) -> list[Any]:
        return ring.owners(replicas, sessions)

    def moved(a: list[Any], b: list[Any]) -> float:
        return sum(x != y for x, y in zip(a, b, strict=True)) / len(sessions)

    rows = []
    for n in range(1, MAX_REPLICAS + 1):
        up, down, busiest = [], [], []
        for trial in range(RING_TRIALS):
            random.seed(1000 * n + trial)  # get_random_string draws from the global generator
            replicas = [ring.new_replica_id() for _ in range(n + 1)]
            before, after = owners(replicas[:n]), owners(replicas)
            up.append(moved(before, after))
            gone = rng.choice(replicas)  # Serve may stop any replica, not only the newest
            down.append(moved(after, owners([r for r in replicas if r != gone])))
            busiest.append(max(after.count(r) for r in replicas) / len(sessions) * (n + 1))
        rows.append({"from": n, "to": n + 1, "ideal": 1 / (n + 1),
                     "up_mean": statistics.fmean(up), "up_min": min(up), "up_max": max(up),
                     "down_mean": statistics.fmean(down), "down_min": min(down), "down_max": max(down),
                     "busiest_share_x_replicas": statistics.fmean(busiest)})
        print(f"  {n} -> {n + 1} replicas: {100 * rows[-1]['up_mean']:.1f}% of sessions move "
              f"(back down: {100 * rows[-1]['down_mean']:.1f}%)", flush=True)
    return {"sessions": SESSIONS, "trials": RING_TRIALS, "router_kwargs": router_kwargs, "rows": rows}


def event_hit_rate(moved: float, length: int) -> float:
    """Hit rate over the chunks that the streams live at a scale event send from then to their end.

    Streams of ``length`` chunks (one token each) start at a steady rate, so at the event a live
    stream is at a position uniform over 0..L-1 and has (L + 1) / 2 chunks left on average (the
    next one included). A stream that moves misses exactly once (its next chunk replays, then hits
    on its new owner); one that stays only hits. Hence 1 - moved / ((L + 1) / 2)."""
    return 1 - moved / ((length + 1) / 2)


# --- 4. the model -----------------------------------------------------------------------------


def serve_cpu() -> dict[str, Any]:
    """CPU ms per unit by process in Serve, from the load benchmark at its highest concurrency: per
    parser chunk over HTTP and per composed token. The CPU tier is HAProxy, Serve's proxy, the Ingress
    and ParserDerender (the Engine replica and vLLM's engine core are the engine's side)."""
    load = orjson.loads((RESULTS / "load.json").read_bytes())
    out: dict[str, Any] = {"load_commit": load["machine"]["git_commit"],
                           "stream_tokens": load["workload"]["parser_output_tokens"]}
    for kind, unit in (("parser", "chunks"), ("composed", "tokens")):
        rows = [r for r in load["cases"] if r["workload"] == kind and r["system"] == "ours"]
        row = max(rows, key=lambda r: r["concurrency"])
        roles = row[f"cpu_ms_per_{unit}_by_role"]
        tier = {k: roles.get(k, 0.0) for k in ("haproxy", "proxy", "Ingress", "ParserDerender")}
        out[kind] = {"concurrency": row["concurrency"], "roles": tier, "tier_ms": sum(tier.values())}
    return out


def model(hits: dict[str, Any], misses: dict[str, Any], ring: dict[str, Any], serve: dict[str, Any]) -> dict[str, Any]:
    """Replicas of one core each per engine token rate, and the autoscaling targets.

    A replica is one Python process: its event loop does the work on one core whatever ``num_cpus``
    says (that only places it), so capacity is counted in cores. Utilisation UTILISATION leaves room
    for bursts and for the sessions a scale event moves."""
    miss = misses["fit"]["new_conversation"]
    parser_ms, composed_ms = serve["parser"]["tier_ms"], serve["composed"]["tier_ms"]
    sizing = [{"tokens_per_s": t,
               "parser_stream_cores": t * parser_ms / 1000 / UTILISATION,
               "parser_stream_replicas": math.ceil(t * parser_ms / 1000 / UTILISATION),
               "composed_cores": t * composed_ms / 1000 / UTILISATION,
               "composed_replicas": math.ceil(t * composed_ms / 1000 / UTILISATION)}
              for t in TOKEN_RATES]
    # Composed streams hold an Ingress request for their whole life: target = open streams per replica.
    streams = [{"tokens_per_s_per_stream": r, "streams_per_replica": UTILISATION * 1000 / (composed_ms * r)}
               for r in STREAM_RATES]
    events, hit_ms = [], hits["cpu"]["mean_ms"]
    for row in ring["rows"]:
        for length in STREAM_LENGTHS:
            mid = (length - 1) / 2  # mean position of a live stream at the event
            events.append({"from": row["from"], "to": row["to"], "length": length, "moved": row["up_mean"],
                           "hit_rate": event_hit_rate(row["up_mean"], length),
                           "extra_cpu_ms_per_live_stream": row["up_mean"] * (miss["a_ms"] + miss["b_ms_per_token"] * mid - hit_ms)})
    return {"hit_ms": hits["cpu"]["mean_ms"], "chunks_per_s_per_core": 1000 / hits["cpu"]["mean_ms"],
            "miss_a_ms": miss["a_ms"], "miss_b_ms_per_token": miss["b_ms_per_token"], "utilisation": UTILISATION,
            "parser_tier_ms_per_chunk": parser_ms, "composed_tier_ms_per_token": composed_ms,
            # Chunk requests are short: Little's law with one server (M/M/1) puts u / (1 - u) in flight.
            "chunk_target_ongoing_requests": UTILISATION / (1 - UTILISATION),
            "sizing": sizing, "composed_streams": streams, "scale_events": events}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4000, help="N: the last stream position measured")
    p.add_argument("--streams", type=int, default=3, help="streams timed for the hit cost")
    p.add_argument("--reps", type=int, default=9, help="calls per miss position (median)")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 300, 1 stream, 3 reps, output under logs.tmp/")
    p.add_argument("--from-json", type=Path, help="only write the report, plot and YAML again from a results JSON")
    opts = p.parse_args()
    set_parser_env()
    if opts.from_json:  # the model again from the saved measurements and the current load.json
        saved = orjson.loads(opts.from_json.read_bytes())
        saved["serve"] = serve_cpu()
        saved["model"] = model(saved["hits"], saved["misses"], saved["ring"], saved["serve"])
        opts.from_json.write_text(orjson.dumps(saved, option=orjson.OPT_INDENT_2).decode())
        plot(saved, opts.from_json.parent / saved["png"])
        write_yaml(saved, opts.from_json.with_suffix(".yaml"))
        rerender(opts.from_json, render)
        return
    if opts.quick:
        opts.tokens, opts.streams, opts.reps = 300, 1, 3
    out = (LOGS / "capacity-quick") if opts.quick else (RESULTS / "capacity")
    start = time.monotonic()

    from serve_app.config import AppArgs
    from serve_app.derender.parser import ParserDerender, build_parser_service

    background = idle_cpu_util(2.0)  # other work on the machine skews per-thread CPU time too (shared cores, caches)
    print(f"machine busy {100 * background:.0f}% before the run; building the parser service (imports vLLM: ~30 s) ...", flush=True)
    args = AppArgs(**PARSER_APP)
    service = asyncio.run(build_parser_service(args, args.resolve()))
    prompt, output = parser_workload(opts.tokens + 1)  # positions 0..N
    positions = sorted({q for q in MISS_POSITIONS if q < opts.tokens} | {opts.tokens})
    print(f"1. hit cost: {opts.streams} streams of {len(output)} chunks", flush=True)
    hits = measure_hits(service, prompt, output, opts, set(positions))
    print(f"   hit: mean {hits['cpu']['mean_ms']:.3f}, p50 {hits['cpu']['p50_ms']:.3f}, p99 {hits['cpu']['p99_ms']:.3f} CPU ms", flush=True)
    print(f"2. miss cost at positions {positions}, {opts.reps} reps", flush=True)
    misses = measure_misses(service, prompt, output, hits.pop("states"), opts.reps)
    print("3. consistent-hash ring", flush=True)
    router_kwargs = cast(Any, ParserDerender).func_or_class.deployment_options(args)["request_router_config"]["request_router_kwargs"]
    ring = ring_moves(router_kwargs)
    serve = serve_cpu()
    machine = {**machine_info(), "nproc": len(os.sched_getaffinity(0)), "background_cpu_util": background}
    data: dict[str, Any] = {"machine": machine, "opts": vars(opts), "serve": serve, "hits": hits, "misses": misses,
            "ring": ring, "model": model(hits, misses, ring, serve),
            "yaml_path": str(out.with_suffix(".yaml").relative_to(REPO)), "png": f"{out.name}_miss.png"}
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.parent / data["png"]
    plot(data, png)
    write_yaml(data, out.with_suffix(".yaml"))
    data["total_s"] = time.monotonic() - start
    write_results(out, data, render)
    print(f"wrote {png} and {out.with_suffix('.yaml')}")


if __name__ == "__main__":
    main()
