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
    from vllm.entrypoints.serve.exception_handling.utils import sanitize_message as vllm_sanitize

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
