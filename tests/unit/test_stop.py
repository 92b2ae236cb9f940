"""``serve_app.derender.stop``: the one rule for which final token's text an answer leaves out."""

from __future__ import annotations

import pytest

from serve_app.derender.stop import StopTokens, engine_stop_reason

EOS = (2, 7)  # the model's EOS ids (a generation config can list several)
IDS = [11, 12, 13]


@pytest.mark.parametrize(
    ("ids", "finish", "stop_reason", "req", "dropped"),
    [
        ([*IDS, 2], "stop", None, None, True),  # EOS, reported as null
        ([*IDS, 7], "stop", 7, None, True),  # another EOS id, named by the engine
        ([*IDS, 7], "stop", None, None, True),  # ... or reported as null
        ([*IDS, 13], "stop", 13, {"stop_token_ids": [13]}, True),  # a stop_token_ids hit
        ([*IDS, 13], "stop", None, {"stop_token_ids": [13]}, True),  # ... without its stop_reason
        ([*IDS, 13], "stop", 13, None, True),  # stop_reason names the token that stopped generation
        (IDS, "stop", None, None, False),  # stop on an ordinary token (orchestrator, trimmed, replayed)
        (IDS, "stop", 2, None, False),  # stop_reason names a token the output does not end on
        ([*IDS, 2], "stop", "</s>", None, False),  # a stop string: matched in text, no token to drop
        ([*IDS, 2], "length", None, None, False),
        ([*IDS, 2], "abort", None, None, False),
        ([*IDS, 2], None, None, None, False),  # a chunk mid-stream
        ([*IDS, 2], "stop", None, {"include_stop_str_in_output": True}, False),
        ([*IDS, 13], "stop", 13, {"stop_token_ids": [13], "include_stop_str_in_output": True}, False),
        ([], "stop", None, None, False),  # a finish-only chunk
    ],
)
def test_the_last_token_is_dropped_only_when_it_is_the_stop_token(ids, finish, stop_reason, req, dropped):
    stops = StopTokens.of_request(EOS, req)
    assert stops.ends_on_stop(ids, finish, stop_reason) is dropped
    assert list(stops.text_ids(ids, finish, stop_reason)) == (ids[:-1] if dropped else ids)


def test_of_request_reads_models_and_dicts_alike():
    class Request:
        stop_token_ids = [13]
        include_stop_str_in_output = False

    assert StopTokens.of_request(EOS, Request()).ids == StopTokens.of_request(EOS, {"stop_token_ids": [13]}).ids == {2, 7, 13}
    assert StopTokens.of_request(EOS, None).ids == {2, 7}


@pytest.mark.parametrize(
    ("choice", "request_stop_ids", "want"),
    [
        ({"finish_reason": "stop", "stop_reason": 2}, None, None),  # the tokens-only engine's EOS: null, as coupled
        ({"finish_reason": "stop", "stop_reason": 2}, [2], 2),  # the request itself listed it
        ({"finish_reason": "stop", "stop_reason": 7}, None, 7),  # another EOS id: coupled reports it too
        ({"finish_reason": "length", "stop_reason": 2}, None, 2),
        ({"finish_reason": "stop", "stop_reason": "</s>"}, None, "</s>"),
    ],
)
def test_engine_stop_reason_maps_as_coupled_vllm_serve(choice, request_stop_ids, want):
    engine_stop_reason(choice, 2, request_stop_ids)
    assert choice["stop_reason"] == want
