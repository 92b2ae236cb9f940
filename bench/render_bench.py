"""Render benchmark: serve_app on Ray Serve next to vLLM 0.32's ``vllm launch render``, one run, one machine.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.render_bench

One run does, in order (only one server takes traffic at a time; vLLM stays up, idle, in between):

1. ``vllm launch render`` (the reference server, same model and parser flags as our app) over HTTP.
2. Our ``RenderService`` in-process, without HTTP or Ray: the render work itself, the floor.
3. Our Serve app, once per configuration (``--configs``), each in a fresh subprocess with its own
   environment and ``ray.init``, because Serve reads ``RAY_SERVE_*`` flags at import time in every
   Ray process. Per configuration: HTTP through Serve's proxy (proxy -> Ingress -> Render), HTTP
   straight to the ingress replica when direct ingress is on (Ingress -> Render), and a
   ``DeploymentHandle`` to ``Render`` from an async driver (driver -> Render). The ``coloc-*``
   configurations use the product option ``AppArgs.colocate_in_ingress=["render", "plain_derender"]``:
   no Render deployment, every Ingress replica renders in-process, scaled by Ingress replicas.
4. ``vllm launch render`` once more, to show how much the machine drifted during the run.

Every path is driven with the same payloads (a short chat, a multi-turn chat with tools, a
completions request) at concurrency 1 (latency p50 / p99) and at ``--concurrency`` (throughput),
plus ``GET /version`` over HTTP to price a hop that does no render work. CPU time per request is
taken from ``/proc/stat`` (whole machine, minus the load generator's own process time) and from
``/proc/<pid>/stat`` per process role (proxy, HAProxy, Ingress, Render, ...), so the CPU cost of
each hop can be compared on a machine where CPU, not waiting, is the limit.

Results: a markdown table on stdout and in ``bench/results/render.md``, the raw numbers in
``bench/results/render.json``; server logs in ``bench/results/logs.tmp/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.cpu import idle_cpu_util
from bench.common.load import client_session, http_call, measure
from bench.common.paths import LOGS, REPO, RESULTS
from bench.common.ray_internals import direct_ingress_ports, serve_flags
from bench.common.render_report import render_report
from bench.common.report import cli, diff_keys, listed, machine_info, rerender, write_results
from bench.common.serve_cluster import (
    APP_NAME,
    COLOCATE,
    prepare_driver,
    replica_counts,
    run_config_worker,
    run_worker,
    start_app,
    wait_haproxy_up,
)
from bench.common.servers import VllmRender, shown, wait_http
from tests.harness.payloads import WEATHER_AND_CONVERSION_TOOLS

APP_ARGS: dict[str, Any] = {
    "model": "qwen3-tiny",
    "tool_call_parser": "hermes",
    "reasoning_parser": "qwen3",
    "enable_auto_tool_choice": True,
}

# --------------------------------------------------------------------------------------------
# Payloads: identical bytes go to vLLM, to our ingress and to the Render handle.
# --------------------------------------------------------------------------------------------

PAYLOADS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (HTTP path, Render method, body)
    "chat": (
        "/v1/chat/completions/render",
        "chat",
        {
            "model": "qwen3-tiny",
            "messages": [{"role": "user", "content": "Hello! Can you tell me a short joke about computers?"}],
            "max_tokens": 64,
        },
    ),
    "chat_tools": (
        "/v1/chat/completions/render",
        "chat",
        {
            "model": "qwen3-tiny",
            "messages": [
                {"role": "system", "content": "You are a helpful travel assistant. Use the tools when useful."},
                {"role": "user", "content": "What's the weather like in Paris and in Berlin today?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Berlin\"}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
                {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp_c\": 15, \"sky\": \"light rain\"}"},
                {"role": "assistant", "content": "Paris is 18 °C and cloudy; Berlin is 15 °C with light rain."},
                {"role": "user", "content": "Thanks! Should I pack an umbrella for Berlin? And what is 15 °C in Fahrenheit?"},
            ],
            "tools": WEATHER_AND_CONVERSION_TOOLS,
            "tool_choice": "auto",
            "temperature": 0.7,
            "max_tokens": 256,
        },
    ),
    "completion": (
        "/v1/completions/render",
        "completion",
        {"model": "qwen3-tiny", "prompt": "Once upon a time, in a land far away, there lived a", "max_tokens": 32, "temperature": 0.8},
    ),
}


def payload_bytes(name: str) -> bytes:
    return json.dumps(PAYLOADS[name][2]).encode()


# Serve configurations. env: extra environment for every Ray process (Serve reads RAY_SERVE_* at import
# time); render: Render num_replicas; coloc: the product's colocate_in_ingress=["render", "plain_derender"]
# (no Render / PlainDerender deployments, the ingress renders in-process) with that many Ingress replicas.
_TPUT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
_HA = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
CONFIGS: dict[str, dict[str, Any]] = {
    "default-r1": {"env": {}, "render": 1},
    "default-r2": {"env": {}, "render": 2},
    "threads-r2": {"env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}, "render": 2},
    "direct-r2": {"env": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}, "render": 2},
    "haproxy-r2": {"env": _HA, "render": 2},
    "tput-r1": {"env": _TPUT, "render": 1},
    "tput-r2": {"env": _TPUT, "render": 2},
    "tput-nogrpc-r2": {"env": {**_TPUT, "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}, "render": 2},
    "tput-haproxy-r2": {"env": {**_TPUT, **_HA}, "render": 2},
    "coloc-default-i2": {"env": {}, "coloc": 2},
    "coloc-tput-i2": {"env": _TPUT, "coloc": 2},
    "coloc-tput-haproxy-i2": {"env": {**_TPUT, **_HA}, "coloc": 2},
}
DEFAULT_CONFIGS = "default-r1,default-r2,tput-r2,tput-haproxy-r2,coloc-tput-haproxy-i2"


def topology(cfg: dict[str, Any]) -> str:
    if cfg.get("coloc"):
        return f"Ingress ×{cfg['coloc']}, render + plain derender colocated in the ingress"
    return f"Ingress ×1 → Render ×{cfg['render']}"

# --------------------------------------------------------------------------------------------
# Measurement over HTTP
# --------------------------------------------------------------------------------------------


async def measure_http(base: str, *, payloads: list[str], concurrency: int, opts: argparse.Namespace,
                       label: dict[str, Any], version: bool = True) -> list[dict[str, Any]]:
    """c=1 latency and c=N throughput for each payload (POST render) and for GET /version."""
    rows = []
    cases: list[tuple[str, str, str, bytes | None]] = [("POST", p, PAYLOADS[p][0], payload_bytes(p)) for p in payloads]
    if version:
        cases.append(("GET", "version", "/version", None))
    async with client_session(concurrency) as session:
        for method, name, path, body in cases:
            call = http_call(session, method, base + path, body)
            for conc in (1, concurrency):
                stats = await measure(
                    call, concurrency=conc, duration=opts.duration, warmup=opts.warmup,
                    min_requests=opts.min_requests if conc == 1 else 0,
                )
                rows.append({**label, "payload": name, **stats})
                _progress(rows[-1])
    return rows


def _progress(row: dict[str, Any]) -> None:
    print(
        f"  {row.get('config', ''):>16} {row['path']:>12} {row['payload']:>10} c={row['concurrency']:<3}"
        f" n={row['n']:<5} err={row['errors']:<2} {row['rps']:7.1f} req/s  p50 {row['p50_ms']:7.2f} ms"
        f"  p99 {row['p99_ms']:7.2f} ms  cpu/req {row['cpu_ms_per_req']:6.2f} ms"
        f" (server {row['server_cpu_ms_per_req']:6.2f})",
        flush=True,
    )


async def fetch_responses(base: str, payloads: list[str]) -> dict[str, Any]:
    """One response per payload with a fixed X-Request-Id, for the parity check against vLLM."""
    out: dict[str, Any] = {}
    async with client_session(1) as session:
        for p in payloads:
            async with session.post(
                base + PAYLOADS[p][0], data=payload_bytes(p),
                headers={"content-type": "application/json", "x-request-id": "bench-parity"},
            ) as resp:
                text = await resp.text()
                out[p] = {"status": resp.status, "body": _json_or_text(text)}
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------------------------
# vLLM reference server
# --------------------------------------------------------------------------------------------


async def measure_vllm(server: VllmRender, opts: argparse.Namespace, label: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    responses = await fetch_responses(server.base, opts.payloads)
    rows = await measure_http(server.base, payloads=opts.payloads, concurrency=opts.concurrency, opts=opts,
                              label={"system": "vllm", "config": label, "path": "http"})
    return rows, responses


# --------------------------------------------------------------------------------------------
# In-process render (no HTTP, no Ray): the work itself
# --------------------------------------------------------------------------------------------


async def _inproc_main(opts: argparse.Namespace) -> dict[str, Any]:
    from serve_app.config import AppArgs
    from serve_app.render import RenderService

    args = AppArgs(**APP_ARGS)
    t0 = time.monotonic()
    service = await RenderService.create(args, args.resolve())
    build_s = time.monotonic() - t0
    rows = []
    for p in opts.payloads:
        method = getattr(service, PAYLOADS[p][1])
        body = payload_bytes(p)

        async def call(method: Any = method, body: bytes = body) -> None:
            await method(body)

        stats = await measure(call, concurrency=1, duration=opts.duration, warmup=opts.warmup, min_requests=opts.min_requests)
        rows.append({"system": "serve_app", "config": "in-process", "path": "inproc", "payload": p, **stats})
        _progress(rows[-1])
    return {"rows": rows, "build_s": build_s}


# --------------------------------------------------------------------------------------------
# One Serve configuration, in its own process (RAY_SERVE_* flags are read at import time)
# --------------------------------------------------------------------------------------------


async def _worker_main(opts: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    result: dict[str, Any] = {"config": cfg["name"], "env": cfg["env"], "topology": topology(cfg), "rows": []}
    result["flags"] = serve_flags()
    port = cfg["port"]

    def make_app() -> Any:
        if cfg.get("coloc"):
            return build_app(AppArgs(**APP_ARGS, colocate_in_ingress=COLOCATE,
                                     deployments={"ingress": {"num_replicas": cfg["coloc"]}}))
        return build_app(AppArgs(**APP_ARGS, deployments={"render": {"num_replicas": cfg["render"]}}))

    t0 = time.monotonic()
    result["ray_init_s"], result["serve_run_s"] = start_app(make_app, port=port, namespace=f"bench_{cfg['name']}")
    if (counts := replica_counts()) is not None:
        result["deployments"] = counts

    proxy_base = f"http://127.0.0.1:{port}"
    targets: list[tuple[str, str]] = [("http", proxy_base)]
    await wait_http(proxy_base + "/version", 120, ok_in_a_row=3)
    if result["flags"]["direct_ingress"]:
        deadline = time.monotonic() + 60
        while not (ports := direct_ingress_ports(APP_NAME)) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        result["direct_ingress_ports"] = ports
        if ports and ports[0] != port:
            direct = f"http://127.0.0.1:{ports[0]}"
            await wait_http(direct + "/version", 60, ok_in_a_row=3)
            targets.append(("http-direct", direct))
    if result["flags"]["ha_proxy"]:
        result["haproxy_replicas_up"] = await wait_haproxy_up(len(result.get("direct_ingress_ports", [])) or 1)
    result["startup_s"] = time.monotonic() - t0
    # Prime every ingress replica we can address (and the proxy) with a few renders before anything is timed.
    t3 = time.monotonic()
    prime = [proxy_base] + [f"http://127.0.0.1:{p}" for p in result.get("direct_ingress_ports", []) if p != port]
    async with client_session(4) as session:
        for base in prime:
            call = http_call(session, "POST", base + PAYLOADS["chat"][0], payload_bytes("chat"))
            await asyncio.gather(*(call() for _ in range(8)))
    result["prime_s"] = time.monotonic() - t3
    result["idle_cpu_util"] = idle_cpu_util()
    print(f"[{cfg['name']}] up in {result['startup_s']:.1f} s (ray.init {result['ray_init_s']:.1f} s, serve.run "
          f"{result['serve_run_s']:.1f} s); targets {targets}; flags {result['flags']}", flush=True)

    result["responses"] = await fetch_responses(proxy_base, opts.payloads)
    for path, base in targets:
        label = {"system": "serve_app", "config": cfg["name"], "path": path}
        result["rows"] += await measure_http(base, payloads=opts.payloads, concurrency=opts.concurrency, opts=opts, label=label)

    # The handle path: driver -> Render, the raw body in and JSON bytes out, as another deployment would call it.
    render = None if cfg.get("coloc") else serve.get_deployment_handle("Render", app_name=APP_NAME)
    for p in opts.payloads if render is not None else []:
        method, body = getattr(render, PAYLOADS[p][1]), payload_bytes(p)

        async def handle_call(method: Any = method, body: bytes = body) -> None:
            out = await method.remote(body)
            if not isinstance(out, bytes):
                raise TypeError(f"unexpected {type(out)}")

        for conc in (1, opts.concurrency):
            stats = await measure(handle_call, concurrency=conc, duration=opts.duration, warmup=opts.warmup,
                                  min_requests=opts.min_requests if conc == 1 else 0)
            result["rows"].append({"system": "serve_app", "config": cfg["name"], "path": "handle", "payload": p, **stats})
            _progress(result["rows"][-1])
    return result


def run_config(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    cfg = {**CONFIGS[name], "name": name}
    return run_config_worker("bench.render_bench", cfg, topology(cfg), _failed(cfg), _passthrough(opts), LOGS / name,
                             opts.config_timeout)


def _failed(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"config": cfg["name"], "env": cfg["env"], "topology": topology(cfg), "rows": []}


def _passthrough(opts: argparse.Namespace) -> list[str]:
    return ["--duration", str(opts.duration), "--warmup", str(opts.warmup), "--min-requests", str(opts.min_requests),
            "--concurrency", str(opts.concurrency), "--payloads", ",".join(opts.payloads)]


def run_inproc(opts: argparse.Namespace) -> dict[str, Any]:
    LOGS.mkdir(parents=True, exist_ok=True)
    out = LOGS / "inproc.json"
    out.unlink(missing_ok=True)
    print("\n== serve_app RenderService in-process (no HTTP, no Ray)", flush=True)
    cmd = [sys.executable, "-m", "bench.render_bench", "--inproc", str(out), *_passthrough(opts)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with (LOGS / "inproc.log").open("w") as log:
        subprocess.run(cmd, stderr=log, env=env, cwd=REPO, timeout=opts.config_timeout)
    return json.loads(out.read_text()) if out.exists() else {"rows": [], "error": "in-process run failed, see inproc.log"}


def parity(vllm_resp: dict[str, Any], ours: dict[str, Any]) -> dict[str, str]:
    """Compare our response to vLLM's for each payload (same X-Request-Id on both)."""
    out = {}
    for p, v in vllm_resp.items():
        o = ours.get(p)
        if o is None:
            out[p] = "not fetched"
        elif v["status"] != 200 or o["status"] != 200:
            out[p] = f"status vLLM {v['status']} / ours {o['status']}"
        elif isinstance(v["body"], dict) and isinstance(o["body"], dict):
            out[p] = diff_keys(v["body"], o["body"])
        else:
            out[p] = "identical" if v["body"] == o["body"] else "differs"
    return out


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.render_bench", __doc__)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated Serve configurations to run, from: {', '.join(CONFIGS)} (default: %(default)s)")
    ap.add_argument("--payloads", default=",".join(PAYLOADS), help="comma-separated payloads (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrency of the throughput cases (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=2.5, help="seconds measured per case (default: %(default)s)")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds of warm-up per case (default: %(default)s)")
    ap.add_argument("--min-requests", type=int, default=150, help="at least this many requests per c=1 case (default: %(default)s)")
    ap.add_argument("--config-timeout", type=float, default=420, help="seconds before a configuration's worker is killed")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (no ratios)")
    ap.add_argument("--no-inproc", action="store_true", help="skip the in-process render baseline")
    ap.add_argument("--no-vllm-again", action="store_true", help="do not measure vLLM a second time at the end")
    ap.add_argument("--out", type=Path, default=RESULTS / "render", help="output path without extension (default: %(default)s)")
    ap.add_argument("--from-json", type=Path, help="only re-render the markdown report from a results JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--inproc", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.payloads = listed(ap, opts.payloads, PAYLOADS)
    prepare_driver()

    if opts.worker:
        run_worker(opts.worker, lambda cfg: _worker_main(opts, cfg), _failed)
    if opts.from_json:
        rerender(opts.from_json, render_report)
        return
    if opts.inproc:
        res = asyncio.run(_inproc_main(opts))
        Path(opts.inproc).write_text(json.dumps(res, default=str))
        return

    configs = listed(ap, opts.configs, CONFIGS)
    t_start = time.monotonic()
    data: dict[str, Any] = {"machine": machine_info(), "options": {k: v for k, v in vars(opts).items() if k not in ("worker", "inproc")},
                            "rows": [], "configs": []}
    out_abs = opts.out.resolve()
    data["options"]["out"] = str(out_abs.relative_to(REPO) if out_abs.is_relative_to(REPO) else out_abs)
    vllm_responses: dict[str, Any] = {}
    server = VllmRender(APP_ARGS, "vllm.log")
    try:
        if not opts.no_vllm:
            print(f"== vLLM launch render on port {server.port}", flush=True)
            server.start()
            data["vllm"] = {"startup_s": server.startup_s, "idle_cpu_util": idle_cpu_util(),
                            "command": shown(server.command())}
            print(f"   up in {server.startup_s:.1f} s", flush=True)
            rows, vllm_responses = asyncio.run(measure_vllm(server, opts, "run start"))
            data["rows"] += rows
            data["vllm"]["responses"] = vllm_responses
            if opts.no_vllm_again:
                server.stop()
        if not opts.no_inproc:
            inproc = run_inproc(opts)
            data["rows"] += inproc.get("rows", [])
            data["inproc"] = {k: v for k, v in inproc.items() if k != "rows"}
        for name in configs:
            res = run_config(name, opts)
            data["rows"] += res.pop("rows", [])
            if vllm_responses and "responses" in res:
                res["parity"] = parity(vllm_responses, res["responses"])
            data["configs"].append(res)
        if not opts.no_vllm and not opts.no_vllm_again:
            print("\n== vLLM launch render again (drift check)", flush=True)
            rows, _ = asyncio.run(measure_vllm(server, opts, "run end"))
            data["rows"] += rows
    finally:
        server.stop()
    data["total_s"] = time.monotonic() - t_start
    write_results(opts.out, data, render_report)


if __name__ == "__main__":
    main()