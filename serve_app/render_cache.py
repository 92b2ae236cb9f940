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

Behind each process's LRU, :class:`NodePieceStore` shares pieces between the processes of one machine
(LMDB, a memory-mapped file): a front door that spreads a conversation's turns over several replicas
would otherwise have each replica tokenize the turns the others saw. Its directory is named after the
tokenizer (its JSON and the cuts), so only the same tokenizer's ids are found there, and a piece is
taken only if the text stored with it equals the piece.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_NODE_BYTES",
    "CacheStats",
    "NodePieceStore",
    "PieceCache",
    "PrefixTokenizer",
    "cache_verdict",
    "cut_tokens",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 2**20
"""Per process: about 100 agent conversations of 8k tokens, pieces shared across them counted once."""
DEFAULT_NODE_BYTES = 256 * 2**20
"""Per machine and tokenizer (:class:`NodePieceStore`): a file of at most this size, emptied when full."""

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
    """Pieces found in this process's LRU."""
    misses: int = 0
    """Pieces tokenized."""
    evictions: int = 0
    hit_chars: int = 0
    miss_chars: int = 0
    node_hits: int = 0
    """Pieces found in the machine's :class:`NodePieceStore` (another process tokenized them)."""
    node_hit_chars: int = 0


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

    def count(self, pieces: list[str], found: list[array | None], from_node: dict[str, array] | None = None) -> None:
        """Counts each piece a hit, a node hit (a missing piece in ``from_node``) or a miss."""
        for p, ids in zip(pieces, found, strict=True):
            if ids is not None:
                self.stats.hits += 1
                self.stats.hit_chars += len(p)
            elif from_node and p in from_node:
                self.stats.node_hits += 1
                self.stats.node_hit_chars += len(p)
            else:
                self.stats.misses += 1
                self.stats.miss_chars += len(p)

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


_ID_BYTES = array("I").itemsize
_LEN = 4  # bytes of a stored piece's text length


class NodePieceStore:
    """Piece text -> token ids, shared by every process of this machine that opens the same directory.

    An LMDB environment (``lmdb``: a memory-mapped B+tree file, readers never blocked, one writer at a
    time across processes): a read is ~1 us, a write transaction ~5 us. Keys are a 16-byte BLAKE2b of
    the piece; the value holds the piece's text before its ids, and a read takes the ids only when that
    text equals the piece, so ids are never taken for other text, digest collision or not. When the file
    is full it is emptied and filled again (this process's LRU still holds its own pieces). Any error
    turns the store off for this process (``broken`` says why); a render never fails for it.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        import lmdb

        self.path, self.max_bytes = path, max_bytes
        self.broken: str | None = None
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # No fsync (sync, metasync): a piece lost to a machine crash is tokenized again. Writes through
        # write(), not the map (writemap off): a full filesystem is then an error, not a SIGBUS.
        self._env = lmdb.open(str(path), map_size=max_bytes, sync=False, metasync=False, readahead=False,
                              max_readers=1024, max_dbs=0)
        self._env.reader_check()  # slots left by processes that died
        self._lmdb_error = lmdb.Error
        self._full = lmdb.MapFullError
        self._max_value = max_bytes // 64  # one long /tokenize text must not empty the store

    _opened: dict[Path, NodePieceStore] = {}
    _opening = threading.Lock()

    @classmethod
    def open(cls, root: str | os.PathLike[str], fingerprint: str, max_bytes: int) -> tuple[NodePieceStore | None, str]:
        """The store for one tokenizer under ``root``, or ``None`` and why not. One per directory and
        process (LMDB opens an environment once per process): a second caller gets the same store."""
        path = Path(root).absolute() / fingerprint
        with cls._opening:
            try:
                store = cls._opened.get(path) or cls(path, max_bytes)
            except Exception as exc:  # noqa: BLE001 - lmdb missing, a directory we may not write, a bad map size: off
                return None, f"not shared on this machine ({path}: {exc})"
            cls._opened[path] = store
        return store, f"shared on this machine ({path})"

    @staticmethod
    def _key(raw: bytes) -> bytes:
        return hashlib.blake2b(raw, digest_size=16).digest()

    def _fail(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        logger.warning("Render cache shared on this machine turned off in this process: %s", self.broken)

    def get_many(self, pieces: list[str]) -> dict[str, array]:
        """The stored ids of those of ``pieces`` found (stored text equal to the piece)."""
        out: dict[str, array] = {}
        if self.broken is not None:
            return out
        try:
            with self._env.begin(buffers=True) as txn:
                for piece in pieces:
                    raw = piece.encode("utf-8", "surrogatepass")
                    value = txn.get(self._key(raw))
                    n = len(raw)
                    if (value is None or int.from_bytes(value[:_LEN], "little") != n or value[_LEN : _LEN + n] != raw
                            or (len(value) - _LEN - n) % _ID_BYTES):
                        continue
                    ids = array("I")
                    ids.frombytes(value[_LEN + n :])
                    out[piece] = ids
        except self._lmdb_error as exc:
            self._fail(exc)
            return {}
        return out

    def put_many(self, items: dict[str, array]) -> None:
        """Store each piece's ids (one write transaction); when the file is full, empty it first."""
        if self.broken is not None:
            return
        values = []
        for piece, ids in items.items():
            raw = piece.encode("utf-8", "surrogatepass")
            value = len(raw).to_bytes(_LEN, "little") + raw + ids.tobytes()
            if len(value) <= self._max_value:
                values.append((self._key(raw), value))
        if not values:
            return
        try:
            try:
                self._write(values)
            except self._full:
                # Emptied in a transaction of its own: its pages are free for the next one, not for itself.
                # Reader slots a killed process left would pin the old pages: cleared first.
                self._env.reader_check()
                with self._env.begin(write=True) as txn:
                    txn.drop(self._env.open_db(), delete=False)
                try:
                    self._write(values)
                except self._full:
                    pass  # these pieces alone fill the map: left out
        except self._lmdb_error as exc:
            self._fail(exc)

    def _write(self, values: list[tuple[bytes, bytes]]) -> None:
        with self._env.begin(write=True) as txn:
            for key, value in values:
                txn.put(key, value)


