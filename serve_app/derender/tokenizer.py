"""The detokenizer's view of a model's tokenizer, on ``tokenizers`` alone (no transformers, no torch).

It reproduces what vLLM's derender asks of a Hugging Face fast tokenizer: ``len()``,
``convert_ids_to_tokens`` (with ``skip_special_tokens``), ``convert_tokens_to_string`` (the Rust
decoder over vocab pieces) and ``decode`` of single ids for logprobs. Which ids count as special
is the Hugging Face tokenizer's ``all_special_ids``; the builder computes it once
(:meth:`serve_app.config.AppArgs.resolve`) so replicas never load transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["DetokTokenizer"]


class DetokTokenizer:
    def __init__(self, tokenizer_dir: str | Path, special_ids: Iterable[int]) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_dir) / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(special_ids)
        decoder = self._tok.decoder
        self._decode_pieces = decoder.decode if decoder is not None else " ".join
        # id -> vocab piece, looked up per generated token; a list index beats a Rust call.
        self._pieces: list[str | None] = [self._tok.id_to_token(i) for i in range(self.vocab_size)]
        self.piece_set = frozenset(p for p in self._pieces if p is not None)
        config = json.loads(path.read_text(encoding="utf-8"))
        self.space_marker = _metaspace_replacement(config)
        self._single: dict[str, str] = {}
        # A byte-level decoder turns each piece into its bytes and decodes their concatenation, so a
        # piece whose bytes are whole characters adds exactly its own text to any decode that ends on
        # a whole character (:meth:`whole_text`). Others (SentencePiece's Strip, byte fallback) do not.
        self.byte_level = (config.get("decoder") or {}).get("type") == "ByteLevel"
        self._whole: dict[int, str | None] = {}

    def piece(self, token_id: int) -> str | None:
        """The vocab piece of ``token_id``; ``None`` outside the vocabulary (as ``id_to_token``)."""
        if 0 <= token_id < self.vocab_size:
            return self._pieces[token_id]
        return None

    def whole_text(self, token_id: int) -> str | None:
        """The text of ``token_id``'s piece if the decoder is byte-level and the piece decodes on its
        own to whole characters (non-empty, no U+FFFD); else ``None``. Memoised for vocabulary ids only,
        so ids a client makes up cannot grow it."""
        if not 0 <= token_id < self.vocab_size:
            return None
        if token_id in self._whole:
            return self._whole[token_id]
        piece = self.piece(token_id)
        text = self.tokens_to_string([piece]) if self.byte_level and piece else None
        if not text or "\ufffd" in text:
            text = None
        self._whole[token_id] = text
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str | None]:
        special = self.special_ids if skip_special_tokens else ()
        return [self.piece(i) for i in ids if i not in special]

    def tokens_to_string(self, pieces: list[str]) -> str:
        if len(pieces) == 1:
            # The incremental window is usually one piece; memoise those decodes (bounded by vocab).
            text = self._single.get(pieces[0])
            if text is None:
                text = self._single[pieces[0]] = self._decode_pieces(pieces)
            return text
        return self._decode_pieces(pieces)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _metaspace_replacement(config: dict) -> str | None:
    """vLLM's ``get_leading_space_marker``: the Metaspace replacement of the pre-tokenizer, if any."""
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace":
        return pre.get("replacement", "▁")
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "▁")
    return None
