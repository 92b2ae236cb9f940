"""The Engine deployment: ``/inference/v1/generate`` and abort against a real ``vllm serve --tokens-only``
on the same model directory; by-handle calls; disconnect aborts; an engine restart leaves the CPU tier up.

Real components only: Ray, the vLLM CPU engine (qwen3-tiny) in our Engine replica, and vLLM's own
server as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def _sse(text: str) -> list:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def _stream_view(events: list) -> dict:
    """A generate stream as its tokens, whatever the chunking.

    vLLM's output collector merges the tokens that are ready when its consumer lags (both servers
    share the host's two cores with the test), so the number of chunks is not part of the contract:
    token ids and logprobs concatenate per choice, each other field keeps its values that are set.
    With continuous usage, each chunk's `completion_tokens` must count the tokens streamed so far.
    """
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    view: dict = {"top": {}, "choices": {}, "usage": []}
    streamed: dict[int, int] = {}
    for chunk in events[:-1]:
        for key, value in chunk.items():
            if key not in ("choices", "usage") and value is not None:
                view["top"].setdefault(key, set()).add(json.dumps(value))
        for choice in chunk["choices"]:
            slot = view["choices"].setdefault(choice["index"], {"token_ids": [], "logprobs": []})
            slot["token_ids"] += choice["token_ids"]
            streamed[choice["index"]] = streamed.get(choice["index"], 0) + len(choice["token_ids"])
            if choice.get("logprobs") is not None:
                slot["logprobs"] += choice["logprobs"]["content"]
            for key, value in choice.items():
                if key not in ("index", "token_ids", "logprobs") and value is not None:
                    slot.setdefault(key, []).append(value)
        if chunk.get("usage") is not None:
            if chunk["choices"]:
                assert chunk["usage"]["completion_tokens"] == sum(streamed.values()), chunk
            view["usage"] = chunk["usage"]
    return view


def _both(engine_app_url: str, ref_url: str, body: dict, rid: str) -> tuple[httpx.Response, httpx.Response]:
    headers = {"X-Request-Id": rid}
    ours = httpx.post(engine_app_url + "/inference/v1/generate", json=body, headers=headers, timeout=120)
    theirs = httpx.post(ref_url + "/inference/v1/generate", json=body, headers=headers, timeout=120)
    return ours, theirs


def _strip_created(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "created"}


class TestGenerateWire:
    """Same request, same `X-Request-Id`: the same bytes as vLLM's, but for `created`."""

    @pytest.mark.parametrize(
        "sampling_params",
        [
            {"temperature": 0, "max_tokens": 12},
            {"temperature": 0, "max_tokens": 6, "logprobs": 3},
            {"temperature": 1.0, "seed": 7, "max_tokens": 5, "n": 2},
            {"temperature": 0, "max_tokens": 40, "extra_args": {"scripted_output": [9707, 1879, 151645]}},
            # No max_tokens: the server-side default applies (the script's EOS ends it early).
            {"temperature": 0, "extra_args": {"scripted_output": [9707, 151645]}},
        ],
    )
    def test_non_streaming_equals_vllm(self, engine_app_url, vllm_tokens_only, sampling_params):
        body = {"token_ids": PROMPT, "sampling_params": sampling_params, "model": "qwen3-tiny"}
        ours, theirs = _both(engine_app_url, vllm_tokens_only.url, body, "wire-1")
        assert ours.status_code == theirs.status_code == 200, ours.text
        assert _strip_created(ours.json()) == _strip_created(theirs.json())

    @pytest.mark.parametrize(
        "extra",
        [
            {},
            {"stream_options": {"include_usage": True}},
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            {"return_token_ids": True},
        ],
    )
    def test_streaming_equals_vllm(self, engine_app_url, vllm_tokens_only, extra):
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 2},
            "stream": True,
            **extra,
        }
        ours, theirs = _both(engine_app_url, vllm_tokens_only.url, body, "wire-2")
        assert ours.status_code == theirs.status_code == 200
        assert ours.headers["content-type"].startswith("text/event-stream")
        assert _stream_view(_sse(ours.text)) == _stream_view(_sse(theirs.text))

    def test_scripted_output_is_forced(self, engine_app_url, vllm_tokens_only):
        script = [151667, 198, 40, 1265, 1618, 13, 198, 151668, 271, 9707, 151645]
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0.8, "max_tokens": 50, "extra_args": {"scripted_output": script}}}
        ours, theirs = _both(engine_app_url, vllm_tokens_only.url, body, "wire-3")
        assert ours.json()["choices"][0]["token_ids"] == script == theirs.json()["choices"][0]["token_ids"]

    @pytest.mark.parametrize(
        "body",
        [
            {"token_ids": [], "sampling_params": {}},
            {"token_ids": [-1], "sampling_params": {}},
            {"token_ids": PROMPT, "sampling_params": {"stop": ["x"]}},
            {"token_ids": PROMPT, "sampling_params": {"n": 100}},
            {"token_ids": PROMPT, "sampling_params": {}, "model": "nope"},
            {"token_ids": PROMPT, "sampling_params": {}, "output_mode": "text"},
            {"sampling_params": {}},
        ],
    )
    @pytest.mark.parametrize("stream", [False, True])
    def test_errors_equal_vllm(self, engine_app_url, vllm_tokens_only, body, stream):
        ours, theirs = _both(engine_app_url, vllm_tokens_only.url, {**body, "stream": stream}, "wire-4")
        assert ours.status_code == theirs.status_code >= 400
        assert ours.json() == theirs.json()

    def test_abort_routes(self, engine_app_url, vllm_tokens_only):
        for path in ("/inference/v1/abort_requests", "/abort_requests"):
            ours = httpx.post(engine_app_url + path, json={"request_ids": ["generate-tokens-x"]})
            theirs = httpx.post(vllm_tokens_only.url + path, json={"request_ids": ["generate-tokens-x"]})
            assert ours.status_code == theirs.status_code == 200
            assert ours.content == theirs.content == b""
            missing = httpx.post(engine_app_url + path, json={})
            assert missing.status_code == 400
            assert missing.json()["error"]["message"] == "Missing 'request_ids' in request body"


