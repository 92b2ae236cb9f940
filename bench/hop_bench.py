"""Does removing the Ingress -> ParserDerender hop pay? (issue 13, item 5)

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.hop_bench

One tool-and-reasoning stream (``bench.parser_bench``'s workload, one token per chunk, state carried
by the client) over HTTP, against the same app in several topologies, each in a fresh local cluster
of its own (Serve reads its flags at process start):

* ``split-1``: one Ingress replica, parser streams go one Serve hop on to one ParserDerender replica
  (the consistent-hash router keeps a stream on it).
* ``coloc-1``: one Ingress replica that derenders parser streams itself
  (``colocate_in_ingress: [..., parser_derender]``, the client sending ``x-session-id``, which is what
  sends a stream's chunks to the Ingress's own parsers): no hop, and one replica holds every session.
* ``coloc-2``: two such Ingress replicas behind HAProxy balancing as Serve configures it
  (``leastconn``, blind to the header): what colocation costs without front-door affinity (chunks
  land on either replica, and a miss replays the carried history).
* ``coloc-2-hdr``: the same two replicas, HAProxy balancing on the ``x-session-id`` header
  (``RAY_SERVE_HAPROXY_BALANCE_ALGORITHM=hdr(x-session-id)``, as ``make run`` sets): front-door
  affinity at HAProxy's cost; a request without the header is balanced round-robin.
* ``coloc-2-proxy``: the same two replicas behind Serve's Python proxy instead of HAProxy, the Ingress
  deployment on Serve's consistent-hash router (which keys on ``x-session-id``): affinity from Serve
  itself, paying the Python proxy's cost per request.

Per topology: per-chunk latency (p50, p99), the total of the first 1000 and 4000 chunks, and the
Ingress's session-cache outcomes (``/metrics``). vLLM's totals for the same 1000- and 4000-token
streams come from ``bench/results/parser.json`` (``bench.parser_bench`` on this machine, which
measures ``vllm launch render`` per position). Results: ``bench/results/hop.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

from bench.common.parser_stream import PARSER_APP, chunk_body, parser_workload, set_parser_env
from bench.common.paths import LOGS, RESULTS
from bench.common.report import machine_info, machine_line, write_results
from bench.common.serve_cluster import (
    COLOCATE,
    prepare_driver,
    run_worker,
    run_worker_process,
    session_outcomes,
    start_app,
    wait_haproxy_up,
)
from bench.common.servers import free_port

CONSISTENT_HASH = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
COLOC = [*COLOCATE, "parser_derender"]
TOPOLOGIES: dict[str, dict[str, Any]] = {
    "split-1": {"ingress": 1, "colocate": COLOCATE, "haproxy": True, "header": False},
    "coloc-1": {"ingress": 1, "colocate": COLOC, "haproxy": True, "header": True},
    "coloc-2": {"ingress": 2, "colocate": COLOC, "haproxy": True, "header": True,
                "env": {"RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "leastconn"}},
    "coloc-2-hdr": {"ingress": 2, "colocate": COLOC, "haproxy": True, "header": True,
                    "env": {"RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-session-id)"}},
    "coloc-2-proxy": {"ingress": 2, "colocate": COLOC, "haproxy": False, "header": True, "router": CONSISTENT_HASH},
}
# Misses replay the carried history, so a topology that misses gets a shorter stream.
TOKENS = {"coloc-2": 1000}


def _session_outcomes(base: str) -> dict[str, float]:
    return session_outcomes(httpx.get(f"{base}/metrics", timeout=30).text)


def _stream(client: httpx.Client, url: str, prompt: list[int], output: list[int], rid: str,
            header: bool) -> list[float]:
    headers = {"content-type": "application/json", **({"x-session-id": rid} if header else {})}
    lat, state = [], None
    for i in range(len(output)):
        t = time.perf_counter()
        r = client.post(url, content=chunk_body(i, output, state, prompt, rid), headers=headers)
        lat.append(time.perf_counter() - t)
        if r.status_code != 200:
            raise RuntimeError(f"chunk {i}: HTTP {r.status_code}: {r.text[:300]}")
        state = r.json()["stream_state"]
        if i % 500 == 0:
            print(f"  chunk {i}/{len(output)}: {1000 * statistics.median(lat[-100:]):.2f} ms p50 (last 100)", flush=True)
    return lat


async def _worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    from serve_app.app import build_app
    from serve_app.config import AppArgs

    topo = TOPOLOGIES[cfg["name"]]
    ingress: dict[str, Any] = {"num_replicas": topo["ingress"]}
    if "router" in topo:
        ingress["request_router_config"] = {"request_router_class": topo["router"],
                                            "request_router_kwargs": {"num_fallback_replicas": 0}}
    args = AppArgs(**PARSER_APP, colocate_in_ingress=topo["colocate"],
                   deployments={"ingress": ingress, "parser_derender": {"num_replicas": 1}})
    port = free_port()
    start_app(lambda: build_app(args), port=port, namespace=f"hop-{cfg['name']}")
    if topo["haproxy"]:
        await wait_haproxy_up(topo["ingress"])
    base = f"http://127.0.0.1:{port}"
    prompt, output = parser_workload(cfg["tokens"])
    url = f"{base}/v1/chat/completions/derender"
    with httpx.Client(timeout=120) as c:
        _stream(c, url, prompt, output[:50], "warmup", topo["header"])
        before = _session_outcomes(base)
        print(f"{cfg['name']}: {len(output)} chunks", flush=True)
        lat = _stream(c, url, prompt, output, f"hop-{cfg['name']}", topo["header"])
        after = _session_outcomes(base)
    outcomes = {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss", "new")}
    ordered = sorted(lat)
    return {
        "config": cfg["name"], "topology": topo, "tokens": len(output), "outcomes": outcomes,
        "hit_rate": outcomes["hit"] / max(1, outcomes["hit"] + outcomes["miss"]),
        "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "total_1000_s": sum(lat[:1000]) if len(lat) >= 1000 else None,
        "total_4000_s": sum(lat[:4000]) if len(lat) >= 4000 else None,
    }


def _total(ours: float | None, vllm: float) -> str:
    return "-" if ours is None else f"{ours:.2f} ({vllm / ours:.1f}x)"


def render_report(data: dict[str, Any]) -> str:
    vllm = data["vllm"]
    lines = [
        "# Removing the Ingress -> ParserDerender hop (issue 13, item 5)",
        "",
        machine_line(data["machine"], ("ray", "vllm")),
        "",
        "One tool + reasoning stream over HTTP, one token per chunk (`bench/hop_bench.py`). vLLM's totals: "
        f"`vllm launch render` on this machine ({vllm['source']}): 1000 tokens {vllm['total_1000_s']:.2f} s, "
        f"4000 tokens {vllm['total_4000_s']:.2f} s.",
        "",
        "| topology | front door | header | chunk p50 ms | chunk p99 ms | hits / misses | 1000 tok s (vLLM / ours) "
        "| 4000 tok s (vLLM / ours) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        topo = r["topology"]
        door = ("HAProxy " + topo.get("env", {}).get("RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "leastconn")
                if topo["haproxy"] else "Python proxy, consistent hash")
        lines.append(
            f"| {r['config']} (Ingress x{topo['ingress']}) | {door} | {'x-session-id' if topo['header'] else '-'} "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r['outcomes']['hit']:.0f} / {r['outcomes']['miss']:.0f} | {_total(r['total_1000_s'], vllm['total_1000_s'])} "
            f"| {_total(r['total_4000_s'], vllm['total_4000_s'])} |"
        )
    lines += ["", "Goals (issue 13): 1000 tokens >= 10x vLLM, 4000 tokens >= 40x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hop_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(TOPOLOGIES))
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    set_parser_env()  # what importing parser_bench set in this process and its workers
    prepare_driver()
    if opts.worker:
        run_worker(opts.worker, _worker_main, lambda cfg: {"config": cfg["name"], "topology": TOPOLOGIES[cfg["name"]]})
    parser = json.loads((RESULTS / "parser.json").read_text())
    vllm = {"total_1000_s": parser["vllm"]["total_1000_s"], "total_4000_s": parser["vllm"]["total_4000_s"],
            "source": f"bench/results/parser.json, {parser['machine'].get('date_utc', 'same machine')}"}
    results, t0 = [], time.monotonic()
    for name in opts.configs.split(","):
        topo = TOPOLOGIES[name]
        env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1" if topo["haproxy"] else "0",
               **topo.get("env", {})}
        cfg = {"name": name, "env": env, "tokens": min(opts.tokens, TOKENS.get(name, opts.tokens)),
               "out": str(LOGS / f"hop-{name}.json")}
        print(f"== {name}", flush=True)
        result, code = run_worker_process("bench.hop_bench", cfg, [], LOGS / f"hop-{name}.log", timeout=900)
        results.append(result or {"config": name, "topology": topo, "error": f"worker exited {code}"})
    data = {"machine": machine_info(), "vllm": vllm, "results": results, "total_s": time.monotonic() - t0}
    write_results(RESULTS / "hop.json", data, render_report)


if __name__ == "__main__":
    main()
