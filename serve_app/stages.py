"""Where each stage runs for one Ingress replica: decided here, once, from the configuration.

A stage named in ``colocate_in_ingress`` runs in the Ingress's process, wrapped in :class:`InProcess`
(the same ``.method.remote()`` surface as its deployment handle); the others are reached by handle.
:func:`build_stages` builds them all, and the composed path over them
(:func:`serve_app.compose.build_composed`), once per replica; :func:`choose_derender` picks, per chat
derender request, which of them answers, and :func:`parse_chat` asks it (falling back to this
replica's parsers when ParserDerender cannot answer). The Ingress only routes.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from serve_app.compose import ComposedService, Observe, build_composed
from serve_app.errors import ServiceUnavailableError
from serve_app.health import StageHealth, replica_gone, routable, routable_replicas
from serve_app.timeouts import within
from serve_app.wire import stream_id

if TYPE_CHECKING:
    from serve_app.config import AppArgs, ResolvedModel
    from serve_app.derender.parser_service import ParserDerenderService

__all__ = [
    "ChatDerenderTarget",
    "InProcess",
    "IngressStages",
    "ParsedChat",
    "build_stages",
    "choose_derender",
    "fail_fast",
    "parse_chat",
    "unreachable",
]

ChatDerenderTarget = Literal["plain", "local", "remote", "fallback"]
"""Who derenders a ``/v1/chat/completions/derender`` request: plain derender (no parser configured),
this replica's own parsers (``local``), the ParserDerender deployment by handle (``remote``), or this
replica's parsers because no ParserDerender replica can take a stream chunk (``fallback``)."""


def choose_derender(
    *,
    has_parser: bool,
    local_parser: bool,
    header_session: str | None,
    stream_id: str | None,
    remote_reachable: bool,
    front_door_hashes: bool = False,
) -> ChatDerenderTarget:
    """Where one chat derender request goes.

    Args:
        has_parser: the server has a tool or reasoning parser configured (as vLLM, chat derender
            parses exactly then).
        local_parser: this replica holds the parsers (``parser_derender`` colocated).
        header_session: the request's ``x-session-id``.
        stream_id: the stream chunk's request id (:func:`serve_app.wire.stream_id`); ``None`` for a
            whole request.
        remote_reachable: ParserDerender has a replica a call can reach (:func:`unreachable`).
        front_door_hashes: the front door keeps every chunk of a stream on one Ingress replica by its
            stream id (``make run``'s HAProxy: :func:`serve_app.front_door.hashes_stream_id`).

    Returns:
        ``plain`` without a parser; ``local`` for what the front door keeps on this replica (a whole
        request, a stream sent with ``x-session-id``, any stream when the front door hashes its id);
        ``remote`` for other stream chunks, keyed on
        the stream id so a stream meets its live parser; ``fallback`` for those when no
        ParserDerender replica can take them and this replica holds the parsers: the carried state
        is replayed here instead of waiting for a replacement replica to import vLLM.
    """
    if not has_parser:
        return "plain"
    if local_parser and (header_session or stream_id is None or front_door_hashes):
        return "local"
    if local_parser and not remote_reachable:
        return "fallback"
    return "remote"


def unreachable(health: StageHealth, stage: Any) -> bool:
    """Whether a stage deployment has no replica a call can reach now: none RUNNING, as the
    controller last said, or none left to this process's router (a colocated stage always runs)."""
    name = getattr(stage, "deployment_name", None)
    if name is None:
        return False
    health.refresh_soon()
    return health.down(name) or routable_replicas(stage) == 0


def fail_fast(health: StageHealth, stage: Any) -> None:
    """A 503 now for a stage deployment with no replica to reach (see :func:`unreachable`)."""
    if unreachable(health, stage):
        raise ServiceUnavailableError(f"{stage.deployment_name} has no running replica; retry later.")


class InProcess:
    """A colocated stage: ``obj.method.remote(*args)`` awaits ``service.method(*args)`` in this process,
    the same surface as its deployment handle, so callers do not care which they hold."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def __getattr__(self, name: str) -> Any:
        # A sync method's async twin (``chat_async``), where the service has one, decides itself
        # what leaves the event loop (plain derender: a big request decodes in a worker thread).
        method = getattr(self.service, f"{name}_async", None) or getattr(self.service, name)
        remote = method if inspect.iscoroutinefunction(method) else _as_coroutine(method)
        return SimpleNamespace(remote=remote)


def _as_coroutine(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any) -> Any:
        return fn(*args)

    return call


@dataclass(frozen=True, slots=True)
class IngressStages:
    """One Ingress replica's stages: deployment handles, or :class:`InProcess` when colocated."""

    render: Any
    plain_derender: Any
    chat_derender: Any
    """Plain derender, or the ParserDerender handle when a parser is configured."""
    parser_derender: Any | None
    """The ParserDerender handle (its cache stats reach /metrics); ``None`` without a parser."""
    local_parser: ParserDerenderService | None
    """The parsers in this process (``parser_derender`` colocated); the composed path's when there is one."""
    engine: Any | None
    composed: ComposedService | None
    """The composed OpenAI API (``/v1/chat/completions``, ``/v1/completions``); ``None`` without an engine."""


