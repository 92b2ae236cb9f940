"""``mistral-sp``: Mistral's SentencePiece ``tokenizer.model.v1`` (shipped in ``mistral-common``) as a
fast tokenizer, with the Mistral instruct template and a tiny Llama-shaped config.

This is the family where the first output token's leading space depends on the prompt: ``▁The``
decodes to ``"The"`` on a fresh window and to ``" The"`` after prompt context, which is why derender
seeds its detokenizer from the prompt's last ids.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from serve_app.models._files import package_file, read_template, write_json

VOCAB_SIZE = 32000
MAX_POSITIONS = 8192


class _SentencePieceSource:
    """The attributes ``LlamaConverter`` reads from a slow tokenizer, without building one."""

    legacy = True
    add_prefix_space = True

    def __init__(self, vocab_file: str) -> None:
        self.vocab_file = vocab_file

    def convert_ids_to_tokens(self, index: int) -> str:
        return ("<unk>", "<s>", "</s>")[index]


def build_tokenizer_json(sp_model: Path, path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import LlamaConverter, generate_merges

    class Converter(LlamaConverter):
        # transformers 5.19's SpmConverter.tokenizer passes vocab scores where the extractor now
        # expects a model type; build the byte-fallback BPE directly, merges ordered by piece score.
        def tokenizer(self, proto):  # noqa: ANN001
            vocab_scores = self.vocab(proto)
            vocab = {piece: i for i, (piece, _score) in enumerate(vocab_scores)}
            merges = generate_merges(vocab, vocab_scores)
            return Tokenizer(BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))

    tok = Converter(_SentencePieceSource(str(sp_model))).converted()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    # Like the released Llama/Mistral tokenizer.json: BOS is added by the post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path))


def build(d: Path) -> None:
    sp_model = package_file("mistral_common", "data", "tokenizer.model.v1")
    shutil.copyfile(sp_model, d / "tokenizer.model")
    build_tokenizer_json(sp_model, d / "tokenizer.json")
    write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "clean_up_tokenization_spaces": False,
            "legacy": True,
            "model_max_length": MAX_POSITIONS,
            "chat_template": read_template("mistral_instruct.jinja"),
        },
    )
    write_json(
        d / "config.json",
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 128,
            "intermediate_size": 256,
            "max_position_embeddings": MAX_POSITIONS,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            # >= 5 tells transformers this is not a pre-fix Mistral regex it must warn about.
            "transformers_version": "5.0.0",
            "vocab_size": VOCAB_SIZE,
        },
    )