def tokenizer_fingerprint(backend_json: str, cuts: list[str]) -> str:
    """Names a :class:`NodePieceStore` directory: the tokenizer's JSON, the cuts and the value layout."""
    h = hashlib.sha256(f"piece-store-1:{_ID_BYTES}:".encode())
    h.update(json.dumps(cuts).encode())
    h.update(backend_json.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


class PrefixTokenizer:
    """``encode(text)``: the ids ``backend.encode(text, add_special_tokens=False)`` gives, from cached pieces.

    ``backend`` is a ``tokenizers.Tokenizer`` this object owns (no truncation, no padding); ``cuts`` are
    :func:`cut_tokens`. Build one with :meth:`for_tokenizer`, which checks the tokenizer first.
    """

    def __init__(self, backend: Any, cuts: list[str], cache: PieceCache, node: NodePieceStore | None = None) -> None:
        self.backend, self.cuts, self.cache, self.node = backend, cuts, cache, node
        # Longest first: with the cuts clear of each other the order only matters for speed.
        self._cut = re.compile("|".join(re.escape(c) for c in sorted(cuts, key=len, reverse=True)))

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any, templates: list[str], max_bytes: int = DEFAULT_MAX_BYTES,
                      node_dir: str | os.PathLike[str] | None = None,
                      node_bytes: int = DEFAULT_NODE_BYTES) -> tuple[PrefixTokenizer | None, str]:
        """A cache for a transformers fast tokenizer and its chat templates, or ``None`` and why not;
        shared with this machine's other processes under ``node_dir`` (:class:`NodePieceStore`) unless
        that is ``None`` or ``node_bytes`` is 0."""
        from tokenizers import Tokenizer

        backend = getattr(hf_tokenizer, "_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            return None, f"{type(hf_tokenizer).__name__} is not a Hugging Face fast tokenizer"
        if max_bytes <= 0:
            return None, "disabled (cache size 0)"
        if getattr(hf_tokenizer, "split_special_tokens", False) or backend.encode_special_tokens:
            return None, "the tokenizer splits special tokens"
        backend_json = backend.to_str()
        spec = json.loads(backend_json)
        reason = cache_verdict(spec)
        if reason is not None:
            return None, reason
        cuts = cut_tokens(spec, templates)
        if not cuts:
            return None, "the chat templates write no added token to cut after"
        own = Tokenizer.from_str(backend_json)
        own.no_truncation()
        own.no_padding()
        own.encode_special_tokens = False
        encoder = cls(own, cuts, PieceCache(max_bytes))
        reason = encoder.self_check(hf_tokenizer)
        if reason is not None:
            return None, reason
        status = f"on: cut after {', '.join(cuts)}"
        if node_dir is not None and node_bytes > 0:
            # The JSON of the tokenizer that encodes (no truncation, no padding), whatever the caller's state.
            encoder.node, shared = NodePieceStore.open(node_dir, tokenizer_fingerprint(own.to_str(), cuts), node_bytes)
            status += f"; {shared}"
        return encoder, status

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
            from_node = self.node.get_many(missing) if self.node is not None else {}
            for p, ids in from_node.items():  # kept here too: the next turn finds them without the store
                self.cache.put(p, ids)
            missing = [p for p in missing if p not in from_node]
            if max_new_chars is not None and sum(map(len, missing)) > max_new_chars:
                return None
            self.cache.count(pieces, found, from_node)
            encodings = self.backend.encode_batch_fast(missing, add_special_tokens=False) if missing else []
            new = {p: array("I", e.ids) for p, e in zip(missing, encodings, strict=True)}
            for p, ids in new.items():
                self.cache.put(p, ids)
            if new and self.node is not None:
                self.node.put_many(new)
            new.update(from_node)
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
