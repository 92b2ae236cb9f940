"""Workloads more than one benchmark sends: the tool-and-reasoning chat and its scripted output
(``parser_bench``, ``load_bench``), the multilingual text of the plain derender streams
(``derender_bench``, ``load_bench``), what a streamed output joins up to and two streams compared call by
call (for parity checks), whether a streamed event carries output."""

from __future__ import annotations

from typing import Any

from tests.harness.payloads import UNTYPED_WEATHER_TOOLS as TOOLS

MODEL = "qwen3-tiny"

CHAT_REQUEST: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Compare the weather in Paris and Tokyo and explain your reasoning."}],
    "tools": TOOLS,
}
THOUGHT = (
    "Let me think about what the user needs. They want the weather in Paris and in Tokyo, compared. "
    "I should call get_weather once per city, with metric units, then compare temperature, wind and rain. "
)
ANSWER = "I will look up both cities now and then compare them for you.\n"
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}\n</tool_call>'
)

MULTILINGUAL_TEXT = (
    "The history of the printing press is a story about how ideas travel. Before Gutenberg, a book was copied "
    "by hand, one page at a time, and a single library might hold a few hundred volumes. Within fifty years of "
    "the first movable-type press, millions of books were in circulation across Europe, and the price of a "
    "pamphlet fell to what a worker earned in a day. Scholars could compare the same text in two cities; errors "
    "could be found, corrected and reprinted. 印刷术的历史也是思想传播的历史。在中国，活字印刷早在毕昇的时代就已出现，"
    "而日本語の木版印刷も長い伝統を持っています。 Today we print with light and electrons 💡⚡, send a page across the "
    "world in milliseconds 🌍, and still argue about what deserves to be read 📚🤔. Numbers matter too: 3.14159, "
    "1,000,000 copies, 42% of readers, and the year 1455. Code is text as well: `def hello(): return \"world\"` and "
    "{\"key\": [1, 2, 3]}. Finally, a few accented words — café, naïve, façade, Zürich, São Paulo — and a parrot 🦜."
)


def tokenizer(model: str = MODEL) -> Any:
    """The Hugging Face tokenizer of a builtin model (built offline on first use)."""
    from transformers import AutoTokenizer

    from serve_app.config import AppArgs

    return AutoTokenizer.from_pretrained(AppArgs(model=model).resolve().tokenizer_dir)


def chat_prompt(tok: Any, request: dict[str, Any]) -> list[int]:
    """The prompt ids the chat template gives ``request`` (messages and tools), generation prompt added."""
    prompt = tok.apply_chat_template(request["messages"], tools=request.get("tools"), add_generation_prompt=True, tokenize=True)
    return list(prompt if isinstance(prompt, list) else prompt["input_ids"])


def tool_reasoning_output(tok: Any, tokens: int) -> list[int]:
    """``tokens`` output ids: a ``<think>`` block (repeated thought, cut to fit), the end of reasoning, an
    answer, two hermes ``<tool_call>``s and ``<|im_end|>``. Shorter than the fixed tail, the tail alone."""
    tail = tok.encode("\n</think>\n\n" + ANSWER + CALLS) + [tok.convert_tokens_to_ids("<|im_end|>")]
    think = tok.encode("<think>\n")
    step = tok.encode(THOUGHT)
    while len(think) + len(tail) < tokens:
        think += step
    return think[: max(0, tokens - len(tail))] + tail


def text_output(tok: Any, tokens: int) -> list[int]:
    """``tokens`` ids of :data:`MULTILINGUAL_TEXT`, repeated as paragraphs (English, CJK, emoji)."""
    ids: list[int] = []
    para = 0
    while len(ids) < tokens:
        ids += tok.encode(("\n\n" if para else "") + MULTILINGUAL_TEXT, add_special_tokens=False)
        para += 1
    return ids[:tokens]


def chat_variant(k: int, base: dict[str, Any] = CHAT_REQUEST) -> dict[str, Any]:
    """``base`` with its last user message tagged ``(conversation k)``: distinct prompts for concurrent
    streams, as real traffic has (ParserDerender's session cache keys streams by their state)."""
    messages = [dict(m) for m in base["messages"]]
    messages[-1]["content"] = f"{messages[-1]['content']} (conversation {k})"
    return {**base, "messages": messages}


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a chat stream's chunks (derender ``chunk`` objects or SSE events) add up to: content,
    reasoning, tool-call names and arguments by index, the finish reason."""
    deltas = [c["choices"][0].get("delta") or {} for c in chunks if c.get("choices")]
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            args[tc["index"]] = args.get(tc["index"], "") + (fn.get("arguments") or "")
            if fn.get("name"):
                names[tc["index"]] = names.get(tc["index"], "") + fn["name"]
    finish = None
    for c in chunks:
        for choice in c.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    return {
        "content": "".join(d.get("content") or "" for d in deltas),
        "reasoning": reasoning,
        "reasoning_chars": len(reasoning),
        "tool_names": [names.get(k, "") for k in sorted(args)],
        "tool_arguments": [args[k] for k in sorted(args)],
        "finish_reason": finish,
    }


def without_random_fields(obj: Any) -> Any:
    """``obj`` with what differs on every call left out: ``created`` anywhere, tool-call ``id`` values
    (``chatcmpl-tool-…``, random on both sides) and other ``chatcmpl-…`` ids, ``last_tool_call_ids`` entries."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "created":
                continue
            if k == "id" and isinstance(v, str) and v.startswith("chatcmpl-"):
                out[k] = "<id>"
            elif k == "last_tool_call_ids" and isinstance(v, list):
                out[k] = ["<id>"] * len(v)
            else:
                out[k] = without_random_fields(v)
        return out
    if isinstance(obj, list):
        return [without_random_fields(v) for v in obj]
    return obj


def compare_calls(ref: list[tuple[Any, Any]], ours: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Two streams' (chunk, carried state) per call, compared call by call (``created`` and random ids aside)."""
    out: dict[str, Any] = {"calls": len(ref)}
    parts = []
    for what, k in (("chunks", 0), ("states", 1)):
        a = [without_random_fields(x[k]) for x in ref]
        b = [without_random_fields(x[k]) for x in ours]
        bad = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
        if not bad and len(a) == len(b):
            parts.append(f"{what} identical")
            continue
        lengths = f" (lengths {len(a)} / {len(b)})" if len(a) != len(b) else ""
        keys = sorted({key for i in bad for key in set(a[i]) | set(b[i]) if a[i].get(key) != b[i].get(key)}) if bad else []
        parts.append(f"{what}: {len(bad)} of {len(a)} differ{lengths}" + (f" (in {', '.join(keys)})" if keys else ""))
        if bad:
            out[f"first_{what}_diff"] = {"call": bad[0], "vllm": a[bad[0]], "ours": b[bad[0]]}
    out["result"] = "; ".join(parts)
    out["identical"] = all(p.endswith("identical") for p in parts)
    return out


def has_output(event: dict[str, Any]) -> bool:
    """Whether a streamed event (an SSE chat chunk, an engine chunk) carries output: token ids, or a content,
    reasoning or tool-call delta."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("token_ids") or delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
            return True
    return False