def with_cluster_transport(handle: Any | None) -> Any | None:
    """``handle`` over the transport this cluster's Serve settings pick, read here in the replica:
    Serve's gRPC under make run's ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (less CPU per streamed token,
    bench/results/composed.md), else Ray actor calls. A handle's default is fixed in the process that
    built the app, which for a driver's ``serve.run`` (a bench, a user's script) is not the cluster's.
    gRPC's 4 MiB cap on a message is lifted by make run's ``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=-1``
    (the Makefile's SERVE_ENV), cluster-wide, as the flag that picks gRPC."""
    if handle is None or getattr(handle, "deployment_name", None) is None:
        return handle
    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT  # no public accessor in Ray 2.60

    return handle.options(_by_reference=not RAY_SERVE_USE_GRPC_BY_DEFAULT)


async def build_stages(
    args: AppArgs,
    model: ResolvedModel,
    render: Any,
    plain_derender: Any,
    parser_derender: Any | None,
    engine: Any | None,
    health: StageHealth | None = None,
    observe: Observe | None = None,
) -> IngressStages:
    """The stages of one Ingress replica from its deployment handles: each colocated one built in
    this process (vLLM's render state, ~0.6 GiB, shared with the parsers), and the composed path,
    whose derender always runs here (one Serve hop per token). ``health``: the replica's view of the
    deployments, for the composed path's fast 503 when no engine replica can be reached; ``observe``:
    where the composed path reports its stage times (the Ingress's metrics)."""
    colocated = set(args.colocate_in_ingress)
    # The handles this replica calls; a colocated stage's handle is left as it is, unused here.
    if "render" not in colocated:
        render = with_cluster_transport(render)
    if "plain_derender" not in colocated:
        plain_derender = with_cluster_transport(plain_derender)
    parser_derender, engine = with_cluster_transport(parser_derender), with_cluster_transport(engine)
    render_state = None
    if "render" in colocated:
        from serve_app.render import RenderService

        service = await RenderService.create(args, model)
        render, render_state = InProcess(service), service.state
    plain = None
    if "plain_derender" in colocated or engine is not None:
        from serve_app.derender.plain import build_plain_service

        plain = build_plain_service(args, model)
    if "plain_derender" in colocated:
        plain_derender = InProcess(plain)
    parsers = None
    if args.has_parser and ("parser_derender" in colocated or engine is not None):
        from serve_app.derender.parser import build_parser_service

        parsers = await build_parser_service(args, model, render_state)
    composed = None
    if engine is not None:
        assert plain is not None
        engine_down = None if health is None else lambda: unreachable(health, engine)
        composed = build_composed(args, model, render, engine, parsers or plain, plain, engine_down, observe)
    return IngressStages(
        render=render,
        plain_derender=plain_derender,
        chat_derender=parser_derender if args.has_parser else plain_derender,
        parser_derender=parser_derender if args.has_parser else None,
        local_parser=parsers if "parser_derender" in colocated else None,
        engine=engine,
        composed=composed,
    )


@dataclass(frozen=True, slots=True)
class ParsedChat:
    """A chat derender answer through the parsers, and what the Ingress counts of it."""

    body: bytes
    """The response JSON bytes."""
    outcome: str
    """The session cache's outcome (:data:`serve_app.derender.parser_service.SessionOutcome`)."""
    fallback: str | None
    """Why a stream chunk meant for ParserDerender was parsed here instead
    (:data:`serve_app.metrics.PARSER_FALLBACK_REASONS`); ``None`` if it was not."""


async def parse_chat(
    stages: IngressStages,
    health: StageHealth,
    body: bytes,
    header_session: str | None,
    *,
    front_door_hashes: bool,
    timeout_s: float | None,
) -> ParsedChat:
    """One chat derender request with a parser configured, answered where :func:`choose_derender`
    says: this replica's parsers or ParserDerender by handle (within ``timeout_s``), and here after
    all if ParserDerender's replica died under the call or none is left to route to.

    Raises the stage's error (a 400 as vLLM's), or 503/504 when ParserDerender cannot answer and
    this replica holds no parsers."""
    session_id = header_session or stream_id(body)
    remote = stages.chat_derender
    target = choose_derender(
        has_parser=True,
        local_parser=stages.local_parser is not None,
        header_session=header_session,
        stream_id=session_id,
        front_door_hashes=front_door_hashes,
        remote_reachable=stages.local_parser is None or not unreachable(health, remote),
    )
    if target != "remote":
        # Local: a stream's chunks reach this replica again only if the front door hashes
        # x-session-id or the body's stream id (config.py, colocate_in_ingress); if not, they are
        # still right (a miss replays the carried state), only slower, and /metrics counts the misses.
        return await _parse_here(stages, body, "unroutable" if target == "fallback" else None)
    # A stream's chunks go to the replica holding its live parser: Serve's consistent-hash router
    # keys on session_id, which the proxy only sets on the first hop, so it is re-applied here.
    fail_fast(health, remote)
    handle = remote.options(session_id=session_id) if session_id else remote
    try:
        call = handle.chat_traced.remote(body)
        out, outcome, _ = await within(call, timeout_s, "ParserDerender", routable(handle))
    except Exception as exc:
        # No replica left to wait for, or the one holding the chunk died under it: parsed here at
        # once (the carried state replayed, as on any replica) rather than after a replacement has
        # imported vLLM. Without parsers in this process it stays the 503 with Retry-After.
        reason = "replica_died" if replica_gone(exc) else "unroutable" if isinstance(exc, ServiceUnavailableError) else None
        if stages.local_parser is None or reason is None:
            raise
        return await _parse_here(stages, body, reason)
    return ParsedChat(out, outcome, None)


async def _parse_here(stages: IngressStages, body: bytes, fallback: str | None) -> ParsedChat:
    assert stages.local_parser is not None
    out, outcome = await stages.local_parser.chat_with_outcome_async(body)
    return ParsedChat(out, outcome, fallback)
