"""``serve_app.render_cache``: the prompt-piece token cache gives exactly the tokenizer's ids.

Real tokenizers (the three builtin families), no vLLM: the ids of a rendered chat prompt from
:class:`PrefixTokenizer` must equal the ids of the call vLLM makes (``tokenizer(text,
add_special_tokens=False)``), cold and warm, for generated conversations (hypothesis) rendered by each
model's own chat template; special-token strings inside message text, odd whitespace and combining
characters included. The cache's bounds and eviction, and the verdicts that turn it off where a
piece-wise encode would differ, are checked too, each against the tokenizer's real behaviour.
"""

from __future__ import annotations

import copy
import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.render_cache import PieceCache, PrefixTokenizer, cache_verdict, cut_tokens

MODELS = ("qwen3-tiny", "deepseek-v4", "mistral-sp")


@pytest.fixture(scope="module")
def hf(model_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(model_dirs[name])) for name in MODELS}


def _templates(tok: Any) -> list[str]:
    t = tok.chat_template
    return list(t.values()) if isinstance(t, dict) else [t]


@pytest.fixture(scope="module")
def encoders(hf: dict[str, Any]) -> dict[str, PrefixTokenizer]:
    out = {}
    for name, tok in hf.items():
        encoder, why = PrefixTokenizer.for_tokenizer(tok, _templates(tok))
        assert encoder is not None, f"{name}: {why}"
        out[name] = encoder
    return out


def test_cuts_are_the_template_tokens(encoders: dict[str, PrefixTokenizer]) -> None:
    assert {"<|im_start|>", "<|im_end|>", "<tool_call>", "<tool_response>", "<think>"} <= set(encoders["qwen3-tiny"].cuts)
    assert {"<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"} <= set(encoders["deepseek-v4"].cuts)
    assert encoders["mistral-sp"].cuts == ["</s>"]  # [INST] is plain text in this vocabulary


# --- exactness on rendered conversations -------------------------------------------------------------