def _engine_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Engine", app_name="engine_app").stats.remote().result(timeout_s=30)


def _wait_idle(timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while _engine_stats()["num_unfinished_requests"]:
        assert time.monotonic() < deadline, "engine still holds the request"
        time.sleep(0.2)


class TestByHandle:
    def test_generate_and_stream(self, engine_app_url):
        from ray import serve

        engine = serve.get_deployment_handle("Engine", app_name="engine_app")
        body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 5}}
        whole = json.loads(engine.generate.remote(body).result(timeout_s=60))

        async def stream() -> list[dict]:
            return [c async for c in engine.options(stream=True).generate_stream.remote(body)]

        chunks = asyncio.run(stream())
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"

    def test_paced_streams_carry_merged_tokens_in_order(self, engine_app_url):
        """The session's engine is paced at 20 messages/s: concurrent streams get every scripted token,
        in order, with messages carrying several tokens, and the finish on the last one."""
        from ray import serve

        engine = serve.get_deployment_handle("Engine", app_name="engine_app")
        scripts = [list(range(1000 + 100 * s, 1060 + 100 * s)) for s in range(4)]

        async def stream(script: list[int]) -> list[dict]:
            body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": len(script),
                                                             "extra_args": {"scripted_output": script}}}
            return [c async for c in engine.options(stream=True).generate_stream.remote(body)]

        async def all_streams() -> list[list[dict]]:
            return await asyncio.gather(*(stream(s) for s in scripts))

        for script, chunks in zip(scripts, asyncio.run(all_streams()), strict=True):
            choices = [c["choices"][0] for c in chunks]
            assert [t for c in choices for t in c["token_ids"]] == script
            assert max(len(c["token_ids"]) for c in choices) > 1
            assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]

    def test_handle_errors_are_api_errors(self, engine_app_url):
        from ray import serve

        from serve_app.errors import ApiError

        engine = serve.get_deployment_handle("Engine", app_name="engine_app")
        with pytest.raises(Exception) as info:
            engine.generate.remote({"token_ids": [], "sampling_params": {}}).result(timeout_s=60)
        cause = getattr(info.value, "cause", info.value)
        assert isinstance(cause, ApiError) and cause.status_code == 400


