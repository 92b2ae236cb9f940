"""``serve_app.app``: the shipped ``serve_config.yaml`` is a resource plan that fits the machine it
ships for (2 CPUs): every replica at ``max_replicas``, plus room to replace the largest one.

The real-count deployment itself runs in ``tests/e2e/test_serve_run.py`` (``/ready`` once every
replica is RUNNING); this is the arithmetic, checked without a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from serve_app.app import merge_options
from serve_app.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]
MACHINE_CPUS = 2  # the development and CI machine: the README's `make run` must fit it


def _graph(args: AppArgs) -> dict[str, Any]:
    from serve_app.derender.parser import ParserDerender
    from serve_app.derender.plain import PlainDerender
    from serve_app.engine import Engine
    from serve_app.ingress import Ingress
    from serve_app.render import Render

    graph = {"Ingress": Ingress, "Render": Render, "PlainDerender": PlainDerender}
    if args.has_parser:
        graph["ParserDerender"] = ParserDerender
    if args.engine.enabled:
        graph["Engine"] = Engine
    return graph


def plan(config: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """``{deployment: (replicas at most, logical CPUs each)}`` as Serve would run ``config``'s app."""
    (app,) = config["applications"]
    args = AppArgs.model_validate(app["args"])
    overrides = {d["name"]: d for d in app.get("deployments", [])}
    out = {}
    for name, deployment in _graph(args).items():
        override = {k: v for k, v in overrides.get(name, {}).items() if k != "name"}
        options = merge_options(deployment.func_or_class.deployment_options(args), override)
        replicas = (options.get("autoscaling_config") or {}).get("max_replicas") or options.get("num_replicas", 1)
        out[name] = (replicas, options["ray_actor_options"]["num_cpus"])
    return out


def test_serve_config_fits_the_machine_at_max_replicas_with_room_to_replace_one():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    deployments = plan(config)
    assert set(deployments) == {"Ingress", "Render", "PlainDerender", "ParserDerender", "Engine"}
    at_max = sum(n * cpus for n, cpus in deployments.values())
    largest = max(cpus for _, cpus in deployments.values())
    assert at_max + largest <= MACHINE_CPUS, deployments
    # No single point of failure in the stages that hold streams.
    assert deployments["Ingress"][0] >= 2
    parser = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["deployments"]
    (parser_options,) = [d for d in parser if d["name"] == "ParserDerender"]
    assert parser_options["autoscaling_config"]["min_replicas"] >= 2


def test_every_deployment_bounds_its_queue():
    """Overload answers 503 with Retry-After (BackPressureError), never an unbounded queue."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    for name, deployment in _graph(args).items():
        options = deployment.func_or_class.deployment_options(args)
        assert 0 < options["max_queued_requests"] <= 4 * options["max_ongoing_requests"], name
