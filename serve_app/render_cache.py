"""Exact token-id cache for rendered prompts: an agent's next request repeats the previous one's text.

A Hugging Face ``tokenizers`` encode first splits the text at its added tokens (``<|im_start|>``,
``<|im_end|>``, ...), then normalizes, pre-tokenizes and encodes each piece between them on its own.
So a prompt cut right after an added token the tokenizer itself matches there gives pieces whose ids,
concatenated, are exactly the ids of the whole text. :class:`PrefixTokenizer` cuts the rendered
prompt after the added tokens its chat templates write, looks each piece up by its text in a
bytes-bounded LRU (:class:`PieceCache`), and encodes only the pieces it has not seen. Consecutive
turns of a conversation share every piece but the newest messages.

Why a cut is exact (tokenizers' ``AddedVocabulary``): added tokens with ``normalized: false`` are
found first, in the raw text, leftmost-longest. A cut token ``T`` that no other such token contains,
extends or overlaps (no suffix of one is a prefix of the other) is matched at every place it occurs,
and matching restarts after it, so the text before and after the cut splits as it does in the whole.
Each piece is then encoded without regard to where it sits, unless a component looks at positions or
neighbours. :func:`cache_verdict` enables the cache only when none does, decided once from the
tokenizer's own JSON:

* no added token with ``lstrip``, ``rstrip`` or ``single_word`` (they reach over the cut);
* normalizers and pre-tokenizers of the kinds that work piece by piece (``NFC``, ``Prepend``,
  ``Split``, ``ByteLevel``, ...); Metaspace with ``prepend_scheme: first`` (Mistral / Llama-2 style:
  only the first piece gets the ``▁``) and any kind not listed turn the cache off;
* no BPE dropout (not deterministic), and the tokenizer not told to split special tokens.

Only encodes without special tokens added (a chat prompt: the template writes them), without offsets
and within the truncation length take this path; the caller falls back to the tokenizer otherwise.
The cache encodes with a private copy of the tokenizer (no truncation or padding state shared with
the caller's). Pure Python over ``tokenizers``: no Ray, no vLLM.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "CacheStats", "PieceCache", "PrefixTokenizer", "cache_verdict", "cut_tokens"]

DEFAULT_MAX_BYTES = 64 * 2**20
"""Per process: about 100 agent conversations of 8k tokens, pieces shared across them counted once."""

# Components that transform each piece on its own, whatever sits before or after it.
_SAFE_NORMALIZERS = frozenset({
    "BertNormalizer", "ByteLevel", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "Precompiled", "Prepend",
    "Replace", "Sequence", "Strip", "StripAccents",
})
_SAFE_PRE_TOKENIZERS = frozenset({
    "BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "Metaspace", "Punctuation", "Sequence", "Split",
    "UnicodeScripts", "Whitespace", "WhitespaceSplit",
})


def _components(node: Any, key: str) -> list[dict[str, Any]]:
    """``node`` and the members of any ``Sequence`` in it, flattened."""
    if not isinstance(node, dict):
        return []
    out = [node]
    for child in node.get(key) or ():
        out += _components(child, key)
    return out


def cache_verdict(spec: dict[str, Any]) -> str | None:
    """``None`` when pieces cut after added tokens encode exactly as the whole text does, by the
    tokenizer's JSON ``spec``; otherwise why not."""
    for token in spec.get("added_tokens") or ():
        for flag in ("lstrip", "rstrip", "single_word"):
            if token.get(flag):
                return f"added token {token.get('content')!r} has {flag}"
    for n in _components(spec.get("normalizer"), "normalizers"):
        if n.get("type") not in _SAFE_NORMALIZERS:
            return f"normalizer {n.get('type')} is not known to work piece by piece"
    for p in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") not in _SAFE_PRE_TOKENIZERS:
            return f"pre-tokenizer {p.get('type')} is not known to work piece by piece"
        if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") == "first":
            return "Metaspace prepend_scheme 'first' marks only the first piece"
    model = spec.get("model") or {}
    if model.get("dropout"):
        return "BPE dropout is not deterministic"
    return None


def cut_tokens(spec: dict[str, Any], templates: list[str]) -> list[str]:
    """The added tokens to cut after: written by one of the chat ``templates`` and clear of every other
    added token the same pass matches (none contains, extends or overlaps it), so the tokenizer matches
    each wherever it occurs. Tokens matched in the raw text (``normalized: false``) always qualify; the
    others only under an identity normalizer (none, or an empty ``Sequence``), where the normalized
    text they are matched in is the raw text (an ``NFC`` could fuse a token's last character with the next)."""
    tokens = [t for t in spec.get("added_tokens") or () if t.get("content")]
    normalizer = spec.get("normalizer")
    identity = normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))
    candidates = {t["content"] for t in tokens if identity or not t.get("normalized")}
    # Under an identity normalizer both passes match in the same text: clear of all tokens; else of the raw ones.
    rivals = [t["content"] for t in tokens if identity or not t.get("normalized")]
    return sorted(c for c in candidates if any(c in tpl for tpl in templates) and all(_clear(c, o) for o in rivals if o != c))


def _clear(cut: str, other: str) -> bool:
    if cut in other:  # a longer token over the same text would win
        return False
    # A suffix of one that is a prefix of the other: a match of either can swallow the start of the other.
    return not any(other.endswith(cut[:i]) or cut.endswith(other[:i]) for i in range(1, min(len(cut), len(other))))


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    hit_chars: int = 0
    miss_chars: int = 0


