"""Our app on a fresh local Ray Serve cluster, as the benchmarks run it.

Serve reads ``RAY_SERVE_*`` flags at import time in every Ray process, so each configuration runs
in its own worker process (``python -m bench.<bench> --worker <cfg json>``) with its own environment
and ``ray.init``: :func:`run_worker_process` on the parent's side, :func:`run_worker` on the worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, NoReturn

from bench.common.paths import REPO
from bench.common.ray_internals import haproxy_replicas_up
from bench.common.servers import free_port, kill_group, spawn_group, wait_http
from tests.harness.metrics import session_outcomes as session_outcomes  # re-exported for the benches

APP_NAME = "serve_app"
COLOCATE = ["render", "plain_derender"]  # AppArgs.colocate_in_ingress of the colocated configurations


def make_run_env() -> dict[str, str]:
    """The Serve flags ``make run`` starts Ray with (the Makefile's ``SERVE_ENV``)."""
    import shlex

    from serve_app.front_door import HAPROXY_BALANCE

    line = next(ln for ln in (REPO / "Makefile").read_text().splitlines() if ln.startswith("SERVE_ENV :="))
    env = dict(kv.split("=", 1) for kv in shlex.split(line.split(":=", 1)[1]))
    # The Makefile's FRONT_DOOR_BALANCE: HAProxy hashes each parser-stream chunk's stream id.
    return {**env, "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": HAPROXY_BALANCE}


def shipped_colocate() -> list[str]:
    """``colocate_in_ingress`` of the shipped ``serve_config.yaml``."""
    import yaml

    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    return list(config["applications"][0]["args"]["colocate_in_ingress"])


_YAML_DEPLOYMENTS = {"Ingress": "ingress", "Render": "render", "PlainDerender": "plain_derender",
                     "ParserDerender": "parser_derender", "Engine": "engine"}


def shipped_app_args() -> dict[str, Any]:
    """``serve_config.yaml``'s args with its per-deployment options folded into ``deployments`` (the builder
    deep-merges them over each deployment's defaults, as Serve's override does)."""
    import yaml

    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    app = next(a for a in config["applications"] if a["name"] == APP_NAME)
    args: dict[str, Any] = dict(app["args"])
    deployments: dict[str, Any] = dict(args.get("deployments") or {})
    for entry in app.get("deployments") or []:
        entry = dict(entry)
        key = _YAML_DEPLOYMENTS[entry.pop("name")]
        deployments[key] = {**deployments.get(key, {}), **entry}
    args["deployments"] = deployments
    return args
QUIET_LOGS = {"log_level": "WARNING", "enable_access_log": False}
"""Serve's ``logging_config`` as ``serve_config.yaml`` sets it: no access log line per request."""


def prepare_driver() -> None:
    """What every benchmark driver process sets before it starts anything."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import uvloop

        uvloop.install()  # a cheaper client loop leaves more of the machine to the servers
    except ImportError:
        pass


def start_serve(*, port: int, namespace: str) -> float:
    """``ray.init`` a local cluster (8 logical CPUs) and start Serve's HTTP on 127.0.0.1:``port``, logs quiet.
    Returns the seconds of ``ray.init``."""
    import ray
    from ray import serve

    t0 = time.monotonic()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace=namespace,
             logging_level="WARNING")
    ray_init_s = time.monotonic() - t0
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET_LOGS)
    return ray_init_s


@contextlib.contextmanager
def local_serve(namespace: str) -> Iterator[int]:
    """:func:`start_serve` on a free port (yielded); Serve shut down after the block, Ray in any case."""
    import ray
    from ray import serve

    port = free_port()
    try:
        start_serve(port=port, namespace=namespace)
        yield port
        serve.shutdown()
    finally:
        ray.shutdown()


def start_app(make_app: Callable[[], Any], *, port: int, namespace: str) -> tuple[float, float]:
    """:func:`start_serve`, then build the app and run it as ``APP_NAME`` at ``/``, logs quiet. Returns the
    seconds of ``ray.init`` and of the rest."""
    from ray import serve

    t0 = time.monotonic()
    ray_init_s = start_serve(port=port, namespace=namespace)
    t1 = t0 + ray_init_s
    serve.run(make_app(), name=APP_NAME, route_prefix="/", logging_config=QUIET_LOGS)
    return ray_init_s, time.monotonic() - t1


def start_ours(app_args: dict[str, Any], *, namespace: str, ingress: int, ready_timeout: float) -> tuple[str, dict[str, Any]]:
    """Our app built from ``app_args`` (a dict of ``AppArgs``) by :func:`start_app` on a free port, waited for
    (``/ready`` twice in a row, ``ingress`` replicas UP in HAProxy). Returns its base URL and
    ``haproxy_replicas_up``, ``startup_s``, ``deployments``."""
    from serve_app.app import build_app
    from serve_app.config import AppArgs

    args = AppArgs(**app_args)
    port = free_port()
    t0 = time.monotonic()
    start_app(lambda: build_app(args), port=port, namespace=namespace)
    base = f"http://127.0.0.1:{port}"
    asyncio.run(wait_http(base + "/ready", ready_timeout, ok_in_a_row=2))
    up = asyncio.run(wait_haproxy_up(ingress))
    return base, {"haproxy_replicas_up": up, "startup_s": time.monotonic() - t0, "deployments": replica_counts()}


@contextlib.contextmanager
def vllm_and_ours(vllm: dict[str, Any], ours: dict[str, Any] | None, setup: dict[str, Any], *, namespace: str,
                  ingress: int) -> Iterator[str | None]:
    """Launch the vLLM servers (``{"render": VllmRender, "serve": VllmServe}``, or fewer), start ours from the
    ``AppArgs`` dict ``ours`` by :func:`start_ours` meanwhile (None: not), then wait for vLLM; yields ours' base
    URL. ``setup`` gets ``vllm_<name>_command`` / ``_startup_s``, ours' ``ours_*`` start-up and ``make run``'s
    env. Everything started is stopped after the block (the local Ray cluster shut down with Serve)."""
    from bench.common.load import progress
    from bench.common.servers import VllmServe, shown

    try:
        for name, server in vllm.items():
            progress(f"starting vllm {name}")
            server.launch()
            setup[f"vllm_{name}_command"] = shown(server.command())
        base = None
        if ours is not None:
            progress("starting ours (Ray Serve, as make run)")
            base, up = start_ours(ours, namespace=namespace, ingress=ingress, ready_timeout=300)
            setup.update(ours_haproxy_replicas_up=up["haproxy_replicas_up"], ours_startup_s=up["startup_s"],
                         ours_deployments=up["deployments"], ours_app_args=ours, ours_env=make_run_env())
            progress(f"  ours up in {setup['ours_startup_s']:.0f} s: {setup['ours_deployments']}")
        for name, server in vllm.items():
            setup[f"vllm_{name}_startup_s"] = asyncio.run(server.wait_ready(600 if isinstance(server, VllmServe) else 300))
            progress(f"  vllm {name} up in {setup[f'vllm_{name}_startup_s']:.0f} s")
        yield base
    finally:
        for server in vllm.values():
            server.stop()
        if ours is not None:
            import ray

            ray.shutdown()


def replica_counts(app_name: str = APP_NAME) -> dict[str, int] | None:
    """Replicas of every deployment of the app (None if Serve cannot say)."""
    from ray import serve

    try:
        status = serve.status().applications[app_name].deployments
        return {name: sum(d.replica_states.values()) for name, d in status.items()}
    except Exception:  # noqa: BLE001 - informational only
        return None


async def wait_haproxy_up(want: int, timeout: float = 60) -> int:
    """Wait (at most ``timeout`` s) until HAProxy has ``want`` replicas UP; returns how many it has."""
    deadline = time.monotonic() + timeout
    while (up := haproxy_replicas_up()) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return up


_HANDLE_LOOP: asyncio.AbstractEventLoop | None = None


def handle_call(deployment: str, method: str, *args: Any, app_name: str = APP_NAME, timeout: float = 60) -> Any:
    """``await handle.<method>.remote(*args)`` on a deployment of the app, from any thread. Throughput-optimized
    Serve routes handle calls on the caller's event loop, which must keep running after the call: every
    call goes through one event loop kept running in a daemon thread."""
    global _HANDLE_LOOP
    import threading

    from ray import serve

    if _HANDLE_LOOP is None:
        _HANDLE_LOOP = asyncio.new_event_loop()
        threading.Thread(target=_HANDLE_LOOP.run_forever, name="bench-handles", daemon=True).start()

    async def call() -> Any:
        handle = serve.get_deployment_handle(deployment, app_name=app_name)
        return await getattr(handle, method).remote(*args)

    return asyncio.run_coroutine_threadsafe(call(), _HANDLE_LOOP).result(timeout=timeout)


def run_worker(cfg_json: str, main: Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]],
               failed: Callable[[dict[str, Any]], dict[str, Any]]) -> NoReturn:
    """The worker process: run ``main(cfg)``, write its result (or ``failed(cfg)`` with the error) to
    ``cfg["out"]`` as JSON, and exit."""
    cfg = json.loads(cfg_json)
    result: dict[str, Any]
    try:
        result = asyncio.run(main(cfg))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed configuration
        import traceback

        traceback.print_exc()
        result = {**failed(cfg), "error": repr(exc)[:1000]}
    Path(cfg["out"]).write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    # No serve.shutdown(): it waits for graceful draining (about 30 s with RAY_SERVE_THROUGHPUT_OPTIMIZED)
    # and this process's local cluster dies with ray.shutdown() anyway.
    try:
        import ray

        ray.shutdown()
    finally:
        os._exit(0)


def run_worker_process(module: str, cfg: dict[str, Any], passthrough: list[str], log_path: Path,
                       timeout: float) -> tuple[dict[str, Any] | None, int | None]:
    """Run ``python -m <module> --worker <cfg>`` with ``cfg["env"]`` on top of this environment, echo and
    log its stdout (stderr to the log only), then stop its process group whatever happened. Returns the
    result it wrote to ``cfg["out"]`` (None if none) and its exit code."""
    out = Path(cfg["out"])
    out.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # PYTHONPATH: Ray workers inherit it (the package is installed editable anyway).
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": pythonpath, **cfg["env"]}
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(cfg), *passthrough]
    with log_path.open("w") as log:
        proc = spawn_group(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(line)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(proc)
    return (json.loads(out.read_text()) if out.exists() else None), proc.returncode


def run_config_worker(module: str, cfg: dict[str, Any], topology: str, failed: dict[str, Any], passthrough: list[str],
                      stem: Path, timeout: float) -> dict[str, Any]:
    """One Serve configuration ``cfg`` (``name``, ``env``, ...) in its worker (:func:`run_worker_process`) on a
    free ``port``, writing ``<stem>.json``, logging to ``<stem>.log``. Returns its result, or ``failed`` with
    the error when it wrote none; ``wall_s`` added."""
    cfg = {**cfg, "port": free_port(), "out": f"{stem}.json"}
    print(f"\n== serve_app {cfg['name']}: env {cfg['env'] or '{}'}, {topology}", flush=True)
    t0 = time.monotonic()
    result, code = run_worker_process(module, cfg, passthrough, Path(f"{stem}.log"), timeout)
    if result is None:
        result = {**failed, "error": f"worker exited {code}, see {stem}.log"}
    result["wall_s"] = time.monotonic() - t0
    return result
