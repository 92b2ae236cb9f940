"""What the Serve controller says of this application's deployments, for readiness and fail-fast.

The Ingress asks at most once a second, off its event loop, and answers from the last answer:
``/ready`` lists the deployments that are not HEALTHY, and a call to a stage with no RUNNING
replica is a 503 with ``Retry-After`` at once instead of a request queued until a replacement
starts (which, for a replica importing vLLM, takes minutes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeploymentHealth", "StageHealth", "fetch_serve_status", "replica_gone", "routable", "routable_replicas"]


def routable_replicas(handle: Any) -> int | None:
    """How many replicas this process's router for ``handle`` can send a request to now (``None``:
    not known yet). Zero is the state in which Serve queues a call until a replacement is RUNNING,
    which for a replica importing vLLM takes minutes: the router drops a replica the moment a call
    to it fails with the actor dead, seconds before the controller's status shows it. Ray 2.60's
    router internals, read here only, and any change to them reads as "not known"."""
    try:
        router = handle._router._asyncio_router  # no public accessor in Ray 2.60
        if not router.running_replicas_populated():
            return None
        return len(router.request_router.curr_replicas)
    except AttributeError:
        return None


def routable(stage: Any) -> Callable[[], bool] | None:
    """For :func:`serve_app.timeouts.within`: whether a call to ``stage`` can still reach a replica
    (``None`` for a colocated stage, which always can)."""
    if getattr(stage, "deployment_name", None) is None:
        return None
    return lambda: routable_replicas(stage) != 0

def replica_gone(exc: BaseException) -> bool:
    """Whether a call failed because its replica's actor died or became unreachable (Ray's
    ``RayActorError`` family: ``ActorDiedError``, ``ActorUnavailableError``), so it can go to another
    replica. The router has then dropped that replica (``on_replica_actor_died``) or will probe it
    before using it again. Matched by name, so this module needs no Ray import."""
    exc = getattr(exc, "cause", None) or exc  # a RayTaskError carries the original as ``cause``
    return any(cls.__name__ == "RayActorError" for cls in type(exc).__mro__)


_READY = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})  # Serve's DeploymentStatus values that are ready


@dataclass(frozen=True, slots=True)
class DeploymentHealth:
    status: str  # Serve's: HEALTHY, UPDATING, UNHEALTHY, ...
    running: int  # replicas RUNNING


def fetch_serve_status(app_name: str) -> dict[str, DeploymentHealth] | None:
    """The application's deployments as the controller sees them (``None``: not deployed). Blocking.

    Read from the controller's instance details as it sends them, a plain dict: ``serve.status()``
    validates them into pydantic models first, which cloudpickles every deployment's request router
    class, ~0.2 s of CPU a call; at one call a second that was a fifth of a core per Ingress replica
    (bench/results/composed.md)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    app = (client.get_serve_details().get("applications") or {}).get(app_name) if client is not None else None
    if app is None:
        return None
    return {
        name: DeploymentHealth(_state(d.get("status")), sum(_state(r.get("state")) == "RUNNING" for r in d.get("replicas") or ()))
        for name, d in (app.get("deployments") or {}).items()
    }


def _state(value: Any) -> str:
    """Serve's states are str Enums: ``.value`` is the bare name ("HEALTHY"), str() is not."""
    return str(getattr(value, "value", value))


class StageHealth:
    """The last known health of one application's deployments, refreshed in the background."""

    def __init__(
        self, app_name: str, fetch: Callable[[str], dict[str, DeploymentHealth] | None] = fetch_serve_status, ttl_s: float = 1.0
    ) -> None:
        self.app_name = app_name
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._fetched_at = float("-inf")
        self._deployments: dict[str, DeploymentHealth] | None = None
        self._refreshing: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Ask the controller now, unless the last answer is under ``ttl_s`` old."""
        if time.monotonic() - self._fetched_at > self._ttl_s:
            self._deployments = await asyncio.to_thread(self._fetch, self.app_name)
            self._fetched_at = time.monotonic()

    def refresh_soon(self) -> None:
        """Refresh in the background if stale; never makes the caller wait."""
        if time.monotonic() - self._fetched_at > self._ttl_s and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh())

    def not_ready(self) -> list[str]:
        """``name (STATUS)`` for each deployment that is neither HEALTHY nor autoscaling (UPSCALING,
        DOWNSCALING: Serve's own application status stays RUNNING then, and every replica it has runs)."""
        if self._deployments is None:
            return [f"{self.app_name} (not deployed)"]
        return sorted(f"{name} ({d.status})" for name, d in self._deployments.items() if d.status not in _READY)

    def down(self, deployment: str) -> bool:
        """True when the last answer, under ``ttl_s`` old, showed ``deployment`` with no RUNNING replica
        (unknown: not down). An older answer is not trusted: after a quiet spell it may predate the
        stage coming up (the Engine still loading when this replica last asked), and the first request
        would get a 503 for a stage that runs; the router's own view still fails fast then."""
        if time.monotonic() - self._fetched_at > self._ttl_s:
            return False
        d = (self._deployments or {}).get(deployment)
        return d is not None and d.running == 0
