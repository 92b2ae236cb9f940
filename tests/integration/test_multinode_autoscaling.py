"""Multi-node autoscaling on one machine (issue 14): the graph on a local cluster that Ray's own autoscaler
grows and shrinks (fake multi-node provider), placed by tier resource as ``configs/gpu-layout.yaml``.

The scenario (``tests/harness/cluster_scenario.py``) runs as its own driver process: this session may
already have its own Ray initialised in-process. It starts an isolated cluster (head, one ``cpu_tier``
node of 2 CPUs, one ``engine_node`` node; a second ``cpu_tier`` node only when needed), deploys the app
with ParserDerender and PlainDerender autoscaled (1-2 each), ramps parser and plain derender HTTP
streams until the autoscaler adds the second node and the new replicas run on it, then trickles while
Serve scales back down and the autoscaler removes the idle node, and tears the cluster down. These
tests assert on its JSON (4 minutes on a quiet machine, 8 under load; ~10 GiB of RSS at peak).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.cluster_scenario import SCALED, run_in_subprocess

pytestmark = pytest.mark.timeout(1200)  # the scenario has 15 minutes, then its teardown


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: Path = tmp_path_factory.mktemp("multinode") / "scenario.json"
    t0 = time.monotonic()
    result, safety, rc = run_in_subprocess(out, "--logs-dir", str(out.parent / "logs"), timeout_s=900)
    log = out.with_suffix(".log").read_text(errors="replace")[-4000:] if out.with_suffix(".log").exists() else ""
    return {"result": result, "safety": safety, "rc": rc, "seconds": time.monotonic() - t0, "log": log}


def _checks(scenario: dict[str, Any], *names: str) -> None:
    result = scenario["result"]
    assert result.get("status") == "done", (result.get("status"), result.get("error"), scenario["log"])
    failed = {n: result["checks"].get(n) for n in names if not result["checks"].get(n)}
    assert not failed, failed


def _extra(result: dict[str, Any]) -> set[str]:
    return set(result["extra_nodes"])


def test_the_scenario_ran_to_the_end(scenario):
    assert scenario["rc"] == 0, (scenario["rc"], scenario["result"].get("checks"), scenario["log"])
    result = scenario["result"]
    assert result["status"] == "done" and all(result["checks"].values()), result["checks"]


def test_a_second_cpu_tier_node_joins_and_new_replicas_run_on_it(scenario):
    _checks(scenario, "started_with_one_node_of_each_type", "second_cpu_tier_node_joined", "parser_derender_scaled_up",
            "plain_derender_scaled_up", "parser_derender_replica_on_new_node", "plain_derender_replica_on_new_node")
    result = scenario["result"]
    extra = _extra(result)
    assert len(extra) == 1 and not extra & set(result["initial_nodes"])
    # The first cpu_tier node was full (4 replicas x 0.5 CPU of 2): every added replica went to the new node.
    first = next(nid for nid, kind in result["initial_nodes"].items() if kind == "cpu_tier")
    for s in result["samples"]:
        for name in SCALED:
            placed = s["placement"].get(name, {})
            assert placed.get(first, 0) <= 1 and set(placed) <= {first, *extra}, (s["t"], name, placed)


def test_replicas_scale_down_and_the_idle_node_is_removed(scenario):
    _checks(scenario, "scaled_down_to_one_replica", "extra_node_removed")
    result = scenario["result"]
    final = result["samples"][-1]
    assert final["nodes"] == {"head": 1, "cpu_tier": 1, "engine_node": 1}
    assert all(final["running"][n] == 1 for n in SCALED)
    assert any("Removing 1 nodes of type cpu_tier (idle)" in line for line in result["autoscaler_log"]), result["autoscaler_log"]
    assert result["timing"]["scale_down_s"] is not None


def test_every_stream_across_scale_up_and_down_matches_the_unloaded_run(scenario):
    _checks(scenario, "every_stream_identical", "streams_in_flight_across_scale_up", "streams_in_flight_across_scale_down")
    summary = scenario["result"]["stream_summary"]
    assert summary["identical"] == summary["total"] > 20, summary
    assert summary["across_scale_up"] > 0 and summary["across_scale_down"] > 0


def test_engine_sits_on_the_engine_node_and_the_cpu_tier_on_cpu_tier_nodes(scenario):
    _checks(scenario, "engine_on_engine_node", "cpu_tier_replicas_on_cpu_tier_nodes", "engine_serves")


def test_the_time_series_is_recorded(scenario):
    samples = scenario["result"]["samples"]
    assert len(samples) > 20
    keys = {"t", "phase", "nodes", "running", "placement", "chunks_per_s", "p99_ms"}
    assert all(keys <= set(s) for s in samples)
    assert {s["phase"] for s in samples} >= {"ramp", "peak", "trickle"}
    assert max(s["chunks_per_s"] for s in samples) > 0


def test_teardown_leaves_no_process_and_no_temp_dir(scenario):
    result, safety = scenario["result"], scenario["safety"]
    assert result["teardown"]["left"] == [] and result["teardown"]["temp_dir_removed"], result["teardown"]
    # The test's own sweep after the driver exited found nothing of the cluster either.
    assert safety is not None and safety["found"] == 0 and safety["left"] == [], safety
    assert not Path(result["temp_dir"]).exists()
