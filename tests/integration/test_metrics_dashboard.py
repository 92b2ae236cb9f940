"""The Grafana dashboard (``deploy/grafana/serve_app.json``) queries series that exist.

``serve_app_*``: the app's own series. Traffic goes to the real app (render, a parser-derender stream,
a 404), then ``/metrics`` is scraped: every ``serve_app_*`` name a dashboard query uses must be in the
scrape, with the labels the query groups by.

``ray_serve_*`` and ``autoscaler_*``: Ray's series reach Prometheus through Ray's metrics agent, which
these tests do not scrape (the test cluster starts without it). Their names are checked against the
installed Ray instead: the metric is defined in ``ray/serve`` (``ray_`` prefix, ``_total`` / ``_bucket``
suffixes added on export) or ``ray/autoscaler``, or Ray's own Grafana dashboards query it verbatim.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "serve_app.json"
NAME = re.compile(r"\b((?:serve_app|ray_serve|autoscaler)_[a-zA-Z0-9_]+)\b")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _names(prefix: str) -> set[str]:
    return {n for e in _exprs() for n in NAME.findall(e) if n.startswith(prefix)}


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job", "application"}
    # The app's own series and Ray Serve's, next to each other.
    assert _names("serve_app_") and _names("ray_serve_") and _names("autoscaler_")


@pytest.fixture(scope="module")
def scrape(app_url: str) -> dict[str, set[str]]:
    """Sample names in one scrape of /metrics after some traffic, each with the label names it carries."""
    with httpx.Client(base_url=app_url, timeout=60) as c:
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        prompt = c.post("/v1/chat/completions/render", json=chat).json()["token_ids"]
        state = None
        for i, ids in enumerate([[9707], [1879], [151645]]):  # "Hello", " world", <|im_end|>: new, hit, hit
            choice = {"index": 0, "token_ids": ids, "finish_reason": "stop" if i == 2 else None}
            body = {
                "stream": True,
                "generate_chunk": {"request_id": "dash", "choices": [choice]},
                "stream_state": state,
                "chat_request": chat,
                "prompt_token_ids": prompt,
            }
            r = c.post("/v1/chat/completions/derender", json=body)
            assert r.status_code == 200, r.text
            state = r.json()["stream_state"]
        assert c.get("/no/such/route").status_code == 404
        text = c.get("/metrics").text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels


def test_every_serve_app_series_the_dashboard_queries_is_scraped_with_its_labels(scrape):
    names = _names("serve_app_")
    assert names - scrape.keys() == set()
    for expr in _exprs():
        grouped = {label.strip() for g in GROUPING.findall(expr) for label in g.split(",")} - {"le", ""}
        for name in {n for n in NAME.findall(expr) if n.startswith("serve_app_")}:
            assert grouped <= scrape[name], (expr, name, scrape[name])
    # Every Ingress replica's counters, labelled; the ParserDerender replicas' caches, asked at the scrape.
    assert "replica" in scrape["serve_app_http_requests_total"]
    assert "replica" in scrape["serve_app_parser_session_cache_tokens"]


def _ray_sources() -> tuple[str, str]:
    import ray

    base = Path(ray.__file__).parent
    defined = "\n".join(p.read_text(errors="replace") for d in ("serve", "autoscaler") for p in (base / d).rglob("*.py"))
    dashboards = "\n".join(p.read_text(errors="replace") for p in (base / "dashboard/modules/metrics/dashboards").glob("*.py"))
    return defined, dashboards


def test_every_ray_series_the_dashboard_queries_exists_in_the_installed_ray():
    defined, dashboards = _ray_sources()
    missing = []
    for name in sorted(_names("ray_serve_") | _names("autoscaler_")):
        if name in dashboards:
            continue  # Ray's own dashboards query it under this exact name
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        literal = base.removeprefix("ray_") if base.startswith("ray_serve_") else base.removeprefix("autoscaler_")
        if f'"{literal}"' not in defined:
            missing.append(name)
    assert missing == []
