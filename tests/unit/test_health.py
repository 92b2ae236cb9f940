"""``serve_app.health``: readiness and fail-fast from the controller's last answer (a stand-in fetch here;
the real one runs in tests/integration/test_engine.py and tests/e2e/test_serve_run.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from serve_app.errors import ApiError
from serve_app.health import DeploymentHealth, StageHealth
from serve_app.ingress import Ingress


class Controller:
    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def __call__(self, app_name: str):
        self.calls += 1
        return self.answer


def test_not_ready_lists_what_is_not_healthy_and_caches_for_the_ttl():
    controller = Controller({"Ingress": DeploymentHealth("HEALTHY", 2), "Engine": DeploymentHealth("UPDATING", 0)})
    health = StageHealth("app", controller, ttl_s=60)

    async def run() -> list[str]:
        await health.refresh()
        await health.refresh()  # within the TTL: no second controller call
        return health.not_ready()

    assert asyncio.run(run()) == ["Engine (UPDATING)"]
    assert controller.calls == 1
    assert health.down("Engine") and not health.down("Ingress") and not health.down("Unknown")


def test_an_answer_older_than_the_ttl_marks_nothing_down():
    """After a quiet spell the last answer may predate a stage coming up: it fails nothing fast."""
    controller = Controller({"Engine": DeploymentHealth("UPDATING", 0)})
    fresh, stale = StageHealth("app", controller, ttl_s=60), StageHealth("app", controller, ttl_s=0.01)
    asyncio.run(fresh.refresh())
    asyncio.run(stale.refresh())
    time.sleep(0.02)
    assert fresh.down("Engine") and not stale.down("Engine")
    assert fresh.not_ready() == stale.not_ready() == ["Engine (UPDATING)"]


def test_before_any_answer_nothing_is_down_and_nothing_is_ready():
    health = StageHealth("app", Controller(None))
    assert not health.down("Engine")
    assert health.not_ready() == ["app (not deployed)"]


def test_a_stage_with_no_running_replica_fails_fast():
    controller = Controller({"ParserDerender": DeploymentHealth("UNHEALTHY", 0), "Render": DeploymentHealth("HEALTHY", 1)})
    owner = SimpleNamespace(health=StageHealth("app", controller, ttl_s=60))

    async def run() -> None:
        await owner.health.refresh()
        fail_fast = Ingress.func_or_class._fail_fast
        fail_fast(owner, SimpleNamespace(deployment_name="Render"))  # running: passes
        fail_fast(owner, SimpleNamespace(remote=None))  # a colocated stage: always passes
        with pytest.raises(ApiError) as got:
            fail_fast(owner, SimpleNamespace(deployment_name="ParserDerender"))
        assert got.value.status_code == 503 and "ParserDerender" in got.value.message

    asyncio.run(run())


def test_autoscaling_deployments_are_ready_as_in_serves_own_application_status():
    # Serve reports the application RUNNING while a deployment autoscales; a readiness probe must not
    # take every pod out of service on each scale event (deploy/kuberay/*.rayservice.yaml).
    controller = Controller(
        {
            "Ingress": DeploymentHealth("UPSCALING", 2),
            "ParserDerender": DeploymentHealth("DOWNSCALING", 3),
            "Engine": DeploymentHealth("UNHEALTHY", 1),
            "Render": DeploymentHealth("UPDATING", 1),
        }
    )
    health = StageHealth("app", controller, ttl_s=60)
    asyncio.run(health.refresh())
    assert health.not_ready() == ["Engine (UNHEALTHY)", "Render (UPDATING)"]


def test_routable_replicas_is_unknown_before_a_handle_routes():
    """A handle that has not routed yet has no router view: unknown, so nothing fails fast on it."""
    from ray.serve.handle import DeploymentHandle

    from serve_app.health import routable_replicas

    assert routable_replicas(DeploymentHandle("Engine", "serve_app")) is None
    assert routable_replicas(object()) is None
