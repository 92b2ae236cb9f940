"""``serve_app.render``, in-process over vLLM's own render stack (qwen3-tiny, no Ray): a chat message
whose role the template does not know is a 400 on every route that renders chat messages (issue 12;
vLLM 0.32 drops it from the prompt without a word), while known roles render exactly as vLLM does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app.compose import ComposedService, Stages
from serve_app.config import AppArgs
from serve_app.derender.plain import build_plain_service
from serve_app.errors import ApiError, envelope
from serve_app.render import OPENAI_ROLES, RenderService, check_roles, template_roles


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def args() -> AppArgs:
    return AppArgs(model="qwen3-tiny")


@pytest.fixture(scope="module")
def render(loop, args) -> RenderService:
    return loop.run_until_complete(RenderService.create(args, args.resolve()))


def _messages(role: str) -> list[dict]:
    return [{"role": "user", "content": "hi"}, {"role": role, "content": "XYZ", "name": "f"}]


BODIES = {  # every route that renders chat messages
    "chat": lambda role: {"messages": _messages(role)},
    "tokenize": lambda role: {"messages": _messages(role)},
    "messages": lambda role: {"model": "qwen3-tiny", "max_tokens": 5, "messages": [{"role": role, "content": "XYZ"}]},
    "responses": lambda role: {"input": [{"role": role, "content": "XYZ"}]},
}


def _error(loop, call) -> dict:
    with pytest.raises(ApiError) as got:
        loop.run_until_complete(call)
    status, body = envelope(got.value)
    assert status == 400 == body["error"]["code"], body
    return body["error"]


@pytest.mark.parametrize("method", sorted(BODIES))
def test_an_unknown_role_is_a_400_on_every_route_that_renders_messages(render, loop, method):
    error = _error(loop, getattr(render, method)(json.dumps(BODIES[method]("foo")).encode()))
    if method in ("chat", "tokenize"):  # vLLM takes any role here; the others type theirs (schema 400s)
        assert error == {
            "message": "Unsupported message role 'foo' in messages[1]. Expected one of: "
            "assistant, developer, function, system, tool, user.",
            "type": "BadRequestError",
            "param": "messages",
            "code": 400,
        }


@pytest.mark.parametrize("role", sorted(OPENAI_ROLES))
def test_known_roles_render_exactly_as_vllm(render, loop, role):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    body = {"messages": _messages(role)}
    state = render.state
    theirs = loop.run_until_complete(
        state.serving_render.render_chat_request(ChatCompletionRequest.model_validate(body), SimpleNamespace(headers={}))
    )
    ours = json.loads(loop.run_until_complete(render.chat(json.dumps(body).encode())))
    assert ours["token_ids"] == theirs.token_ids
    their_tokens = loop.run_until_complete(
        state.serving_tokenization.create_tokenize(TokenizeChatRequest.model_validate(body), SimpleNamespace(headers={}))
    )
    assert json.loads(loop.run_until_complete(render.tokenize(json.dumps(body).encode()))) == their_tokens.model_dump()


def test_the_composed_chat_refuses_it_before_the_engine(render, loop, args):
    async def no_engine(*_):
        raise AssertionError("the engine must not be reached")

    plain = build_plain_service(args, args.resolve())
    stages = Stages(render.chat, render.completion, no_engine, no_engine)  # type: ignore[arg-type]
    composed = ComposedService(stages, plain, plain, eos_token_id=None)
    for stream in (False, True):
        error = _error(loop, composed.chat({"messages": _messages("foo"), "stream": stream}))
        assert error["message"].startswith("Unsupported message role 'foo' in messages[1].")


class TestTemplateRoles:
    def test_a_builtin_template_names_only_openai_roles(self, model_dirs: dict[str, Path]):
        for name in ("qwen3-tiny", "deepseek-v4", "mistral-sp"):
            template = json.loads((model_dirs[name] / "tokenizer_config.json").read_text())["chat_template"]
            assert template_roles([template]) == OPENAI_ROLES

    def test_roles_a_template_dispatches_on_are_known(self):
        llama3 = """{%- if messages[0]['role'] == 'system' %}{%- elif message.role == "tool" or message.role == "ipython" %}
        {%- if message['role'] not in ['observation', "user"] %}{{ '<|start_header_id|>' + message['role'] }}"""
        roles = template_roles([llama3])
        assert roles == OPENAI_ROLES | {"ipython", "observation"}
        check_roles([{"role": "ipython", "content": "42"}], roles)
        with pytest.raises(ApiError, match="Unsupported message role 'foo' in messages\\[0\\]"):
            check_roles([{"role": "foo", "content": "42"}], roles)

    def test_a_hostile_template_is_scanned_in_one_pass(self):
        # Unclosed lists and strings after every "role ==": each is read a bounded way, not to the end.
        assert template_roles(["role == [" * 20000, "role == 'x" * 20000]) >= OPENAI_ROLES


def test_small_bodies_apply_the_template_on_the_event_loop_others_in_vllms_pool(loop, monkeypatch):
    """A chat render whose body is at most ``INLINE_TEMPLATE_BYTES`` runs Jinja on the event loop
    (no hop to vLLM's renderer pool); a bigger body, more than ``INLINE_TEMPLATE_MESSAGES`` messages,
    or a template the request brings, still runs in the pool. The same holds for a handle caller's
    dict, judged by its size in JSON. Where it ran changes nothing in the answer."""
    import threading

    from serve_app.render import INLINE_TEMPLATE_BYTES, INLINE_TEMPLATE_MESSAGES

    args = AppArgs(model="qwen3-tiny", trust_request_chat_template=True)
    service = loop.run_until_complete(RenderService.create(args, args.resolve()))
    tokenizer = service.state.online_renderer.renderer.get_tokenizer()
    threads: list[str] = []
    apply = tokenizer.apply_chat_template

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return apply(*a, **kw)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    small = {"messages": [{"role": "user", "content": "hi"}]}
    big = {**small, "user": "x" * INLINE_TEMPLATE_BYTES}  # a field the prompt leaves out: same prompt
    own = {**small, "chat_template": tokenizer.chat_template}
    many = {"messages": [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(INLINE_TEMPLATE_MESSAGES + 1)]}
    answers = {}
    for as_dict in (False, True):
        for name, body in (("small", small), ("big", big), ("own", own), ("many", many)):
            threads.clear()
            sent = body if as_dict else json.dumps(body).encode()
            answers[name, as_dict] = json.loads(loop.run_until_complete(service.chat(sent)))
            assert len(threads) == 1, threads
            on_loop = threads[0] == threading.current_thread().name
            assert on_loop is (name == "small"), (name, as_dict, threads)
    ids = {key: answer["token_ids"] for key, answer in answers.items()}
    assert ids["small", False] == ids["big", False] == ids["own", False] == ids["small", True] == ids["big", True]
    assert ids["many", True] == ids["many", False] and len(ids["many", True]) > INLINE_TEMPLATE_MESSAGES


def test_a_rendered_request_is_written_as_its_whole_model_dump(render, loop, monkeypatch):
    """The answer leaves the token ids out of ``model_dump`` and writes the validated list in its place:
    the bytes are those of the whole dump as vLLM's route writes it (``json.dumps``)."""
    from serve_app import render as render_module
    from serve_app.wire import dump_json

    rendered = []
    answer_json = render_module._generate_request_json
    monkeypatch.setattr(render_module, "_generate_request_json", lambda g: rendered.append(g) or answer_json(g))
    body = {"messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 16, "seed": 3}
    answer = loop.run_until_complete(render.chat(json.dumps(body).encode(), "r1"))
    (request,) = rendered
    assert answer == answer_json(request) and len(request.token_ids) >= 64  # the list orjson writes
    whole = render_module._always_emit_max_tokens(request, request.model_dump())
    assert answer == dump_json(whole)


def test_a_model_keeping_its_ids_dumps_as_model_dump_extra_fields_last():
    """``_dump_keeping`` (render answers, ``/tokenize``): the same keys, order and values as ``model_dump``,
    extra fields (vLLM's OpenAI models allow them) after the declared ones, the id list itself kept."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse

    from serve_app.render import _dump_keeping
    from serve_app.wire import dump_json

    tokens = list(range(100))
    for extra in ({}, {"z_extra": [1, 2], "a_extra": "x"}):
        response = TokenizeResponse(count=100, max_model_len=4096, tokens=tokens, token_strs=["a"], **extra)
        dumped = _dump_keeping(response, "tokens")
        assert list(dumped) == list(response.model_dump()) and list(dumped)[len(dumped) - len(extra):] == list(extra)
        assert dump_json(dumped) == dump_json(response.model_dump())
        assert dumped["tokens"] is response.tokens
