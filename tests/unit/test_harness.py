"""The test and bench harness's stream client and /metrics reader (tests/harness), which many tests rely on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.harness.derender_stream import carry_state, split, token_chunks
from tests.harness.metrics import session_outcomes, summed_by


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


def test_summed_by_keys_on_the_named_labels_and_sums_the_rest_away():
    text = "\n".join([
        "# TYPE serve_app_http_requests counter",
        'serve_app_http_requests_total{method="POST",route="/a",status="200",replica="x"} 4.0',
        'serve_app_http_requests_total{method="POST",route="/a",status="200",replica="y"} 1.0',
        'serve_app_http_requests_total{method="POST",route="/a",status="400",replica="x"} 2.0',
        "# TYPE ttft histogram",
        'ttft_bucket{le="0.1",replica="x"} 3.0',
        'ttft_bucket{le="0.1",replica="y"} 0.0',
        'ttft_bucket{le="+Inf",replica="x"} 5.0',
        'ttft_count{replica="x"} 5.0',
        'ttft_sum{replica="x"} 0.9',
    ]) + "\n"
    assert summed_by(text, "serve_app_http_requests_total", "method", "route", "status") == {"POST /a 200": 5.0, "POST /a 400": 2.0}
    assert summed_by(text, "ttft_bucket", "le") == {"0.1": 3.0, "+Inf": 5.0}
    assert summed_by(text, "ttft_bucket", "missing") == {"?": 8.0}
    assert summed_by(text, "absent_total", "le") == {}
    assert summed_by(text, "ttft_sum") == {"": 0.9}  # no label named: every series summed
    families = list(text_string_to_metric_families(text))  # parsed once, read twice: the same sums
    assert summed_by(families, "ttft_bucket", "le") == summed_by(text, "ttft_bucket", "le")
    assert summed_by(families, "serve_app_http_requests_total", "status") == {"200": 5.0, "400": 2.0}
