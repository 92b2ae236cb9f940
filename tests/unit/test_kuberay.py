"""``deploy/kuberay``: one RayService manifest per GPU config (and the CPU demo), valid, in sync with its
source config, and built from it: GPUs from tensor x pipeline parallelism, node-local probes, drain
timings above Serve's, a PodDisruptionBudget for the CPU tier, HF_TOKEN from a Secret, the model cache.

The schemas (``rayservice.schema.json``, ``poddisruptionbudget.schema.json``) are hand-written
structural subsets of KubeRay's CRD and of policy/v1 (their ``$comment`` says why and from what); here
they must accept every manifest and reject typical mistakes.
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
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sync = _load_sync()
OUTPUTS = list(sync.MANIFESTS)


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((KUBERAY / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft202012Validator]:
    return {"RayService": _validator("rayservice.schema.json"), "PodDisruptionBudget": _validator("poddisruptionbudget.schema.json")}


def _docs(output: str) -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((ROOT / output).read_text()))
    assert [d["kind"] for d in docs] == ["RayService", "PodDisruptionBudget"]
    return {d["kind"]: d for d in docs}


def _source(output: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / sync.MANIFESTS[output][0]).read_text())


def _embedded(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def _groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _pods(service: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod template: the head's, then each worker group's."""
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


