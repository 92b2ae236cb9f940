"""``serve_app.metrics``: the ParserDerender session-cache series the ingress exports at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serve_app.metrics import HttpMetrics


def _samples(metrics: HttpMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("serve_app_parser_session_")
    }


def _stats(replica: str, sessions: int, tokens: int) -> dict:
    return {"replica": replica, "sessions": sessions, "session_tokens": tokens, "hits": 9, "misses": 1, "evictions": 2, "expirations": 3}


def test_without_a_parser_derender_no_session_cache_series_exist():
    assert _samples(HttpMetrics()) == {}


def test_each_replica_gets_its_series_and_a_gone_replica_disappears():
    metrics = HttpMetrics()
    metrics.set_session_caches([_stats("r1", 2, 100), _stats("r2", 5, 700)], max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 1
    assert got[("serve_app_parser_session_cache_max_tokens", ())] == 1000
    assert got[("serve_app_parser_session_cache_sessions", (("replica", "r2"),))] == 5
    assert got[("serve_app_parser_session_cache_tokens", (("replica", "r1"),))] == 100
    assert got[("serve_app_parser_session_cache_evictions_total", (("replica", "r1"),))] == 2
    assert got[("serve_app_parser_session_cache_expirations_total", (("replica", "r2"),))] == 3

    metrics.set_session_caches([_stats("r2", 1, 50), TimeoutError("r1 did not answer")], max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 0  # a replica is missing
    assert ("serve_app_parser_session_cache_sessions", (("replica", "r1"),)) not in got
    assert got[("serve_app_parser_session_cache_tokens", (("replica", "r2"),))] == 50


def test_replicas_that_could_not_be_asked_leave_only_the_up_series_at_zero():
    metrics = HttpMetrics()
    metrics.set_session_caches(None, max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 0
    assert not any(name == "serve_app_parser_session_cache_sessions" for name, _ in got)


def test_a_scrape_holds_every_ingress_replicas_series_labelled_by_replica():
    a, b = HttpMetrics(), HttpMetrics()
    a.observe("/v1/chat/completions/render", "POST", 200, 0.003)
    b.observe("/v1/chat/completions/render", "POST", 200, 0.004)
    b.observe("/v1/chat/completions/render", "POST", 503, 0.001)
    a.set_replicas({"ra": a.families(), "rb": b.families()})
    families = {f.name: f for f in text_string_to_metric_families(a.render().decode())}
    requests = {
        (s.labels["replica"], s.labels["status"]): s.value for s in families["serve_app_http_requests"].samples if s.name.endswith("_total")
    }
    assert requests == {("ra", "200"): 1, ("rb", "200"): 1, ("rb", "503"): 1}
    counts = [s for s in families["serve_app_http_request_duration_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in counts) == ["ra", "rb"]
    assert families["serve_app_metrics_ingress_replicas"].samples[0].value == 2