_TEXT = st.lists(
    st.one_of(
        st.sampled_from(list("abc xyz\n\t  .,:{}\"'") + ["é", "e\u0301", "\u0301", "東京", "🦜", "\u00a0", "▁"]),
        st.sampled_from(["<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "<｜User｜>", "</s>", "<s>", "[INST]"]),
    ),
    max_size=40,
).map("".join)


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    """A growing chat: system, then user / assistant (with reasoning and tool calls) / tool turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": draw(_TEXT)}]
    for i in range(draw(st.integers(1, 5))):
        messages.append({"role": "user", "content": draw(_TEXT) or "hi"})
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": draw(_TEXT)})}}
        reply: dict[str, Any] = {"role": "assistant", "content": draw(_TEXT), "reasoning_content": draw(_TEXT)}
        if draw(st.booleans()):
            reply["tool_calls"] = [call]
            messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": draw(_TEXT)}]
            messages.append({"role": "assistant", "content": draw(_TEXT) or "ok"})
        else:
            messages.append(reply)
    return messages


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <|im_end|> of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _prefixes(tok: Any, name: str, messages: list[dict[str, Any]]) -> list[str]:
    """The conversation rendered after each user turn, as an agent sends it turn by turn."""
    out = []
    for end in range(2, len(messages) + 1):
        chat = messages[:end]
        if chat[-1]["role"] != "user":
            continue
        if name == "mistral-sp":  # its template: alternating user / assistant only, no tools
            chat = [m for m in chat if m["role"] in ("user", "assistant") and "tool_calls" not in m]
            chat = [m for i, m in enumerate(chat) if m["role"] == ("user", "assistant")[i % 2]]
            if not chat or chat[-1]["role"] != "user":
                continue
        kwargs = {} if name == "mistral-sp" else {"tools": TOOLS}
        out.append(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs))
    return out


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_rendered_conversations_encode_as_the_tokenizer(hf: dict[str, Any], encoders: dict[str, PrefixTokenizer],
                                                        name: str, messages: list[dict[str, Any]]) -> None:
    tok, warm = hf[name], encoders[name]  # one encoder per model for the whole run: its cache warms up
    for text in _prefixes(tok, name, messages):
        want = tok(text, add_special_tokens=False)["input_ids"]
        cold = PrefixTokenizer(warm.backend, warm.cuts, PieceCache()).encode(text)
        assert cold == want
        assert warm.encode(text) == want
        assert warm.encode(text) == want  # every piece from the cache now


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_any_text_encodes_as_the_tokenizer(hf: dict[str, Any], encoders: dict[str, PrefixTokenizer], name: str, text: str) -> None:
    assert encoders[name].encode(text) == hf[name](text, add_special_tokens=False)["input_ids"]


def test_warm_cache_tokenizes_only_new_text(hf: dict[str, Any]) -> None:
    tok = hf["qwen3-tiny"]
    encoder, _ = PrefixTokenizer.for_tokenizer(tok, _templates(tok))
    assert encoder is not None
    messages = [{"role": "system", "content": "You are terse. " * 50}, {"role": "user", "content": "first question"}]
    encoder.encode(tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False))
    before = copy.copy(encoder.cache.stats)
    messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "a new question"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert encoder.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    new_chars = encoder.cache.stats.miss_chars - before.miss_chars
    assert 0 < new_chars < 80  # the two new messages, not the 750-character system prompt
    assert encoder.cache.stats.hit_chars - before.hit_chars > 750


# --- the cache itself -----------------------------------------------------------------------------


def test_piece_cache_is_bounded_by_bytes_and_evicts_least_recently_used() -> None:
    ids = array("I", range(10))
    cost = PieceCache.cost("piece-0", ids)
    cache = PieceCache(max_bytes=3 * cost)
    for i in range(3):
        cache.put(f"piece-{i}", ids)
    assert len(cache) == 3 and cache.bytes == 3 * cost
    assert cache.get("piece-0") is ids  # now the most recently used
    cache.put("piece-3", ids)
    assert cache.get("piece-1") is None  # the least recently used went
    assert cache.get("piece-0") is ids and cache.get("piece-3") is ids
    assert cache.bytes <= cache.max_bytes and cache.stats.evictions == 1
    cache.put("piece-3", array("I", range(10)))  # replacing a key keeps the count right
    assert cache.bytes == 3 * cost


def test_piece_cache_skips_a_piece_larger_than_the_bound() -> None:
    cache = PieceCache(max_bytes=200)
    cache.put("x" * 500, array("I", [1]))
    assert len(cache) == 0 and cache.bytes == 0


def test_piece_cache_counts_hits_and_misses() -> None:
    cache = PieceCache()
    assert cache.get("abc") is None
    cache.put("abc", array("I", [1, 2]))
    assert cache.get("abc") == array("I", [1, 2])
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_chars, cache.stats.miss_chars) == (1, 1, 3, 3)


def test_a_size_of_zero_turns_the_cache_off(hf: dict[str, Any]) -> None:
    tok = hf["qwen3-tiny"]
    encoder, why = PrefixTokenizer.for_tokenizer(tok, _templates(tok), max_bytes=0)
    assert encoder is None and "0" in why


# --- where the cache stays off, and why that is right ---------------------------------------------------


def _spec(tok: Any) -> dict[str, Any]:
    return json.loads(tok._tokenizer.to_str())


def _piecewise_differs(spec: dict[str, Any], cut: str, texts: list[str]) -> bool:
    """Whether encoding ``texts`` cut after ``cut`` gives other ids than the whole, for this tokenizer spec."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(spec))
    encoder = PrefixTokenizer(tok, [cut], PieceCache())
    return any(encoder.encode(t) != tok.encode(t, add_special_tokens=False).ids for t in texts)


def test_metaspace_prepend_first_is_refused_and_would_differ(hf: dict[str, Any]) -> None:
    # mistral-sp as Llama-2 / Mistral tokenizers ship it today: Metaspace marks only the text's first piece.
    spec = _spec(hf["mistral-sp"])
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    assert "prepend_scheme" in (cache_verdict(spec) or "")
    assert _piecewise_differs(spec, "</s>", ["[INST] hi [/INST] hello</s>[INST] again [/INST]"])
    spec["pre_tokenizer"]["prepend_scheme"] = "always"
    assert cache_verdict(spec) is None
    assert not _piecewise_differs(spec, "</s>", ["[INST] hi [/INST] hello</s>[INST] again [/INST]"])


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_stripping_added_tokens_are_refused_and_would_differ(hf: dict[str, Any], flag: str) -> None:
    spec = _spec(hf["qwen3-tiny"])
    for token in spec["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token[flag] = True
    assert flag in (cache_verdict(spec) or "")
    if flag == "rstrip":  # the whitespace after the cut belongs to the token: pieces would keep it
        assert _piecewise_differs(spec, "<|im_end|>", ["a<|im_end|>\n  b"])


def test_unknown_components_and_dropout_are_refused(hf: dict[str, Any]) -> None:
    spec = _spec(hf["qwen3-tiny"])
    assert cache_verdict(spec) is None
    assert "Fancy" in (cache_verdict({**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Fancy"}]}}) or "")
    assert "Fancy" in (cache_verdict({**spec, "normalizer": {"type": "Fancy"}}) or "")
    assert "dropout" in (cache_verdict({**spec, "model": {**spec["model"], "dropout": 0.1}}) or "")


def test_split_special_tokens_turns_the_cache_off(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dirs["qwen3-tiny"]), split_special_tokens=True)
    encoder, why = PrefixTokenizer.for_tokenizer(tok, _templates(tok))
    assert encoder is None and "split" in why


def test_cut_tokens_skip_overlapping_and_normalized_tokens() -> None:
    def tok(content: str, normalized: bool = False) -> dict[str, Any]:
        return {"content": content, "normalized": normalized}

    spec = {"normalizer": {"type": "NFC"}, "added_tokens": [
        tok("<a>"), tok("<a>x"),          # <a> is the start of a longer token: not a safe cut; <a>x is
        tok("<b|"), tok("|c>"),           # "<b|" ends with the start of "|c>": neither is safe
        tok("<d>"),                       # clear of all others
        tok("<n>", normalized=True),      # matched in NFC-normalized text: not under NFC
    ]}
    template = "<a><a>x<b||c><d><n>"
    assert cut_tokens(spec, [template]) == ["<a>x", "<d>"]
    assert cut_tokens(spec, ["no tokens here"]) == []
    identity = {**spec, "normalizer": None}
    assert cut_tokens(identity, [template]) == ["<a>x", "<d>", "<n>"]
