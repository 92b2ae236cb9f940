"""The test and bench harness's stream client and /metrics reader (tests/harness), which many tests rely on."""

from __future__ import annotations

from tests.harness.derender_stream import carry_state, split, token_chunks
from tests.harness.metrics import session_outcomes


def test_token_chunks_finish_only_the_last_chunk():
    chunks = token_chunks(split([1, 2, 3, 4, 5], 2), "rid", "length", stop_reason=7)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[1, 2], [3, 4], [5]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None, None, 7]
    assert {c["request_id"] for c in chunks} == {"rid"}


def test_carry_state_sends_each_answer_state_with_the_next_chunk():
    sent = []

    def post(body):
        sent.append(body)
        return {"chunk": {"n": len(sent)}, "stream_state": {"after": len(sent)}}

    answers = list(carry_state(post, token_chunks([[1], [2], [3]]), {"start": True}, prompt_token_ids=[9]))
    assert [b["stream_state"] for b in sent] == [{"start": True}, {"after": 1}, {"after": 2}]
    assert all(b["stream"] is True and b["prompt_token_ids"] == [9] for b in sent)
    assert [a["chunk"]["n"] for a in answers] == [1, 2, 3]


def test_session_outcomes_sum_over_replicas():
    text = "\n".join([
        "# TYPE serve_app_parser_session_chunks counter",
        'serve_app_parser_session_chunks_total{outcome="hit",replica="a"} 3.0',
        'serve_app_parser_session_chunks_total{outcome="hit",replica="b"} 2.0',
        'serve_app_parser_session_chunks_total{outcome="miss",replica="a"} 1.0',
        "# TYPE other counter",
        'other_total{outcome="hit"} 100.0',
    ]) + "\n"
    assert session_outcomes(text) == {"hit": 5.0, "miss": 1.0}
