"""The Grafana dashboard (``deploy/grafana/serve_app.json``) and the alert rules
(``deploy/prometheus/alerts.yml``) query series that exist, and the app exports what an operator expects.

``serve_app_*`` and ``vllm:*``: the app's own series and the Engine replicas' vLLM series, both on the
app's ``/metrics``. Real traffic goes to the engine app (render, a parser-derender stream, composed
streams, a stream the client leaves, a 404), then ``/metrics`` is scraped: every such name a query uses
must be in the scrape, with the labels the query groups by. The ``vllm:*`` families must carry the names
and labels a real ``vllm serve`` on the same model exports, plus ``replica``.

``ray_serve_*``, ``ray_vllm_*`` and ``autoscaler_*``: Ray's series reach Prometheus through Ray's metrics
agent, which these tests do not scrape (the test cluster starts without it). Their names are checked
against the installed packages instead: ``ray_vllm_*`` against the metrics ``RayPrometheusStatLogger``
registers for this model (built offline, as the Engine replica builds it), the others against the metric
defined in ``ray/serve`` or ``ray/autoscaler`` (``ray_`` prefix, ``_total`` / ``_bucket`` suffixes added on
export) or queried verbatim by Ray's own Grafana dashboards.

Logs: a line the Ingress logs during a request carries that request's id in the replica's log file.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.derender_stream import carry_state, token_chunks

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "serve_app.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
NAME = re.compile(r"(?<![\w:])((?:serve_app|ray_serve|ray_vllm|autoscaler)_[a-zA-Z0-9_]+|vllm:[a-zA-Z0-9_:]+)")
GROUPING = re.compile(r"\bby \(([^)]*)\)\s*\(")
COMPOSED = ("/v1/chat/completions", "/v1/completions")
LONG = {"max_tokens": 3000, "ignore_eos": True}


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    alerts = yaml.safe_load(ALERTS.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])] + [
        r["expr"] for g in alerts["groups"] for r in g["rules"]
    ]


def _names(prefix: str) -> set[str]:
    return {n for e in _exprs() for n in NAME.findall(e) if n.startswith(prefix)}


def _grouped(expr: str, name: str) -> set[str]:
    """The labels the aggregations around ``name`` in ``expr`` group by (``sum by (a, le) (... name ...)``)."""
    labels: set[str] = set()
    for match in GROUPING.finditer(expr):
        depth, end = 1, match.end()
        while depth and end < len(expr):
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        if name in NAME.findall(expr[match.end() : end]):
            labels |= {label.strip() for label in match.group(1).split(",")}
    return labels - {"le", ""}


def _labels(text: str) -> dict[str, set[str]]:
    """Sample name -> every label name it carries, in one exposition."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels


def _value(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name and labels.items() <= s.labels.items()
    )


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job", "application"}
    # The app's own series, the engines' (both ways) and Ray Serve's, next to each other.
    for prefix in ("serve_app_", "vllm:", "ray_vllm_", "ray_serve_", "autoscaler_"):
        assert _names(prefix), prefix


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _leave_a_stream(c: httpx.Client, path: str, body: dict) -> None:
    """Start a long stream, read its first event, hang up."""
    with c.stream("POST", path, json={**body, **LONG, "stream": True}) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))


@pytest.fixture(scope="module")
def baseline(engine_app_url: str) -> str:
    """/metrics before this module's traffic: the engine app is shared with other modules (whose faults,
    an engine killed mid-stream say, stay in its counters), so counts are compared against it."""
    return httpx.get(engine_app_url + "/metrics", timeout=120).text


