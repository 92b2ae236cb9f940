"""Model sources as vLLM takes ``--model`` (serve_app/model_source.py): builtins, directories and hub ids
read offline from a real hub-layout cache filled with a builtin model's files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app._vllm import engine_cli_args, vllm_cli_args
from serve_app.config import AppArgs
from serve_app.model_source import ModelSourceError, fetch
from tests.conftest import make_hub_cache

ROOT = Path(__file__).resolve().parents[2]
REPO = "Qwen/Qwen3-Tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def test_builtin_and_directory(model_dirs):
    assert fetch("qwen3-tiny").path == model_dirs["qwen3-tiny"]
    snap = fetch(str(model_dirs["mistral-sp"]))
    assert snap.path == model_dirs["mistral-sp"] and snap.repo_id is None and snap.commit is None


def test_hub_id_offline_from_the_cache(offline_hub, model_dirs):
    snapshot = make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    snap = fetch(REPO)
    assert (snap.path, snap.repo_id, snap.commit) == (snapshot, REPO, COMMIT)
    assert not (snap.path / "model.safetensors").exists()  # the CPU tier's cache holds no weights


def test_download_dir_is_the_cache(offline_hub, model_dirs, tmp_path):
    other = tmp_path / "models"
    snapshot = make_hub_cache(other, REPO, model_dirs["qwen3-tiny"], COMMIT)
    assert fetch(REPO, download_dir=str(other)).path == snapshot


def test_revision_picks_the_snapshot(offline_hub, model_dirs):
    make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    pinned = make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], OTHER, ref=None)
    assert fetch(REPO).commit == COMMIT  # refs/main
    assert fetch(REPO, revision=OTHER).path == pinned


def test_uncached_offline_names_the_id_the_cache_and_the_fetch(offline_hub):
    with pytest.raises(ModelSourceError) as info:
        fetch("Org/Missing", revision="v1")
    message = str(info.value)
    assert "'Org/Missing'" in message and str(offline_hub) in message and "HF_HUB_OFFLINE" in message
    assert "hf download Org/Missing --revision v1" in message
    # No lower layer's traceback: raised `from None`.
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_neither_builtin_nor_directory_nor_hub_id(offline_hub):
    with pytest.raises(ModelSourceError, match="neither a builtin"):
        fetch("/no/such/dir")


def test_app_args_resolve_a_hub_model(offline_hub, model_dirs):
    snapshot = make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    args = AppArgs(model=REPO, reasoning_parser="qwen3")
    model = args.resolve()
    assert (model.model_dir, model.tokenizer_dir) == (str(snapshot), str(snapshot))
    assert (model.hub_id, model.revision) == (REPO, COMMIT)
    assert model.served_model_names == [REPO]  # as `vllm serve ID`
    assert model.max_model_len == 4096 and model.eos_token_ids
    # The CPU tier reads the local snapshot; the engine gets the id at the pinned commit and loads
    # the weights itself, as `vllm serve` does.
    assert vllm_cli_args(args, model)[:2] == ["--model", str(snapshot)]
    argv = engine_cli_args(args, model)
    assert argv[argv.index("--model") + 1] == REPO and argv[argv.index("--revision") + 1] == COMMIT
    assert argv[argv.index("--tokenizer") + 1] == REPO and argv[argv.index("--tokenizer-revision") + 1] == COMMIT
    assert argv[argv.index("--served-model-name") + 1] == REPO


def test_download_dir_reaches_the_engine(offline_hub, model_dirs, tmp_path):
    make_hub_cache(tmp_path / "models", REPO, model_dirs["qwen3-tiny"], COMMIT)
    args = AppArgs(model=REPO, download_dir=str(tmp_path / "models"))
    argv = engine_cli_args(args, args.resolve())
    assert argv[argv.index("--download-dir") + 1] == str(tmp_path / "models")


def test_separate_tokenizer_id(offline_hub, model_dirs):
    make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    tok = make_hub_cache(offline_hub, "Qwen/Tokenizer", model_dirs["qwen3-tiny"], OTHER)
    args = AppArgs(model=REPO, tokenizer="Qwen/Tokenizer")
    model = args.resolve()
    assert model.tokenizer_dir == str(tok) and model.tokenizer_revision == OTHER
    argv = engine_cli_args(args, model)
    assert argv[argv.index("--tokenizer") + 1] == "Qwen/Tokenizer" and argv[argv.index("--tokenizer-revision") + 1] == OTHER


def test_a_replica_on_another_node_reads_the_pinned_commit(offline_hub, model_dirs, tmp_path, monkeypatch):
    """The builder pinned COMMIT; main moved on meanwhile on the replica's node, whose cache also
    sits elsewhere: the replica still reads COMMIT, from its own cache."""
    make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    model = AppArgs(model=REPO).resolve()
    node_cache = tmp_path / "node-b"
    theirs = make_hub_cache(node_cache, REPO, model_dirs["qwen3-tiny"], COMMIT, ref=None)
    make_hub_cache(node_cache, REPO, model_dirs["qwen3-tiny"], OTHER)  # refs/main -> OTHER
    monkeypatch.setenv("HF_HUB_CACHE", str(node_cache))
    here = model.on_this_node()
    assert here.model_dir == str(theirs) and here.tokenizer_dir == str(theirs)
    assert here.model_copy(update={"model_dir": model.model_dir, "tokenizer_dir": model.tokenizer_dir}) == model


def test_a_replica_without_the_snapshot_fails_clearly(offline_hub, model_dirs, tmp_path, monkeypatch):
    make_hub_cache(offline_hub, REPO, model_dirs["qwen3-tiny"], COMMIT)
    model = AppArgs(model=REPO).resolve()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelSourceError, match=f"{REPO}.*revision '{COMMIT}'.*not in the Hugging Face cache"):
        model.on_this_node()


def test_environment_read_by_a_fresh_process(model_dirs, tmp_path):
    """As a replica starts: HF_HUB_OFFLINE and HF_HUB_CACHE in its environment from the start."""
    make_hub_cache(tmp_path / "hub", REPO, model_dirs["qwen3-tiny"], COMMIT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = f"from serve_app.config import AppArgs; m = AppArgs(model={REPO!r}).resolve(); print(m.revision, m.model_dir)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [COMMIT, str(tmp_path / "hub" / "models--Qwen--Qwen3-Tiny" / "snapshots" / COMMIT)]
