"""``deploy/kuberay``: the RayService manifest is valid, generated from ``serve_config.yaml`` and in sync.

The schema (``rayservice.schema.json``) is a hand-written structural subset of KubeRay's RayService CRD
(its ``$comment`` says why and from what); here it must accept the manifest and reject typical mistakes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"


def _load_sync() -> Any:
    spec = importlib.util.spec_from_file_location("kuberay_sync", KUBERAY / "sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync = _load_sync()


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((KUBERAY / "rayservice.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _embedded(manifest: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _source() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def _leaves(node: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf value by path; list entries that have a ``name`` are keyed by it (applications, deployments)."""
    if isinstance(node, dict):
        return {p: v for key, value in node.items() for p, v in _leaves(value, (*path, str(key))).items()}
    if isinstance(node, list) and node and all(isinstance(e, dict) and "name" in e for e in node):
        return {p: v for entry in node for p, v in _leaves({k: v for k, v in entry.items() if k != "name"}, (*path, entry["name"])).items()}
    return {path: node}


def _groups(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _container(manifest: dict[str, Any], group: str) -> dict[str, Any]:
    return _groups(manifest)[group]["template"]["spec"]["containers"][0]


def test_manifest_validates_against_the_rayservice_schema(manifest, validator):
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(manifest)]
    assert errors == []


@pytest.mark.parametrize(
    ("mistake", "edit"),
    [
        ("misspelt field", lambda m: m["spec"]["rayClusterConfig"].__setitem__("workerGroupSpec", [])),
        ("int rayStartParams value", lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0)),
        ("unquoted resources", lambda m: _groups(m)["cpu-tier"]["rayStartParams"].__setitem__("resources", '{"cpu_tier": 1}')),
        ("unknown upgrade type", lambda m: m["spec"]["upgradeStrategy"].__setitem__("type", "Rolling")),
        ("bad quantity", lambda m: _container(m, "engine")["resources"]["limits"].__setitem__("memory", "48 GB")),
        ("worker group without maxReplicas", lambda m: _groups(m)["engine"].pop("maxReplicas")),
        ("probe without a handler", lambda m: _container(m, "cpu-tier")["livenessProbe"].pop("httpGet")),
    ],
)
def test_schema_rejects_typical_mistakes(manifest, validator, mistake, edit):
    broken = yaml.safe_load(yaml.safe_dump(manifest))
    edit(broken)
    assert not validator.is_valid(broken), mistake


def test_embedded_serve_config_is_serve_config_yaml_plus_exactly_the_documented_additions(manifest):
    embedded, source = _embedded(manifest), _source()
    assert embedded == sync.apply_additions(source)
    have, want = _leaves(embedded), _leaves(source)
    changed = {p for p in have.keys() | want.keys() if have.get(p, "<absent>") != want.get(p, "<absent>")}
    assert changed == {path for path, _, _ in sync.ADDITIONS}
    for path, value, why in sync.ADDITIONS:  # each one documented in the embedded text, too
        assert f"#   {'.'.join(path)} = {json.dumps(value)}: {why}" in manifest["spec"]["serveConfigV2"]


def test_embedded_serve_config_is_valid_for_serve_and_for_the_app(manifest):
    from ray.serve.schema import ServeDeploySchema

    from serve_app.config import AppArgs

    config = ServeDeploySchema.model_validate(_embedded(manifest))
    (app,) = config.applications
    AppArgs.model_validate(app.args)
    assert str(config.proxy_location.value) == "EveryNode"


def _declared(group: dict[str, Any]) -> dict[str, float]:
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


