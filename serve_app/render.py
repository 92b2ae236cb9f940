"""``Render``: OpenAI / Anthropic requests -> ``GenerateRequest`` (prompt token ids + sampling params).

The work is vLLM's own: :func:`serve_app._vllm.build_render_state` builds the objects
``vllm launch render`` serves with, so token ids and sampling params match it for the same model,
flags and request. What this module adds is the shell: body parsing and validation with vLLM's
400s, errors raised as typed :class:`~serve_app.errors.ApiError`, JSON bytes out (one copy back
through Ray), the fix for vLLM 0.32 dropping ``max_tokens`` when it equals 16, and a 400 for a chat
message whose role the template would silently leave out of the prompt (:func:`check_roles`).

Template application and tokenization, the CPU-heavy part of a big prompt, run in vLLM's renderer
thread pool (``make_async`` in ``vllm/renderers``), off this replica's event loop, except the template
of a light request (a small body, few messages, the server's own template: ~0.4 ms of Jinja), which
is applied here and spares the hop to the pool and back (:func:`_template_is_light`). Tokenization
goes through an exact cache of prompt pieces (:mod:`serve_app.render_cache`, ``render_cache_bytes``)
where the tokenizer allows it: an agent's next turn repeats the previous one's text, and only the new
text is tokenized (``prompt_cache_status`` says whether it is on, and why not). The pieces are also
shared by the render processes of one machine (``render_cache_node_bytes``), so a turn that reaches
another Ingress replica than the conversation's last one still finds the earlier text tokenized.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Any

import orjson
from ray import serve

from serve_app._vllm import RawRequest, RenderState, call_vllm, install_prompt_cache, template_inline
from serve_app.config import AppArgs, ResolvedModel
from serve_app.errors import BadRequestError
from serve_app.heap import freeze_startup_heap
from serve_app.render_cache import DEFAULT_MAX_BYTES
from serve_app.wire import dump_json, dump_json_ids, load_body, validate_model

__all__ = ["OPENAI_ROLES", "Render", "RenderService", "check_roles", "template_roles"]

OPENAI_ROLES = frozenset({"assistant", "developer", "function", "system", "tool", "user"})
"""The OpenAI API's message roles (vLLM's typed messages). vLLM passes any other role on to the template."""

# A template picks a message's branch by comparing its role with literals (`message.role == "tool"`,
# `message['role'] in ['user', 'system']`): a role it never names falls through every branch and
# vanishes from the prompt. Literals are read up to a length, so one scan stays linear.
_ROLE_TEST = re.compile(r"""role["'\]]*\s*(?:==|!=|(?:not\s+)?in)\s*(\[[^\]]{0,500}\]|\([^)]{0,500}\)|"[^"]{0,100}"|'[^']{0,100}')""")
_QUOTED = re.compile(r"""["']([^"']+)["']""")


def template_roles(templates: list[str]) -> frozenset[str]:
    """The roles a chat may use with these templates: OpenAI's, and every role they name (Llama 3's
    ``ipython``, GLM's ``observation``, ...)."""
    return OPENAI_ROLES.union(name for t in templates for test in _ROLE_TEST.findall(t) for name in _QUOTED.findall(test))


def check_roles(messages: Any, roles: frozenset[str]) -> None:
    """Raise vLLM's 400 for the first message whose role is not in ``roles``.

    vLLM 0.32 accepts any role (``CustomChatCompletionMessageParam``) and a template that does not
    know it drops the message without a word; here that is a clear 400 instead.
    """
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in roles:
            raise BadRequestError(
                f"Unsupported message role {role!r} in messages[{i}]. Expected one of: {', '.join(sorted(roles))}.",
                param="messages",
            )


def _always_emit_max_tokens(generate_request: Any, dumped: dict[str, Any]) -> dict[str, Any]:
    # vLLM 0.32 serialises SamplingParams with omit_defaults, so max_tokens == 16 (the completions
    # default) vanishes and /inference/v1/generate then substitutes max_model_len - prompt_len.
    # Always emitting it keeps the requested budget across the render -> generate hop.
    params = dumped.get("sampling_params")
    if isinstance(params, dict) and "max_tokens" not in params:
        params["max_tokens"] = generate_request.sampling_params.max_tokens
    return dumped


def _dump_keeping(model: Any, key: str) -> dict[str, Any]:
    """``model.model_dump()``, but ``model.<key>`` (token ids, most of an answer) is the validated list
    itself: dumping would copy it id by id (~80 us at 6k ids) into an equal one. Same keys in the same
    order as ``model_dump``: the declared fields, then any extra ones."""
    rest = model.model_dump(exclude={key})
    dumped = {}
    for name in type(model).model_fields:
        if name == key:
            dumped[name] = getattr(model, key)
        elif name in rest:
            dumped[name] = rest.pop(name)
    dumped.update(rest)
    return dumped


def _generate_request_json(generate_request: Any) -> bytes:
    """A rendered ``GenerateRequest`` as vLLM's route writes it (:func:`serve_app.wire.dump_json_ids`)."""
    return dump_json_ids(_always_emit_max_tokens(generate_request, _dump_keeping(generate_request, "token_ids")), "token_ids")


INLINE_TEMPLATE_BYTES = 1 << 15
"""A chat render's body up to this size may have its template applied on the event loop (:func:`_template_is_light`)."""
INLINE_TEMPLATE_MESSAGES = 128
"""Jinja costs ~15 us a message (many tiny messages fit in a small body), so more go to the pool."""


def _template_is_light(body: Any, request: Any) -> bool:
    """Whether this request's chat template may run on the event loop (:func:`serve_app._vllm.template_inline`):
    a small body, few messages, and the server's own template. At the limits it is a few ms of Jinja,
    no more than the rest of vLLM's render already does there; typical agent turns take ~0.4 ms."""
    messages = getattr(request, "messages", None)
    if messages is None:
        messages = getattr(request, "input", None)  # Responses API
    return (
        (not isinstance(messages, list) or len(messages) <= INLINE_TEMPLATE_MESSAGES)
        and _own_template(request) is None
        and _json_size(body) <= INLINE_TEMPLATE_BYTES
    )


def _json_size(body: Any) -> float:
    """The body's size in JSON bytes: as sent (HTTP), or written compactly for a handle caller's dict
    (~20 us for 30 kB, where the template it decides on takes ~0.4 ms); infinite if it is not JSON."""
    if isinstance(body, (bytes, bytearray)):
        return len(body)
    try:
        return len(orjson.dumps(body))
    except (TypeError, orjson.JSONEncodeError):
        return math.inf


def _own_template(request: Any) -> Any:
    """The chat template a request brings (``chat_template``, or in ``chat_template_kwargs``), else ``None``."""
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    return getattr(request, "chat_template", None) or kwargs.get("chat_template")


async def _validated(validate: Any, token_ids: list[int]) -> None:
    validate(token_ids, parameter="prompt")


class RenderService:
    """Ray-free render core over vLLM's ``ServingRender`` and ``ServingTokenization``."""

    def __init__(self, state: RenderState, cache_bytes: int = DEFAULT_MAX_BYTES, node_dir: str | None = None,
                 node_bytes: int = 0) -> None:
        from serve_app._vllm import render_request_models

        self.state = state
        # Prompt pieces shared by a conversation's turns are tokenized once (serve_app/render_cache.py),
        # per process and, under node_dir, per machine.
        self.prompt_cache, self.prompt_cache_status = install_prompt_cache(state, cache_bytes, node_dir, node_bytes)
        templates = state.chat_templates()
        self._roles = template_roles(templates) if templates is not None else None  # None: roles not checked here
        models = render_request_models()
        self._error_cls = models["error"]
        self._chat = models["chat"]
        self._completion = models["completion"]
        self._messages = models["messages"]
        self._responses = models["responses"]
        self._tokenize = models["tokenize"]
        self._detokenize = models["detokenize"]

    @classmethod
    async def create(cls, args: AppArgs, model: ResolvedModel) -> RenderService:
        from serve_app._vllm import build_render_state

        node_dir = args.render_cache_dir or os.path.join(tempfile.gettempdir(), "serve_app-render-cache")
        return cls(await build_render_state(args, model), args.render_cache_bytes, node_dir, args.render_cache_node_bytes)

    async def _run(self, validator: Any, handler: Any, body: bytes | dict, raw_request: RawRequest | None) -> Any:
        """Parse, validate and serve one request; every failure leaves as an :class:`ApiError`.

        ``body`` is the raw JSON body (the HTTP path) or an already-parsed dict (handle callers).
        Validation runs inside :func:`call_vllm` too: vLLM's request validators raise its own errors.
        """

        async def serve_one() -> Any:
            data = load_body(body)
            request = validate_model(validator, data)
            self._check_roles(request)
            with template_inline(_template_is_light(body, request)):
                return await (handler(request) if raw_request is None else handler(request, raw_request))

        return await call_vllm(serve_one(), self._error_cls)

    def _check_roles(self, request: Any) -> None:
        """Chat messages only (chat render, chat ``/tokenize``): the other requests type their roles."""
        messages = getattr(request, "messages", None)
        if self._roles is None or not isinstance(messages, list):
            return
        own = _own_template(request)
        if own is None:
            check_roles(messages, self._roles)
        elif self.state.args.trust_request_chat_template:  # an untrusted one: vLLM refuses the request
            check_roles(messages, self._roles | template_roles([own] if isinstance(own, str) else []))

    async def chat(self, body: bytes, request_id: str | None = None) -> bytes:
        out = await self._run(self._chat, self.state.serving_render.render_chat_request, body, RawRequest.with_request_id(request_id))
        return _generate_request_json(out)

    async def completion(self, body: bytes, request_id: str | None = None) -> bytes:
        render = self.state.serving_render.render_completion_request
        out = await self._run(self._completion, render, body, RawRequest.with_request_id(request_id))
        # Token-id prompts pass vLLM's render unchecked; an id past the model's vocabulary would
        # reach the engine (vLLM's own check, with the renderer's tokenizer and model vocab size).
        validate = self.state.online_renderer.renderer.validate_token_ids
        for item in out:
            await call_vllm(_validated(validate, item.token_ids), self._error_cls)
        return b"[" + b",".join(_generate_request_json(item) for item in out) + b"]"  # dump_json of the list

    async def messages(self, body: bytes, request_id: str | None = None) -> bytes:
        render = self.state.serving_render.render_messages_request
        out = await self._run(self._messages, render, body, RawRequest.with_request_id(request_id))
        return _generate_request_json(out)

    async def responses(self, body: bytes, request_id: str | None = None) -> bytes:
        out = await self._run(self._responses, self.state.serving_render.render_responses_request, body, None)
        return _generate_request_json(out)

    async def tokenize(self, body: bytes, request_id: str | None = None) -> bytes:
        tokenization = self.state.serving_tokenization
        out = await self._run(self._tokenize, tokenization.create_tokenize, body, RawRequest.with_request_id(request_id))
        return dump_json_ids(_dump_keeping(out, "tokens"), "tokens")

    async def detokenize(self, body: bytes, request_id: str | None = None) -> bytes:
        tokenization = self.state.serving_tokenization
        out = await self._run(self._detokenize, tokenization.create_detokenize, body, RawRequest.with_request_id(request_id))
        return dump_json(out.model_dump())


@serve.deployment(name="Render")
class Render:
    """Serve shell over :class:`RenderService`.

    Each method takes the request as raw JSON bytes or a dict and returns the response as the JSON
    bytes vLLM would send, so the ingress forwards them without re-encoding. By handle::

        render = serve.get_deployment_handle("Render", app_name="serve_app")
        generate_request = json.loads(await render.chat.remote({"messages": [...]}))
    """

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            "max_ongoing_requests": 32,
            "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 0.5},
            "health_check_period_s": 10,
        }

    async def __init__(self, args: AppArgs, model: ResolvedModel) -> None:  # type: ignore[misc]  # Serve awaits it
        self.service = await RenderService.create(args, model)
        freeze_startup_heap()

    async def chat(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.chat(body, request_id)

    async def completion(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.completion(body, request_id)

    async def messages(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.messages(body, request_id)

    async def responses(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.responses(body, request_id)

    async def tokenize(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.tokenize(body, request_id)

    async def detokenize(self, body: bytes, request_id: str | None = None) -> bytes:
        return await self.service.detokenize(body, request_id)
