"""The builtin model directories: real vocabularies at their real ids, templates, reproducible builds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from serve_app.models import BUILTIN_MODELS, build_model, resolve_model


@pytest.fixture(scope="module")
def tokenizers(model_dirs: dict[str, Path]):
    return {name: AutoTokenizer.from_pretrained(path) for name, path in model_dirs.items()}


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


class TestQwen3Tiny:
    def test_known_ids(self, tokenizers):
        tok = tokenizers["qwen3-tiny"]
        assert tok.encode("Hello world") == [9707, 1879]
        expected = {
            "<|endoftext|>": 151643,
            "<|im_start|>": 151644,
            "<|im_end|>": 151645,
            "<tool_call>": 151657,
            "</tool_call>": 151658,
            "<tool_response>": 151665,
            "</tool_response>": 151666,
            "<think>": 151667,
            "</think>": 151668,
        }
        assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
        assert tok.encode("<think>x</think>") == [151667, 87, 151668]

    def test_think_and_tool_markers_survive_skip_special_tokens(self, tokenizers):
        tok = tokenizers["qwen3-tiny"]
        ids = tok.encode("<|im_start|><think>a</think><tool_call>{}</tool_call><|im_end|>")
        assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>{}</tool_call>"

    def test_byte_level_roundtrip(self, tokenizers):
        tok = tokenizers["qwen3-tiny"]
        text = "héllo 😀 世界\n\n\tcode()  x"
        assert tok.decode(tok.encode(text)) == text

    def test_chat_template(self, tokenizers):
        tok = tokenizers["qwen3-tiny"]
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
        no_think = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    def test_chat_template_tools_and_results(self, tokenizers):
        tok = tokenizers["qwen3-tiny"]
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        msgs = [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "sunny"},
        ]
        text = tok.apply_chat_template(msgs, tools=[tool], tokenize=False, add_generation_prompt=True)
        assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text

    def test_tiny_engine_config_and_weights(self, model_dirs):
        from safetensors import safe_open

        d = model_dirs["qwen3-tiny"]
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] == ["Qwen3ForCausalLM"]
        assert config["head_dim"] == 64  # vLLM's CPU attention rejects 16
        with safe_open(str(d / "model.safetensors"), "np") as f:
            emb = f.get_tensor("model.embed_tokens.weight")
            assert emb.shape == (config["vocab_size"], config["hidden_size"])
            assert len(list(f.keys())) == 2 + 11 * config["num_hidden_layers"]


class TestDeepSeekV4:
    def test_known_ids(self, tokenizers):
        tok = tokenizers["deepseek-v4"]
        assert tok.encode("Hello world", add_special_tokens=False) == [19923, 2058]
        for token, tid in {"<think>": 128821, "</think>": 128822, "<｜tool▁calls▁begin｜>": 128806,
                           "<｜User｜>": 128803, "<｜Assistant｜>": 128804}.items():
            assert tok.convert_tokens_to_ids(token) == tid

    def test_chat_template_thinking_and_tools(self, tokenizers):
        tok = tokenizers["deepseek-v4"]
        msgs = [{"role": "user", "content": "hi"}]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
        )
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking=True).endswith(
            "<｜Assistant｜><think>"
        )
        call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        text = tok.apply_chat_template(
            msgs + [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "ok"}],
            tools=[{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert "### f\nDescription: d" in text
        assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>" in text
        assert "<｜tool▁output▁begin｜>ok<｜tool▁output▁end｜>" in text


class TestMistralSp:
    def test_matches_sentencepiece(self, tokenizers, model_dirs):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dirs["mistral-sp"] / "tokenizer.model"))
        tok = tokenizers["mistral-sp"]
        assert tok.encode("Hello world") == [1, 22557, 1526]
        for text in ["Hello world", "  two  spaces", "héllo 😀 世界\n\nx\ty", "The answer is 42."]:
            assert tok.encode(text, add_special_tokens=False) == sp.encode(text)

    def test_leading_space_depends_on_context(self, tokenizers):
        tok = tokenizers["mistral-sp"]
        the = tok.convert_tokens_to_ids("▁The")
        assert tok.decode([the]) == "The"  # a fresh window drops the SentencePiece space ...
        assert tok.decode([22557, the]) == "Hello The"  # ... which prompt context keeps

    def test_byte_fallback(self, tokenizers):
        tok = tokenizers["mistral-sp"]
        ids = tok.encode("🦜", add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids) == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>"]
        assert tok.decode(ids) == "🦜"
        assert "\ufffd" in tok.decode(ids[:3])  # an incomplete byte sequence on its own

    def test_chat_template(self, tokenizers):
        tok = tokenizers["mistral-sp"]
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
        assert tok.apply_chat_template(msgs, tokenize=False) == "<s>[INST] S\n\nhi [/INST]yo</s>[INST] again [/INST]"
        with pytest.raises(Exception, match="alternate"):
            tok.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_build_is_reproducible(name: str, tmp_path: Path, model_dirs: dict[str, Path]):
    fresh = build_model(name, tmp_path / name)
    assert _digest(fresh) == _digest(model_dirs[name])


def test_resolve_model_rejects_unknown(tmp_path: Path):
    from serve_app.model_source import ModelSourceError

    with pytest.raises(ModelSourceError, match="neither a builtin"):
        resolve_model(str(tmp_path / "missing"))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
