"""Reading the app's own ``/metrics`` as the tests and benches need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


def summed_by(metrics: str | list[Metric], sample: str, *labels: str) -> dict[str, float]:
    """The values of every ``sample`` series in ``metrics`` (a ``/metrics`` text, or its families parsed
    once for several sums), summed over the series that share ``labels``' values (every other label,
    such as ``replica``, summed away), keyed by those values joined with spaces (``"?"`` for a series
    without one)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics) if isinstance(metrics, str) else metrics:
        for s in family.samples:
            if s.name == sample:
                key = " ".join(s.labels.get(label, "?") for label in labels)
                out[key] = out.get(key, 0.0) + s.value
    return out


def session_outcomes(metrics_text: str) -> dict[str, float]:
    """Parser-derender chunks by session-cache outcome (hit: its live parser; miss: a replay of the carried
    state; new: a stream's first; none), summed over the Ingress replicas (the Ingress counts them
    whichever replica parsed)."""
    return summed_by(metrics_text, "serve_app_parser_session_chunks_total", "outcome")
