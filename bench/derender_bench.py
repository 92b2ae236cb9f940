"""Derender benchmark: serve_app's plain derender next to vLLM 0.32's ``vllm launch render``, one run, one machine.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.derender_bench

The path measured is chat derender **without a parser** (the server has no ``--tool-call-parser`` /
``--reasoning-parser``, so chat derender is plain detokenization): vLLM's ``ServingDerender`` on one
side, our ``PlainDerender`` (deployed, or colocated in the ingress) on the other. One run does:

1. ``vllm launch render`` for the model, with no parser flags (``serve_app._vllm.vllm_cli_args`` of
   ``AppArgs(model=...)``: model, tokenizer, max model length, served name), over HTTP.
2. ``PlainDerenderService`` in-process (no HTTP, no Ray): the derender work itself, the floor.
3. Our Serve app, ``build_app(AppArgs(model=...))``, once per configuration (``--configs``), each in
   a fresh subprocess with its own environment and ``ray.init`` (Serve reads ``RAY_SERVE_*`` at
   import time): over HTTP through the front door, and by ``DeploymentHandle`` to ``PlainDerender``
   from an async driver (raw JSON bytes, and a dict) where that deployment exists.
4. vLLM once more, to show the drift of the machine over the run.

Workload: the model's tokenizer encodes a long English paragraph with some CJK and emoji; the first
N ids are the "generated" output. Per system:

* **stream**: a full chat stream of ``--tokens`` chunks, one token per chunk, sent one after the
  other as the protocol says (``{"stream": true, "model", "generate_chunk", "stream_state": <the
  previous response's>, "prompt_tokens", "prompt_token_ids"}``), ended by the usage-only chunk.
  Per-chunk latency p50 / p99 over all chunks of ``--streams`` streams, and by position in the
  stream (chunks 0-99 against the last 100), to show whether the cost grows with the output.
* **non-stream**: one chat derender of N tokens, N in ``--lengths``, repeated ``--reps`` times
  (p50), plus one completions derender of ``--tokens`` tokens.

Every output is compared to vLLM's: every streamed chunk and carried state, the concatenated text,
the non-streaming chat and completions responses (``created`` aside).

Results: ``bench/results/derender.md`` and ``.json``; logs in ``bench/results/logs.tmp/``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from bench.common.cpu import cpu_by_role, idle_cpu_util, proc_cpu
from bench.common.derender_report import render_report
from bench.common.load import client_session, http_call
from bench.common.paths import LOGS, RESULTS
from bench.common.ray_internals import direct_ingress_ports, serve_flags
from bench.common.report import cli, diff_keys, listed, machine_info, options_json, rerender, write_results
from bench.common.serve_cluster import (
    APP_NAME,
    COLOCATE,
    make_run_env,
    prepare_driver,
    replica_counts,
    run_config_worker,
    run_worker,
    start_app,
    wait_haproxy_up,
)
from bench.common.servers import VllmRender, shown, wait_http
from bench.common.stats import latency_stats
from bench.common.workloads import chat_prompt, text_output, tokenizer
from tests.harness.derender_stream import chunk, split, token_chunks

MODEL_NAME = "qwen3-tiny"
RID = "generate-tokens-bench"  # the request id of every generate response sent
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions/derender", "/v1/completions/derender"

_TPUT_HA = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
CONFIGS: dict[str, dict[str, Any]] = {
    "plain-default": {"env": {}, "coloc": False},
    "plain-tput-haproxy": {"env": _TPUT_HA, "coloc": False},
    "coloc-default": {"env": {}, "coloc": True},
    "coloc-tput-haproxy": {"env": _TPUT_HA, "coloc": True},
    # make run's SERVE_ENV: its front door middleware too (Serve's disconnect hint on derender routes),
    # without the parser-stream hash, which plain derender does not use.
    "coloc-make-run": {"env": {k: v for k, v in make_run_env().items() if k != "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"}, "coloc": True},
}
DEFAULT_CONFIGS = ",".join(CONFIGS)


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


def workload(model: str, max_tokens: int) -> dict[str, Any]:
    """Output ids (realistic text, at least ``max_tokens`` of them) and a rendered chat prompt's ids."""
    tok = tokenizer(model)
    messages = [{"role": "user", "content": "Write a long essay about the history of printing, with some Chinese and emoji."}]
    try:
        prompt = chat_prompt(tok, {"messages": messages})
    except Exception:  # noqa: BLE001 - a model without a chat template
        prompt = tok.encode(messages[0]["content"])
    return {"ids": text_output(tok, max_tokens), "prompt": list(prompt), "chat_request": {"model": model, "messages": messages}}


