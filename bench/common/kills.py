"""Replicas SIGKILLed on a schedule during a run (``--kill 0.3:Ingress,0.5:ParserDerender``), the failed
requests each kill is blamed for, and the report's section on them."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from bench.common.load import progress


def parse_kills(spec: str) -> list[tuple[float, str]]:
    """``"0.3:ParserDerender,0.5:Ingress"`` -> [(0.3, "ParserDerender"), (0.5, "Ingress")]: when (a share of
    the traffic time) to SIGKILL one replica of which deployment."""
    kills = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        at, _, deployment = part.partition(":")
        kills.append((float(at), deployment))
    return sorted(kills)


async def killer(kills: list[tuple[float, str]], duration: float, t0: float, events: list[dict[str, Any]]) -> None:
    """SIGKILL one live replica of each scheduled deployment at its time (found in the GCS actor table, as
    the memory sampler finds them); each kill recorded with its time, replica and pid."""
    import signal

    from bench.common.ray_internals import gcs_actors

    for share, deployment in kills:
        await asyncio.sleep(max(0.0, t0 + share * duration - time.perf_counter()))
        actors = await asyncio.to_thread(gcs_actors)
        live = sorted((info.get("Name") or "", int(info["Pid"])) for info in actors.values()
                      if (info.get("ActorClassName") or "").endswith(":" + deployment)
                      and info.get("State") == "ALIVE" and info.get("Pid"))
        if not live:
            events.append({"t": round(time.perf_counter() - t0, 2), "deployment": deployment, "killed": None})
            progress(f"  kill {deployment}: no live replica")
            continue
        name, pid = live[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pid = -pid
        events.append({"t": round(time.perf_counter() - t0, 2), "deployment": deployment, "replica": name, "pid": pid})
        progress(f"  [{time.perf_counter() - t0:6.0f} s] SIGKILL {deployment} replica {name} (pid {pid})")


def blame(kills: list[dict[str, Any]], failures: list[Any], memory: dict[str, dict[str, Any]],
          window: float) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each kill with the failed requests within ``window`` s after it and whether its deployment got a
    replica started after it; the failures outside every window. A killed replica's memory is not
    judged: its row in ``memory`` is set not gated (its RSS series just ends)."""
    killed = {f"{k['deployment']}#{k['replica'].rsplit('#', 1)[-1][:6]}" for k in kills if k.get("replica")}
    for label in killed & memory.keys():
        memory[label]["gated"] = False
    rows = []
    for k in kills:
        inside = [f for f in failures if 0 <= f[0] - k["t"] <= window]
        replaced = any(label.startswith(f"{k['deployment']}#") and row["first_seen_s"] > k["t"] for label, row in memory.items())
        rows.append({**k, "failures": len(inside), "failure_kinds": sorted({f[1].split(":")[0] for f in inside}), "replaced": replaced})
    outside = [f for f in failures if not any(0 <= f[0] - k["t"] <= window for k in kills)]
    return rows, outside


def kills_section(kills: list[dict[str, Any]], outside: list[Any], window: float) -> list[str]:
    """The report's markdown lines on the kills (none without kills)."""
    if not kills:
        return []
    lines = ["## Replicas killed (SIGKILL) during the traffic", "",
             f"A request that failed (5xx, hang, transport error, in-band error, unexpected status) within {window:g} s "
             "after a kill is counted as that kill's; the client does not retry.", "",
             "| at s | deployment | replica (pid) | failed requests within the window | kinds | replaced |",
             "|---|---|---|---|---|---|"]
    for k in kills:
        lines.append(f"| {k['t']:.0f} | {k['deployment']} | {k.get('replica', '-')} ({k.get('pid', '-')}) | {k['failures']} | "
                     f"{', '.join(k['failure_kinds']) or '-'} | {'yes' if k['replaced'] else 'no'} |")
    lines += ["", f"Failed requests outside those windows: {len(outside)}"
              + (f" (first: {outside[:3]})" if outside else "") + ".", ""]
    return lines
