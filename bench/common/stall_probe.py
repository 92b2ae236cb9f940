"""Whether the machine itself held every process at once during a case.

A thread that asks to sleep 10 ms, over and over, at the harness's niceness (0, above every Ray
worker's 15): when it wakes 50 ms or more late, nothing on the machine was running it, so a stream
held at that moment may have been held by the machine (a vCPU not scheduled by its host), not by a
server. Run beside each system's case, it tells a hold that both servers see from one only ours makes."""

from __future__ import annotations

import threading
import time
from typing import Any

TICK_S = 0.010
STALL_S = 0.050


def sleeper_stalls(oversleeps_s: list[float], seconds: float) -> dict[str, Any]:
    """How late the sleeper woke, over a window of ``seconds``: the wakes ``STALL_S`` or more late,
    the longest, and their total against the window."""
    late = [s for s in oversleeps_s if s >= STALL_S]
    return {
        "seconds": seconds,
        "stalls": len(late),
        "longest_ms": max(late) * 1e3 if late else 0.0,
        "stalled_share": sum(late) / seconds if seconds > 0 else float("nan"),
    }


class StallProbe:
    """``with StallProbe() as probe: ...``; then ``probe.summary()``."""

    def __init__(self) -> None:
        self._oversleeps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-probe", daemon=True)
        self._window = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(TICK_S)
            self._oversleeps.append(time.monotonic() - t - TICK_S)

    def __enter__(self) -> StallProbe:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._window = time.monotonic() - self._started

    def summary(self) -> dict[str, Any]:
        return sleeper_stalls(self._oversleeps, self._window)