def stream_bodies(w: dict[str, Any], n: int, model: str) -> list[dict[str, Any]]:
    """The chunks of one stream (one token each, the last with finish_reason), then the usage-only chunk.

    ``stream_state`` is filled in by the caller from the previous response."""
    prompt = w["prompt"]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    chunks = [*token_chunks(split(w["ids"][:n]), RID, "length"), {"request_id": RID, "choices": [], "usage": usage}]
    return [{"stream": True, "model": model, "generate_chunk": c, "prompt_tokens": len(prompt), "prompt_token_ids": prompt}
            for c in chunks]


def chat_body(w: dict[str, Any], n: int, model: str) -> bytes:
    return json.dumps({"model": model, "generate_response": chunk(w["ids"][:n], RID, finish_reason="length"),
                       "prompt_tokens": len(w["prompt"]), "prompt_token_ids": w["prompt"], "chat_request": w["chat_request"]}).encode()


def completion_body(w: dict[str, Any], n: int, model: str) -> bytes:
    gen = chunk(w["ids"][:n], RID, finish_reason="length")
    return json.dumps({"model": model, "generate_responses": [gen], "prompt_tokens": [len(w["prompt"])],
                       "prompt_token_ids": [w["prompt"]],
                       "completion_request": {"model": model, "prompt": "Write a long essay"}}).encode()


# --------------------------------------------------------------------------------------------
# Measurement: a "call" takes request bytes (or a dict) and returns response bytes
# --------------------------------------------------------------------------------------------

Call = Callable[[Any], Awaitable[bytes]]


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        obj = dict(obj)
        obj.pop("created", None)
        if isinstance(obj.get("chunk"), dict):
            obj["chunk"] = {k: v for k, v in obj["chunk"].items() if k != "created"}
    return obj


async def run_stream(call: Call, bodies: list[dict[str, Any]], as_dict: bool = False,
                     keep: bool = False) -> tuple[list[float], list[Any], str]:
    """One stream, chunk after chunk, carrying stream_state. Returns per-chunk seconds (token chunks only),
    the responses (``created`` stripped) when ``keep``, and the concatenated text."""
    lat: list[float] = []
    outs: list[Any] = []
    text: list[str] = []
    state = None
    for body in bodies:
        req = {**body, "stream_state": state}
        payload = req if as_dict else json.dumps(req).encode()
        t0 = time.perf_counter()
        raw = await call(payload)
        dt = time.perf_counter() - t0
        out = json.loads(raw)
        if "stream_state" not in out:
            raise RuntimeError(f"unexpected response: {raw[:300]!r}")
        state = out["stream_state"]
        if body["generate_chunk"]["choices"]:
            lat.append(dt)
            for c in out["chunk"]["choices"]:
                text.append(c["delta"].get("content") or "")
        if keep:
            outs.append(_strip(out))
    return lat, outs, "".join(text)


async def measure_streams(call: Call, bodies: list[dict[str, Any]], streams: int, as_dict: bool = False) -> dict[str, Any]:
    """``streams`` full streams after one warm-up stream; per-chunk stats overall and by position; CPU by role."""
    await run_stream(call, bodies[:50], as_dict)  # warm-up (not timed)
    per_stream: list[list[float]] = []
    procs0, t0 = proc_cpu(), time.perf_counter()
    for _ in range(streams):
        lat, _, _ = await run_stream(call, bodies, as_dict)
        per_stream.append(lat)
    elapsed = time.perf_counter() - t0
    by_role = cpu_by_role(procs0, proc_cpu())
    n_tok = len(per_stream[0])
    allv = [x for s in per_stream for x in s]
    return {**latency_stats(allv), "streams": streams, "chunks_per_stream": n_tok, "stream_s": elapsed / streams,
            "first100": latency_stats([x for s in per_stream for x in s[:100]]),
            "last100": latency_stats([x for s in per_stream for x in s[-100:]]),
            "cpu_ms_per_chunk_by_role": {k: v / len(allv) * 1e3 for k, v in sorted(by_role.items())}}