def _containers(service: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for pod in _pods(service) for c in pod["spec"]["containers"]]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def _leaves(node: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf value by path; list entries that have a ``name`` are keyed by it (applications, deployments)."""
    if isinstance(node, dict):
        return {p: v for key, value in node.items() for p, v in _leaves(value, (*path, str(key))).items()}
    if isinstance(node, list) and node and all(isinstance(e, dict) and "name" in e for e in node):
        return {p: v for entry in node for p, v in _leaves({k: v for k, v in entry.items() if k != "name"}, (*path, entry["name"])).items()}
    return {path: node}


# -- the deployments' code defaults, from the code ---------------------------------------------------


def _code_defaults() -> dict[str, dict[str, Any]]:
    from serve_app.config import AppArgs
    from serve_app.derender.parser import ParserDerender
    from serve_app.derender.plain import PlainDerender
    from serve_app.engine import Engine
    from serve_app.ingress import Ingress
    from serve_app.render import Render

    return {d.name: d.func_or_class.deployment_options(AppArgs()) for d in (Ingress, Render, PlainDerender, ParserDerender, Engine)}


ARG_KEYS = {**sync.CPU_TIER_DEPLOYMENTS, sync.ENGINE_DEPLOYMENT: sync.ENGINE_KEY}


def _effective(app: dict[str, Any], name: str, option: str) -> Any:
    """A deployment option as Serve ends up with it (``serve_app.app.merge_options`` for args.deployments,
    then Serve's config override, which replaces a whole option)."""
    from serve_app.app import merge_options

    serve = next((d for d in app.get("deployments") or [] if d["name"] == name), {})
    if option in serve:
        return serve[option]
    merged = merge_options(_code_defaults()[name], (app["args"].get("deployments") or {}).get(ARG_KEYS[name]) or {})
    return merged.get(option)


def _deployed(app: dict[str, Any]) -> list[str]:
    args = app["args"]
    names = ["Ingress", "Render", "PlainDerender"]
    if args.get("tool_call_parser") or args.get("reasoning_parser"):
        names.append("ParserDerender")
    if (args.get("engine") or {}).get("enabled"):
        names.append("Engine")
    return names


# -- validity and sync -------------------------------------------------------------------------------


def test_the_manifests_are_one_per_gpu_config_and_the_demo():
    sources = {src for src, _ in sync.MANIFESTS.values()}
    gpu_configs = {f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml") if p.name != "gpu-layout.yaml"}
    assert sources == gpu_configs | {"serve_config.yaml"}
    assert {p.name for p in KUBERAY.glob("*.rayservice.yaml")} == {Path(o).name for o in OUTPUTS}


@pytest.mark.parametrize("output", OUTPUTS)
def test_manifest_validates_against_the_schemas(output, validators):
    for kind, doc in _docs(output).items():
        assert [f"{e.json_path}: {e.message}" for e in validators[kind].iter_errors(doc)] == [], kind


@pytest.mark.parametrize(
    ("mistake", "edit"),
    [
        ("misspelt field", lambda s, p: s["spec"]["rayClusterConfig"].__setitem__("workerGroupSpec", [])),
        (
            "int rayStartParams value",
            lambda s, p: s["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),
        ),
        ("unquoted rayStartParams resources", lambda s, p: _groups(s)["engine"]["rayStartParams"].__setitem__("resources", '{"x": 1}')),
        ("resources in both places", lambda s, p: _groups(s)["cpu-tier"]["rayStartParams"].__setitem__("num-cpus", "4")),
        ("rayStartParams labels", lambda s, p: _groups(s)["cpu-tier"]["rayStartParams"].__setitem__("labels", "a=b")),
        ("bad label key", lambda s, p: _groups(s)["cpu-tier"]["labels"].__setitem__("serve app/tier", "cpu")),
        ("bad group quantity", lambda s, p: _groups(s)["cpu-tier"]["resources"].__setitem__("cpu_tier", "one")),
        ("unknown upgrade type", lambda s, p: s["spec"]["upgradeStrategy"].__setitem__("type", "Rolling")),
        (
            "bad quantity",
            lambda s, p: _groups(s)["engine"]["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("memory", "48 GB"),
        ),
        ("worker group without maxReplicas", lambda s, p: _groups(s)["engine"].pop("maxReplicas")),
        (
            "preStop without a handler",
            lambda s, p: _groups(s)["cpu-tier"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"].pop("exec"),
        ),
        ("volume without a source", lambda s, p: _groups(s)["cpu-tier"]["template"]["spec"]["volumes"][0].pop("persistentVolumeClaim")),
        ("PDB with both bounds", lambda s, p: p["spec"].__setitem__("maxUnavailable", 1)),
        ("PDB misspelt field", lambda s, p: p["spec"].__setitem__("minAvailible", 1)),
    ],
)
def test_schemas_reject_typical_mistakes(validators, mistake, edit):
    docs = _docs("deploy/kuberay/qwen3.rayservice.yaml")
    service, budget = yaml.safe_load(yaml.safe_dump(docs["RayService"])), yaml.safe_load(yaml.safe_dump(docs["PodDisruptionBudget"]))
    edit(service, budget)
    assert not (validators["RayService"].is_valid(service) and validators["PodDisruptionBudget"].is_valid(budget)), mistake


def test_sync_check_passes_for_every_manifest_and_catches_a_stale_one(tmp_path, capsys):
    done = subprocess.run([sys.executable, str(KUBERAY / "sync.py"), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("is in sync with") == len(OUTPUTS)
    stale = tmp_path / "qwen3.rayservice.yaml"
    stale.write_text((KUBERAY / "qwen3.rayservice.yaml").read_text().replace("maxReplicas: 8", "maxReplicas: 9"))
    assert sync.main(["--source", str(ROOT / "configs" / "qwen3.yaml"), "--output", str(stale), "--check"]) == 1
    assert "-      maxReplicas: 9" in capsys.readouterr().out


@pytest.mark.parametrize("output", OUTPUTS)
def test_embedded_serve_config_is_the_source_plus_exactly_the_documented_additions(output):
    service = _docs(output)["RayService"]
    embedded, source = _embedded(service), _source(output)
    adds = sync.additions(source, sync.MANIFESTS[output][1])
    assert embedded == sync.apply_additions(source, adds)
    have, want = _leaves(embedded), _leaves(source)
    changed = {p for p in have.keys() | want.keys() if have.get(p, "<absent>") != want.get(p, "<absent>")}
    assert changed == {path for path, _, _ in adds}
    for path, value, why in adds:  # each one documented in the embedded text, too
        assert f"#   {'.'.join(path)} = {json.dumps(value)}: {why}" in service["spec"]["serveConfigV2"]


@pytest.mark.parametrize("output", OUTPUTS)
def test_embedded_serve_config_is_valid_for_serve_and_for_the_app(output):
    from ray.serve._private.config import ReplicaConfig
    from ray.serve.schema import ServeDeploySchema

    from serve_app.config import AppArgs

    embedded = _embedded(_docs(output)["RayService"])
    config = ServeDeploySchema.model_validate(embedded)
    (app,) = config.applications
    AppArgs.model_validate(app.args)
    assert str(config.proxy_location.value) == "EveryNode"
    for name in _deployed(_app(embedded)):  # what each replica asks Ray for, through Serve's own checks
        ReplicaConfig.create(object, ray_actor_options=_effective(_app(embedded), name, "ray_actor_options"))


# -- what the cluster is built from the config -------------------------------------------------------


def _parallel(engine: dict[str, Any], key: str) -> int:
    return int(engine.get(key) or (engine.get("extra_engine_args") or {}).get(key) or 1)


@pytest.mark.parametrize("output", OUTPUTS)
def test_engine_group_holds_tensor_x_pipeline_gpus_per_replica(output):
    service, source, opts = _docs(output)["RayService"], _source(output), sync.MANIFESTS[output][1]
    engine = _app(source)["args"]["engine"]
    group = _groups(service)["engine"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    if opts.engine_accelerator == "CPU":  # the demo: vLLM's CPU backend, no GPUs anywhere
        assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in _containers(service))
        return
    tp, pp = _parallel(engine, "tensor_parallel_size"), _parallel(engine, "pipeline_parallel_size")
    per_pod = limits["nvidia.com/gpu"]
    assert per_pod % tp == 0 and per_pod <= opts.gpus_per_node  # a TP group never straddles pods
    assert (tp * pp) % per_pod == 0
    pods = tp * pp // per_pod
    auto = _effective(_app(source), "Engine", "autoscaling_config") or {}
    num = _effective(_app(source), "Engine", "num_replicas")
    lo, hi = (num, num) if isinstance(num, int) else (auto.get("min_replicas", 1), auto.get("max_replicas", 1))
    assert (group["minReplicas"], group["maxReplicas"]) == (lo * pods, hi * pods)
    assert group["template"]["spec"]["containers"][0]["image"].endswith("-gpu")


def _with_engine(engine: dict[str, Any], engine_options: dict[str, Any] | None = None) -> str:
    config = yaml.safe_load((ROOT / "configs" / "qwen3.yaml").read_text())
    app = _app(config)
    app["args"]["engine"] = {"enabled": True, **engine}
    app["args"]["deployments"] = {"engine": engine_options or {}}
    return yaml.safe_dump(config)


@pytest.mark.parametrize(
    ("engine", "options", "gpus_per_pod", "pods", "replicas"),
    [
        ({"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, {}, 8, 2, (1, 1)),  # DeepSeek-R1 on two 8-GPU nodes
        ({"extra_engine_args": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}}, {}, 8, 2, (1, 1)),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {"num_replicas": 3}, 4, 1, (3, 3)),  # fits one node
        ({"tensor_parallel_size": 4}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, 4, 1, (1, 4)),
        ({}, {"ray_actor_options": {"num_gpus": 1}}, 1, 1, (1, 1)),
    ],
)
def test_gpus_per_pod_and_pods_per_replica_follow_tp_and_pp(engine, options, gpus_per_pod, pods, replicas):
    service, _ = sync.build_manifest(_with_engine(engine, options), sync.Options(), "t")
    group = _groups(service)["engine"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus_per_pod
    assert (group["minReplicas"], group["maxReplicas"]) == (replicas[0] * pods, replicas[1] * pods)


@pytest.mark.parametrize(
    ("engine", "options", "message"),
    [
        ({"tensor_parallel_size": 16}, {}, "exceeds the 8 GPUs of one node"),
        ({"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "placement_group_strategy": "STRICT_PACK"}, {}, "STRICT_PACK"),
        ({}, {}, "must ask for it"),  # one GPU worker: the replica itself takes the GPU
        ({"tensor_parallel_size": 2}, {"ray_actor_options": {"num_gpus": 1}}, "takes no GPU itself"),
        ({"tensor_parallel_size": 2, "extra_engine_args": {"tensor_parallel_size": 4}}, {}, "disagree"),
    ],
)
def test_impossible_engine_shapes_are_refused_with_a_reason(tmp_path, capsys, engine, options, message):
    source = tmp_path / "model.yaml"
    source.write_text(_with_engine(engine, options))
    assert sync.main(["--source", str(source), "--output", str(tmp_path / "m.yaml")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m.yaml").exists()


def test_a_parallel_engines_actor_options_must_be_where_its_placement_group_is_built(tmp_path, capsys):
    config = yaml.safe_load(_with_engine({"tensor_parallel_size": 2}))
    _app(config)["deployments"].append({"name": "Engine", "ray_actor_options": {"num_cpus": 2}})
    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(config))
    assert sync.main(["--source", str(source), "--output", str(tmp_path / "m.yaml")]) == 2
    assert "under args.deployments.engine" in capsys.readouterr().err


def test_a_manifest_for_ones_own_config_is_written_valid_and_checked(tmp_path, validators):
    source, output = tmp_path / "my-model.yaml", tmp_path / "my-model.rayservice.yaml"
    source.write_text(_with_engine({"tensor_parallel_size": 8, "pipeline_parallel_size": 2}))
    flags = ["--model-cache", "hostpath:/mnt/hf", "--offline"]
    assert sync.main(["--source", str(source), "--output", str(output), *flags]) == 0
    assert sync.main(["--source", str(source), "--output", str(output), *flags, "--check"]) == 0
    service, budget = yaml.safe_load_all(output.read_text())
    assert validators["RayService"].is_valid(service) and validators["PodDisruptionBudget"].is_valid(budget)
    assert service["metadata"]["name"] == "serve-app-my-model"
    assert f"--output {output} --model-cache hostpath:/mnt/hf --offline" in output.read_text().splitlines()[1]
    for pod in _pods(service):
        assert pod["spec"]["volumes"] == [{"name": "model-cache", "hostPath": {"path": "/mnt/hf", "type": "DirectoryOrCreate"}}]
        assert _env(pod["spec"]["containers"][0])["HF_HUB_OFFLINE"] == "1"


# -- probes, draining, disruption --------------------------------------------------------------------


@pytest.mark.parametrize("output", OUTPUTS)
def test_probes_are_kuberays_node_local_ones(output):
    """No probe is set, so KubeRay injects its own (raylet health through this pod's dashboard agent;
    for RayService workers also this pod's Serve proxy /-/healthz on the port named ``serve``). An
    application route through HAProxy reaches any pod's Ingress: never a liveness probe here."""
    service = _docs(output)["RayService"]
    port = _embedded(service)["http_options"]["port"]
    for container in _containers(service):
        assert not {"livenessProbe", "readinessProbe", "startupProbe"} & container.keys(), container["name"]
    for group in _groups(service).values():
        (container,) = group["template"]["spec"]["containers"]
        assert {"name": "serve", "containerPort": port} in container["ports"]


@pytest.mark.parametrize("output", OUTPUTS)
def test_grace_period_exceeds_prestop_plus_drain_which_exceeds_serves_graceful_shutdown(output):
    from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S

    service = _docs(output)["RayService"]
    app = _app(_embedded(service))
    serve_s = max(_effective(app, n, "graceful_shutdown_timeout_s") or DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S for n in _deployed(app))
    assert serve_s >= 120  # the Ingress's own (serve_app/ingress.py)
    for pod in _pods(service):
        (container,) = pod["spec"]["containers"]
        drain = float(_env(container)["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        prestop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert prestop[0] == "sleep"  # only a sleep: no `ray stop` (KubeRay PR #2724)
        assert pod["spec"]["terminationGracePeriodSeconds"] > float(prestop[1]) + drain and drain > serve_s
    for group in _groups(service).values():  # every HTTP endpoint sleeps before SIGTERM
        assert group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]


def test_sync_graceful_shutdown_defaults_are_the_codes():
    from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S

    defaults = _code_defaults()
    for name in ARG_KEYS:
        want = defaults[name].get("graceful_shutdown_timeout_s", DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)
        assert sync.CODE_GRACEFUL_SHUTDOWN_S.get(name, sync.SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S) == want, name


def _pod_labels(service: dict[str, Any], group: dict[str, Any]) -> dict[str, str]:
    """The labels KubeRay gives a worker pod (common/pod.go labelPod: template labels, the group's
    labels, then ray.io/node-type and ray.io/group, which cannot be overridden)."""
    return {
        **group["template"].get("metadata", {}).get("labels", {}),
        **group.get("labels", {}),
        "ray.io/node-type": "worker",
        "ray.io/group": group["groupName"],
        "ray.io/is-ray-node": "yes",
    }


@pytest.mark.parametrize("output", OUTPUTS)
def test_disruption_budget_keeps_a_cpu_tier_pod_and_selects_only_those(output):
    docs = _docs(output)
    service, budget = docs["RayService"], docs["PodDisruptionBudget"]
    groups = _groups(service)
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= _pod_labels(service, groups["cpu-tier"]).items()
    assert not selector.items() <= _pod_labels(service, groups["engine"]).items()
    assert selector["app.kubernetes.io/instance"] == service["metadata"]["name"]  # not another RayService's pods
    # An integer minAvailable (the only kind for operator-owned pods), below minReplicas so a node can drain.
    assert isinstance(budget["spec"]["minAvailable"], int)
    assert 1 <= budget["spec"]["minAvailable"] < groups["cpu-tier"]["minReplicas"]


# -- environment, secrets, model cache ---------------------------------------------------------------


@pytest.mark.parametrize("output", OUTPUTS)
def test_every_pod_gets_hf_token_from_a_secret_and_the_hub_cache_on_the_model_volume(output):
    service = _docs(output)["RayService"]
    for pod in _pods(service):
        (container,) = pod["spec"]["containers"]
        env = _env(container)
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": sync.HF_SECRET, "key": "HF_TOKEN", "optional": True}}
        assert env["VLLM_API_KEY"]["secretKeyRef"]["optional"] is True
        assert env["HF_HUB_OFFLINE"] in ("0", "1")
        (mount,) = [m for m in container["volumeMounts"] if env["HF_HOME"].startswith(m["mountPath"])]
        assert env["HF_HUB_CACHE"] == env["HF_HOME"] + "/hub"
        assert mount["name"] in {v["name"] for v in pod["spec"]["volumes"]}
    if output != "deploy/kuberay/demo.rayservice.yaml":  # a real model: a cache that outlives pods
        assert _pods(service)[0]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "hf-model-cache"}


@pytest.mark.parametrize("output", OUTPUTS)
def test_every_container_starts_ray_with_make_runs_serve_env(output):
    from serve_app.front_door import HAPROXY_BALANCE

    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("SERVE_ENV :="))
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in line
    for container in _containers(_docs(output)["RayService"]):
        env = _env(container)
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"] == HAPROXY_BALANCE


# -- placement ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("output", OUTPUTS)
def test_each_tier_is_pinned_to_its_group_by_resource_and_label(output):
    service = _docs(output)["RayService"]
    groups, app = _groups(service), _app(_embedded(service))
    cpu, engine = groups["cpu-tier"], groups["engine"]
    assert cpu["resources"] == {sync.CPU_TIER: "1"} and engine["resources"] == {sync.ENGINE_NODE: "1"}
    assert service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    assert service["spec"]["rayClusterConfig"]["autoscalerOptions"]["version"] == "v2"  # scales for label selectors
    for name in _deployed(app):
        asks = _effective(app, name, "ray_actor_options")
        if name == "Engine":
            assert asks["resources"] == {sync.ENGINE_NODE: sync.TIER_SHARE}
            continue
        assert asks["resources"] == {sync.CPU_TIER: sync.TIER_SHARE} and not asks.get("num_gpus"), name
        assert asks["label_selector"].items() <= cpu["labels"].items(), name
        assert not asks["label_selector"].items() <= engine["labels"].items(), name


def test_gpu_layout_uses_the_same_custom_resources():
    text = (ROOT / "configs" / "gpu-layout.yaml").read_text()
    assert f"""--resources='{{"{sync.ENGINE_NODE}": 1}}'""" in text and f"""--resources='{{"{sync.CPU_TIER}": 1}}'""" in text
    app = _app(yaml.safe_load(text))
    for name in _deployed(app):
        tier = sync.ENGINE_NODE if name == sync.ENGINE_DEPLOYMENT else sync.CPU_TIER
        assert _effective(app, name, "ray_actor_options")["resources"] == {tier: sync.TIER_SHARE}, name


def test_images_and_ray_version_match_the_pinned_ray():
    from importlib.metadata import version

    ray = version("ray")
    for output in OUTPUTS:
        cluster = _docs(output)["RayService"]["spec"]["rayClusterConfig"]
        assert cluster["rayVersion"] == ray
        for container in _containers(_docs(output)["RayService"]):
            assert container["image"] in (f"rayproject/ray:{ray}-py311", f"rayproject/ray:{ray}-py311-gpu")