@pytest.fixture(scope="module")
def scrape(engine_app_url: str, baseline: str) -> str:
    """One scrape of /metrics after some real traffic (the client left one composed stream)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=engine_app_url, timeout=120) as c:
        prompt = c.post("/v1/chat/completions/render", json=chat).json()["token_ids"]

        def post(body: dict) -> dict:
            r = c.post("/v1/chat/completions/derender", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        parts = token_chunks([[9707], [1879], [151645]], "dash")  # "Hello", " world", <|im_end|>: new, hit, hit
        list(carry_state(post, parts, chat_request=chat, prompt_token_ids=prompt))
        assert c.get("/no/such/route").status_code == 404
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "Hi"})):
            r = c.post(path, json={**body, "max_tokens": 8, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
        assert c.post("/v1/chat/completions", json={**chat, "max_tokens": 4}).status_code == 200
        _leave_a_stream(c, "/v1/chat/completions", chat)
        # The Ingress records the stream once its request ends: wait for it (bounded; no timing asserted).
        deadline = time.monotonic() + 60
        while True:
            text = c.get("/metrics").text
            if _value(text, "serve_app_stream_errors_total", route="/v1/chat/completions", cause="client_disconnect") >= 1:
                return text
            assert time.monotonic() < deadline, "the stream the client left was never counted"
            time.sleep(0.5)


def test_every_app_series_the_dashboard_and_alerts_query_is_scraped_with_its_labels(scrape):
    labels = _labels(scrape)
    names = _names("serve_app_") | _names("vllm:")
    assert names - labels.keys() == set()
    for expr in _exprs():
        for name in {n for n in NAME.findall(expr) if n.startswith(("serve_app_", "vllm:"))}:
            assert _grouped(expr, name) <= labels[name], (expr, name, labels[name])
    # Every Ingress replica's counters, labelled; the ParserDerender replicas' caches and the Engine
    # replicas' vLLM series, asked at the scrape.
    assert "replica" in labels["serve_app_http_requests_total"]
    assert "replica" in labels["serve_app_parser_session_cache_tokens"]
    assert {"replica", "model_name", "engine"} <= labels["vllm:generation_tokens_total"]


def test_composed_streams_are_timed_and_a_stream_the_client_left_is_no_200(scrape, baseline):
    for route in COMPOSED:
        assert _value(scrape, "serve_app_time_to_first_token_seconds_count", route=route) >= 1, route
        assert _value(scrape, "serve_app_inter_token_latency_seconds_count", route=route) >= 1, route
        for stage in ("render", "engine_first_chunk"):  # the composed stages before the first chunk
            assert _value(scrape, "serve_app_composed_stage_seconds_count", route=route, stage=stage) >= 1, (route, stage)
    assert _value(scrape, "serve_app_composed_stage_seconds_count", route="/v1/chat/completions", stage="engine") >= 1
    # The stream the client left: a 499 and a client_disconnect; every other cause is exported, and
    # none was added by this module's traffic.
    route = "/v1/chat/completions"
    assert _value(scrape, "serve_app_http_requests_total", route=route, status="499") >= 1
    for cause in ("engine_died", "timeout", "internal"):
        exported = {(x.labels.get("route"), x.labels.get("cause")) for f in text_string_to_metric_families(scrape) for x in f.samples}
        assert (route, cause) in exported, cause
        added = _value(scrape, "serve_app_stream_errors_total", route=route, cause=cause) - _value(
            baseline, "serve_app_stream_errors_total", route=route, cause=cause
        )
        assert added == 0, cause
    assert _value(scrape, "serve_app_metrics_engine_replicas") == 1
    assert _value(scrape, "serve_app_engine_metrics_up") == 1
    assert _value(scrape, "vllm:generation_tokens_total") > 0
    assert _value(scrape, "vllm:time_to_first_token_seconds_count") >= 4


def test_engine_series_have_vllm_serves_names_and_labels_plus_the_replica(scrape, vllm_tokens_only):
    """The same vllm:* families as a real `vllm serve --tokens-only` on this model, label for label."""
    body = {"token_ids": [151644, 872, 198, 9707, 151645], "sampling_params": {"max_tokens": 4}}
    assert httpx.post(vllm_tokens_only.url + "/inference/v1/generate", json=body, timeout=120).status_code == 200
    theirs_text = httpx.get(vllm_tokens_only.url + "/metrics", timeout=30).text

    def families(text: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for f in text_string_to_metric_families(text):
            if f.name.startswith("vllm:"):
                out.setdefault(f.name, set()).update(label for s in f.samples for label in s.labels)
        return out

    ours, theirs = families(scrape), families(theirs_text)
    assert ours.keys() == theirs.keys()
    for name, labels in ours.items():
        assert labels == theirs[name] | {"replica"}, name
    sample_names = {name for name in _labels(scrape) if name.startswith("vllm:")}
    assert sample_names == {name for name in _labels(theirs_text) if name.startswith("vllm:")}


_RAY_NAMES = """
import json, sys
import serve_app.vllm_cli  # noqa: F401  (vLLM's version lookup, as in the Engine replica)
from vllm import AsyncEngineArgs
from vllm.v1.metrics.ray_wrappers import RayPrometheusMetric, RayPrometheusStatLogger

