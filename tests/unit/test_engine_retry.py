"""``serve_app.compose``: a composed request whose Engine replica died before answering (before the
first chunk, for a stream) goes to another replica at once; once it has streamed, the death is the
in-band error. Stand-in stages with Ray's real exception classes; the real thing, two CPU engines
and a SIGKILL, is tests/integration/test_engine_failover.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from serve_app.compose import ENGINE_ATTEMPTS, ComposedService, Stages
from serve_app.config import AppArgs
from serve_app.derender.plain import build_plain_service
from serve_app.errors import ServiceUnavailableError, envelope
from serve_app.health import replica_gone

HELLO = [9707, 0, 1879]  # "Hello" "!" " world"
EOS = 151645
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def plain():
    args = AppArgs(model="qwen3-tiny")
    return build_plain_service(args, args.resolve())


class Replicas:
    """Engine replicas as a router sees them: each call goes to the next live one; a dead one raises
    what Ray raises for it (``died_with``), and ``cut_after`` chunks into a stream for ``cut``."""

    def __init__(self, dead: int, died_with: type[Exception] = ActorDiedError, cut: bool = False) -> None:
        self.dead, self.died_with, self.cut = dead, died_with, cut
        self.calls: list[int] = []  # which replica each call reached (0 .. dead-1 are dead)

    def _route(self) -> int:
        replica = len(self.calls)
        self.calls.append(replica)
        return replica

    def _error(self) -> Exception:
        return self.died_with() if self.died_with is ActorDiedError else self.died_with("gone", None)  # type: ignore[call-arg]

    async def generate(self, gen: dict[str, Any]) -> bytes:
        if self._route() < self.dead:
            raise self._error()
        return json.dumps({"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO, "finish_reason": "length"}]}).encode()

    async def stream(self, gen: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        dead = self._route() < self.dead
        if dead and not self.cut:
            raise self._error()
        yield {"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO[:1], "finish_reason": None}]}
        if dead:
            raise self._error()
        yield {"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO[1:], "finish_reason": "length"}]}


def _service(plain, engine: Replicas, prompts: int = 1, routable: bool = True) -> ComposedService:
    def gen(i: int) -> dict[str, Any]:
        return {"request_id": f"r-{i}" if prompts > 1 else "r", "token_ids": [1], "sampling_params": {"stop_token_ids": None}}

    async def render_chat(body: dict, rid: str | None) -> bytes:
        return json.dumps(gen(0)).encode()

    async def render_completion(body: dict, rid: str | None) -> bytes:
        return json.dumps([gen(i) for i in range(prompts)]).encode()

    stages = Stages(render_chat, render_completion, engine.generate, engine.stream, engine_routable=lambda: routable)
    return ComposedService(stages, plain, plain, EOS)


async def _collect(call: Any) -> list[dict[str, Any]]:
    return [c async for c in await call]


def test_ray_actor_errors_mean_the_replica_is_gone():
    assert replica_gone(ActorDiedError()) and replica_gone(ActorUnavailableError("gone", None))
    assert not replica_gone(RuntimeError("engine failed")) and not replica_gone(ServiceUnavailableError("x"))


@pytest.mark.parametrize("died_with", [ActorDiedError, ActorUnavailableError])
def test_a_request_whose_replica_died_goes_to_another(plain, died_with):
    engine = Replicas(dead=1, died_with=died_with)
    out = json.loads(asyncio.run(_service(plain, engine).chat(CHAT)))
    assert out["choices"][0]["message"]["content"] == "Hello! world" and engine.calls == [0, 1]


def test_a_stream_whose_replica_died_before_its_first_chunk_goes_to_another(plain):
    engine = Replicas(dead=1)
    chunks = asyncio.run(_collect(_service(plain, engine).chat({**CHAT, "stream": True})))
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hello! world" and engine.calls == [0, 1]
    engine = Replicas(dead=1)
    chunks = asyncio.run(_collect(_service(plain, engine, prompts=2).completion({"prompt": ["a", "b"], "stream": True})))
    assert not [c for c in chunks if "error" in c] and engine.calls == [0, 1, 2, 3]  # both prompts opened again


def test_every_prompt_of_a_completion_is_retried_on_its_own(plain):
    engine = Replicas(dead=1)
    out = json.loads(asyncio.run(_service(plain, engine, prompts=2).completion({"prompt": ["a", "b"]})))
    assert [c["text"] for c in out["choices"]] == ["Hello! world"] * 2 and sorted(engine.calls) == [0, 1, 2]


def test_a_stream_cut_after_its_first_chunk_ends_with_the_in_band_error(plain):
    engine = Replicas(dead=1, cut=True)
    chunks = asyncio.run(_collect(_service(plain, engine).chat({**CHAT, "stream": True})))
    assert chunks[0]["choices"][0]["delta"]["content"] == "Hello" and chunks[-1]["error"]["code"] == 503
    assert engine.calls == [0]  # the client retries it (the README's failure modes), not the server


def test_attempts_are_bounded_and_no_replica_left_is_a_503(plain):
    engine = Replicas(dead=ENGINE_ATTEMPTS + 5)
    with pytest.raises(ActorDiedError) as info:
        asyncio.run(_service(plain, engine).chat(CHAT))
    assert len(engine.calls) == ENGINE_ATTEMPTS and envelope(info.value)[0] == 503
    # The router has nothing left to send to: 503 (with Retry-After at the edge) while the call waits.
    stuck = Stages(None, None, lambda gen: asyncio.sleep(3600), None, engine_routable=lambda: False)  # type: ignore[arg-type]
    service = ComposedService(stuck, plain, plain, EOS)
    with pytest.raises(ServiceUnavailableError, match="Engine has no running replica"):
        asyncio.run(service._generate({"request_id": "r"}))