def test_custom_resources_pin_each_tier_to_its_group(manifest):
    groups = _groups(manifest)
    assert _declared(groups["cpu-tier"]) == {sync.CPU_TIER: 1}
    assert _declared(groups["engine"]) == {sync.ENGINE_NODE: 1}
    assert manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    gpu_limits = groups["engine"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_limits["nvidia.com/gpu"] == 1
    (app,) = _embedded(manifest)["applications"]
    asks = {d["name"]: d["ray_actor_options"] for d in app["deployments"]}
    assert set(asks) == {*sync.CPU_TIER_DEPLOYMENTS, sync.ENGINE_DEPLOYMENT}
    for name in sync.CPU_TIER_DEPLOYMENTS:
        assert asks[name]["resources"] == {sync.CPU_TIER: sync.TIER_SHARE} and not asks[name].get("num_gpus"), name
    assert asks["Engine"]["resources"] == {sync.ENGINE_NODE: sync.TIER_SHARE} and asks["Engine"]["num_gpus"] == 1


def test_gpu_layout_uses_the_same_placement_scheme():
    text = (ROOT / "configs" / "gpu-layout.yaml").read_text()
    assert f"""--resources='{{"{sync.ENGINE_NODE}": 1}}'""" in text and f"""--resources='{{"{sync.CPU_TIER}": 1}}'""" in text
    (app,) = yaml.safe_load(text)["applications"]
    for d in app["deployments"]:
        tier = sync.ENGINE_NODE if d["name"] == sync.ENGINE_DEPLOYMENT else sync.CPU_TIER
        assert d["ray_actor_options"]["resources"] == {tier: sync.TIER_SHARE}, d["name"]


def test_probes_use_the_apps_readiness_and_liveness_routes(manifest):
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & head.keys()  # KubeRay's own for the head
    for name, group in _groups(manifest).items():
        (container,) = group["template"]["spec"]["containers"]
        script = container["readinessProbe"]["exec"]["command"][-1]
        assert all(f"localhost:8000{path}" in script for path in ("/-/healthz", "/ready", "/health")), name
    cpu = _groups(manifest)["cpu-tier"]["template"]["spec"]["containers"][0]
    assert cpu["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert "livenessProbe" not in _groups(manifest)["engine"]["template"]["spec"]["containers"][0]


def test_readiness_script_needs_the_proxy_joins_on_ready_and_then_stays_while_health_answers(tmp_path):
    """Run the probe's shell logic with ``wget`` stubbed (``OK``: the paths that answer 200)."""
    script = sync._READINESS_SCRIPT.replace(sync.READY_MARK, str(tmp_path / "mark"))
    stub = tmp_path / "bin"
    stub.mkdir()
    wget = 'for a; do url="$a"; done\nfor ok in $OK; do case "$url" in *":8000$ok") exit 0;; esac; done\nexit 8\n'
    (stub / "wget").write_text("#!/bin/sh\n" + wget)
    (stub / "wget").chmod(0o755)

    def probe(*ok: str) -> bool:
        env = {"PATH": f"{stub}:/usr/bin:/bin", "OK": " ".join(ok)}
        return subprocess.run(["bash", "-c", script], env=env).returncode == 0

    assert not probe("/-/healthz", "/health")  # never ready yet: /health alone is not enough
    assert not probe("/ready", "/health")  # no proxy on this node (or it drains): no traffic
    assert probe("/-/healthz", "/ready")
    assert probe("/-/healthz", "/health")  # was ready: stays in while an Ingress answers (rolling upgrade)
    assert not probe("/-/healthz")
    assert not probe("/health", "/ready")  # proxy draining, even once ready


def test_images_and_ray_version_match_the_pinned_ray(manifest):
    from importlib.metadata import version

    ray = version("ray")
    spec = manifest["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == ray
    images = [c["image"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]]
    assert images == [f"rayproject/ray:{ray}-py311", f"rayproject/ray:{ray}-py311", f"rayproject/ray:{ray}-py311-gpu"]


def test_sync_check_passes_and_catches_a_stale_manifest(tmp_path, monkeypatch, capsys):
    done = subprocess.run([sys.executable, str(KUBERAY / "sync.py"), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    stale = tmp_path / "rayservice.yaml"
    stale.write_text((KUBERAY / "rayservice.yaml").read_text().replace("maxReplicas: 8", "maxReplicas: 9"))
    monkeypatch.setattr(sync, "OUTPUT", stale)
    assert sync.main(["--check"]) == 1
    assert "-      maxReplicas: 9" in capsys.readouterr().out