async def measure_repeat(call: Call, body: Any, reps: int) -> dict[str, Any]:
    await call(body)  # warm-up
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await call(body)
        lat.append(time.perf_counter() - t0)
    return latency_stats(lat)


async def measure_system(call: Call, w: dict[str, Any], opts: argparse.Namespace, *, streaming: bool = True,
                         as_dict: bool = False, nonstream: bool = True, completion_call: Call | None = None) -> dict[str, Any]:
    """All cases for one access path to one system."""
    model, n = opts.served_name, opts.tokens
    res: dict[str, Any] = {}
    if streaming:
        res["stream"] = await measure_streams(call, stream_bodies(w, n, model), opts.streams, as_dict)
        print(f"    stream{' (dict)' if as_dict else ''}: per chunk p50 {res['stream']['p50_ms']:.3f} ms, p99 "
              f"{res['stream']['p99_ms']:.3f} ms; chunks 0-99 p50 {res['stream']['first100']['p50_ms']:.3f}, last 100 p50 "
              f"{res['stream']['last100']['p50_ms']:.3f}; {res['stream']['stream_s']:.2f} s per stream", flush=True)
    if nonstream:
        conv = (lambda b: json.loads(b)) if as_dict else (lambda b: b)
        res["chat"] = {}
        for length in opts.lengths:
            res["chat"][str(length)] = await measure_repeat(call, conv(chat_body(w, length, model)), opts.reps)
        if completion_call is not None:
            res["completion"] = {str(n): await measure_repeat(completion_call, conv(completion_body(w, n, model)), opts.reps)}
        print("    non-stream chat p50 ms: " + ", ".join(f"{k}: {v['p50_ms']:.2f}" for k, v in res["chat"].items())
              + (f"; completion {n}: {res['completion'][str(n)]['p50_ms']:.2f}" if "completion" in res else ""), flush=True)
    return res


async def reference_outputs(call: Call, completion_call: Call, w: dict[str, Any], opts: argparse.Namespace) -> dict[str, Any]:
    """What parity is checked on: every streamed response, the text, the non-streaming responses."""
    model, n = opts.served_name, opts.tokens
    _, outs, text = await run_stream(call, stream_bodies(w, n, model), keep=True)
    chat = _strip(json.loads(await call(chat_body(w, n, model))))
    completion = _strip(json.loads(await completion_call(completion_body(w, n, model))))
    return {"stream": outs, "stream_text": text, "chat": chat, "completion": completion}


