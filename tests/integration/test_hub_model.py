"""A model given by Hugging Face id, served offline from a hub-layout cache: the whole graph, engine
included, as ``vllm serve ORG/NAME`` would start with ``HF_HUB_OFFLINE=1``.

The cache holds qwen3-tiny's files (weights too) as ``Qwen/Qwen3-Tiny``, an id that exists nowhere else:
every replica resolves it from the cache in its own environment, the CPU tier by the commit the builder
pinned, the Engine by handing the id and commit to vLLM, which finds the snapshot and loads the weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import CPU_ENGINE, QWEN3_PARSER_ARGS, deploy_app, make_hub_cache

REPO = "Qwen/Qwen3-Tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_app_url(serve_instance: None, model_dirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    cache = tmp_path_factory.mktemp("hub")
    make_hub_cache(cache, REPO, model_dirs["qwen3-tiny"], COMMIT, weights=True)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    with pytest.MonkeyPatch.context() as mp:  # the builder (this process) reads the same cache, offline
        for key, value in env.items():
            mp.setenv(key, value)
        replicas = {"ray_actor_options": {"runtime_env": {"env_vars": env}}}
        url = deploy_app(
            "hub_app",
            "/hub",
            model=REPO,
            **QWEN3_PARSER_ARGS,
            engine={"enabled": True, **CPU_ENGINE},
            deployments={k: replicas for k in ("ingress", "render", "plain_derender", "parser_derender", "engine")},
        )
    yield url
    serve.delete("hub_app")


def test_models_lists_the_hub_id(hub_app_url):
    models = httpx.get(hub_app_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [REPO]
    assert models["data"][0]["root"].endswith(f"models--Qwen--Qwen3-Tiny/snapshots/{COMMIT}")


def test_chat_completion_from_the_cached_model(hub_app_url):
    body = {"model": REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    response = httpx.post(hub_app_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == REPO
    assert data["usage"]["completion_tokens"] > 0 and data["choices"][0]["finish_reason"] in {"length", "stop"}


def test_engine_generates_by_token_ids(hub_app_url):
    body = {"model": REPO, "token_ids": [9707, 11, 1879], "sampling_params": {"max_tokens": 3, "temperature": 0}}
    response = httpx.post(hub_app_url + "/inference/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 3