class TestCancellation:
    def test_client_disconnect_aborts_engine_request(self, engine_app_url):
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_tokens": 3000, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", engine_app_url + "/inference/v1/generate", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert _engine_stats()["num_unfinished_requests"] == 1
        _wait_idle()

    def test_composed_disconnect_aborts_engine_request(self, engine_app_url):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", engine_app_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            assert next(line for line in resp.iter_lines() if line.startswith("data: "))
        _wait_idle()

    def test_abort_route_ends_a_running_stream(self, engine_app_url):
        body = {
            "token_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_tokens": 3000, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream(
            "POST", engine_app_url + "/inference/v1/generate", json=body, headers={"X-Request-Id": "to-abort"}, timeout=60
        ) as resp:
            events = (line for line in resp.iter_lines() if line.startswith("data: "))
            next(events)
            assert httpx.post(engine_app_url + "/abort_requests", json={"request_ids": ["generate-tokens-to-abort"]}).status_code == 200
            rest = [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in events]
        assert rest[-1] == "[DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "abort"
        _wait_idle()


@pytest.mark.parametrize("stream", ["false", "true", 1, {}])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ],
)
def test_a_stream_flag_that_is_not_a_boolean_is_a_400(engine_app_url, path, body, stream):
    """A truthy ``"false"`` was answered as SSE; any non-boolean ``stream`` is a 400 in the envelope."""
    resp = httpx.post(engine_app_url + path, json={**body, "stream": stream}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == 400 and "boolean" in error["message"]


@pytest.mark.parametrize("bad_id", [151936, 200_000, 2**31, 2**33])  # qwen3-tiny's model vocabulary: 151936 rows
def test_token_ids_past_the_vocabulary_are_a_400_and_the_engine_lives(engine_app_url, bad_id):
    """A tokens-only vLLM engine indexes such an id and its EngineCore dies for good (every later
    request a 500): ours answers vLLM's out-of-vocabulary 400 before the engine sees it."""
    for path, body, param in [
        ("/inference/v1/generate", {"token_ids": [9707, bad_id], "sampling_params": {"max_tokens": 2}}, "token_ids"),
        ("/v1/completions", {"prompt": [9707, bad_id], "max_tokens": 2}, "prompt"),
        ("/v1/completions/render", {"prompt": [bad_id]}, "prompt"),
    ]:
        resp = httpx.post(engine_app_url + path, json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and f"Token id {bad_id} is out of vocabulary" in error["message"]
    ok = httpx.post(engine_app_url + "/v1/completions", json={"prompt": [9707, 151935], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the last row of the vocabulary is fine, and the engine is alive


def test_no_engine_routes_without_engine(app_url):
    for path in ("/inference/v1/generate", "/v1/chat/completions", "/v1/completions", "/abort_requests"):
        resp = httpx.post(app_url + path, json={})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == 404


def test_engine_restart_keeps_cpu_tier_up(engine_app_url):
    """Kill the engine replica: render and derender keep answering; generation comes back by itself."""
    import ray
    from ray import serve

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "Engine" in a["name"] and "engine_app" in a["name"]]
    assert len(actors) == 1, actors
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    assert httpx.get(engine_app_url + "/ready", timeout=30).json() == {"status": "ready"}
    with httpx.stream("POST", engine_app_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        events = (line[6:] for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(next(events))["object"] == "chat.completion.chunk"
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
        rest = list(events)
    # The engine died mid-stream: the stream ends cleanly with vLLM's in-band error frame and [DONE].
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"  # the replica went away: retry
    chat = {"messages": [{"role": "user", "content": "Hello"}]}
    for _ in range(5):
        render = httpx.post(engine_app_url + "/v1/chat/completions/render", json=chat, timeout=30)
        assert render.status_code == 200
        assert httpx.get(engine_app_url + "/health", timeout=30).status_code == 200  # liveness: up
        time.sleep(0.5)
    deadline = time.monotonic() + 60  # readiness: 503 once the controller has seen the engine go
    while (not_ready := httpx.get(engine_app_url + "/ready", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "/ready never reported the dead engine"
        time.sleep(0.5)
    assert not_ready.status_code == 503 and not_ready.headers["retry-after"]
    assert "Engine" in not_ready.json()["error"]["message"]
    # Meanwhile the composed API: a malformed request is still the client's 400 (render checks it
    # first), a good one a fast 503 with Retry-After, never a call queued until the engine is back.
    cases = (
        ("/v1/chat/completions", {**chat, "max_tokens": 3}, {**chat, "temperature": "hot"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}, {"prompt": "hi", "n": "two"}),
    )
    for path, good, bad in cases:
        bad_answer = httpx.post(engine_app_url + path, json=bad, timeout=30)
        assert bad_answer.status_code == 400 and bad_answer.json()["error"]["code"] == 400, bad_answer.text
        down = httpx.post(engine_app_url + path, json=good, timeout=30)
        assert down.status_code == 503 and down.headers["retry-after"], down.text
        assert down.json()["error"]["message"] == "Engine has no running replica; retry later."
    deadline = time.monotonic() + 180
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 3}}
    while True:
        resp = httpx.post(engine_app_url + "/inference/v1/generate", json=body, timeout=120)
        if resp.status_code == 200:
            break
        assert resp.json()["error"]["code"] in (500, 503)  # an enveloped error meanwhile, never a hang
        assert time.monotonic() < deadline, resp.text
        time.sleep(2)
    assert len(resp.json()["choices"][0]["token_ids"]) == 3
    assert serve.status().applications["engine_app"].status == "RUNNING"
    deadline = time.monotonic() + 60
    while httpx.get(engine_app_url + "/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(1)
