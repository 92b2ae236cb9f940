"""A vLLM v1 logits processor that forces a scripted token sequence per request.

A random tiny model almost never emits ``<think>`` blocks or ``<tool_call>`` JSON. To test the
reasoning and tool-call paths on realistic outputs, both our engine and a coupled ``vllm serve`` load
this processor (``--logits-processors serve_app.testing.scripted:ScriptedOutputLogitsProcessor``,
or ``engine.logits_processors`` in :class:`~serve_app.config.EngineArgs`), and a request carries its
script in ``SamplingParams.extra_args``: over OpenAI HTTP as ``"vllm_xargs": {"scripted_output":
[ids...]}``, which render copies into the ``GenerateRequest``'s ``sampling_params.extra_args``.

At output step ``i`` every logit except ``script[i]`` becomes ``-inf``, so greedy and random
sampling both pick ``script[i]``; past the end of the script the logits are left alone (end the
script with the EOS id, e.g. ``<|im_end|>``, to stop there). Logprobs stay the model's own (vLLM's
default ``raw_logprobs`` are taken before logits processors run). Requests without a script are
untouched. Cost: one row fill per scripted request per step.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

__all__ = ["SCRIPT_KEY", "ScriptedOutputLogitsProcessor"]

SCRIPT_KEY = "scripted_output"
"""The ``extra_args`` / ``vllm_xargs`` key holding the list of token ids to force."""


def _script(params: SamplingParams) -> list[int] | None:
    script = (params.extra_args or {}).get(SCRIPT_KEY)
    if script is None:
        return None
    if not isinstance(script, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in script):
        raise ValueError(f"{SCRIPT_KEY} must be a list of token ids")
    return script


class ScriptedOutputLogitsProcessor(AdapterLogitsProcessor):
    """Forces ``extra_args["scripted_output"]`` token by token; see the module docstring."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _script(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        script = _script(params)
        if not script:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(script):
                token = script[step]
                logits.fill_(float("-inf"))
                logits[token] = 0.0
            return logits

        return force
