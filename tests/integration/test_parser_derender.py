"""ParserDerender on a real Ray cluster: session affinity, cache hits, streams that change replica,
and autoscaling from one replica to two while streams are open."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import deploy_app
from tests.harness.derender_stream import carry_state, split, token_chunks
from tests.harness.payloads import MINIMAL_WEATHER_TOOLS as TOOLS

CHAT_REQUEST = {"messages": [{"role": "user", "content": "Weather in Paris and Tokyo?"}], "tools": TOOLS}
OUTPUT = (
    "<think>\nThe user wants the weather in two cities, so I call the tool twice.\n</think>\n\n"
    "Checking both cities now.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def scaling_app(serve_instance, model_dirs):
    """qwen3-tiny with hermes + qwen3, ParserDerender autoscaled 1 -> 2 on one ongoing request;
    deleted after the module so later tests have the room."""
    from ray import serve

    yield deploy_app(
        "parser_scaling",
        "/parser_scaling",
        model="qwen3-tiny",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        deployments={
            "parser_derender": {
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 1,
                    "downscale_delay_s": 3600,
                    "look_back_period_s": 2,
                    "metrics_interval_s": 0.5,
                }
            }
        },
    )
    serve.delete("parser_scaling")


def rendered_stream_inputs(app_url: str, tokenizer_dir) -> tuple[list[int], list[int]]:
    """CHAT_REQUEST's prompt ids as ``app_url`` renders it, and OUTPUT's ids ending in ``<|im_end|>``."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with httpx.Client(base_url=app_url, timeout=60) as c:
        prompt = c.post("/v1/chat/completions/render", json=CHAT_REQUEST).json()["token_ids"]
    return prompt, tok.encode(OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.fixture(scope="module")
def stream_inputs(scaling_app, model_dirs) -> tuple[list[int], list[int]]:
    return rendered_stream_inputs(scaling_app, model_dirs["qwen3-tiny"])


def _chunk_body(request_id: str, ids: list[int], last: bool, state, prompt: list[int]) -> dict:
    return {
        "stream": True,
        "generate_chunk": {
            "request_id": request_id,
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop" if last else None}],
        },
        "stream_state": state,
        "chat_request": CHAT_REQUEST,
        "prompt_token_ids": prompt,
    }


def _normalize(chunk: dict) -> dict:
    """Drop what legitimately differs between two runs: the timestamp and random tool-call ids."""
    text = json.dumps({k: v for k, v in chunk.items() if k != "created"})
    return json.loads(re.sub(r"chatcmpl-tool-[0-9a-f]+", "chatcmpl-tool-X", text))


def _stream_http(
    base_url: str, request_id: str, prompt: list[int], output: list[int], step: int = 1, headers: dict | None = None,
    sizes: list[int] | None = None,
) -> list[dict]:
    """The stream's chunks over HTTP; ``sizes``, if given, gets each answer's length in bytes."""
    with httpx.Client(base_url=base_url, timeout=60, headers=headers) as c:

        def post(body: dict) -> dict:
            r = c.post("/v1/chat/completions/derender", json=body)
            assert r.status_code == 200, r.text
            if sizes is not None:
                sizes.append(len(r.content))
            return r.json()

        parts = token_chunks(split(output, step), request_id)
        return [data["chunk"] for data in carry_state(post, parts, chat_request=CHAT_REQUEST, prompt_token_ids=prompt)]


def _joined(chunks: list[dict]) -> dict:
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or tc.get("id")
            call["name"] += (tc.get("function") or {}).get("name") or ""
            call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    return {
        "content": "".join(d.get("content") or "" for d in deltas),
        "reasoning": "".join(d.get("reasoning") or "" for d in deltas),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": chunks[-1]["choices"][0]["finish_reason"],
    }


def _session_counts(base_url: str) -> dict[str, float]:
    """Chunks by session-cache outcome, summed over Ingress replicas (the ``replica`` label)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = dict.fromkeys(("hit", "miss", "new", "none"), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            if s.name == "serve_app_parser_session_chunks_total" and s.labels.get("outcome") in counts:
                counts[s.labels["outcome"]] += s.value
    return counts


def _replicas() -> int:
    from ray import serve

    app = serve.status().applications["parser_scaling"]
    return app.deployments["ParserDerender"].replica_states.get("RUNNING", 0)


def _session_ids_by_replica(handle, prefix: str, per_replica: int, output: list[int], prompt: list[int]) -> dict[str, list[str]]:
    """``per_replica`` session ids (``{prefix}-{i}``) on each of the two ParserDerender replicas, found
    by asking: Ray's consistent-hash ring places them. Probed with request id ``probe``, so a stream
    that then uses an id as its request id opens its own session."""
    placed: dict[str, list[str]] = {}
    for i in range(128):
        sid = f"{prefix}-{i}"
        body = _chunk_body("probe", output[:1], False, None, prompt)
        _, _, replica = handle.options(session_id=sid).chat_traced.remote(body).result()
        if len(placed.setdefault(replica, [])) < per_replica:
            placed[replica].append(sid)
        if len(placed) == 2 and all(len(ids) == per_replica for ids in placed.values()):
            return placed
    raise AssertionError(f"128 session ids did not give {per_replica} on each of two replicas: {placed}")


def test_autoscales_to_two_replicas_while_streams_stay_correct(scaling_app, stream_inputs):
    """Concurrent open streams push ParserDerender from 1 to 2 replicas; every stream's output is the
    same as the non-streaming answer, whichever replica answered which chunk."""
    prompt, output = stream_inputs
    assert _replicas() == 1
    with httpx.Client(base_url=scaling_app, timeout=60) as c:
        body = {
            "generate_response": {"request_id": "whole", "choices": [{"index": 0, "token_ids": output}]},
            "prompt_token_ids": prompt,
            "chat_request": CHAT_REQUEST,
        }
        whole = c.post("/v1/chat/completions/derender", json=body).json()["choices"][0]
    expected = {
        "content": whole["message"]["content"],
        "reasoning": whole["message"]["reasoning"],
        "tool_calls": [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]} for t in whole["message"]["tool_calls"]],
        "finish_reason": whole["finish_reason"],
    }
    assert expected["finish_reason"] == "tool_calls" and len(expected["tool_calls"]) == 2

    stop = threading.Event()
    results: list[dict] = []
    errors: list[BaseException] = []

    def client(n: int) -> None:
        try:
            k = 0
            while not stop.is_set():
                got = _joined(_stream_http(scaling_app, f"load-{n}-{k}", prompt, output))
                for call in got["tool_calls"]:
                    assert call.pop("id").startswith("chatcmpl-tool-")
                results.append(got)
                k += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with ThreadPoolExecutor(6) as pool:
        for n in range(6):
            pool.submit(client, n)
        deadline = time.monotonic() + 120
        while _replicas() < 2 and time.monotonic() < deadline and not errors:
            time.sleep(0.5)
        scaled = _replicas()
        # Keep streaming across the new replica joining the hash ring (some sessions remap: misses).
        time.sleep(3)
        stop.set()
    assert not errors, errors[0]
    assert scaled == 2
    assert results and all(r == expected for r in results), [r for r in results if r != expected][:1]


def test_streams_hit_their_live_parser(scaling_app, stream_inputs):
    """With stable replicas, every chunk after a stream's first finds its live parser (>= 99% hits)."""
    prompt, output = stream_inputs
    before = _session_counts(scaling_app)
    for n in range(8):
        _stream_http(scaling_app, f"affinity-{n}", prompt, output, step=1 + n % 3)
    after = _session_counts(scaling_app)
    hits, misses, new = (after[k] - before[k] for k in ("hit", "miss", "new"))
    assert new == 8
    assert hits / (hits + misses) >= 0.99, (hits, misses)


def test_a_stream_moving_replica_replays_to_identical_output(scaling_app, stream_inputs):
    """Half a stream on one replica, the rest on the other: the second replica misses once, replays
    the carried history, and every chunk equals the unmoved stream's."""
    from ray import serve

    prompt, output = stream_inputs
    handle = serve.get_deployment_handle("ParserDerender", app_name="parser_scaling")
    (first,), (second,) = _session_ids_by_replica(handle, "probe", 1, output, prompt).values()

    def run(switch_at: int | None) -> tuple[list[dict], list[str]]:
        chunks, outcomes, state = [], [], None
        for i, tid in enumerate(output):
            sid = second if switch_at is not None and i >= switch_at else first
            body = _chunk_body("move", [tid], i == len(output) - 1, state, prompt)
            out, outcome, _ = handle.options(session_id=sid).chat_traced.remote(body).result()
            data = json.loads(out)
            state = data["stream_state"]
            chunks.append(_normalize(data["chunk"]))
            outcomes.append(outcome)
        return chunks, outcomes

    switch = len(output) // 2
    unmoved, unmoved_outcomes = run(None)
    moved, moved_outcomes = run(switch)
    assert moved == unmoved
    assert unmoved_outcomes == ["new"] + ["hit"] * (len(output) - 1)
    assert moved_outcomes[switch] == "miss" and moved_outcomes[switch + 1 :] == ["hit"] * (len(output) - switch - 1)


def test_client_stream_keeps_each_stream_on_its_live_parser(scaling_app, stream_inputs):
    """``ServeAppClient.derender_chat_stream`` (by handle, no HTTP): chunk for chunk what the HTTP route
    streams, and with several ParserDerender replicas every chunk after a stream's first is a hit on
    the replica holding its parser (the client sets the routing session; without it chunks would
    spread over the replicas and miss)."""
    import asyncio

    from serve_app.client import ServeAppClient

    prompt, output = stream_inputs
    assert _replicas() == 2  # test_autoscales_... scaled up (downscale_delay_s: an hour)

    def same(chunk: dict) -> dict:  # the stream's request id is in each chunk's id
        return {k: v for k, v in _normalize(chunk).items() if k != "id"}

    over_http = [same(c) for c in _stream_http(scaling_app, "http", prompt, output)]

    from ray import serve

    handle = serve.get_deployment_handle("ParserDerender", app_name="parser_scaling")

    def stats() -> dict[str, tuple[int, int]]:
        replies = handle.broadcast("stats").results(timeout_s=60)
        return {s["replica"]: (s["hits"], s["misses"]) for s in replies}

    # Four stream ids on each replica: 8 ids taken blindly all land on one about once in a hundred runs.
    placed = _session_ids_by_replica(handle, "client", 4, output, prompt)

    async def streams(ids: list[str]) -> list[list[dict]]:
        client = ServeAppClient("parser_scaling")

        async def one(sid: str) -> list[dict]:
            stream = client.derender_chat_stream(chat_request=CHAT_REQUEST, prompt_token_ids=prompt)
            chunks = []
            for i, tid in enumerate(output):
                last = "stop" if i == len(output) - 1 else None
                choice = {"index": 0, "token_ids": [tid], "finish_reason": last}
                out = await stream.derender({"request_id": sid, "choices": [choice]})
                assert out["stream_state"] == stream.stream_states[0]
                chunks.append(same(out["chunk"]))
            return chunks

        return await asyncio.gather(*(one(sid) for sid in ids))

    before = stats()
    results = asyncio.run(streams([sid for ids in placed.values() for sid in ids]))
    after = stats()
    assert len(results) == 8 and all(chunks == over_http for chunks in results)
    # Every chunk after a stream's first a hit, on the replica its id hashes to: four streams' worth each.
    gained = {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in placed}
    assert gained == {r: (4 * (len(output) - 1), 0) for r in placed}


_CAPPED_CLIENT = """
import asyncio, json, sys
import ray
from serve_app.client import ServeAppClient

address, request = sys.argv[1], json.loads(sys.stdin.read())
ray.init(address=address, namespace="serve", log_to_driver=False)

async def run():
    stream = ServeAppClient("parser_scaling").derender_chat_stream(
        chat_request=request["chat_request"], prompt_token_ids=request["prompt"])
    chunks, transports = [], []
    for i, tid in enumerate(request["output"]):
        last = "stop" if i == len(request["output"]) - 1 else None
        out = await stream.derender({"request_id": "capped", "choices": [{"index": 0, "token_ids": [tid], "finish_reason": last}]})
        chunks.append(out["chunk"])
        transports.append(stream.transport)
    return {"chunks": chunks, "transports": transports}

print(json.dumps(asyncio.run(run())))
"""


def test_client_stream_past_grpc_message_cap_carries_on_by_actor_calls(scaling_app, stream_inputs):
    """A caller whose gRPC cap is below what a stream's answers grow to (its carried state): the
    stream starts over gRPC, switches to Ray actor calls at the first answer past the cap, and its
    chunks equal the HTTP route's. Run in a driver of its own with the cap lowered in its environment,
    as a user's process would have it."""
    import os
    import subprocess
    import sys

    import ray

    prompt, output = stream_inputs
    sizes: list[int] = []
    over_http = _stream_http(scaling_app, "capped", prompt, output, sizes=sizes)
    cap = (sizes[0] + sizes[-1]) // 2  # the first answers fit, the last do not
    env = {**os.environ, "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(cap)}
    request = json.dumps({"chat_request": CHAT_REQUEST, "prompt": prompt, "output": output})
    done = subprocess.run([sys.executable, "-c", _CAPPED_CLIENT, ray.get_runtime_context().gcs_address], input=request,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    switched = got["transports"].index("actor")  # the fault: an answer past the cap
    assert 0 < switched < len(output) - 1 and set(got["transports"][switched:]) == {"actor"}
    assert [_normalize(c) for c in got["chunks"]] == [_normalize(c) for c in over_http]


def test_client_stream_error_is_the_api_error(scaling_app, stream_inputs):
    """A chunk the route answers with a 400 raises that :class:`ApiError` by handle too, over gRPC."""
    import asyncio

    from serve_app.client import ServeAppClient
    from serve_app.errors import ApiError

    prompt, output = stream_inputs
    choices = [{"index": 0, "token_ids": output[:1]}, {"index": 1, "token_ids": output[:1]}]
    with httpx.Client(base_url=scaling_app, timeout=60) as c:
        r = c.post("/v1/chat/completions/derender", json=_chunk_body("bad", [], False, None, prompt) | {
            "generate_chunk": {"request_id": "bad", "choices": choices}})
    assert r.status_code == 400

    async def by_handle() -> ApiError:
        stream = ServeAppClient("parser_scaling").derender_chat_stream(chat_request=CHAT_REQUEST, prompt_token_ids=prompt)
        with pytest.raises(ApiError) as info:
            await stream.derender({"request_id": "bad", "choices": choices})
        return info.value

    error = asyncio.run(by_handle())
    assert (error.status_code, error.message) == (400, r.json()["error"]["message"])
