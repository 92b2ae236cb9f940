"""Replica-local cache of live parser sessions, keyed by a digest of the client-carried state.

vLLM rebuilds a parser and replays the whole output on every streaming chunk because parser state
cannot travel in ``stream_state``. Here a replica keeps the live session after answering a chunk,
filed under the digest of the state it just returned. The next chunk of that stream carries exactly
that state, so it finds the session (a hit) and only the new delta is parsed. Any other replica, or
this one after an eviction, misses and replays as vLLM does, with identical output: the cache is
an optimisation, never the source of truth.

The digest covers the output by lengths, tails and flags, not every id (hashing a growing state on
every chunk would make each chunk O(n) twice over), so the caller confirms a hit by comparing the
full output id lists it holds against the session's, a C-speed list comparison. The prompt, sent
whole with every chunk, enters as its own digest (:func:`prompt_key`): a session keeps that, not
the prompt.

A session is taken out of the cache while it is used, so a retried or duplicated chunk (same state
twice) misses and replays instead of feeding one parser twice, and a session is only ever used by
one thread at a time: the replica's event loop (a hit) or the derender worker thread (a long
replay, ``ParserDerenderService.chat_async``). Both take and put sessions, so the cache's compound
operations hold a lock (uncontended almost always: a few hundred nanoseconds).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Generic, TypeVar

__all__ = ["CacheStats", "SessionCache", "prompt_key", "state_digest"]

T = TypeVar("T")


_TAIL = 8


def prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    """A 128-bit digest of a prompt's token ids (u32, as ``protocol.TokenId`` bounds them)."""
    return blake2b(array("I", prompt_token_ids).tobytes(), digest_size=16).digest()


def state_digest(
    config_key: bytes,
    prompt: bytes,
    output_token_ids: Sequence[int],
    output_chunk_lens: Sequence[int],
    flags: Iterable[Any],
) -> bytes:
    """A 128-bit digest of a stream state's identity: request configuration, the prompt's
    :func:`prompt_key`, output list lengths and tails, and the small flags (role sent, tool-call
    ids). Equal states always give equal digests; a digest match is confirmed against the full
    output lists by the caller.
    """
    parts = (
        len(output_token_ids),
        tuple(output_token_ids[-_TAIL:]),
        len(output_chunk_lens),
        tuple(output_chunk_lens[-_TAIL:]),
        tuple(flags),
    )
    return blake2b(config_key + prompt + repr(parts).encode(), digest_size=16).digest()


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    replayed_tokens: int = 0  # output tokens re-parsed because of misses
    evictions: int = 0
    expirations: int = 0


class SessionCache(Generic[T]):
    """LRU + TTL map from state digest to a live session, bounded in entries and in tokens held.

    Generic: parser derender's request cache (:class:`~serve_app.derender.request.RequestConfigs`)
    is one too, its "tokens" the bytes each configuration keeps, its entries read with :meth:`get`.
    """

    def __init__(self, max_sessions: int, ttl_s: float, max_tokens: int) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.stats = CacheStats()
        self._entries: OrderedDict[bytes, tuple[float, int, T]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # entries, token count and stats change together

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token ids held by the cached sessions, as each counts its own (the memory bound is on this)."""
        return self._tokens

    def values(self) -> list[T]:
        """What is cached, least recently used first (expired entries included until evicted)."""
        with self._lock:
            return [value for _, _, value in self._entries.values()]

    def take(self, key: bytes) -> T | None:
        """Remove and return the session filed under ``key``, if any and not expired."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            stamp, tokens, session = entry
            self._tokens -= tokens
            if time.monotonic() - stamp > self.ttl_s:
                self.stats.expirations += 1
                return None
            return session

    def peek(self, key: bytes) -> T | None:
        """The session filed under ``key``, if any and not expired, left in the cache as it is."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[2]

    def get(self, key: bytes) -> T | None:
        """The entry filed under ``key``, left in the cache as its most recently used, if any and not expired."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            stamp, tokens, value = entry
            now = time.monotonic()
            if now - stamp > self.ttl_s:
                del self._entries[key]
                self._tokens -= tokens
                self.stats.expirations += 1
                return None
            self._entries.move_to_end(key)
            self._entries[key] = (now, tokens, value)
            return value

    def put(self, key: bytes, session: T, tokens: int) -> None:
        if self.max_sessions <= 0 or tokens > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= old[1]
            self._entries[key] = (time.monotonic(), tokens, session)
            self._tokens += tokens
            self._evict()

    def count_hit(self) -> None:
        with self._lock:
            self.stats.hits += 1

    def count_miss(self, replayed_tokens: int) -> None:
        """A chunk that found no session and replays ``replayed_tokens`` carried output tokens."""
        with self._lock:
            self.stats.misses += 1
            self.stats.replayed_tokens += replayed_tokens

    def _evict(self) -> None:  # under the lock
        now = time.monotonic()
        entries = self._entries
        # Oldest first: expired entries, then least recently used ones beyond the bounds.
        while entries:
            key, (stamp, tokens, _) = next(iter(entries.items()))
            expired = now - stamp > self.ttl_s
            if not expired and len(entries) <= self.max_sessions and self._tokens <= self.max_tokens:
                break
            del entries[key]
            self._tokens -= tokens
            if expired:
                self.stats.expirations += 1
            else:
                self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
