"""Memory of the Serve processes a bench started: RSS of every live Serve actor (found by the GCS actor
table), of their children, of raylet / gcs_server, and of the driver."""

from __future__ import annotations

import os
from typing import Any

from bench.common.ray_internals import gcs_actors


def _proc_label(info: dict[str, Any]) -> tuple[str, str]:
    """(label, role) of an actor from the GCS actor table."""
    cls, name = info.get("ActorClassName") or "", info.get("Name") or ""
    if cls.startswith("ServeReplica:"):
        deployment = cls.split(":")[-1]
        return f"{deployment}#{name.rsplit('#', 1)[-1][:6]}", "replica"
    if cls == "ServeController":
        return "ServeController", "controller"
    if cls in ("ProxyActor", "HAProxyManager"):
        return cls, "proxy"
    return cls or name or "actor", "replica"


def cmd_name(proc: Any) -> str:
    """A psutil process's program name (``haproxy``, ``raylet``, ``VLLM::EngineCore``)."""
    try:
        cmd = proc.cmdline()
        if cmd:
            return os.path.basename(cmd[0].split()[0])
        return proc.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"


def sample_processes() -> dict[str, dict[str, Any]]:
    """RSS (bytes) of every live Serve actor process (found by the GCS actor table), of their child processes
    (summed by command name: ``haproxy``, ``VLLM::EngineCore``), of raylet / gcs_server, and of this process."""
    import psutil

    out: dict[str, dict[str, Any]] = {}
    for info in gcs_actors().values():
        if info.get("State") != "ALIVE" or not info.get("Pid"):
            continue
        label, role = _proc_label(info)
        try:
            proc = psutil.Process(int(info["Pid"]))
            out[label] = {"rss": proc.memory_info().rss, "pid": proc.pid, "role": role}
            for child in proc.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                except psutil.Error:
                    continue
                entry = out.setdefault(f"{label} › {cmd_name(child)}", {"rss": 0, "pids": [], "role": "child"})
                entry["rss"] += rss
                entry["pids"].append(child.pid)
        except psutil.Error:
            continue
    me = psutil.Process()
    out["load generator (this process)"] = {"rss": me.memory_info().rss, "pid": me.pid, "role": "client"}
    for child in me.children(recursive=True):
        try:
            name = cmd_name(child)
            if name in ("raylet", "gcs_server"):
                out[name] = {"rss": child.memory_info().rss, "pid": child.pid, "role": "ray-system"}
        except psutil.Error:
            continue
    return out