class PieceCache:
    """Piece text -> token ids, least recently used first out, at most ``max_bytes`` (keys and ids as
    ``sys.getsizeof`` counts them). Thread-safe: vLLM tokenizes in its renderer's thread pool."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._items: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def cost(piece: str, ids: array) -> int:
        return sys.getsizeof(piece) + sys.getsizeof(ids)

    def get(self, piece: str) -> array | None:
        return self.get_many([piece])[0]

    def get_many(self, pieces: list[str], count: bool = True) -> list[array | None]:
        """The cached ids of each piece (``None``: not cached), marked as recently used; ``count``: in the stats."""
        with self._lock:
            found = [self._items.get(p) for p in pieces]
            for p, ids in zip(pieces, found, strict=True):
                if ids is not None:
                    self._items.move_to_end(p)
            if count:
                self.count(pieces, found)
            return found

    def count(self, pieces: list[str], found: list[array | None]) -> None:
        for p, ids in zip(pieces, found, strict=True):
            if ids is None:
                self.stats.misses += 1
                self.stats.miss_chars += len(p)
            else:
                self.stats.hits += 1
                self.stats.hit_chars += len(p)

    def put(self, piece: str, ids: array) -> None:
        cost = self.cost(piece, ids)
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(piece, None)
            if old is not None:
                self.bytes -= self.cost(piece, old)
            self._items[piece] = ids
            self.bytes += cost
            while self.bytes > self.max_bytes:
                key, value = self._items.popitem(last=False)
                self.bytes -= self.cost(key, value)
                self.stats.evictions += 1


class PrefixTokenizer:
    """``encode(text)``: the ids ``backend.encode(text, add_special_tokens=False)`` gives, from cached pieces.

    ``backend`` is a ``tokenizers.Tokenizer`` this object owns (no truncation, no padding); ``cuts`` are
    :func:`cut_tokens`. Build one with :meth:`for_tokenizer`, which checks the tokenizer first.
    """

    def __init__(self, backend: Any, cuts: list[str], cache: PieceCache) -> None:
        self.backend, self.cuts, self.cache = backend, cuts, cache
        # Longest first: with the cuts clear of each other the order only matters for speed.
        self._cut = re.compile("|".join(re.escape(c) for c in sorted(cuts, key=len, reverse=True)))

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any, templates: list[str],
                      max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[PrefixTokenizer | None, str]:
        """A cache for a transformers fast tokenizer and its chat templates, or ``None`` and why not."""
        from tokenizers import Tokenizer

        backend = getattr(hf_tokenizer, "_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            return None, f"{type(hf_tokenizer).__name__} is not a Hugging Face fast tokenizer"
        if max_bytes <= 0:
            return None, "disabled (cache size 0)"
        if getattr(hf_tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
            return None, "the tokenizer splits special tokens"
        spec = json.loads(backend.to_str())
        reason = cache_verdict(spec)
        if reason is not None:
            return None, reason
        cuts = cut_tokens(spec, templates)
        if not cuts:
            return None, "the chat templates write no added token to cut after"
        own = Tokenizer.from_str(backend.to_str())
        own.no_truncation()
        own.no_padding()
        own.encode_special_tokens = False
        encoder = cls(own, cuts, PieceCache(max_bytes))
        reason = encoder.self_check(hf_tokenizer)
        if reason is not None:
            return None, reason
        return encoder, f"on: cut after {', '.join(cuts)}"

    def pieces(self, text: str) -> list[str]:
        """``text`` cut right after every cut token."""
        out, start = [], 0
        for m in self._cut.finditer(text):
            out.append(text[start:m.end()])
            start = m.end()
        if start < len(text) or not out:
            out.append(text[start:])
        return out

    def encode(self, text: str) -> list[int]:
        ids = self.encode_within(text, None)
        assert ids is not None
        return ids

    def encode_within(self, text: str, max_new_chars: int | None) -> list[int] | None:
        """The ids of ``text``; ``None`` (nothing done) if more than ``max_new_chars`` of it is not cached."""
        pieces = self.pieces(text)
        found = self.cache.get_many(pieces, count=False)
        if None in found:
            missing = list(dict.fromkeys(p for p, ids in zip(pieces, found, strict=True) if ids is None))
            if max_new_chars is not None and sum(map(len, missing)) > max_new_chars:
                return None
            self.cache.count(pieces, found)
            encodings = self.backend.encode_batch_fast(missing, add_special_tokens=False)
            new = {p: array("I", e.ids) for p, e in zip(missing, encodings, strict=True)}
            for p, ids in new.items():
                self.cache.put(p, ids)
            found = [new[p] if ids is None else ids for p, ids in zip(pieces, found, strict=True)]
        else:
            self.cache.count(pieces, found)
        out: list[int] = []
        for piece_ids in found:
            out.extend(piece_ids or ())
        return out

    def self_check(self, hf_tokenizer: Any) -> str | None:
        """A last guard at startup: probes around every cut token must encode as the tokenizer itself
        encodes them (``None``), through the caller's own tokenizer call; else why not."""
        probes = []
        for cut in self.cuts:
            probes += [cut, f"a{cut}b", f" {cut} x ", f"\n{cut}\n\n  y", cut + cut, f"{cut}e\u0301 caf\u00e9 \U0001f99c {cut}",
                       f"x{cut}   {cut}\t\n{cut}1"]
        probes.append("".join(f"  {c}\n\n" for c in self.cuts) + "hello  world")
        for probe in probes:
            want = list(hf_tokenizer(probe, add_special_tokens=False)["input_ids"])
            got = PrefixTokenizer(self.backend, self.cuts, PieceCache(2**20)).encode(probe)
            if got != want:
                return f"self-check failed on {probe!r}"
        return None
