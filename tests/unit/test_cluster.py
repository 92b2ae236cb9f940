"""The local autoscaling cluster's pieces without starting Ray: its autoscaler config, node types, the
scenario's resource plan, and teardown (which must end the cluster's processes and nothing else)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness.cluster import FAKE_HEAD_NODE_ID, STATE_FILE, LocalAutoscalingCluster, node_type_of, teardown_cluster
from tests.harness.cluster_scenario import CPU_TIER_DEPLOYMENTS, NODE_TYPES, SCALED, Options, app_args


@pytest.fixture
def cluster():
    c = LocalAutoscalingCluster(NODE_TYPES, head_resources={"CPU": 1}, idle_timeout_minutes=0.25)
    yield c
    shutil.rmtree(c.temp_dir, ignore_errors=True)


def test_autoscaling_config_is_valid_for_rays_autoscaler(cluster):
    from ray.autoscaler._private.util import validate_config

    config = cluster.autoscaling_config()
    validate_config(config)
    assert config["provider"]["type"] == "fake_multinode"
    assert config["provider"]["gcs_address"] == cluster.address  # never <ip>:6379, someone else's cluster
    assert config["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 1}  # no tier resource on the head
    assert config["available_node_types"]["cpu_tier"]["max_workers"] == 2
    assert config["idle_timeout_minutes"] == 0.25


def test_ray_start_is_isolated(cluster):
    argv = cluster.argv(cluster.temp_dir / "autoscaling.json")
    assert f"--temp-dir={cluster.temp_dir}" in argv and f"--port={cluster.port}" in argv and "--block" in argv
    assert "--include-dashboard=false" in argv and "--min-worker-port=0" in argv
    env = cluster.environment()
    assert env["RAY_FAKE_CLUSTER"] == "1" and env["TMPDIR"].startswith(str(cluster.temp_dir))
    assert len(str(cluster.temp_dir)) < 30  # Ray's socket paths sit below it (108-byte limit)


def test_node_types_are_told_apart_by_their_custom_resource():
    head = {"NodeID": FAKE_HEAD_NODE_ID, "Resources": {"CPU": 1.0}}
    cpu = {"NodeID": "f" * 51 + "00001", "Resources": {"CPU": 2.0, "cpu_tier": 1.0, "memory": 1.0}}
    engine = {"NodeID": "f" * 51 + "00002", "Resources": {"CPU": 1.0, "engine_node": 1.0}}
    assert [node_type_of(n, NODE_TYPES) for n in (head, cpu, engine)] == ["head", "cpu_tier", "engine_node"]


def test_scenario_plan_needs_a_second_node_and_empties_it_first():
    """One replica of each CPU-tier deployment fills a cpu_tier node exactly, so every added replica needs a
    second node; the added replicas fit on that one node, and it always holds fewer replicas than the first,
    so Serve's downscaling (fewest replicas first) empties it and the autoscaler can remove it."""
    opts = Options()
    deployments = app_args(opts)["deployments"]
    node_cpus = NODE_TYPES["cpu_tier"].resources["CPU"]
    keys = {"Ingress": "ingress", "Render": "render", "PlainDerender": "plain_derender", "ParserDerender": "parser_derender"}
    cpus = {name: deployments[keys[name]]["ray_actor_options"]["num_cpus"] for name in CPU_TIER_DEPLOYMENTS}
    assert all(deployments[keys[n]]["ray_actor_options"]["resources"] == {"cpu_tier": 0.001} for n in CPU_TIER_DEPLOYMENTS)
    assert deployments["engine"]["ray_actor_options"]["resources"] == {"engine_node": 0.001}
    assert deployments["engine"]["ray_actor_options"]["num_cpus"] <= NODE_TYPES["engine_node"].resources["CPU"]
    assert sum(cpus.values()) == node_cpus
    maxima = {"ParserDerender": opts.parser_max, "PlainDerender": opts.plain_max}
    added = {name: maxima[name] - 1 for name in SCALED}
    assert sum(cpus[n] * k for n, k in added.items()) <= node_cpus
    assert 0 < sum(added.values()) < len(CPU_TIER_DEPLOYMENTS)


def _spawn_fake_cluster(temp_dir: Path, shm: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A stand-in for a cluster: a session leader with children (as ``ray start``), and a process that left
    the session but names the temp dir (as a raylet), with a child that names nothing, and that maps a
    /dev/shm file it never unlinks (as a SIGKILLed vLLM process leaves its shared memory)."""
    leader = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    (temp_dir / STATE_FILE).write_text(json.dumps({"sid": leader.pid}))
    code = (
        "import mmap, os, subprocess, sys, time; os.setsid(); subprocess.Popen(['sleep', '301']);"
        "f = open(sys.argv[2], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096); time.sleep(300)"
    )
    escaped = subprocess.Popen([sys.executable, "-c", code, str(temp_dir / "marker"), shm])
    return leader, escaped


def test_teardown_ends_the_clusters_processes_and_nothing_else(tmp_path):
    temp_dir = tmp_path / "sa_ray_test"
    temp_dir.mkdir()
    bystander = subprocess.Popen(["sleep", "302"])
    shm = f"/dev/shm/serve_app_test_{os.getpid()}"
    leader, escaped = _spawn_fake_cluster(temp_dir, shm)
    try:
        deadline = time.monotonic() + 10
        def ready() -> bool:
            maps = Path(f"/proc/{escaped.pid}/maps").read_text()
            return len(psutil.Process(escaped.pid).children()) >= 1 and len(psutil.Process(leader.pid).children()) >= 2 and shm in maps

        while not ready():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tree = [leader.pid, escaped.pid, *(c.pid for p in (leader, escaped) for c in psutil.Process(p.pid).children())]
        report = teardown_cluster(temp_dir, timeout_s=20)
        leader.wait(timeout=5)
        escaped.wait(timeout=5)
        assert report.found == 5 and report.left == [] and report.temp_dir_removed
        assert report.shm_removed == [shm] and not Path(shm).exists()
        assert not temp_dir.exists()
        for pid in tree:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None and os.getpid() and psutil.Process(os.getpid()).is_running()
        # Idempotent: a second sweep finds nothing.
        assert teardown_cluster(temp_dir).found == 0
    finally:
        for p in (bystander, leader, escaped):
            p.kill()
            p.wait()
        Path(shm).unlink(missing_ok=True)