def parity(ref: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rs, os_ = ref["stream"], ours["stream"]
    bad = [i for i, (a, b) in enumerate(zip(rs, os_, strict=False)) if a != b]
    out["stream_chunks"] = ("identical" if not bad and len(rs) == len(os_) else
                            f"{len(bad)} of {len(rs)} differ (first at {bad[0] if bad else len(min(rs, os_, key=len))})")
    if bad:
        out["first_diff"] = {"vllm": rs[bad[0]], "ours": os_[bad[0]]}
    out["stream_text"] = "identical" if ref["stream_text"] == ours["stream_text"] else "differs"
    out["stream_text_equals_nonstream"] = ours["stream_text"] == ours["chat"]["choices"][0]["message"]["content"]
    for k in ("chat", "completion"):
        out[k] = diff_keys(ref[k], ours[k])
    out["all_identical"] = all(out[k] == "identical" for k in ("stream_chunks", "stream_text", "chat", "completion"))
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# HTTP and handle calls
# --------------------------------------------------------------------------------------------


def http_calls(session: Any, base: str) -> tuple[Call, Call]:
    def make(path: str) -> Call:
        return lambda body: http_call(session, "POST", base + path, body)()

    return make(CHAT_PATH), make(COMPLETION_PATH)


def inproc_calls(service: Any) -> tuple[Call, Call]:
    async def chat(body: Any) -> bytes:
        return service.chat(body)

    async def completion(body: Any) -> bytes:
        return service.completion(body)

    return chat, completion


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


def vllm_server(model: str) -> VllmRender:
    """vLLM for ``model`` with no parser flags, so its chat derender is plain detokenization."""
    return VllmRender({"model": model}, f"derender-vllm-{model}.log")


async def measure_vllm(v: VllmRender, w: dict[str, Any], opts: argparse.Namespace, ref: bool) -> dict[str, Any]:
    async with client_session(1) as session:
        chat, completion = http_calls(session, v.base)
        out: dict[str, Any] = {}
        if ref:
            out["reference"] = await reference_outputs(chat, completion, w, opts)
        out["http"] = await measure_system(chat, w, opts, completion_call=completion)
        return out


# --------------------------------------------------------------------------------------------
# In-process floor
# --------------------------------------------------------------------------------------------


async def measure_inproc(w: dict[str, Any], opts: argparse.Namespace, ref: dict[str, Any] | None) -> dict[str, Any]:
    from serve_app.config import AppArgs
    from serve_app.derender.plain import build_plain_service

    args = AppArgs(model=opts.model)
    service = build_plain_service(args, args.resolve())
    chat, completion = inproc_calls(service)
    out: dict[str, Any] = {}
    if ref is not None:
        out["parity"] = parity(ref, await reference_outputs(chat, completion, w, opts))
    out["bytes"] = await measure_system(chat, w, opts, completion_call=completion)
    out["dict"] = await measure_system(chat, w, opts, as_dict=True, nonstream=False)
    return out


# --------------------------------------------------------------------------------------------
# One Serve configuration, in its own process
# --------------------------------------------------------------------------------------------


def topology(cfg: dict[str, Any]) -> str:
    return ("Ingress ×1 with render + plain derender colocated (Render, PlainDerender not deployed)" if cfg["coloc"]
            else "Ingress ×1 → PlainDerender ×1 (autoscaling 1-4), Render ×1 idle")


async def _worker_main(opts: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AppArgs

    w = json.loads(Path(cfg["workload"]).read_text())
    ref = json.loads(Path(cfg["reference"]).read_text()) if cfg.get("reference") else None
    res: dict[str, Any] = {"config": cfg["name"], "env": cfg["env"], "topology": topology(cfg)}
    res["flags"] = serve_flags("direct_ingress", "ha_proxy", "grpc_between_deployments")
    port = cfg["port"]
    t0 = time.monotonic()
    start_app(lambda: build_app(AppArgs(model=opts.model, colocate_in_ingress=COLOCATE if cfg["coloc"] else [])),
              port=port, namespace=f"dbench_{cfg['name']}")
    base = f"http://127.0.0.1:{port}"
    await wait_http(base + "/health", 120, ok_in_a_row=3)
    if res["flags"]["ha_proxy"]:
        res["haproxy_replicas_up"] = await wait_haproxy_up(len(direct_ingress_ports(APP_NAME)) or 1)
    res["startup_s"] = time.monotonic() - t0
    if (counts := replica_counts()) is not None:
        res["deployments"] = counts
    res["idle_cpu_util"] = idle_cpu_util()
    print(f"[{cfg['name']}] up in {res['startup_s']:.1f} s; deployments {res.get('deployments')}; flags {res['flags']}", flush=True)

    async with client_session(1) as session:
        chat, completion = http_calls(session, base)
        if ref is not None:
            res["parity_http"] = parity(ref, await reference_outputs(chat, completion, w, opts))
            print(f"    parity over HTTP: {res['parity_http']}", flush=True)
        print("  http", flush=True)
        res["http"] = await measure_system(chat, w, opts, completion_call=completion)

    if not cfg["coloc"]:
        handle = serve.get_deployment_handle("PlainDerender", app_name=APP_NAME)

        async def h_chat(body: Any) -> bytes:
            return await handle.chat.remote(body)

        async def h_completion(body: Any) -> bytes:
            return await handle.completion.remote(body)

        if ref is not None:
            res["parity_handle"] = parity(ref, await reference_outputs(h_chat, h_completion, w, opts))
        print("  handle (bytes)", flush=True)
        res["handle"] = await measure_system(h_chat, w, opts, completion_call=h_completion)
        print("  handle (dict)", flush=True)
        res["handle_dict"] = await measure_system(h_chat, w, opts, as_dict=True, nonstream=False)
    return res


def _passthrough(opts: argparse.Namespace) -> list[str]:
    return ["--model", opts.model, "--tokens", str(opts.tokens), "--streams", str(opts.streams),
            "--reps", str(opts.reps), "--lengths", ",".join(map(str, opts.lengths))]


def run_config(name: str, opts: argparse.Namespace, files: dict[str, str]) -> dict[str, Any]:
    cfg = {**CONFIGS[name], "name": name, **files}
    return run_config_worker("bench.derender_bench", cfg, topology(cfg), _failed(cfg), _passthrough(opts),
                             LOGS / f"derender-{opts.model}-{name}", opts.config_timeout)


def _failed(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"config": cfg["name"], "env": cfg["env"], "topology": topology(cfg)}


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.derender_bench", __doc__)
    ap.add_argument("--model", default=MODEL_NAME, help="builtin model (default: %(default)s)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--tokens", type=int, default=1000, help="output length of the streams (default: %(default)s)")
    ap.add_argument("--lengths", default="100,500,1000,2000", help="non-streaming output lengths (default: %(default)s)")
    ap.add_argument("--streams", type=int, default=3, help="timed streams per case (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="timed non-streaming calls per case (default: %(default)s)")
    ap.add_argument("--config-timeout", type=float, default=300)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-vllm-again", action="store_true", help="do not measure vLLM again at the end")
    ap.add_argument("--out", type=Path, default=RESULTS / "derender")
    ap.add_argument("--from-json", type=Path, help="only re-render the markdown report from a results JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.lengths = [int(x) for x in listed(ap, opts.lengths)]
    opts.served_name = opts.model
    prepare_driver()
    if opts.worker:
        run_worker(opts.worker, lambda cfg: _worker_main(opts, cfg), _failed)
    if opts.from_json:
        rerender(opts.from_json, render_report)
        return
    configs = listed(ap, opts.configs, CONFIGS)
    t_start = time.monotonic()
    LOGS.mkdir(parents=True, exist_ok=True)
    w = workload(opts.model, max([opts.tokens, *opts.lengths]))
    wfile = LOGS / f"derender-{opts.model}-workload.json"
    wfile.write_text(json.dumps(w))
    data: dict[str, Any] = {"machine": machine_info(),
                            "options": options_json(opts, "worker"),
                            "workload": {"prompt_len": len(w["prompt"]), "ids_digest": _digest(w["ids"])}, "configs": []}
    files = {"workload": str(wfile)}
    v = vllm_server(opts.model)
    try:
        if not opts.no_vllm:
            print(f"== vLLM launch render ({opts.model}, no parser) on port {v.port}", flush=True)
            startup = v.start()
            data["vllm"] = {"startup_s": startup, "command": shown(v.command())}
            res = asyncio.run(measure_vllm(v, w, opts, ref=True))
            ref = res.pop("reference")
            rfile = LOGS / f"derender-{opts.model}-reference.json"
            rfile.write_text(json.dumps(ref))
            files["reference"] = str(rfile)
            data["vllm_start"] = res
            data["workload"]["vllm_text_head"] = ref["stream_text"][:200]
            if opts.no_vllm_again:
                v.stop()
        ref = json.loads(Path(files["reference"]).read_text()) if "reference" in files else None
        print("\n== PlainDerenderService in-process", flush=True)
        data["inproc"] = asyncio.run(measure_inproc(w, opts, ref))
        if data["inproc"].get("parity"):
            print(f"    parity: {data['inproc']['parity']}", flush=True)
        for name in configs:
            data["configs"].append(run_config(name, opts, files))
        if not opts.no_vllm and not opts.no_vllm_again:
            print("\n== vLLM launch render again (drift check)", flush=True)
            data["vllm_end"] = asyncio.run(measure_vllm(v, w, opts, ref=False))
    finally:
        v.stop()
    data["total_s"] = time.monotonic() - t_start
    write_results(opts.out, data, render_report)


if __name__ == "__main__":
    main()
