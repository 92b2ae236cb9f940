"""The coupled oracle: what ``vllm serve``'s chat serving returns for given output token ids.

No engine runs. vLLM's real :class:`OpenAIServingChat` (built with the same flags as ``vllm serve``
would pass it, over the render stack :func:`serve_app._vllm.build_render_state` builds) is asked to
``create_chat_completion``: it renders the request with vLLM's ``OnlineRenderer`` (so the parser's
``adjust_request`` mutates the request exactly as under ``vllm serve``: e.g. hermes turning
``skip_special_tokens`` off), maps it to ``SamplingParams``, and then calls ``engine_client.generate``.
That call lands on :class:`ScriptedEngine`, which plays back scripted output token ids as the v1
engine's output processor would: one ``IncrementalDetokenizer`` per choice, built by
``IncrementalDetokenizer.from_new_request`` from an ``EngineCoreRequest`` carrying the rendered
prompt and the request's sampling params, fed with ``update(new_ids, stop_terminated)`` per engine
step (a multi-token step is speculative decoding) and read with ``get_next_output_text``; DELTA
outputs one per step (streaming), FINAL_ONLY one aggregate at the end (non-streaming). vLLM's own
``chat_completion_stream_generator`` / ``chat_completion_full_generator`` then parse the text with
the configured parsers. SSE strings are parsed back into dicts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve_app.config import AppArgs, ResolvedModel

__all__ = ["CoupledOracle", "CoupledResult", "ScriptedChoice"]


@dataclass
class ScriptedChoice:
    """One choice's engine output: the token ids, how the engine finished it, and its steps.

    ``finish_reason`` "stop" with ``stop_reason`` None or an int is an engine-side stop (EOS or a
    ``stop_token_ids`` hit): the last token is the stop token and, as in the engine, is not
    detokenized. ``chunks`` are the engine steps' token lists (concatenating to ``token_ids``).
    """

    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    chunks: list[list[int]] | None = None

    def steps(self) -> list[list[int]]:
        chunks = self.chunks if self.chunks is not None else [[t] for t in self.token_ids]
        assert [t for c in chunks for t in c] == list(self.token_ids), "chunks must concatenate to token_ids"
        assert all(chunks), "engine steps carry at least one token"
        return [list(c) for c in chunks]


@dataclass
class CoupledResult:
    prompt_token_ids: list[int]
    sampling_params: Any
    response: dict[str, Any] | None = None  # non-streaming ChatCompletionResponse
    events: list[dict[str, Any]] = field(default_factory=list)  # streaming SSE events, [DONE] excluded
    # Per choice index, when the request asked for logprobs: the same engine logprobs in the shape
    # `/inference/v1/generate` sends them (GenerateLogProbsContent dicts, one per output token),
    # which is what a derender client forwards.
    generate_logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def synthetic_logprobs_rows(token_ids: Sequence[int], num_logprobs: int, vocab: int, seed: int) -> list[tuple[list[int], list[float], int]]:
    """What the sampler would report per position: ``[sampled, top1..topk]`` ids and logprobs, and
    the sampled token's rank. Deterministic in ``seed`` so streaming and non-streaming runs agree."""
    import random

    rng = random.Random(seed)
    rows = []
    for t in token_ids:
        k = max(num_logprobs, 0)
        tops: list[int] = []
        while len(tops) < k:
            c = rng.randrange(vocab)
            if c != t and c not in tops:
                tops.append(c)
        rank = rng.randint(1, k + 1)
        top_ids = tops[: k]
        if rank <= k:  # the sampled token is among the top k, at position `rank`
            top_ids = (top_ids[: rank - 1] + [t] + top_ids[rank - 1 :])[:k]
        lps = sorted((-rng.random() * 6 for _ in range(k)), reverse=True)
        sampled_lp = lps[rank - 1] if rank <= k else (min(lps) - 0.5 if lps else -rng.random() * 6)
        rows.append(([t, *top_ids], [sampled_lp, *lps], rank))
    return rows


class _Script:
    def __init__(self, choices: Sequence[ScriptedChoice], interleave: bool) -> None:
        self.choices = list(choices)
        self.interleave = interleave
        self.prompt_token_ids: list[int] | None = None
        self.sampling_params: Any = None
        self.logprob_rows: list[list[tuple[list[int], list[float], int]]] = []
        self.generate_logprobs: dict[int, list[dict[str, Any]]] = {}


