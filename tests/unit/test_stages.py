"""``serve_app.stages``: where each stage of an Ingress replica runs, decided once, and where a chat
derender request goes. The stage services are real (qwen3-tiny's plain derender); the deployment
handles are stand-ins, as Ray is not running here (tests/integration/test_colocation.py runs them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.compose import ComposedService
from serve_app.config import AppArgs
from serve_app.derender.plain_service import PlainDerenderService
from serve_app.health import DeploymentHealth, StageHealth
from serve_app.stages import InProcess, build_stages, choose_derender, unreachable

PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}


class TestChooseDerender:
    def route(self, **overrides: Any) -> str:
        facts = {"has_parser": True, "local_parser": True, "header_session": None, "stream_id": "s", "remote_reachable": True}
        return choose_derender(**{**facts, **overrides})

    def test_without_a_parser_chat_derender_is_plain_whatever_else_holds(self) -> None:
        assert self.route(has_parser=False) == "plain"
        assert self.route(has_parser=False, local_parser=False, remote_reachable=False) == "plain"

    def test_what_the_front_door_keeps_here_is_parsed_here(self) -> None:
        assert self.route(header_session="abc") == "local"
        assert self.route(stream_id=None) == "local"  # a whole request (or a body with no readable stream id)

    def test_a_stream_chunk_goes_to_parser_derender_keyed_on_its_stream(self) -> None:
        assert self.route() == "remote"
        assert self.route(local_parser=False, header_session="abc") == "remote"
        assert self.route(local_parser=False, stream_id=None) == "remote"

    def test_with_no_parser_derender_replica_to_take_a_chunk_it_is_parsed_here(self) -> None:
        assert self.route(remote_reachable=False) == "fallback"

    def test_without_local_parsers_an_unreachable_parser_derender_stays_remote(self) -> None:
        # The route then answers the 503 with Retry-After, as before.
        assert self.route(local_parser=False, remote_reachable=False) == "remote"


class _Controller:
    def __init__(self, deployments: dict[str, DeploymentHealth]) -> None:
        self.deployments = deployments

    def __call__(self, app_name: str) -> dict[str, DeploymentHealth]:
        return self.deployments


def test_unreachable_is_a_deployment_with_no_running_replica_never_a_colocated_stage() -> None:
    controller = _Controller({"ParserDerender": DeploymentHealth("UNHEALTHY", 0), "Render": DeploymentHealth("HEALTHY", 1)})

    async def run() -> None:
        health = StageHealth("app", controller, ttl_s=60)
        await health.refresh()
        assert unreachable(health, SimpleNamespace(deployment_name="ParserDerender"))
        assert not unreachable(health, SimpleNamespace(deployment_name="Render"))
        assert not unreachable(health, InProcess(object()))

    asyncio.run(run())


class Handle(SimpleNamespace):
    """A stand-in deployment handle: what build_stages and build_composed read of one."""

    def options(self, **_: Any) -> Handle:
        return self


def _handles() -> dict[str, Any]:
    return {name: Handle(deployment_name=name) for name in ("Render", "PlainDerender", "ParserDerender", "Engine")}


def test_no_colocation_no_engine_every_stage_is_its_handle() -> None:
    args = AppArgs(model="qwen3-tiny", **PARSERS)
    h = _handles()
    stages = asyncio.run(build_stages(args, args.resolve(), h["Render"], h["PlainDerender"], h["ParserDerender"], None))
    assert stages.render is h["Render"] and stages.plain_derender is h["PlainDerender"]
    assert stages.chat_derender is h["ParserDerender"] and stages.parser_derender is h["ParserDerender"]
    assert stages.local_parser is None and stages.composed is None and stages.engine is None


@pytest.mark.parametrize("colocate", [[], ["plain_derender"]])
def test_without_a_parser_chat_derender_is_plain_and_the_composed_path_reuses_a_colocated_one(colocate: list[str]) -> None:
    args = AppArgs(model="qwen3-tiny", colocate_in_ingress=colocate)
    h = _handles()
    stages = asyncio.run(build_stages(args, args.resolve(), h["Render"], h["PlainDerender"], None, h["Engine"]))
    assert stages.parser_derender is None and stages.local_parser is None
    assert stages.chat_derender is stages.plain_derender
    composed = stages.composed
    assert isinstance(composed, ComposedService) and isinstance(composed.completion_derender, PlainDerenderService)
    assert composed.chat_derender is composed.completion_derender  # no parser: chat derender is plain too
    if colocate:  # one plain derender service in this process, shared by HTTP and the composed path
        assert isinstance(stages.plain_derender, InProcess) and stages.plain_derender.service is composed.completion_derender
    else:
        assert stages.plain_derender is h["PlainDerender"]
