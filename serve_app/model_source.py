"""Where a model's files come from, as ``vllm serve`` takes ``--model``: a builtin name
(:mod:`serve_app.models`), a local directory, or a Hugging Face id.

A hub id is resolved through ``huggingface_hub.snapshot_download`` with only the files the CPU tier
reads (config, generation config, tokenizer, chat templates), never weights: the Engine gets the id
itself and vLLM loads the weights as ``vllm serve`` does. ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` /
``HF_HOME`` and ``HF_TOKEN`` are read at call time (huggingface_hub reads them once, at import), so a
replica honours its own environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_TIER_FILES", "ModelSourceError", "Snapshot", "fetch", "hub_cache_dir", "is_offline"]

# What render, derender and the builder read (vLLM's tokenizer, config and chat-template loaders).
CPU_TIER_FILES = [
    "config.json",
    "generation_config.json",
    "params.json",  # Mistral's own config format (config_format: mistral)
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model, tokenizer.model.v3, ...
    "tekken.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*chat_template*",  # chat_template.jinja / .json, additional_chat_templates/
    "preprocessor_config.json",
    "processor_config.json",
]


class ModelSourceError(ValueError):
    """The model (or tokenizer) cannot be found; the message says where it looked and what to do."""


@dataclass(frozen=True)
class Snapshot:
    path: Path  # a local directory holding (at least) the CPU tier's files
    repo_id: str | None = None  # the hub id, when it came from the hub
    commit: str | None = None  # the hub commit ``path`` holds (``snapshots/<commit>``)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) in this process, now or at import."""
    from huggingface_hub import constants

    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The hub cache vLLM uses: ``download_dir``, else ``HF_HUB_CACHE``, else ``$HF_HOME/hub``."""
    if download_dir:
        return str(Path(download_dir).expanduser())
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", ".", "~")) or source.count("/") != 1


def fetch(source: str, revision: str | None = None, download_dir: str | None = None) -> Snapshot:
    """The local directory of ``source`` on this node, fetched (CPU-tier files only) if it is a hub id.

    Raises:
        ModelSourceError: not a builtin, not a directory here, and not (or not fully) in the hub cache
            while offline; or the hub refused it (not found, gated, unknown revision).
    """
    from serve_app.models import BUILTIN_MODELS, ensure_model, is_builtin

    if is_builtin(source):
        return Snapshot(ensure_model(source))
    path = Path(source).expanduser()
    if path.is_dir():
        return Snapshot(path.resolve())
    if _looks_like_path(source):
        raise ModelSourceError(
            f"model {source!r} is neither a builtin ({', '.join(sorted(BUILTIN_MODELS))}), nor a local "
            "directory on this node, nor a Hugging Face id (org/name)"
        )
    return _fetch_hub(source, revision, download_dir)


def _fetch_hub(repo_id: str, revision: str | None, download_dir: str | None) -> Snapshot:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache, offline = hub_cache_dir(download_dir), is_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=CPU_TIER_FILES,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        fetch_cmd = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        fetch_cmd += f" --cache-dir {cache}" if download_dir or os.environ.get("HF_HUB_CACHE") else ""
        raise ModelSourceError(
            f"model {repo_id!r}{at} is not in the Hugging Face cache {cache} and {how}; fetch it on a "
            f"machine with network into the cache every node uses: `{fetch_cmd}` (the CPU tier reads only "
            f"its config and tokenizer files; engine nodes need the weights too)"
        ) from None
    except (HFValidationError, HfHubHTTPError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(
            f"model {repo_id!r}{at} cannot be fetched from the Hugging Face hub: {first} "
            "(gated models need HF_TOKEN in the environment of every node)"
        ) from None
    snapshot = Path(path)
    commit = snapshot.name if snapshot.parent.name == "snapshots" else revision
    return Snapshot(snapshot, repo_id=repo_id, commit=commit)