class _LogprobsOnly:
    """The fields of ``EngineCoreOutput`` that ``LogprobsProcessor.update_from_output`` reads."""

    def __init__(self, new_logprobs: Any) -> None:
        self.new_logprobs = new_logprobs
        self.new_prompt_logprobs_tensors = None
        self.prompt_token_id_logprobs = None


def _generate_logprobs(token_ids: Sequence[int], top_logprobs: Any, num: int | None) -> list[dict[str, Any]]:
    """``ServingTokens._create_tokens_logprobs`` (the generate endpoint's tokens-mode logprobs)."""
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    out = ServingTokens._create_tokens_logprobs(None, token_ids, top_logprobs, num)  # no use of self
    return [json.loads(c.model_dump_json()) for c in out.content]


class ScriptedEngine:
    """The part of ``EngineClient`` that ``OpenAIServingChat`` touches, with a scripted ``generate``."""

    def __init__(self, vllm_config: Any, renderer: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = None
        self.errored = False
        self.dead_error = RuntimeError("engine dead")
        self.script: _Script | None = None

    def check_admission(self, n: int) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    def generate(self, engine_input: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        script = self.script
        assert script is not None, "no script set"
        self.script = None
        return self._play(script, engine_input, sampling_params, request_id)

    async def _play(self, script: _Script, engine_input: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists

        prompt_ids = list(engine_input["prompt_token_ids"])
        script.prompt_token_ids = prompt_ids
        script.sampling_params = params
        tokenizer = self.renderer.tokenizer
        delta = params.output_kind == RequestOutputKind.DELTA
        n = len(script.choices)
        assert (params.n or 1) == n, f"request n={params.n} but {n} scripted choices"

        detoks, lp_procs = [], []
        for i in range(n):
            # As the engine: n > 1 becomes n child requests, each with its own detokenizer.
            child = params.clone()
            child.n = 1
            core = EngineCoreRequest(
                request_id=f"{i}_{request_id}",
                prompt_token_ids=prompt_ids,
                mm_features=None,
                sampling_params=child,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
            detoks.append(IncrementalDetokenizer.from_new_request(tokenizer, core))
            lp_procs.append(LogprobsProcessor.from_new_request(tokenizer, core))
        want_logprobs = params.logprobs is not None

        # The engine's step order: round robin over the live choices (or one choice after another).
        steps = [choice.steps() for choice in script.choices]
        order: list[tuple[int, int]] = []
        if script.interleave:
            for k in range(max(len(s) for s in steps)):
                order += [(i, k) for i in range(n) if k < len(steps[i])]
        else:
            order = [(i, k) for i in range(n) for k in range(len(steps[i]))]

        finals: list[Any] = [None] * n
        positions = [0] * n
        for i, k in order:
            choice = script.choices[i]
            ids = steps[i][k]
            last = k == len(steps[i]) - 1
            finish = choice.finish_reason if last else None
            engine_stop = finish == "stop" and not isinstance(choice.stop_reason, str)
            stop_string = detoks[i].update(ids, engine_stop)
            assert stop_string is None, "stop strings are not scripted"
            finished = finish is not None
            if want_logprobs:
                rows = script.logprob_rows[i][positions[i] : positions[i] + len(ids)]
                lp_procs[i].update_from_output(
                    _LogprobsOnly(
                        LogprobsLists(
                            np.array([r[0] for r in rows]),
                            np.array([r[1] for r in rows], dtype=np.float32),
                            np.array([r[2] for r in rows]),
                        )
                    )
                )
            positions[i] += len(ids)
            if delta:
                text = detoks[i].get_next_output_text(finished, True)
                all_lps = lp_procs[i].logprobs
                out = CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=ids,
                    cumulative_logprob=None,
                    logprobs=all_lps[-len(ids) :] if all_lps is not None else None,
                    finish_reason=finish,
                    stop_reason=choice.stop_reason if finished else None,
                )
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_ids,
                    prompt_logprobs=None,
                    outputs=[out],
                    finished=False,
                )
            elif last:
                finals[i] = CompletionOutput(
                    index=i,
                    text=detoks[i].get_next_output_text(True, False),
                    token_ids=list(detoks[i].output_token_ids),
                    cumulative_logprob=None,
                    logprobs=lp_procs[i].logprobs,
                    finish_reason=finish,
                    stop_reason=choice.stop_reason if finished else None,
                )
            await asyncio.sleep(0)
        if want_logprobs:
            for i in range(n):
                script.generate_logprobs[i] = _generate_logprobs(
                    script.choices[i].token_ids, lp_procs[i].logprobs, params.logprobs
                )
        if not delta:
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=prompt_ids,
                prompt_logprobs=None,
                outputs=finals,
                finished=True,
            )


class CoupledOracle:
    """vLLM's ``OpenAIServingChat`` over a :class:`ScriptedEngine`, for one model and flag set."""

    def __init__(self, args: AppArgs, model: ResolvedModel) -> None:
        from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.renderers.chat_utils import load_chat_template

        from serve_app._vllm import build_render_state

        self.loop = asyncio.new_event_loop()
        self.state = state = self.loop.run_until_complete(build_render_state(args, model))
        ns = state.args
        self.engine = ScriptedEngine(state.vllm_config, state.online_renderer.renderer)
        # generate/api_router.py's _chat_kwargs, as `vllm serve` builds OpenAIServingChat.
        self.serving = OpenAIServingChat(
            engine_client=self.engine,
            models=state.models,
            response_role=ns.response_role,
            online_renderer=state.online_renderer,
            request_logger=None,
            chat_template=load_chat_template(ns.chat_template),
            chat_template_content_format=ns.chat_template_content_format,
            default_chat_template_kwargs=resolve_default_chat_template_kwargs(ns),
            trust_request_chat_template=ns.trust_request_chat_template,
            return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
            enable_auto_tools=ns.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
            tool_parser=ns.tool_call_parser,
            tool_strict_level=ns.tool_strict_level,
            reasoning_parser=ns.reasoning_parser or state.vllm_config.structured_outputs_config.reasoning_parser,
            enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
            enable_force_include_usage=ns.enable_force_include_usage,
            enable_log_outputs=ns.enable_log_outputs,
            enable_log_deltas=ns.enable_log_deltas,
            enable_per_request_metrics=ns.enable_per_request_metrics,
        )
        # generate/api_router.py's completion serving, over the same engine and renderer.
        self.completion_serving = OpenAIServingCompletion(
            engine_client=self.engine,
            models=state.models,
            online_renderer=state.online_renderer,
            request_logger=None,
            return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
            enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
            enable_force_include_usage=ns.enable_force_include_usage,
            enable_per_request_metrics=ns.enable_per_request_metrics,
        )
        self.tokenizer = self.engine.renderer.tokenizer

    def run(self, chat_request: dict[str, Any], choices: Sequence[ScriptedChoice], *, interleave: bool = True) -> CoupledResult:
        """``POST /v1/chat/completions`` with ``chat_request``; the engine answers ``choices``.

        ``chat_request["stream"]`` picks the mode. Returns the parsed response or SSE events.
        """
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate(json.loads(json.dumps(chat_request)))
        return self._serve(self.serving.create_chat_completion, request, choices, interleave)

    def run_completion(self, completion_request: dict[str, Any], choices: Sequence[ScriptedChoice]) -> CoupledResult:
        """``POST /v1/completions`` with one prompt; the engine answers ``choices``."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = CompletionRequest.model_validate(json.loads(json.dumps(completion_request)))
        return self._serve(self.completion_serving.create_completion, request, choices, True)

    def _serve(self, create: Any, request: Any, choices: Sequence[ScriptedChoice], interleave: bool) -> CoupledResult:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        script = _Script(choices, interleave)
        if request.logprobs and hasattr(request, "top_logprobs"):
            num = request.top_logprobs or 0
            script.logprob_rows = [
                synthetic_logprobs_rows(c.token_ids, num, len(self.tokenizer), seed=1000 * i + len(c.token_ids))
                for i, c in enumerate(choices)
            ]
        self.engine.script = script

        async def go() -> Any:
            out = await create(request)
            if isinstance(out, ErrorResponse):
                raise AssertionError(f"vLLM rejected the request: {out.model_dump()}")
            if not request.stream:
                return json.loads(out.model_dump_json())
            events = []
            async for sse in out:
                assert sse.startswith("data: ") and sse.endswith("\n\n"), sse
                payload = sse[len("data: ") : -2]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise AssertionError(f"vLLM stream error: {event}")
                events.append(event)
            return events

        out = self.loop.run_until_complete(go())
        assert script.prompt_token_ids is not None, "the engine was never called"
        result = CoupledResult(script.prompt_token_ids, script.sampling_params, generate_logprobs=script.generate_logprobs)
        if request.stream:
            result.events = out
        else:
            result.response = out
        return result

    def close(self) -> None:
        self.loop.close()
