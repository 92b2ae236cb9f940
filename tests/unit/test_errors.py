"""Error envelopes: our vLLM-free formatting against vLLM's own handlers on the same inputs."""

from __future__ import annotations

import pickle

import pytest
from pydantic import BaseModel, ValidationError

from serve_app.errors import BadRequestError, NotFoundError, envelope, sanitize_message, validation_error


class _Body(BaseModel):
    messages: list[dict]
    n: int = 1
    prompt: str | list[int]


BAD_BODIES = [
    {"messages": "x", "prompt": "p"},
    {"messages": [], "n": "many", "prompt": [1, "a"]},
    {"prompt": "y" * 500},
    {"messages": [{}] * 3, "prompt": {"k": 1}, "n": 10**5000 if False else "1" * 300},
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_validation_message_matches_vllm(body):
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers import validation as vllm_validation

    with pytest.raises(ValidationError) as info:
        _Body.model_validate(body)
    errors = info.value.errors(include_url=False)  # as FastAPI reports them
    ours = envelope(validation_error(errors))

    class _State:
        class args:
            log_error_stack = False

    class _App:
        state = _State()

    class _Req:
        app = _App()

    import asyncio

    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors])
    response = asyncio.run(vllm_validation.validation_exception_handler(_Req(), exc))
    import json

    assert ours == (response.status_code, json.loads(response.body))


def test_sanitize_matches_vllm():
    from serve_app._vllm import vllm_sanitize_message

    vllm_sanitize = vllm_sanitize_message()

    for message in [
        "model /tmp/m/qwen3 missing",
        'boom\n  File "/usr/lib/x.py", line 3, in f\n    raise X',
        "<object at 0x7f00aa>",
        "relative/dir/file.json broken",
    ]:
        assert sanitize_message(message) == vllm_sanitize(message)


def test_typed_errors_map_to_status_type_and_param():
    assert envelope(NotFoundError("The model `x` does not exist.", param="model")) == (
        404,
        {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}},
    )
    status, body = envelope(RuntimeError("kaboom"))
    assert (status, body["error"]["type"], body["error"]["code"]) == (500, "InternalServerError", 500)


def test_errors_survive_pickling_between_replicas():
    err = pickle.loads(pickle.dumps(BadRequestError("bad", param="n")))
    assert (type(err), err.message, err.param) == (BadRequestError, "bad", "n")


def test_errors_wrapped_by_ray_are_unwrapped():
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError("f", "tb", BadRequestError("bad", param="n")).as_instanceof_cause()
    assert envelope(wrapped)[0] == 400
    assert envelope(wrapped)[1]["error"]["param"] == "n"


# --- hostile messages: bounded, linear-time sanitising, still vLLM's output on ordinary text ------


def test_sanitize_equals_vllm_on_generated_messages():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from serve_app._vllm import vllm_sanitize_message

    vllm_sanitize = vllm_sanitize_message()

    pieces = st.sampled_from(
        ["/", "/usr", "/tmp", "/home", "a", "b-c", "_", ".", ".py", "x.json", " ", "  ", "\n", "\n  ", "\t", "é",
         'File "', '"', ", line ", "12", ", in ", "f", "<obj", " at 0x", "7fA0", ">", ":", "-"]
    )

    @settings(max_examples=3000, deadline=None, database=None)
    @given(st.lists(pieces, max_size=30).map("".join))
    def check(message):
        assert sanitize_message(message) == vllm_sanitize(message)

    check()


@pytest.mark.parametrize(
    "message",
    [
        'File "/usr/lib/python3/x.py", line 3, in f\n    raise X\n  File "b.py", line 9, in g',
        "Traceback:\n   \n  File \"/a/b.py\", line 1, in <module>\n    x = 1  \n  File \"c\", line 2, in h",
        "see /srv/app/a.b/c and /x/y.z/w/v.txt, /a/b.c.d, /a/.b, //a/b.c, /a/b., /-/-.-",
        "<Foo object at 0xdeadBEEF> at 0x12 at 0x>",
    ],
)
def test_sanitize_equals_vllm_on_tracebacks_and_paths(message):
    from serve_app._vllm import vllm_sanitize_message

    vllm_sanitize = vllm_sanitize_message()

    assert sanitize_message(message) == vllm_sanitize(message)


@pytest.mark.parametrize("size", [20_000, 1_000_000])
@pytest.mark.parametrize(
    "unit", ["/a", "/-", "/usr", " ", "\n", '\n File "', 'File "x", line 1', "/a.", " at 0x0"]
)
def test_sanitize_is_bounded_on_hostile_messages(size, unit):
    # The time it takes is in bench/; here, that it answers, on a bounded length.
    message = f"The model `{unit * (size // len(unit))}` does not exist."
    out = sanitize_message(message)
    assert len(out) <= 16384 + len("...[truncated]")


def test_long_messages_are_truncated_with_a_marker():
    out = sanitize_message("x" * 100_000)
    assert out == "x" * 16384 + "...[truncated]"
    assert sanitize_message("y" * 16384) == "y" * 16384


def test_not_found_for_a_hostile_model_name_is_enveloped_and_truncated():
    # (its time, against vLLM's backtracking sanitiser: bench/hostile_bench.py)
    status, body = envelope(NotFoundError(f"The model `{'/a' * 10_000}` does not exist.", param="model"))
    assert status == 404 and body["error"]["code"] == 404 and body["error"]["message"].endswith("...[truncated]")


def test_every_error_class_is_exported():
    """Every error class the module defines is in ``__all__`` (issue 20: ``GatewayTimeoutError`` was not)."""
    import inspect

    from serve_app import errors

    defined = {name for name, obj in vars(errors).items() if inspect.isclass(obj) and obj.__module__ == errors.__name__}
    public = {name for name in defined if not name.startswith("_")}
    assert public <= set(errors.__all__), public - set(errors.__all__)
