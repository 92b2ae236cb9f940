"""Derender wire models with vLLM 0.32's class and field names, in plain pydantic (no vLLM import).

They mirror ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` field for field, so a
client written for ``vllm launch render`` works unchanged and validation errors carry the same
``loc`` (the union branch names included). ``tests/unit/test_protocol.py`` compares them with
vLLM's. Only the derender side lives here; render reuses vLLM's own request models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator, model_validator

__all__ = [
    "DerenderChatRequest",
    "DerenderChatStreamRequest",
    "DerenderCompletionRequest",
    "DerenderCompletionStreamRequest",
    "DerenderStreamState",
    "GenerateLogProb",
    "GenerateLogProbs",
    "GenerateLogProbsContent",
    "GenerateTokensChoice",
    "GenerateTokensResponse",
    "GenerateTokensStreamChoice",
    "GenerateTokensStreamResponse",
    "PREV_TOKENS_LIMIT",
]

PREV_TOKENS_LIMIT = 1024
"""vLLM's bound on ``DerenderStreamState.prev_tokens``."""

_U32 = 2**32
TokenId = Annotated[int, Field(ge=0, lt=_U32)]
"""A token id the tokenizer can take: the Rust tokenizers raise ``OverflowError`` outside u32 (a 500
otherwise). Ids past the vocabulary stay valid: derender decodes them as empty, as vLLM does."""


class _OpenAIModel(BaseModel):
    """vLLM's ``OpenAIBaseModel``: unknown keys are kept and echoed back."""

    model_config = ConfigDict(extra="allow")


class UsageInfo(_OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class SpeculativeDecodingMetrics(_OpenAIModel):
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None


class PerRequestMetrics(_OpenAIModel):
    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None
    speculative_decoding: SpeculativeDecodingMetrics | None = None


class Logprob(BaseModel):
    logprob: FiniteFloat  # echoed into the response, where NaN and infinity cannot be written
    rank: int | None = None
    decoded_token: str | None = None


class PlaceholderRangeInfo(BaseModel):
    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class WeightVersionSpan(BaseModel):
    version: str
    start: int
    end: int


class GenerateLogProb(BaseModel):
    token_id: TokenId
    logprob: FiniteFloat  # echoed into the response, where NaN and infinity cannot be written
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


def _no_negative_ids(v: list[int] | None) -> list[int] | None:
    if v is not None and any(t < 0 for t in v):
        raise ValueError("token_ids must not contain negative values")
    return v


class GenerateTokensChoice(BaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[Annotated[int, Field(lt=_U32)]] | None = None  # negatives: vLLM's message, below
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: GenerateLogProbs | None = None

    _validate_token_ids = field_validator("token_ids")(_no_negative_ids)


class GenerateTokensStreamChoice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateTokensResponse(BaseModel):
    request_id: str = Field(default_factory=lambda: __import__("uuid").uuid4().hex[:16])
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    mm_placeholders: dict[str, list[PlaceholderRangeInfo]] | None = None
    metrics: PerRequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensChoice]


class GenerateTokensStreamResponse(BaseModel):
    request_id: str = Field(default_factory=lambda: __import__("uuid").uuid4().hex[:16])
    usage: UsageInfo | None = None
    prompt_token_ids: list[TokenId] | None = None
    mm_placeholders: dict[str, list[PlaceholderRangeInfo]] | None = None
    metrics: PerRequestMetrics | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensStreamChoice]


class ChatCompletionRequest(_OpenAIModel):
    """The fields of the original chat request that plain derender reads (the rest is kept)."""

    messages: list[Any]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = None
    # Which final token is a stop token whose text is left out (serve_app/derender/stop.py).
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(_OpenAIModel):
    """The fields of the original completion request that derender reads (the rest is kept)."""

    prompt: Any = None
    prompt_embeds: Any = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _prompt_given(self) -> CompletionRequest:
        if not self.prompt and not self.prompt_embeds:
            # vLLM raises its own (non-ValueError) validation error here, reported as a plain 400
            # with param "prompt"; an ApiError passes through pydantic the same way.
            from serve_app.errors import BadRequestError

            raise BadRequestError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        return self


class DerenderStreamState(BaseModel):
    """Client-carried state between streaming derender calls (vLLM 0.32's shape).

    The plain path carries only a bounded incremental-decode window (``prev_tokens`` from
    ``prefix_offset`` on): O(1) bytes per chunk, whatever the generation length.
    """

    prev_tokens: list[str] = Field(default_factory=list)
    prefix_offset: int = Field(default=0, ge=0)
    read_offset: int = Field(default=0, ge=0)
    role_sent: bool = False
    logprob_context_token_ids: list[TokenId] = Field(default_factory=list, max_length=4)
    logprob_text_offset: int = Field(default=0, ge=0)
    output_token_ids: list[TokenId] = Field(default_factory=list)
    output_chunk_lens: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = Field(default_factory=list)

    @field_validator("prev_tokens")
    @classmethod
    def _bound_prev_tokens(cls, v: list[str]) -> list[str]:
        if len(v) > PREV_TOKENS_LIMIT:
            raise ValueError(f"prev_tokens length ({len(v)}) exceeds maximum ({PREV_TOKENS_LIMIT})")
        return v

    @model_validator(mode="after")
    def _validate_output_chunk_lens(self) -> DerenderStreamState:
        total = sum(self.output_chunk_lens)
        if total != len(self.output_token_ids):
            raise ValueError(
                f"output_chunk_lens must sum to len(output_token_ids) "
                f"(got sum={total}, len(output_token_ids)={len(self.output_token_ids)})"
            )
        return self


class DerenderChatRequest(BaseModel):
    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateTokensResponse
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderChatStreamRequest(BaseModel):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateTokensStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionRequest(BaseModel):
    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[GenerateTokensResponse]
    prompt_tokens: list[int] | None = None
    prompt_token_ids: list[list[TokenId] | None] | None = None
    completion_request: CompletionRequest | None = None

    @model_validator(mode="after")
    def _validate_prompt_tokens_length(self) -> DerenderCompletionRequest:
        n = len(self.generate_responses)
        if self.prompt_tokens is not None and len(self.prompt_tokens) != n:
            raise ValueError(f"prompt_tokens length ({len(self.prompt_tokens)}) must equal generate_responses length ({n})")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != n:
            raise ValueError(
                f"prompt_token_ids length ({len(self.prompt_token_ids)}) must equal generate_responses length ({n})"
            )
        return self


class DerenderCompletionStreamRequest(BaseModel):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateTokensStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[TokenId] | None = None
    completion_request: CompletionRequest | None = None


DerenderChatRequestUnion = DerenderChatRequest | DerenderChatStreamRequest
DerenderCompletionRequestUnion = DerenderCompletionRequest | DerenderCompletionStreamRequest
