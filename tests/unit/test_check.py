"""``python -m serve_app check`` over every shipped config, offline, against a hub-layout cache whose
entries are builtin models of each config's tokenizer family.

The stand-ins: qwen3-tiny for Qwen, deepseek-v4 for DeepSeek, mistral-sp for Mistral (with a
``params.json``, Mistral's own config format, written from its ``config.json``). Their ``config.json``
gets the real model's attention heads, layers and context (from each model's published config), so
vLLM's checks of tensor / pipeline parallel sizes and ``max_model_len`` are the real ones. Llama 3 and
gpt-oss have no builtin family: ``check`` says "not cached" for them, and configs/README.md marks
them untested.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.check import CheckFailed, check_config, deployment_plan, replica_resources
from serve_app.config import AppArgs
from tests.conftest import make_hub_cache

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([ROOT / "serve_config.yaml", *(ROOT / "configs").glob("*.yaml")])

# Real shapes (num_attention_heads, num_key_value_heads, num_hidden_layers, max_position_embeddings).
STAND_INS = {
    "Qwen/Qwen3-8B": ("qwen3-tiny", {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36,
                                     "max_position_embeddings": 40960}),
    "deepseek-ai/DeepSeek-R1-0528": ("deepseek-v4", {"num_attention_heads": 128, "num_key_value_heads": 128,
                                                     "num_hidden_layers": 61, "max_position_embeddings": 163840}),
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral-sp", {"num_attention_heads": 32, "num_key_value_heads": 8,
                                                          "num_hidden_layers": 32, "max_position_embeddings": 32768}),
}
UNTESTED = {"llama3.yaml", "gpt-oss.yaml"}  # no builtin of their tokenizer family


def _params_json(config: dict) -> str:
    """Mistral's ``params.json`` for an HF Mistral ``config.json`` (the keys vLLM's adapter reads)."""
    return json.dumps({
        "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "head_dim": config["head_dim"],
        "hidden_dim": config["intermediate_size"], "n_heads": config["num_attention_heads"],
        "n_kv_heads": config["num_key_value_heads"], "norm_eps": config["rms_norm_eps"],
        "vocab_size": config["vocab_size"], "rope_theta": config["rope_theta"],
    })


@pytest.fixture
def stand_in_hub(offline_hub, model_dirs, tmp_path, monkeypatch) -> Path:
    for repo_id, (builtin, shape) in STAND_INS.items():
        snapshot = make_hub_cache(offline_hub, repo_id, model_dirs[builtin], config=shape)
        if builtin == "mistral-sp":
            (snapshot / "params.json").write_text(_params_json(json.loads((snapshot / "config.json").read_text())))
    # The DeepSeek-R1 config names vLLM's tool template, fetched next to where serve deploy runs; the
    # builtin DeepSeek template stands in for it.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    template = (ROOT / "serve_app" / "models" / "templates" / "deepseek_v4.jinja").read_text()
    (cwd / "tool_chat_template_deepseekr1.jinja").write_text(template)
    monkeypatch.chdir(cwd)
    return offline_hub


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_checks(stand_in_hub, path, capsys):
    if path.name in UNTESTED:
        with pytest.raises(CheckFailed, match=r"^not cached: model '[^']+' is not in the Hugging Face cache"):
            check_config(path)
        return
    check_config(path)
    out = capsys.readouterr().out
    app = yaml.safe_load(path.read_text())["applications"][0]
    model = app["args"]["model"]
    if model in STAND_INS:
        assert f"model: {model} (hub id, commit 0123456789abcdef0123456789abcdef01234567" in out
    assert re.search(r"total at max_replicas: [\d.]+ CPU, [\d.]+ GPU", out)
    assert "engine args ok" in out
    for flag in ("tool_call_parser", "reasoning_parser", "tokenizer_mode"):
        if app["args"].get(flag):
            assert f"--{flag.replace('_', '-')} {app['args'][flag]}" in out


def test_deepseek_r1_is_checked_at_its_parallel_sizes(stand_in_hub, capsys):
    check_config(ROOT / "configs" / "deepseek-r1.yaml")
    out = capsys.readouterr().out
    assert "tensor_parallel_size 8, pipeline_parallel_size 2" in out
    assert "--chat-template <file tool_chat_template_deepseekr1.jinja>" in out


def test_readme_marks_exactly_the_untested_configs():
    rows = [line for line in (ROOT / "configs" / "README.md").read_text().splitlines() if line.startswith("| `")]
    marked = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows if "untested" in row.lower()}
    assert marked == UNTESTED


def _config_with(tmp_path: Path, **engine) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "qwen3.yaml").read_text())
    config["applications"][0]["args"]["engine"].update(engine)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ({"tensor_parallel_size": 3}, r"attention heads \(32\) must be divisible by tensor parallel size \(3\)"),
        ({"no_such_argument": 1}, "unknown vLLM engine argument.*no_such_argument"),
        ({"max_num_seqs": "many"}, "--max-num-seqs: invalid int value"),
        ({"max_model_len": 4}, "engine.max_model_len: set max_model_len at the top level"),
    ],
)
def test_a_bad_engine_argument_is_named(stand_in_hub, tmp_path, engine, named):
    with pytest.raises(CheckFailed, match=named):
        check_config(_config_with(tmp_path, **engine))


def test_resources_follow_serve_overrides():
    """The config's ``deployments:`` entries replace build_app's options key by key, as Serve applies them."""
    args = AppArgs(reasoning_parser="qwen3", deployments={"ingress": {"ray_actor_options": {"num_cpus": 2, "memory": 1}}})
    plan = deployment_plan(args, {"Ingress": {"name": "Ingress", "num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5}}})
    assert replica_resources(plan["Ingress"]) == (3, 0.5, 0.0)
    assert replica_resources({"placement_group_bundles": [{"CPU": 1, "GPU": 1}, {"GPU": 1}], "num_replicas": 2}) == (2, 1, 2)


def _cli(path: Path, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_exit_codes_and_one_line_reason(stand_in_hub):
    bad = _cli(ROOT / "configs" / "llama3.yaml", Path.cwd(), stand_in_hub)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]  # one line, no traceback
    assert bad.stderr.startswith("error: not cached: model 'meta-llama/Llama-3.1-8B-Instruct'")
    assert "hf download meta-llama/Llama-3.1-8B-Instruct" in bad.stderr
    good = _cli(ROOT / "configs" / "qwen3.yaml", Path.cwd(), stand_in_hub)
    assert good.returncode == 0, good.stderr[-2000:]
    assert good.stdout.rstrip().endswith("ok") and "Qwen/Qwen3-8B (hub id, commit" in good.stdout