config = AsyncEngineArgs(model=sys.argv[1], served_model_name=["qwen3-tiny"], enforce_eager=True).create_engine_config()
found = {}

def walk(obj, depth=0):
    if isinstance(obj, RayPrometheusMetric):
        found[obj.metric._name] = [type(obj.metric).__name__, list(obj.metric._tag_keys)]
    elif depth < 4 and isinstance(obj, (dict, list, tuple)):
        for v in (obj.values() if isinstance(obj, dict) else obj):
            walk(v, depth + 1)
    elif depth < 4 and type(obj).__module__.startswith("vllm"):
        for v in vars(obj).values():
            walk(v, depth + 1)

walk(RayPrometheusStatLogger(config, [0]))
print(json.dumps(found))
"""


def _ray_vllm_series(model_dir: Path) -> dict[str, set[str]]:
    """Every series name Ray exports for the metrics RayPrometheusStatLogger registers (built offline for
    this model, in a subprocess), with its tag keys: ``ray_`` + name, counters ``_total``, histograms
    ``_bucket`` / ``_sum`` / ``_count``."""
    out = subprocess.run([sys.executable, "-c", _RAY_NAMES, str(model_dir)], capture_output=True, text=True, check=True)
    series: dict[str, set[str]] = {}
    for name, (kind, tags) in json.loads(out.stdout.strip().splitlines()[-1]).items():
        suffixes = {"Counter": ("_total",), "Histogram": ("_bucket", "_sum", "_count")}.get(kind, ("",))
        for suffix in suffixes:
            series[f"ray_{name}{suffix}"] = set(tags)
    return series


def test_every_ray_vllm_series_queried_is_one_ray_prometheus_stat_logger_registers(model_dirs):
    series = _ray_vllm_series(model_dirs["qwen3-tiny"])
    assert {
        "ray_vllm_generation_tokens_total",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_time_to_first_token_seconds_bucket",
    } <= series.keys()
    assert _names("ray_vllm_") - series.keys() == set()
    for expr in _exprs():
        for name in {n for n in NAME.findall(expr) if n.startswith("ray_vllm_")}:
            assert _grouped(expr, name) <= series[name], (expr, name, series[name])
    assert all("ReplicaId" in tags for tags in series.values())


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


def test_a_log_line_during_a_request_carries_its_request_id(engine_app_url):
    """The Ingress logs a rejected request through Serve's logger: the line in its replica log file has the id."""
    import ray

    request_id = f"log-{uuid.uuid4().hex}"
    r = httpx.post(
        engine_app_url + "/v1/chat/completions/render",
        content=b"{not json",
        headers={"content-type": "application/json", "x-request-id": request_id},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.monotonic() + 30
    while True:
        lines = [
            line
            for path in logs.glob("replica_engine_app_Ingress_*.log")
            for line in path.read_text(errors="replace").splitlines()
            if request_id in line
        ]
        if any("-> 400" in line for line in lines):
            break
        assert time.monotonic() < deadline, f"no Ingress log line with {request_id} and '-> 400': {lines}"
        time.sleep(0.5)
