"""Reading the app's own ``/metrics`` as the tests and benches need it."""

from __future__ import annotations


def session_outcomes(metrics_text: str) -> dict[str, float]:
    """Parser-derender chunks by session-cache outcome (hit: its live parser; miss: a replay of the carried
    state; new: a stream's first; none), summed over the Ingress replicas (the Ingress counts them
    whichever replica parsed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "serve_app_parser_session_chunks_total":
                outcome = s.labels.get("outcome", "?")
                out[outcome] = out.get(outcome, 0.0) + s.value
    return out
