"""Two CPU Engine replicas, one SIGKILLed under composed traffic (issue 18, parallel engines).

Every kind of composed request (chat and completions, streamed and not) runs at once on two Engine
replicas; one replica's process is SIGKILLed while they generate. A request the dead replica held
before answering is sent again by the Ingress to the other replica; a stream it had started is cut
with the in-band error and retried once by the client. Every output equals a clean run's, no client
sees a 503 (a live replica is left), and all of it is over before the replacement replica is
RUNNING: nothing waited for the restart. How long the retries take is bench/engine_failover_bench.py's.

Memory: two vLLM CPU engines (~1.5 GiB each, 128 MiB KV cache) and their replacement, one Ingress.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from transformers import AutoTokenizer

from tests.conftest import SERVE_HTTP_PORT
from tests.harness.failover import (
    APP,
    KINDS,
    app_config,
    engine_replicas,
    fault_run,
    request,
    retried_request_ids,
    run_request,
    wait_engines,
)

ROUNDS = 3  # fault rounds at most, until one finds a replica holding both kinds of request


def _running() -> dict[str, int | None]:
    return {rid: pid for rid, (state, pid) in engine_replicas().items() if state == "RUNNING"}


@pytest.fixture(scope="module")
def app(serve_instance, model_dirs) -> Iterator[str]:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = app_config(f"/{APP}")
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [config]}))
    wait_engines(2)
    yield f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["qwen3-tiny"])


def test_a_killed_engine_replica_costs_composed_requests_one_retry_on_the_other(app, tok):
    clean = {}
    for kind in KINDS:
        path, body = request(kind, tok)
        run = run_request(app, kind, body, path)
        assert run.status == 200 and not run.cut and run.output and not run.output["errors"], (kind, run)
        clean[kind] = run.output
    assert clean["chat"]["text"] == clean["chat_stream"]["text"] and clean["completion"]["text"] == clean["completion_stream"]["text"]
    before = _running()
    assert len(before) == 2 and all(before.values())
    victims: list[str] = []

    def holding_both(whole_held: dict[str, int], load: dict[str, tuple[int, int]]) -> int | None:
        # The replica holding whole requests and streams, if one does: the router may have sent
        # either kind all to one replica, and then there is nothing to observe; the round is run again.
        # Per replica, the fewer of its whole requests and its streams (ongoing now less the whole ones).
        both = {rid: min(whole_held.get(rid, 0), ongoing - whole_held.get(rid, 0)) for rid, (ongoing, _) in load.items()}
        replica_id = max(both, key=both.__getitem__)
        if both[replica_id] <= 0:
            return None
        victims.append(replica_id)
        return load[replica_id][1]

    for _ in range(ROUNDS):
        since = time.time()
        runs, killed_at = fault_run(app, tok, holding_both)
        if killed_at is not None:
            break
    assert victims, f"in {ROUNDS} rounds no Engine replica held both whole requests and streams at once"
    (victim_id,) = victims

    # All of it finished before the replacement replica was RUNNING: nothing waited for the restart.
    assert set(_running()) <= set(before), engine_replicas()
    for run in runs:
        assert run.status == 200, (run.kind, run.events)  # a live replica was left: never a 503
        final = run.retry if run.cut else run
        assert final is not None and final.status == 200 and not final.cut, (run.kind, final)
        assert final.output == clean[run.kind], (run.kind, final.output, clean[run.kind])
    # The fault was observed: the killed replica held streams (cut with the in-band 503, each retried
    # once by the client, which went straight to the live replica) and whole requests (sent again by
    # the Ingress, logged with their ids: the client saw nothing).
    cut = [r for r in runs if r.cut]
    assert cut, "no stream ran on the killed replica"
    for run in cut:
        assert run.frames >= 3 and run.cut_error is not None and run.cut_error["code"] == 503, run
        partial = run.output["text"].get(0, "") if run.output else ""
        assert clean[run.kind]["text"][0].startswith(partial), (partial, clean[run.kind])
    whole = {r.response_id for r in runs if not r.cut and r.kind in ("chat", "completion")}
    deadline = time.monotonic() + 30  # log files are flushed by the replica's process, not at once
    while not (retried := retried_request_ids(since) & whole) and time.monotonic() < deadline:
        time.sleep(1)
    assert retried, "no whole request was sent again by the Ingress (none ran on the killed replica?)"
    wait_engines(2, dead={victim_id})  # the replacement, for whatever runs next


def test_engine_options_equal_ray_serve_llms_deployment_options(ray_cluster):
    """``LLMServer.get_deployment_options`` (it reads the runtime env of a running Ray) against ours."""
    pytest.importorskip("pyarrow", reason="Ray Serve LLM's config module imports pyarrow (pip install pyarrow)")
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    from serve_app.placement import placement_options

    for tp, pp, actor in [(2, 1, {"num_cpus": 1}), (4, 2, {"num_cpus": 2, "resources": {"engine_node": 0.001}}), (1, 4, {})]:
        config = LLMConfig(
            model_loading_config={"model_id": "m"},
            engine_kwargs={"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            deployment_config={"ray_actor_options": dict(actor)},
        )
        theirs = LLMServer.get_deployment_options(config)
        ours = placement_options({"ray_actor_options": actor}, {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}, "GPU", "PACK")
        their_bundles = [{k: v for k, v in b.items() if v} for b in theirs["placement_group_bundles"]]
        assert ours["placement_group_bundles"] == their_bundles, (tp, pp)
        assert ours["placement_group_strategy"] == theirs["placement_group_strategy"]
