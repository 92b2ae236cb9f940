"""``serve_app.stages``: where each stage of an Ingress replica runs, decided once, and where a chat
derender request goes. The stage services are real (qwen3-tiny's plain derender and parsers); the
deployment handles are stand-ins raising Ray's own exception classes, as Ray is not running here
(tests/integration/test_colocation.py and test_parser_fallback.py run them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from serve_app.compose import ComposedService
from serve_app.config import AppArgs
from serve_app.derender.plain_service import PlainDerenderService
from serve_app.errors import BadRequestError, ServiceUnavailableError
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


class ParserReplicas(Handle):
    """A stand-in ParserDerender handle: records the routing session of each call, then answers
    ``answer`` or raises ``error`` (Ray's own exception class for a dead replica)."""

    def __init__(self, answer: tuple[bytes, str, str] | None = None, error: Exception | None = None) -> None:
        super().__init__(deployment_name="ParserDerender")
        self.answer, self.error, self.sessions = answer, error, []
        self.session: str | None = None
        self.chat_traced = SimpleNamespace(remote=self._call)

    def options(self, **kw: Any) -> ParserReplicas:
        self.session = kw.get("session_id")
        return self

    async def _call(self, body: bytes) -> tuple[bytes, str, str]:
        self.sessions.append(self.session)
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


def _chunk_body(rid: str) -> bytes:
    import json

    return json.dumps(
        {
            "stream": True,
            "generate_chunk": {"request_id": rid, "choices": [{"index": 0, "token_ids": [9707], "finish_reason": None}]},
            "chat_request": {"messages": [{"role": "user", "content": "x"}]},
            "prompt_token_ids": [1, 2],
        }
    ).encode()


@pytest.fixture(scope="module")
def parser_stages() -> Any:
    """An Ingress replica's stages with its own parsers (real: qwen3-tiny, hermes + qwen3)."""
    args = AppArgs(model="qwen3-tiny", colocate_in_ingress=["parser_derender"], **PARSERS)
    h = _handles()
    return asyncio.run(build_stages(args, args.resolve(), h["Render"], h["PlainDerender"], h["ParserDerender"], None))


def _parse(stages: Any, remote: ParserReplicas, body: bytes, header: str | None = None, hashes: bool = False, local: bool = True) -> Any:
    from dataclasses import replace

    from serve_app.stages import parse_chat

    async def run() -> Any:
        health = StageHealth("app", _Controller({"ParserDerender": DeploymentHealth("HEALTHY", 1)}), ttl_s=60)
        await health.refresh()
        with_remote = replace(stages, chat_derender=remote, parser_derender=remote, local_parser=stages.local_parser if local else None)
        return await parse_chat(with_remote, health, body, header, front_door_hashes=hashes, timeout_s=5)

    return asyncio.run(run())


def _answer(body: bytes) -> dict[str, Any]:
    import json

    out = json.loads(body)
    out["chunk"]["created"] = None
    return out


def test_parse_chat_sends_a_stream_chunk_to_parser_derender_keyed_on_its_stream(parser_stages: Any) -> None:
    remote = ParserReplicas(answer=(b"{}", "hit", "replica-1"))
    parsed = _parse(parser_stages, remote, _chunk_body("s-1"))
    assert (parsed.body, parsed.outcome, parsed.fallback) == (b"{}", "hit", None) and remote.sessions == ["s-1"]


def test_parse_chat_parses_here_what_the_front_door_keeps_here(parser_stages: Any) -> None:
    remote = ParserReplicas(answer=(b"{}", "hit", "replica-1"))
    with_header = _parse(parser_stages, remote, _chunk_body("s-1"), header="s-1")
    hashed = _parse(parser_stages, remote, _chunk_body("s-1"), hashes=True)
    assert remote.sessions == []
    for parsed in (with_header, hashed):
        assert parsed.outcome == "new" and parsed.fallback is None and b'"stream_state"' in parsed.body


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ActorDiedError(), "replica_died"),
        (ActorUnavailableError("gone", None), "replica_died"),
        (ServiceUnavailableError("x"), "unroutable"),
    ],
)
def test_parse_chat_parses_here_when_parser_derender_cannot_answer(parser_stages: Any, error: Exception, reason: str) -> None:
    here = _parse(parser_stages, ParserReplicas(answer=(b"{}", "hit", "r")), _chunk_body("s-1"), header="s-1")
    remote = ParserReplicas(error=error)
    parsed = _parse(parser_stages, remote, _chunk_body("s-1"))
    assert remote.sessions == ["s-1"]  # it was asked first
    assert (parsed.outcome, parsed.fallback) == ("new", reason) and _answer(parsed.body) == _answer(here.body)


def test_parse_chat_passes_on_any_other_error_of_parser_derender(parser_stages: Any) -> None:
    with pytest.raises(BadRequestError):
        _parse(parser_stages, ParserReplicas(error=BadRequestError("bad chunk")), _chunk_body("s-1"))


@pytest.mark.parametrize("error", [ActorDiedError(), ServiceUnavailableError("x")])
def test_without_parsers_here_parse_chat_passes_on_what_parser_derender_raised(parser_stages: Any, error: Exception) -> None:
    remote = ParserReplicas(error=error)
    with pytest.raises(type(error)):
        _parse(parser_stages, remote, _chunk_body("s-1"), header="s-1", local=False)
    assert remote.sessions == ["s-1"]
